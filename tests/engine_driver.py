"""Run stock vLLM's offline ``LLM`` in a fresh interpreter and report what it produced.

The engine tests start this script with ``ASCEND_PATCH=emulate`` in the environment:
the overlay reaches the process through the installed ``.pth``, exactly as it would
for a user's script, and nothing here imports ``ascend_patch`` before vLLM.

    python tests/engine_driver.py SPEC.json   ->   one JSON line on stdout

SPEC: {"engines": [{"model": DIR, "kwargs": {...LLM kwargs}, "runs": [
          {"prompts": [[token ids], ...], "sampling": [{...SamplingParams}, ...]}]}]}
Each run reports per prompt the generated token ids (and their log-probabilities when the
sampling asks for ``logprobs``) and the number of prompt tokens served from the prefix
cache, plus the kernel-seam launch counts for the whole run; each engine reports what
ascend-patch logged while it started and ran.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class _Recorder(logging.Filter):
    """Records what ascend-patch logs. A filter, not a handler: vLLM's logging setup, which
    also runs when the first engine is built, drops the handlers of the vllm.* loggers but
    keeps their filters."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def filter(self, record):
        self.messages.append(record.getMessage())
        return True


def _run_engine(spec: dict) -> dict:
    recorder = _Recorder()
    logging.getLogger("vllm.ascend_patch").addFilter(recorder)
    try:
        result = _generate(spec)
    finally:
        logging.getLogger("vllm.ascend_patch").removeFilter(recorder)
    return {**result, "log": recorder.messages}


def _generate(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ascend_patch.npu import kernels

    kwargs = {"distributed_executor_backend": "uni", "seed": 0, **spec.get("kwargs", {})}
    try:
        llm = LLM(model=spec["model"], **kwargs)
    except Exception as exc:  # reported, so tests can assert on configuration errors
        return {"error": f"{type(exc).__name__}: {exc}"}
    config = llm.llm_engine.vllm_config
    result = {
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "runs": [],
    }
    for run in spec["runs"]:
        params = [SamplingParams(**s) for s in run["sampling"]]
        if len(params) == 1:
            params = params * len(run["prompts"])
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
        with kernels.count_launches() as launches:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        result["runs"].append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "cached": [o.num_cached_tokens or 0 for o in outputs],
                "launches": dict(launches),
                # With SamplingParams(logprobs=0): each generated token's log-probability.
                "logprobs": [[step[token].logprob for step, token in
                              zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                             if o.outputs[0].logprobs else None for o in outputs],
            }
        )
    del llm
    gc.collect()
    return result


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = [_run_engine(engine) for engine in spec["engines"]]
    from vllm.platforms import current_platform

    print(
        json.dumps(
            {
                "platform": type(current_platform).__name__,
                "vllm_C_imported": any(m == "vllm._C" or m.startswith("vllm._C.") for m in sys.modules),
                "engines": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
