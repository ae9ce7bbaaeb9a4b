"""Model Runner V2's top-k/top-p on the kernel seam.

MRV2 masks logits with ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``):
Triton when it imports, else a full-vocabulary sort. On the NPU the mask comes from
``npu_top_k_top_p`` for rows whose k the op takes (k ≤ 1024), from its top-p-only form for rows
without top-k, and from vLLM's sort for the rest, as on the V1 runner
(:func:`ascend_patch.npu.runner.top_k_top_p.filter_top_k_top_p`). Which rows go where is decided from
the host copy of k that MRV2's ``SamplingStates`` keeps (``top_k.np``): the wrapper of
``get_top_k_top_p`` hands it to the k tensor it builds, so a step reads no device value.

All-greedy batches, known from the host temperatures, skip the sampling path's noise: plain
sampling takes one argmax (:func:`greedy_batches_take_argmax`), speculative verification
one argmax and a comparison with the drafts (:func:`greedy_verification_takes_argmax`).
"""

from __future__ import annotations

import torch

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


def all_greedy(sampling_states, idx_mapping_np) -> bool:
    """Whether every request of the batch samples at temperature 0, read from the host copy."""
    return bool((sampling_states.temperature.np[idx_mapping_np] == 0.0).all())


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
            and all_greedy(instance.sampling_states, idx_mapping_np)):
        return processed_logits.argmax(dim=-1), processed_logits
    return wrapped(*args, **kwargs)


def greedy_verification_takes_argmax(wrapped, instance, args, kwargs):
    """Wrapper of ``RejectionSampler._verify``: a batch whose every request is greedy (known on
    the host) is verified with one argmax over its processed logits (:func:`greedy_verification`).
    vLLM's kernels give the same tokens for such rows (keep each draft while it is the target
    argmax, store the argmax at the first rejected step and at the bonus step), but their torch
    implementations compute the sampling rows' statistics and Philox noise for every row first:
    369 launches per generated token against 3 without speculation
    (``scripts/bench_spec_decode.py``, emulated). Watermarking, synthetic, FLy and adaptive
    verification and trace replay take vLLM's path."""
    if len(args) != 10 or kwargs:  # vLLM calls it positionally; anything else takes its path
        return wrapped(*args, **kwargs)
    (logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
     expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np) = args
    sampler = instance.sampler
    if (instance.watermark_key is not None or instance.synthetic_conditional_rates is not None
            or instance.fly_window_size > 0 or instance.enable_adaptive_verification
            or sampler.trace_replay_state is not None
            or not all_greedy(sampler.sampling_states, idx_mapping_np)):
        return wrapped(*args, **kwargs)
    processed = sampler.apply_sampling_params(
        logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled,
        expanded_local_pos, seq_lens_upper_bound_np)
    # A draft model's vocabulary may be narrower than the target's padded one: vLLM's kernels
    # look at the shared part only.
    vocab = processed.shape[-1] if draft_logits is None else min(processed.shape[-1],
                                                                  draft_logits.values.shape[-1])
    sampled, num_sampled = greedy_verification(processed[:, :vocab], draft_sampled, cu_num_logits,
                                               instance.num_speculative_steps)
    return processed, sampled, num_sampled


def greedy_verification(logits: torch.Tensor, draft_sampled: torch.Tensor,
                        cu_num_logits: torch.Tensor, num_speculative_steps: int):
    """Greedy rejection sampling of ``rejection_sample``'s batch layout: request ``r`` owns the
    logit rows ``cu_num_logits[r]:cu_num_logits[r + 1]``, and its step ``i`` verifies the draft
    one row ahead (``draft_sampled[row + 1]``, -1 a placeholder) against the argmax of row ``i``.
    Returns ``sampled`` ``[num_reqs, k + 1]``, the argmax of each step (valid up to the first
    rejected step, or the bonus step, inclusive), and ``num_sampled``, accepted drafts + 1."""
    num_logits = logits.shape[0]
    argmax = logits.argmax(dim=-1)
    starts = cu_num_logits[:-1].long()
    steps = torch.arange(num_speculative_steps + 1, device=logits.device)
    rows = (starts[:, None] + steps).clamp(max=num_logits - 1)
    sampled = argmax[rows]
    drafts = draft_sampled[(rows + 1).clamp(max=num_logits - 1)]
    has_draft = steps < (cu_num_logits[1:].long() - starts - 1)[:, None]
    kept = (sampled == drafts) & (drafts >= 0) & has_draft
    accepted = kept[:, :-1].int().cumprod(dim=1).sum(dim=1)
    return sampled, (accepted + 1).to(torch.int32)
