"""The evidence record ``ascend-patch verify`` writes, and what makes one ``npu-verified`` evidence.

Standard library only: the matrix validation (at every ``import vllm``) imports this module when
a row claims ``npu-verified``. The schema is documented in docs/hardware-kit.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

SCHEMA = 1
KIND = "ascend-patch-verify"
# Every check verify runs, by name: what it proves. "tp" runs only where more than one device is
# visible; every other check must pass for a record to become npu-verified evidence.
CHECKS = {
    "fia-attention": "prefill and mixed batches on npu_fused_infer_attention_score (TND, paged), fp16",
    "paged-attention": "decode-only batches on _npu_paged_attention (ATB, needs NNAL), fp16",
    "chunked-prefill": "prompt chunks behind their own cached part, beside decode rows in one launch",
    "prefix-cache": "prompts served from cached blocks, the suffixes attending behind them",
    "sampler": "seeded top-k sampling on npu_top_k_top_p repeats, within HF's top-k",
    "graphs": "FULL_DECODE_ONLY ACL graphs captured and replayed (padded batches), bf16",
    "mla": "DeepSeek-V3 MLA: decode on atb.npu_multi_head_latent_attention, prefill on the MLA "
           "form of npu_fused_infer_attention_score, with prefix caching and chunked prefill, bf16",
    "moe-grouped-routing": "DeepSeek-V3 grouped sigmoid routing on npu_moe_gating_top_k, experts "
                           "on the NPU MoE ops, bf16",
    "moe": "Qwen3-MoE renormalised softmax routing on npu_moe_gating_top_k_softmax_v2, experts on "
           "npu_moe_init_routing_v2 / npu_grouped_matmul / npu_moe_token_unpermute, bf16",
    "w8a8": "an AscendV1 W8A8 checkpoint (static, dynamic and float layers) on "
            "npu_quantize / npu_dynamic_quant / npu_quant_matmul, bf16",
    "kv-offload": "KV offload to host memory (vLLM's OffloadingConnector, the NPU spec): prompts "
                  "evicted from the device served from host, block copies both ways, fp16",
    "tp": "tensor parallelism over two devices (HCCL), bf16",
}
NEEDS_DEVICES = {"tp": 2}
VERDICTS = ("pass", "fail", "error", "skipped")


def patch_set_digest(declarations) -> str:
    """sha256 of what a patch set declares for one vLLM release: each target, kind and expected
    form. A record made with other declarations is evidence for another patch set."""
    rows = [[d.target, d.kind, d.expected()] for d in declarations]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def summary(checks: list[dict]) -> dict:
    counts = {verdict: sum(c["verdict"] == verdict for c in checks) for verdict in VERDICTS}
    ran = {c["name"] for c in checks}
    missing = [name for name in CHECKS if name not in ran]
    ok = not missing and counts["fail"] == counts["error"] == 0 and counts["pass"] > 0
    return {**counts, "missing": missing, "verdict": "pass" if ok else "fail"}


def conversion_problem(record: dict, version: str, patch_set: str, digest: str) -> str | None:
    """Why ``record`` cannot become the npu-verified evidence of vLLM ``version`` under
    ``patch_set`` (whose declarations have ``digest``), in one line; None if it can."""
    if not isinstance(record, dict) or record.get("kind") != KIND:
        return "not an ascend-patch verify record"
    if record.get("schema") != SCHEMA:
        return f"record schema {record.get('schema')!r}, this ascend-patch reads schema {SCHEMA}"
    if record.get("mode") != "npu":
        return (f"the record was made in {record.get('mode')!r} mode, not on an NPU: emulated runs "
                "are emulated-e2e evidence, never npu-verified")
    found = record.get("versions", {}).get("vllm")
    if found != version:
        return f"the record ran vLLM {found}, not {version}"
    ran = record.get("patch_set", {})
    if ran.get("name") != patch_set:
        return f"the record ran patch set {ran.get('name')}, the matrix puts {version} in {patch_set}"
    if ran.get("digest") != digest:
        return (f"the record's patch set {patch_set} declared other targets than this checkout's "
                f"(digest {str(ran.get('digest'))[:12]} != {digest[:12]}): re-run verify with this ascend-patch")
    result = record.get("summary", {})
    if result.get("verdict") != "pass":
        bad = [c["name"] for c in record.get("checks", []) if c.get("verdict") in ("fail", "error")]
        return (f"the record did not pass: failed {', '.join(bad) or 'none'}, missing "
                f"{', '.join(result.get('missing', [])) or 'none'}")
    skipped = [c["name"] for c in record["checks"] if c["verdict"] == "skipped" and c["name"] not in NEEDS_DEVICES]
    if skipped:
        return f"the record skipped {', '.join(skipped)}"
    device = record.get("device", {})
    for key, value in (("SoC", device.get("soc")), *((f"{k} version", record["versions"].get(k))
                                                     for k in ("torch_npu", "cann", "nnal"))):
        if not value:
            return f"the record does not say its {key}"
    return None


def npu_evidence(record: dict, sha256: str) -> dict:
    """The ``evidence.npu`` entry of compat_matrix.yaml for a record that passed
    :func:`conversion_problem`: its provenance, not its numbers (the record keeps those)."""
    versions = record["versions"]
    return {
        "run": "npu-verify",
        "command": record["command"],
        "record_schema": record["schema"],
        "record_sha256": sha256,
        "date": record["finished"][:10],
        "ascend_patch": record["ascend_patch"],
        "patch_set": record["patch_set"]["name"],
        "patch_set_digest": record["patch_set"]["digest"],
        "soc": record["device"]["soc"],
        "soc_family": record["device"].get("family"),
        "devices": record["device"]["count"],
        "versions": {key: versions.get(key) for key in
                     ("vllm", "torch", "torch_npu", "cann", "nnal", "driver", "transformers", "python")},
        "checks": {c["name"]: c["verdict"] for c in record["checks"]},
    }


def evidence_problem(evidence: object, version: str, patch_set: str) -> str | None:
    """Why ``evidence.npu`` of a matrix row is not the record of a passing hardware run of that
    row (the shape :func:`npu_evidence` writes), in one line; None if it is."""
    if not isinstance(evidence, dict):
        return "npu-verified needs the record of a run on Ascend hardware (scripts/record_matrix_run.py --evidence)"
    if evidence.get("run") != "npu-verify" or evidence.get("record_schema") != SCHEMA:
        return f"not written from an ascend-patch verify record of schema {SCHEMA}"
    if not re.fullmatch(r"[0-9a-f]{64}", str(evidence.get("record_sha256", ""))):
        return "record_sha256 must be the sha256 of the record file"
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(evidence.get("date", ""))):
        return "date must be the run's date, YYYY-MM-DD"
    if evidence.get("patch_set") != patch_set:
        return f"the run used patch set {evidence.get('patch_set')!r}, the row says {patch_set!r}"
    versions = evidence.get("versions")
    if not isinstance(versions, dict) or str(versions.get("vllm")) != version:
        return f"the run's vLLM is not {version}"
    for key in ("torch", "torch_npu", "cann", "nnal"):
        if not versions.get(key):
            return f"versions.{key} is missing"
    if not evidence.get("soc"):
        return "soc is missing"
    checks = evidence.get("checks")
    if not isinstance(checks, dict) or set(checks) != set(CHECKS):
        return f"checks must list exactly {', '.join(CHECKS)}"
    bad = [name for name, verdict in checks.items()
           if verdict != "pass" and not (verdict == "skipped" and name in NEEDS_DEVICES)]
    if bad:
        return f"checks that did not pass: {', '.join(bad)}"
    return None
