"""``ascend-patch verify`` (the hardware acceptance kit) and how its record becomes matrix evidence.

CI has no NPU, so it runs the kit the only way it can: ``verify --emulate``, the same checks in the
same code on the emulated NPU, once per module. Its record must pass, and then round-trip through
``scripts/record_matrix_run.py --evidence`` into a copy of the matrix: refused as it is (an emulated
run is never npu-verified evidence), and accepted once relabelled ``mode: npu`` by this test, a
fixture of the conversion labelled as such in every field it carries into the matrix (it is not
evidence of anything).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from ascend_patch.kit import checks, record
from ascend_patch.overlay import decision, matrix
from ascend_patch.overlay.declarations import applies_to
from tests.helpers.engine import MODELS_DIR
from tests.helpers.patch_sets import installed
from tests.helpers.process import ROOT, clean_env

INSTALLED = installed()

FIXTURE = "fixture: an emulated record relabelled by tests/test_verify.py, not hardware"


def _verify(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascend_patch", "verify", *args], env=clean_env(),
                          capture_output=True, text=True, timeout=1500, cwd=cwd)


@pytest.fixture(scope="module")
def emulated(tiny_models, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    tmp = tmp_path_factory.mktemp("verify")
    out = tmp / "record.json"
    proc = _verify("--emulate", "--models", str(MODELS_DIR), "--output", str(out), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc, json.loads(out.read_text()), out


def test_without_an_npu_verify_says_so_in_one_line_and_exits_2(tmp_path):
    proc = _verify("--output", str(tmp_path / "record.json"), cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("ascend-patch verify: no NPU is usable here (torch_npu is not installed)")
    assert "ascend-patch verify --emulate" in line
    assert proc.stdout == "" and not (tmp_path / "record.json").exists()


def test_emulated_verify_passes_every_check_with_one_progress_line_each(emulated):
    proc, data, _ = emulated
    assert (data["schema"], data["kind"], data["mode"], data["complete"]) == (1, "ascend-patch-verify", "emulate", True)
    assert data["note"].startswith("emulated")
    assert [c["name"] for c in data["checks"]] == list(record.CHECKS)
    assert {c["name"]: c["verdict"] for c in data["checks"]} == dict.fromkeys(record.CHECKS, "pass")
    assert data["summary"] == {"pass": len(record.CHECKS), "fail": 0, "error": 0, "skipped": 0,
                               "missing": [], "verdict": "pass"}
    total = len(record.CHECKS)
    progress = [match.groups() for line in proc.stdout.splitlines()
                if (match := re.match(r"^\[\s*(\d+)/(\d+)\] (\S+)\s+(\S+)", line))]
    assert progress == [(str(i), str(total), name, "PASS") for i, name in enumerate(record.CHECKS, 1)]
    started = re.findall(r"^ascend-patch verify: starting the (\S+) engine \(", proc.stdout, re.MULTILINE)
    assert started == list(dict.fromkeys(c["family"] for c in data["checks"])), "a line as each family starts"
    assert proc.stdout.splitlines()[-1].startswith(f"ascend-patch verify: PASS: {total} passed, 0 failed")
    assert "(emulated)" in proc.stdout.splitlines()[-1]


def test_the_record_carries_versions_numbers_and_timing(emulated):
    _, data, _ = emulated
    from importlib.metadata import version

    assert data["versions"]["vllm"] == version("vllm") and data["versions"]["torch_npu"] is None
    assert data["device"] == {"name": "Ascend NPU (emulated on CPU, 1.0 GiB HBM)", "soc": None,
                              "soc_version": None, "family": None, "count": 2, "emulated": True}
    table = matrix.load()
    patch_set = table.select(data["versions"]["vllm"]).patch_set.name
    release = Version(data["versions"]["vllm"])
    declarations = [d for d in decision.load_patch_set(table, patch_set) if applies_to(d, release)]
    assert data["patch_set"] == {"name": patch_set, "declarations": len(declarations),
                                 "digest": record.patch_set_digest(declarations)}
    checks = {c["name"]: c for c in data["checks"]}
    for check in checks.values():
        numbers = check["numbers"]
        assert numbers["tokens"] > 0 and numbers["exact"] > 0, check
        if "allowed_beyond_tolerance" in numbers:  # MoE routing: a few flips allowed (oracle.logit_tracking)
            assert numbers["beyond_tolerance"] <= numbers["allowed_beyond_tolerance"], check
        else:
            assert 0 <= numbers["worst_gap"] <= numbers["worst_gap_tolerance"], check
        assert check["seconds"] >= 0
    assert checks["prefix-cache"]["numbers"]["cached_tokens"] == 4 * 256
    assert checks["paged-attention"]["numbers"]["paged_attention_launches"] > 0
    assert checks["graphs"]["numbers"]["graph_replays"] > 0
    assert checks["mla"]["numbers"]["run1"]["mla_decode_launches"] > 0
    assert checks["w8a8"]["numbers"]["quant_matmul"] > 0
    assert checks["kv-offload"]["numbers"]["cached_tokens"] == 4 * 256
    for name, family in data["families"].items():
        assert family["startup_seconds"] > 0 and family["seconds"] >= family["startup_seconds"], name
        assert all(run["launches"] for run in family["runs"]) or name == "tp", name
    assert data["seconds"] > 0


# -- every check can fail: the record's runs scored again, altered ----------------------------------


@pytest.fixture(scope="module")
def rescored(emulated, tiny_models, tmp_path_factory):
    """Each family of the emulated record with its models (the W8A8 checkpoint rebuilt the
    same way), so its checks can score the recorded runs again."""
    _, data, _ = emulated
    models = {**tiny_models, "tiny-qwen2-w8a8": checks.w8a8_checkpoint(tiny_models, tmp_path_factory.mktemp("w8a8"))}
    return data, {family.name: (family, models[family.model]) for family in checks.families(models)}


def _score(rescored, name: str, alter=None):
    data, families = rescored
    family, model_dir = next(entry for entry in families.values() if name in entry[0].checks)
    facts = copy.deepcopy(data["families"][family.name])
    requests = family.requests(model_dir)
    assert len(requests) == len(facts["runs"])
    runs = [checks.Run(prompts, report) for (prompts, _), report in zip(requests, facts["runs"])]
    state = checks.State(model_dir, family.dtype, facts, runs)
    if alter:
        alter(state)
    return family.checks[name](state)


def _wrong_tokens(state):
    for run in state.runs:
        run.report["tokens"] = [[(token + 7) % 512 for token in tokens] for tokens in run.tokens]


@pytest.mark.parametrize("name", list(record.CHECKS))
def test_every_check_passes_on_its_run_and_fails_on_other_tokens(rescored, name):
    detail, numbers = _score(rescored, name)
    assert numbers["tokens"] > 0, detail
    with pytest.raises(checks.Failed):
        _score(rescored, name, _wrong_tokens)


def _launches(**changes):
    def alter(state):
        for run in state.runs:
            run.report["launches"].update(changes)
    return alter


@pytest.mark.parametrize(("name", "alter", "problem"), [
    ("fia-attention", _launches(scatter_pa_kv_cache=10**6), "some layer-steps ran composed"),
    ("paged-attention", _launches(paged_attention=0), "fused attention launches for"),
    ("chunked-prefill", lambda s: s.runs[0].report["fused_batches"].update(mixed=0), "no launch held decode rows"),
    ("prefix-cache", lambda s: s.runs[1].report.update(cached=[0, 0, 0, 0]), "served from the cache: [0, 0, 0, 0]"),
    ("sampler", lambda s: s.runs[3].report.update(tokens=s.runs[2].tokens[::-1]), "did not repeat"),
    ("graphs", lambda s: s.runs[0].report.update(graph_replays=0), "no decode step replayed a graph"),
    ("graphs", _launches(paged_attention_workspace=1), "paged-attention updates for"),
    ("mla", _launches(paged_attention=1), "standard attention ran on an MLA model"),
    ("moe-grouped-routing", _launches(grouped_matmul=1), "not two grouped matmuls per dispatch"),
    ("moe", _launches(moe_gating_top_k_softmax_v2=0), "no npu_moe_gating_top_k_softmax_v2 launch"),
    ("w8a8", _launches(quant_matmul=0), "no npu_quant_matmul launch"),
    ("kv-offload", lambda s: s.runs[2].report.update(cached=[0, 0, 0, 0]), "served after eviction: [0, 0, 0, 0]"),
    ("kv-offload", _launches(swap_blocks=0), "block copies: 0 while storing"),
])
def test_a_check_fails_when_its_kernels_did_not_run_as_they_must(rescored, name, alter, problem):
    with pytest.raises(checks.Failed, match=re.escape(problem)):
        _score(rescored, name, alter)


# -- the record and the matrix ------------------------------------------------------------------------


def _convert(record_path: Path, matrix_copy: Path, *version: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "record_matrix_run.py"), *version,
                           "--evidence", str(record_path), "--matrix", str(matrix_copy)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture
def matrix_copy(tmp_path) -> Path:
    path = tmp_path / "compat_matrix.yaml"
    shutil.copy(ROOT / "compat_matrix.yaml", path)
    return path


def _labelled_npu(data: dict) -> dict:
    """The emulated record relabelled as an NPU run: a fixture of the conversion only, saying so
    in every field that reaches the matrix."""
    fixture = copy.deepcopy(data)
    fixture.update(mode="npu", note=FIXTURE, command=f"ascend-patch verify ({FIXTURE})")
    fixture["device"].update(name=FIXTURE, soc=FIXTURE, family=None, emulated=False)
    fixture["versions"].update(torch_npu=FIXTURE, cann=FIXTURE, nnal=FIXTURE, driver=FIXTURE)
    return fixture


def _write_record(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "fixture-record.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def _refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert ": refused: " in line
    return line


def test_an_emulated_record_is_refused_for_npu_verified(emulated, matrix_copy):
    _, _, path = emulated
    before = matrix_copy.read_bytes()
    line = _refusal(_convert(path, matrix_copy))
    assert "made in 'emulate' mode, not on an NPU" in line
    assert matrix_copy.read_bytes() == before


def test_a_passing_npu_labelled_record_becomes_npu_verified_with_its_provenance(emulated, matrix_copy, tmp_path):
    _, data, _ = emulated
    fixture = _labelled_npu(data)
    path = _write_record(tmp_path, fixture)
    readme = (ROOT / "README.md").read_bytes()
    version = fixture["versions"]["vllm"]
    before = matrix.load(matrix_copy).versions[version]
    proc = _convert(path, matrix_copy)
    assert proc.returncode == 0, proc.stderr
    assert (ROOT / "README.md").read_bytes() == readme, "a copy of the matrix never touches the README"
    entry = matrix.load(matrix_copy).versions[version]
    assert entry.status == "npu-verified" and str(entry.date) == fixture["finished"][:10]
    npu = entry.evidence["npu"]
    assert npu["record_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert npu["soc"] == FIXTURE and npu["versions"]["cann"] == FIXTURE and npu["versions"]["vllm"] == version
    assert npu["patch_set"] == entry.patch_set and npu["patch_set_digest"] == fixture["patch_set"]["digest"]
    assert npu["checks"] == dict.fromkeys(record.CHECKS, "pass")
    assert npu["devices"] == 2 and npu["record_schema"] == 1 and npu["run"] == "npu-verify"
    assert {k: v for k, v in entry.evidence.items() if k != "npu"} == before.evidence, "the other evidence stays"
    # The matrix validation demands that evidence: without the SoC the row is refused.
    text = yaml.safe_load(matrix_copy.read_text())
    del text["versions"][version]["evidence"]["npu"]["soc"]
    matrix_copy.write_text(yaml.safe_dump(text))
    with pytest.raises(matrix.MatrixError, match=rf"versions\.{re.escape(version)}\.evidence\.npu: soc is missing"):
        matrix.load(matrix_copy)


def _failed(data):
    data["checks"][0]["verdict"] = "fail"
    data["summary"] = record.summary(data["checks"])


def _missing(data):
    data["checks"] = data["checks"][:-2]
    data["summary"] = record.summary(data["checks"])


@pytest.mark.parametrize(("mutate", "version", "problem"), [
    (_failed, (), "the record did not pass: failed fia-attention, missing none"),
    (_missing, (), "the record did not pass: failed none, missing kv-offload, tp"),
    (lambda d: None, ("0.32.0",), f"the record ran vLLM {INSTALLED.vllm}, not 0.32.0"),
    (lambda d: d["patch_set"].update(name="v0_20"), (),
     f"the record ran patch set v0_20, the matrix puts {INSTALLED.vllm} in {INSTALLED.patch_set}"),
    (lambda d: d["patch_set"].update(digest="0" * 64), (), "declared other targets than this checkout's"),
    (lambda d: d["device"].update(soc=None), (), "the record does not say its SoC"),
    (lambda d: d["versions"].update(nnal=None), (), "the record does not say its nnal version"),
    (lambda d: d.update(schema=2), (), "record schema 2, this ascend-patch reads schema 1"),
    (lambda d: d["checks"][0].pop("verdict"), (), "a malformed record (KeyError: 'verdict')"),
])
def test_record_matrix_run_refuses_a_record_that_is_not_evidence_of_the_row(
        emulated, matrix_copy, tmp_path, mutate, version, problem):
    _, data, _ = emulated
    fixture = _labelled_npu(data)
    assert fixture["versions"]["vllm"] == INSTALLED.vllm
    mutate(fixture)
    before = matrix_copy.read_bytes()
    line = _refusal(_convert(_write_record(tmp_path, fixture), matrix_copy, *version))
    assert problem in line
    assert matrix_copy.read_bytes() == before


def test_record_matrix_run_refuses_what_is_not_a_record(matrix_copy, tmp_path):
    path = tmp_path / "record.json"
    path.write_text("<html>not json</html>")
    assert "not a readable JSON record" in _refusal(_convert(path, matrix_copy, INSTALLED.vllm))
    path.write_text(json.dumps({"versions": {"vllm": INSTALLED.vllm}}))
    assert _refusal(_convert(path, matrix_copy)).endswith("refused: not an ascend-patch verify record")


def test_the_npu_record_names_the_soc_and_stack_torch_npu_reports(monkeypatch):
    """What verify records of the device on an NPU, from a stand-in torch_npu answering as the
    documented API does on an Atlas 800I A2 (npu.get_device_name, npu.device_count,
    npu.utils.get_soc_version / get_cann_version); the stand-in proves the record's wiring only."""
    import types

    from ascend_patch.cli import verify
    from ascend_patch.npu.kernels import npu

    versions = {"CANN": "8.5.0", "DRIVER": "25.2.0"}
    utils = types.SimpleNamespace(get_soc_version=lambda: 223, get_cann_version=versions.__getitem__)
    stand_in = types.SimpleNamespace(npu=types.SimpleNamespace(
        utils=utils, get_device_name=lambda index=None: "Ascend910B3", device_count=lambda: 8))
    monkeypatch.setattr(npu, "_torch_npu", lambda: stand_in)
    device, stack = verify._device(emulated=False)
    assert device == {"name": "Ascend910B3", "soc": "Ascend910B3", "soc_version": 223, "family": "A2",
                      "count": 8, "emulated": False}
    assert stack == {"soc": "Ascend910B3", "soc_version": 223, "cann": "8.5.0", "driver": "25.2.0"}
