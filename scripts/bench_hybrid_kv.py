"""KV blocks and maximum concurrent sequences for the same emulated HBM: vLLM's hybrid KV-cache
manager on against off, for the windowed tiny models (emulated: no NPU figures).

Each engine starts on the emulated NPU with the same emulated HBM and memory utilisation, once
with the hybrid manager (vLLM's default where the platform supports it: one KV-cache group per
layer of the model's pattern, windowed groups holding only their windows' blocks) and once with
``disable_hybrid_kv_cache_manager`` (every layer in one full-attention group). The figures are
vLLM's own: the KV-cache config's block count and groups, and its maximum concurrency for
requests of ``--max-model-len`` tokens (``get_max_concurrency_for_kv_cache_config``, the figure
vLLM logs at start-up; a windowed group counts its window plus one step's tokens,
``--max-num-batched-tokens``). About 40 s per model.

    flock /tmp/ascend-engine.lock .venv/bin/python scripts/bench_hybrid_kv.py [--max-model-len 2048] [--model tiny-gemma3 ...]
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
NAMES = ["tiny-gemma3-5to1", "tiny-gemma3", "tiny-gemma2", "tiny-mistral"]

# Runs inside the engine's interpreter; prints one JSON line.
PLAN = """
import json, sys
from vllm import LLM  # noqa: F401 - vLLM first: the overlay comes in through its .pth
from ascend_patch.kit import engine

model, max_model_len, batched = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
result = {}
for hybrid in (True, False):
    llm, facts = engine.start(model, dtype="bfloat16", max_model_len=max_model_len,
                              max_num_batched_tokens=batched, gpu_memory_utilization=0.9,
                              enforce_eager=True, disable_hybrid_kv_cache_manager=not hybrid)
    result["on" if hybrid else "off"] = facts["kv_cache"]
    engine.shutdown(llm)
print(json.dumps(result))
"""


def _run(model: str, max_model_len: int, batched: int, hbm: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM=hbm)
    proc = subprocess.run([sys.executable, "-c", PLAN, model, str(max_model_len), str(batched)],
                          env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _groups(plan: dict) -> str:
    windows = [group["sliding_window"] for group in plan["groups"]]
    full = windows.count(None)
    return f"{full} full + {len(windows) - full} windowed" if len(windows) > 1 else plan["groups"][0]["spec"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", action="append", help="a windowed model of ascend_patch/kit/tiny_models.py "
                        f"(repeatable; default: {', '.join(NAMES)})")
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens per request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per step")
    parser.add_argument("--hbm", default="256MiB", help="the emulated HBM (ASCEND_PATCH_EMULATED_HBM)")
    args = parser.parse_args()
    from ascend_patch.kit import tiny_models

    models = tiny_models.build(MODELS, args.model or NAMES)
    print(f"emulated NPU, emulated HBM {args.hbm}, bf16, requests of {args.max_model_len} tokens, "
          f"{args.max_num_batched_tokens} tokens per step (vLLM's KV-cache config)")
    print(f"{'model':18} {'manager':8} {'KV groups':22} {'KV blocks':>10} {'max concurrency':>16}")
    for name, path in models.items():
        plans = _run(str(path), args.max_model_len, args.max_num_batched_tokens, args.hbm)
        for manager in ("on", "off"):
            plan = plans[manager]
            print(f"{name:18} {'hybrid' if manager == 'on' else 'one grp':8} {_groups(plan):22} "
                  f"{plan['num_blocks']:>10} {plan['max_concurrency']:>16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
