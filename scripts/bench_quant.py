"""W8A8 against the same model unquantised, on the emulated NPU (no NPU figures).

The tiny Llama, quantised here to msModelSlim AscendV1 (every attention and MLP linear layer
W8A8_DYNAMIC, or W8A8 static), against its float checkpoint, all bf16 (the serving dtype):

1. device launches per decode step per decoder layer: kernel-seam ops and other device ops,
   counted as scripts/bench_engine.py counts them;
2. emulated decode throughput at batch 1 and 32 (host overhead of the emulated path, reference
   kernels included: it says nothing about NPU speed);
3. the bytes of the loaded weights, as charged to the emulated HBM, and the KV blocks left.

    .venv/bin/python scripts/bench_quant.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench_engine  # noqa: E402

from ascend_patch.kit import quantized_models as make_quantized_models  # noqa: E402
from ascend_patch.kit import tiny_models as make_tiny_models  # noqa: E402

THROUGHPUT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, seed=0, max_num_seqs=32,
          distributed_executor_backend="uni")
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
tokens = int(sys.argv[2])
result = {"weights": runner.model_memory_usage,
          "kv_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
for batch in (1, 32):
    prompts = [TokensPrompt(prompt_token_ids=[(i * 7) % 500 + 3, 5, 9]) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    result[batch] = batch * tokens / (time.perf_counter() - start)
print(json.dumps(result))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    args = parser.parse_args()
    models = make_tiny_models.build(bench_engine.MODELS)
    llama = models["tiny-llama"]
    out = bench_engine.MODELS / "quantized"
    calibration = [list(range(3, 67)), list(range(100, 164))]
    variants = {
        "float": llama,
        "W8A8_DYNAMIC": make_quantized_models.ascend_v1(llama, out / "llama-w8a8-dynamic",
                                                        lambda module: "W8A8_DYNAMIC"),
        "W8A8 static": make_quantized_models.ascend_v1(llama, out / "llama-w8a8-static",
                                                       lambda module: "W8A8", calibration),
    }
    emulated = bench_engine._env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="1GiB")
    launches = {name: bench_engine._run(sys.executable, bench_engine.LAUNCHES,
                                        [str(path), "all", str(bench_engine.ROOT)], emulated)
                for name, path in variants.items()}
    speed = {name: bench_engine._run(sys.executable, THROUGHPUT, [str(path), str(args.tokens)],
                                     emulated) for name, path in variants.items()}
    names = list(variants)
    print("tiny Llama, bf16, emulated NPU: W8A8 (AscendV1) against the float checkpoint")
    print(f"{'':38}" + "".join(f"{name:>15}" for name in names))
    rows = [
        ("kernel-seam launches / layer / step", lambda n: bench_engine._total(launches[n]["seam"])),
        ("other device ops / layer / step", lambda n: bench_engine._total(launches[n]["aten"])),
        ("decode tokens/s, batch 1", lambda n: speed[n]["1"]),
        ("decode tokens/s, batch 32", lambda n: speed[n]["32"]),
        ("loaded weights, MiB", lambda n: speed[n]["weights"] / 2**20),
        ("KV blocks (1 GiB HBM, 0.9)", lambda n: speed[n]["kv_blocks"]),
    ]
    for label, value in rows:
        print(f"{label:38}" + "".join(f"{value(name):15.2f}" for name in names))
    for name in names:
        detail = ", ".join(f"{k} {v:g}" for k, v in sorted({**launches[name]["seam"],
                                                            **launches[name]["aten"]}.items()))
        print(f"  {name}: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
