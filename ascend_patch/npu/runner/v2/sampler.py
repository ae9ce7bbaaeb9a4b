"""Model Runner V2's top-k/top-p on the kernel seam.

MRV2 masks logits with ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``):
Triton when it imports, else a full-vocabulary sort. On the NPU the mask comes from
``npu_top_k_top_p`` for rows whose k the op takes (k ≤ 1024), from its top-p-only form for rows
without top-k, and from vLLM's sort for the rest, as on the V1 runner
(:func:`ascend_patch.npu.runner.top_k_top_p.filter_top_k_top_p`). Which rows go where is decided from
the host copy of k that MRV2's ``SamplingStates`` keeps (``top_k.np``): the wrapper of
``get_top_k_top_p`` hands it to the k tensor it builds, so a step reads no device value.
"""

from __future__ import annotations

from ascend_patch.npu.runner.top_k_top_p import HOST_TOP_K, filter_top_k_top_p


def npu_apply_top_k_top_p(original):
    """Replacement of ``vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p``."""

    def apply_top_k_top_p(logits, k, p, has_topp_only_rows=True):
        if k is None and p is None:
            return logits
        return filter_top_k_top_p(logits, k, p)

    return apply_top_k_top_p


def attach_host_top_k(wrapped, instance, args, kwargs):
    """Wrapper of ``SamplingStates.get_top_k_top_p``: the k tensor carries the host values it
    was gathered from, one per row. With speculative decoding the rows are the expanded
    draft positions, which the host mapping does not list: those batches take vLLM's sort."""
    top_k, top_p, has_topp_only_rows = wrapped(*args, **kwargs)
    expanded_idx_mapping, idx_mapping_np = args[0], args[1]
    if top_k is not None and expanded_idx_mapping.shape[0] == len(idx_mapping_np):
        setattr(top_k, HOST_TOP_K, instance.top_k.np[idx_mapping_np])
    return top_k, top_p, has_topp_only_rows


def greedy_batches_take_argmax(wrapped, instance, args, kwargs):
    """Wrapper of ``Sampler._sample_random``: a batch whose every request is greedy (temperature
    0, known on the host) and that masks no top-k/top-p is sampled with one ``argmax``. vLLM's
    Gumbel kernel returns the same token for such rows (the plain logits' first maximum) but
    its torch implementation would hash noise for every row and vocabulary entry first, about 190
    launches per step that the V1 runner's greedy path never issues."""
    if len(args) != 8 or kwargs:  # vLLM calls it positionally; anything else takes its path
        return wrapped(*args, **kwargs)
    (processed_logits, _expanded_idx_mapping, idx_mapping_np, _pos, top_k, top_p,
     _has_topp_only_rows, use_fused_sampler) = args
    if (top_k is None and top_p is None and not use_fused_sampler
            and bool((instance.sampling_states.temperature.np[idx_mapping_np] == 0.0).all())):
        return processed_logits.argmax(dim=-1), processed_logits
    return wrapped(*args, **kwargs)
