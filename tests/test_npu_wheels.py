"""The NPU path against the real torch-npu wheels (tests/npu_wheels.py): every call the emulated
engine makes through the kernel seam, replayed through ``ascend_patch/npu/kernels/npu.py`` into a
stand-in torch_npu whose ops are the wheel's own schemas and meta kernels, must bind on every
torch-npu release the matrix names and return the shapes and dtypes the reference returned.

The calls are recorded (``kernels.record_calls``) from one engine-driver process running a compact
workload per family: dense with prefix caching, chunked prefill and decode graphs (bf16 and fp16),
the sampler's top-k/top-p, sliding-window attention, MLA, MoE (softmax and grouped biased routing)
and W8A8 (static, dynamic and MoE). The replay runs on meta tensors: binding is the real
dispatcher's, the shapes and dtypes the wheel's meta kernels'. Ops the wheel has no meta kernel for
(the ATB paged attention) are checked for binding only.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import npu
from tests import npu_wheels
from tests.conftest import ROOT, prompt_token_ids, run_engine

VERSIONS = npu_wheels.matrix_versions()

PROMPT_LENGTHS = [3, 17, 150]
MAX_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# One sampling per prompt: top-k and top-p, top-p alone, top-k alone (the sampler's three calls).
SAMPLED = [{"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 1, "max_tokens": MAX_TOKENS},
           {"temperature": 0.8, "top_p": 0.9, "seed": 2, "max_tokens": MAX_TOKENS},
           {"temperature": 0.8, "top_k": 5, "seed": 3, "max_tokens": MAX_TOKENS}]
# 64-token chunks: the 150-token prompt prefills in three steps beside the others' decodes; the
# second run is served from the prefix cache.
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "gpu_memory_utilization": 0.9,
          "enable_prefix_caching": True, "enable_chunked_prefill": True,
          "max_num_batched_tokens": 64}
# family -> (model, dtype, extra engine arguments, samplings of the second run)
FAMILIES = {
    "dense": ("tiny-llama", "bfloat16", {}, SAMPLED),
    "dense fp16": ("tiny-qwen2", "float16", {}, [GREEDY]),
    "windowed": ("tiny-mistral", "bfloat16", {}, [GREEDY]),
    "mla": ("tiny-deepseek-v3", "bfloat16", {}, [GREEDY]),
    "moe grouped": ("tiny-deepseek-v3-moe", "bfloat16", {}, [GREEDY]),
    "moe softmax": ("tiny-qwen3-moe", "bfloat16", {}, [GREEDY]),
    "w8a8": ("w8a8", "bfloat16", {"quantization": "ascend"}, [GREEDY]),
    "w8a8 moe": ("w8a8-moe", "bfloat16", {}, [GREEDY]),
}


def _checkpoints(tiny_models, root):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_quantized_models as quantize
    finally:
        sys.path.pop(0)
    qwen2 = tiny_models["tiny-qwen2"]
    # Static W8A8 attention (npu_quantize before the matmul), dynamic W8A8 MLP (npu_dynamic_quant).
    w8a8 = quantize.ascend_v1(qwen2, root / "w8a8",
                              lambda module: "W8A8" if "self_attn" in module else "W8A8_DYNAMIC",
                              prompt_token_ids(qwen2, [64, 64]), bf16_model=True)
    moe = quantize.ascend_v1(tiny_models["tiny-qwen3-moe"], root / "w8a8-moe",
                             lambda module: "W8A8_DYNAMIC")
    return {**tiny_models, "w8a8": w8a8, "w8a8-moe": moe}


@pytest.fixture(scope="module")
def seam_calls(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("npu-wheels")
    models = _checkpoints(tiny_models, root)
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    engines = [{"model": str(models[model]), "kwargs": {**ENGINE, "dtype": dtype, **extra},
                "runs": [{"prompts": prompts, "sampling": [GREEDY]},
                         {"prompts": prompts, "sampling": second}]}
               for model, dtype, extra, second in FAMILIES.values()]
    result = run_engine({"engines": engines, "record_seam": True}, root, timeout=1200)
    assert result["platform"] == "EmulatedNPUPlatform"
    for family, engine in zip(FAMILIES, result["engines"]):
        assert "error" not in engine, (family, engine["error"])
    return result["seam_calls"]


def test_the_workload_reaches_every_op_the_engine_calls(seam_calls):
    """Every seam op but one is called: moe_finalize_routing has a reference and a real path,
    but no layer calls it (the MoE path combines with npu_moe_token_unpermute)."""
    assert {call["op"] for call in seam_calls} == set(kernels.OPS) - {"moe_finalize_routing"}


# --- the replay -----------------------------------------------------------------------------------


def _meta(description):
    """A recorded argument as a meta tensor of the same layout (or the value itself)."""
    if isinstance(description, dict):
        if "tensor" in description:
            t = description["tensor"]
            size = 1 + sum((n - 1) * s for n, s in zip(t["shape"], t["stride"]) if n)
            storage = torch.empty(t["offset"] + size, dtype=getattr(torch, t["dtype"]),
                                  device="meta")
            return storage.as_strided(t["shape"], t["stride"], t["offset"])
        if "dtype" in description:
            return getattr(torch, description["dtype"])
        if "list" in description:
            return [_meta(item) for item in description["list"]]
        return tuple(_meta(item) for item in description["tuple"])
    return description


def layout(description):
    """Shapes and dtypes of a result, tensor by tensor, as ``shape/dtype`` strings."""
    if isinstance(description, dict):
        if "tensor" in description:
            t = description["tensor"]
            return f"{tuple(t['shape'])}/{t['dtype']}"
        if "dtype" in description:
            return description["dtype"]
        return [layout(item) for item in description.get("list", description.get("tuple", []))]
    return description


# What the dispatcher says when an op has no Meta kernel (the op's qualified name first).
_NO_META_KERNEL = re.compile(r"^\w+::(\w+): attempted to run this operator with Meta tensors")


def replay(wheel, torch_npu, call) -> str | None:
    """Make the recorded call through the exact real-path function with ``torch_npu`` installed;
    None if it binds and the meta kernel's shapes and dtypes are the reference's, else why not."""
    args = _meta(call["args"])
    kwargs = {name: _meta(value) for name, value in call["kwargs"].items()}
    try:
        out = getattr(npu, call["op"])(*args, **kwargs)
    except NotImplementedError as exc:
        missing = _NO_META_KERNEL.match(str(exc))
        if missing and missing.group(1) not in wheel.meta:
            return None  # bound; the wheel has no meta kernel to give shapes
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with the call
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    found, expected = layout(kernels.describe(out)), layout(call["out"])
    return None if found == expected else f"returns {found}, the reference {expected}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_recorded_call_binds_and_matches_the_meta_kernel(version, seam_calls, monkeypatch):
    wheel = npu_wheels.load(version)
    torch_npu = npu_wheels.stand_in(wheel)
    monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
    failures = {}
    for call in seam_calls:
        problem = replay(wheel, torch_npu, call)
        if problem:
            failures.setdefault((call["op"], problem), call)
    assert not failures, f"torch-npu {version}:\n" + "\n".join(
        f"{op}: {problem}\n    e.g. {op}{tuple(layout(call['args']))} "
        f"{ {name: layout(value) for name, value in call['kwargs'].items()} }"
        for (op, problem), call in failures.items())
