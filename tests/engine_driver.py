"""Run stock vLLM's offline ``LLM`` in a fresh interpreter and report what it produced.

The engine tests start this script with ``ASCEND_PATCH=emulate`` in the environment:
the overlay reaches the process through the installed ``.pth``, exactly as it would
for a user's script, and nothing here imports ``ascend_patch`` before vLLM.

    python tests/engine_driver.py SPEC.json   ->   one JSON line on stdout

SPEC: {"engines": [{"model": DIR, "kwargs": {...LLM kwargs}, "runs": [RUN, ...]}]}
RUN, by "kind":
  "generate" (default)  {"prompts": [[token ids], ...], "sampling": [{...SamplingParams}, ...]}
  "chat"                {"conversations": [[message, ...], ...], "sampling": [...], "chat": {...}}
                        (``chat`` holds extra ``LLM.chat`` keyword arguments)
  "beam_search"         {"prompts": [[token ids], ...], "beam": {...BeamSearchParams}}
A sampling dict may carry "structured_outputs": {...StructuredOutputsParams}. One sampling
dict applies to every prompt, a list pairs them one by one.

Each run reports the kernel-seam launch counts for the whole run, what kinds of batch the
fused attention launches served ("fused_batches", see ``_fused_batches``) and, per prompt, the
generated token ids of the first completion ("tokens") and, when the sampling asks
for ``logprobs``, each one's log-probability ("logprobs"), the number of prompt tokens
served from the prefix cache, and "outputs": the prompt's token ids and prompt logprobs
and every completion with its tokens, text, finish reason and logprobs (per position a
list of [token id, logprob, rank]). A beam-search run reports its sequences instead.
Each run also reports the graph replays ("graph_replays", and by padded size); each engine
its vLLM-settled cudagraph mode, capture sizes and the graphs it captured. An engine spec with
``"stale_host_params": true`` runs with the graphs' host-parameter updates left out (the
negative control of the graph tests).
Each engine also reports what ascend-patch logged while it started and ran ("log").
A run that raises ends the driver with the traceback, unless SPEC has "report_errors": true:
then the run reports {"error": "Type: message"} and the engine goes on to the next run.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import os
import sys
import traceback

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


def _sampling_params(spec: dict):
    from vllm import SamplingParams

    spec = dict(spec)
    if "logit_bias" in spec:  # JSON object keys are strings
        spec["logit_bias"] = {int(token): bias for token, bias in spec["logit_bias"].items()}
    structured = spec.pop("structured_outputs", None)
    if structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        spec["structured_outputs"] = StructuredOutputsParams(**structured)
    return SamplingParams(**spec)


def _logprobs(positions) -> list | None:
    if positions is None:
        return None
    return [None if p is None else [[t, lp.logprob, lp.rank] for t, lp in p.items()] for p in positions]


def _request_outputs(outputs) -> dict:
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     if o.outputs[0].logprobs else None for o in outputs],
        "cached": [o.num_cached_tokens or 0 for o in outputs],
        "outputs": [
            {
                "prompt_token_ids": list(o.prompt_token_ids),
                "prompt_logprobs": _logprobs(o.prompt_logprobs),
                "completions": [
                    {"tokens": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": _logprobs(c.logprobs)}
                    for c in o.outputs
                ],
            }
            for o in outputs
        ],
    }


def _run(llm, run: dict) -> dict:
    from vllm.inputs import TokensPrompt

    kind = run.get("kind", "generate")
    if kind == "beam_search":
        from vllm.sampling_params import BeamSearchParams

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
        outputs = llm.beam_search(prompts, BeamSearchParams(**run["beam"]))
        return {"beams": [[{"tokens": list(s.tokens), "cum_logprob": s.cum_logprob, "text": s.text}
                           for s in o.sequences] for o in outputs]}
    count = len(run["prompts"] if kind == "generate" else run["conversations"])
    params = [_sampling_params(s) for s in run["sampling"]]
    if len(params) == 1:
        params = params * count
    if kind == "chat":
        outputs = llm.chat(run["conversations"], params, use_tqdm=False, **run.get("chat", {}))
    else:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return _request_outputs(outputs)


@contextlib.contextmanager
def _fused_batches(kernels):
    """Count ``fused_infer_attention_score`` launches by the batch they served, from the query
    and KV lengths the backend passed: "mixed" holds decode rows (one query token) next to
    longer queries; "with_context" holds a multi-token query behind KV already in the cache
    (a chunked-prefill continuation or a prefix-cache hit)."""
    kinds = collections.Counter()
    launch = kernels.fused_infer_attention_score

    def classify(*args, **kwargs):
        ends = kwargs.get("actual_seq_lengths")
        if ends is None:  # BSH one-token queries (windowed decode): neither kind
            return launch(*args, **kwargs)
        query_lens = [end - start for start, end in zip([0, *ends[:-1]], ends)]
        kv_lens = kwargs["actual_seq_lengths_kv"]
        kinds["mixed"] += 1 in query_lens and max(query_lens) > 1
        kinds["with_context"] += any(1 < q < kv for q, kv in zip(query_lens, kv_lens))
        return launch(*args, **kwargs)

    kernels.fused_infer_attention_score = classify
    try:
        yield kinds
    finally:
        kernels.fused_infer_attention_score = launch


def _run_engine(spec: dict, report_errors: bool) -> dict:
    from ascend_patch.npu.compilation import acl_graph

    reissue = acl_graph._reissue
    if spec.get("stale_host_params"):
        acl_graph._reissue = lambda graphs, stream, update, params, buffer: None
    recorder = _Recorder()
    logging.getLogger("vllm.ascend_patch").addFilter(recorder)
    try:
        result = _generate(spec, acl_graph.NPUGraphWrapper, report_errors)
    finally:
        acl_graph._reissue = reissue
        logging.getLogger("vllm.ascend_patch").removeFilter(recorder)
    return {**result, "log": recorder.messages}


def _generate(spec: dict, wrapper, report_errors: bool) -> dict:
    from vllm import LLM

    from ascend_patch.npu import kernels

    captures = wrapper.captures
    kwargs = {"distributed_executor_backend": "uni", "seed": 0, **spec.get("kwargs", {})}
    try:
        llm = LLM(model=spec["model"], **kwargs)
    except Exception as exc:  # reported, so tests can assert on configuration errors
        return {"error": f"{type(exc).__name__}: {exc}"}
    config = llm.llm_engine.vllm_config
    result = {
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
        "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
        "graph_captures": wrapper.captures - captures,
        "runs": [],
    }
    for run in spec["runs"]:
        replays = wrapper.replays.copy()
        with kernels.count_launches() as launches, _fused_batches(kernels) as batches:
            try:
                report = _run(llm, run)
            except Exception as exc:
                if not report_errors:
                    raise
                # e.g. a rejected request: the next run shows whether the engine survived it
                traceback.print_exc()
                report = {"error": f"{type(exc).__name__}: {exc}"}
        by_size = wrapper.replays - replays
        result["runs"].append({**report, "launches": dict(launches), "fused_batches": dict(batches),
                               "graph_replays": sum(by_size.values()),
                               "graph_replays_by_size": {str(size): n for size, n in sorted(by_size.items())}})
    # vLLM <= 0.32 keeps a deleted in-process engine alive unless it is shut down, and
    # freezes the heap when its engine core starts (gc.freeze()): shut down and unfreeze so
    # this engine's tensors, and the emulated HBM they hold, are freed before the next one.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.unfreeze()
    gc.collect()
    return result


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = [_run_engine(engine, spec.get("report_errors", False)) for engine in spec["engines"]]
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
