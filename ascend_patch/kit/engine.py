"""One in-process vLLM engine on the activated NPU platform, and what its requests launched.

Shared by ``ascend-patch verify`` and the engine tests' driver (tests/engine_driver.py): vLLM is
imported by the caller first, so the overlay is already active when these functions run.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
from pathlib import Path


@contextlib.contextmanager
def ascend_patch_log():
    """Yield the list of messages ascend-patch logs while the block runs. A filter, not a
    handler: vLLM's logging setup, which also runs when the first engine is built, drops the
    handlers of the vllm.* loggers but keeps their filters."""
    messages: list[str] = []
    logger = logging.getLogger("vllm.ascend_patch")

    def keep(record: logging.LogRecord) -> bool:
        messages.append(record.getMessage())
        return True

    logger.addFilter(keep)
    try:
        yield messages
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def fused_batches(kernels):
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


@contextlib.contextmanager
def measured():
    """Yield a dict that, once the block ends, holds what the block launched in this process:
    kernel-seam launches by op ("launches"), fused-attention launches by batch kind
    ("fused_batches"), ACL graph replays ("graph_replays"; by padded size, by model tag, and by
    model tag and size: "backbone" the target's, "eagle_head" or "draft_model" a drafter's pieces
    on the V1 runner, "drafter" a drafter's FULL graphs on Model Runner V2), captures
    ("graph_captures") and the captured launches re-issued before replays ("task_updates")."""
    from ascend_patch.npu import kernels
    from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper

    report: dict = {}
    replays, captures = NPUGraphWrapper.replays.copy(), NPUGraphWrapper.captures
    updates = NPUGraphWrapper.task_updates
    with kernels.count_launches() as launches, fused_batches(kernels) as batches:
        try:
            yield report
        finally:
            by_size: collections.Counter[int] = collections.Counter()
            sizes_by_model: dict[str, dict[str, int]] = {}
            for (model, size), n in sorted((NPUGraphWrapper.replays - replays).items()):
                by_size[size] += n
                sizes_by_model.setdefault(model, {})[str(size)] = n
            report.update(launches=dict(launches), fused_batches=dict(batches),
                          graph_replays=sum(by_size.values()),
                          graph_captures=NPUGraphWrapper.captures - captures,
                          task_updates=NPUGraphWrapper.task_updates - updates,
                          graph_replays_by_size={str(size): n for size, n in sorted(by_size.items())},
                          graph_replays_by_model={model: sum(sizes.values())
                                                  for model, sizes in sizes_by_model.items()},
                          graph_replays_by_model_size=sizes_by_model)


def freeze_heap() -> None:
    """Keep every object alive now out of later garbage collections. vLLM runs about twenty
    full ``gc.collect()`` per engine start-up and shut-down, each scanning the whole heap (torch,
    vLLM and transformers modules): on CPU about half of a tiny engine's start-up. What a later
    engine allocates stays collectable; :func:`shutdown` unfreezes, collects and freezes again."""
    gc.collect()
    gc.freeze()


def start(model: str, **kwargs):
    """``(llm, facts)``: the engine (seed 0, in-process unless ``kwargs`` pick another executor)
    and what vLLM settled for it: KV blocks, block size, graph mode, capture sizes, graphs captured."""
    from vllm import LLM

    from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper

    captures = NPUGraphWrapper.captures
    llm = LLM(model=model, **{"distributed_executor_backend": "uni", "seed": 0, **kwargs})
    config = llm.llm_engine.vllm_config
    facts = {
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
        "async_scheduling": config.scheduler_config.async_scheduling,
        "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
        "graph_captures": NPUGraphWrapper.captures - captures,
        "kv_cache": kv_cache_plan(llm),
    }
    return llm, facts


def kv_cache_plan(llm) -> dict | None:
    """What vLLM's KV-cache config for the engine's worker holds: blocks, groups (spec kind,
    layers, window, page bytes), vLLM's maximum concurrency at
    max_model_len, and the bytes charged to the emulated HBM as KV cache (None on an NPU); None unless the
    engine core and its worker run in this process, and for a model without a KV cache."""
    from vllm.platforms import current_platform
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # not a seam: in-process client
    worker = getattr(core and core.model_executor, "driver_worker", None)  # not a seam: uni executor
    if worker is None:
        return None
    config = worker.worker.model_runner.kv_cache_config
    vllm_config = llm.llm_engine.vllm_config
    if not any(group.kv_cache_spec.max_memory_usage_bytes(vllm_config)
               for group in config.kv_cache_groups):
        return None  # encoder-only layers cache nothing (vLLM's concurrency ratio divides by 0)
    books = getattr(current_platform.runtime(), "in_use_by_kind", None)  # the emulated HBM's only
    return {
        "num_blocks": config.num_blocks,
        "groups": [{"spec": type(group.kv_cache_spec).__name__, "layers": len(group.layer_names),
                    "sliding_window": getattr(group.kv_cache_spec, "sliding_window", None),
                    "page_bytes": group.kv_cache_spec.page_size_bytes}
                   for group in config.kv_cache_groups],
        "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, config),
        "charged_bytes": books().get("KV cache") if books else None,
    }


def generate(llm, prompts: list[list[int]], sampling: list[dict], adapters: list | None = None,
             images: list | None = None):
    """``llm.generate`` of token-id prompts; one sampling dict applies to every prompt, a list
    pairs them one by one. ``adapters`` pairs each prompt with a LoRA adapter directory, or None
    for the base model; ``images`` with the seed of a synthetic image
    (:func:`ascend_patch.kit.tiny_vl.image`), or None for a text-only prompt."""
    from vllm.inputs import TokensPrompt

    from ascend_patch.kit import tiny_vl

    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    for request, seed in zip(requests, images or []):
        if seed is not None:
            request["multi_modal_data"] = {"image": tiny_vl.image(seed)}
    return llm.generate(requests, paired_params(sampling, len(prompts)), use_tqdm=False,
                        lora_request=None if adapters is None else lora_requests(adapters))


def lora_requests(adapters: list) -> list:
    """A ``LoRARequest`` per adapter directory (None: the base model), one id per directory."""
    from vllm.lora.request import LoRARequest

    ids = {path: index for index, path in enumerate(dict.fromkeys(filter(None, adapters)), 1)}
    return [None if path is None else LoRARequest(Path(path).name, ids[path], path)
            for path in adapters]


def paired_params(sampling: list[dict], count: int) -> list:
    """``SamplingParams`` for ``count`` requests: one dict applies to all, a list pairs them."""
    params = [sampling_params(s) for s in sampling]
    return params * count if len(params) == 1 else params


def sampling_params(spec: dict):
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


def request_outputs(outputs) -> dict:
    """Per request: the first completion's tokens ("tokens") and, when asked for, their
    log-probabilities ("logprobs"), the prompt tokens served from the prefix cache ("cached"),
    and every completion in full ("outputs")."""
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


SPEC_DECODE_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counts(llm) -> dict | None:
    """vLLM's own speculative-decoding counters (``vllm:spec_decode_num_*``) so far in this
    process, with the accepted drafts by position ("accepted_per_position"), or None when the
    engine keeps no stats (``disable_log_stats``)."""
    if llm.llm_engine.log_stats is False:
        return None
    counts = dict.fromkeys(SPEC_DECODE_COUNTERS, 0)
    per_position: list[int] = []
    for metric in llm.get_metrics():
        if metric.name == PER_POSITION:
            per_position = [a + b for a, b in itertools.zip_longest(per_position, metric.values,
                                                                      fillvalue=0)]
        name = metric.name.removeprefix("vllm:spec_decode_num_")
        if name in counts:
            counts[name] += metric.value
    return {**counts, "accepted_per_position": per_position}


def spec_decode_counts_since(before: dict, after: dict) -> dict:
    """The counters of :func:`spec_decode_counts` between two readings."""
    since = {name: after[name] - before[name] for name in SPEC_DECODE_COUNTERS}
    since["accepted_per_position"] = [
        a - b for a, b in itertools.zip_longest(after["accepted_per_position"],
                                                before["accepted_per_position"], fillvalue=0)]
    return since


def counter_values(llm, names: list[str]) -> dict[str, float]:
    """vLLM's counters of these names so far in this process, summed over their labels (an engine
    that keeps stats)."""
    values = dict.fromkeys(names, 0.0)
    for metric in llm.get_metrics() if names else ():
        if metric.name in values:
            values[metric.name] += metric.value
    return values


def shutdown(llm) -> None:
    """Free the engine and its device memory before the next one starts."""
    import torch

    # vLLM <= 0.32 keeps a deleted in-process engine alive unless it is shut down, and
    # freezes the heap when its engine core starts (gc.freeze()): shut down and unfreeze so
    # this engine's tensors, and the (emulated) HBM they hold, are freed before the next one.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.unfreeze()
    freeze_heap()
    torch.accelerator.empty_cache()  # the device allocator's cached blocks count as used
