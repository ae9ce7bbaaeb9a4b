"""vLLM's speculative-decoding Triton kernels, for the NPU: plain torch.

vLLM's V1 runner launches nine Triton kernels on its speculative-decoding path (the rejection
sampler's four, and the EAGLE/draft-model input preparation of ``vllm/v1/spec_decode/utils.py``).
No torch_npu op does what any of them does, so the NPU runs them as what they are made of here:
gathers, comparisons, cumulative products and scatters, each a generic device op (on the NPU an
aclnn kernel; emulated, a CPU op). Every function:

- takes the kernel's own parameters, by name and in order (``*_ptr`` is the tensor, the
  ``tl.constexpr`` flags are keyword defaults), which is how vLLM launches it on every release
  0.20–0.33: ``kernel[grid](...)`` up to 0.29, its warm-up dispatcher's keyword launch from 0.30;
- ignores the launch grid: the batch it covers is the tensors' (each docstring says which);
- writes exactly what the kernel writes and leaves the rest of each output alone;
- never reads a device value on the host (no ``item``, no data-dependent shapes), so a step
  keeps the host/device overlap vLLM's CUDA path has.

Semantics are the Triton kernels' (vLLM 0.33 ``v1/sample/rejection_sampler.py`` and
``v1/spec_decode/utils.py``, unchanged since 0.20 but for ``USE_FP64_GUMBEL``, 0.23);
``tests/kernels/test_spec_decode.py`` checks each against a per-request transliteration of its
kernel and against vectors derived by hand.
"""

from __future__ import annotations

import torch


def _draft_grid(cu_num_draft_tokens: torch.Tensor, width: int):
    """Per request ``b`` of the flattened drafts: ``start [B]``, ``count [B]``, and for the
    positions ``j < width``: ``index [B, width]`` (``start + j``, clamped into range) and
    ``valid [B, width]`` (``j < count``)."""
    cu = cu_num_draft_tokens.long()
    start = torch.cat((cu.new_zeros(1), cu[:-1]))
    count = cu - start
    positions = torch.arange(width, device=cu.device)
    index = start[:, None] + positions
    valid = positions < count[:, None]
    return start, count, index, valid, positions


def _gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for indices that may point past the end where they are masked out."""
    if values.numel() == 0:
        return values.new_zeros(index.shape)
    return values[index.clamp(0, values.shape[0] - 1)]


def _write_verified(output: torch.Tensor, rows: torch.Tensor, accepted: torch.Tensor,
                    valid: torch.Tensor, count: torch.Tensor, positions: torch.Tensor,
                    drafts: torch.Tensor, replacement: torch.Tensor,
                    bonus: torch.Tensor) -> None:
    """The rejection kernels' common write, for the requests in ``rows``: each request keeps its
    leading accepted drafts, then at the first rejected position the ``replacement`` token, and
    when every draft was accepted the bonus token after them."""
    width = accepted.shape[1]
    kept = torch.cumprod((accepted & valid).to(torch.int32), dim=1).sum(dim=1)  # [B]
    written = (positions < torch.minimum(kept + 1, count)[:, None]) & rows[:, None]
    tokens = torch.where(positions < kept[:, None], drafts, replacement).to(output.dtype)
    output[:, :width] = torch.where(written, tokens, output[:, :width])
    at_end = count[:, None]
    current = output.gather(1, at_end)
    all_kept = (rows & (kept == count))[:, None]
    output.scatter_(1, at_end, torch.where(all_kept, bonus.view(-1, 1).to(output.dtype), current))


def rejection_greedy_sample_kernel(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_argmax_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    max_spec_len,
    uniform_probs_ptr=None,
    synthetic_conditional_rates_ptr=None,
    SYNTHETIC_MODE=False,
):
    """Greedy verification, every request of ``output_token_ids [B, max_spec_len + 1]`` whose
    ``is_greedy`` is set (all of them when it is None): drafts are kept while they equal the
    target's argmax; the first that does not is replaced by it. Synthetic mode keeps a draft
    with the conditional rate of its position instead (``uniform < rate``), a padded draft (-1)
    never."""
    output = output_token_ids_ptr
    start, count, index, valid, positions = _draft_grid(cu_num_draft_tokens_ptr, max_spec_len)
    drafts = _gather(draft_token_ids_ptr, index)
    target = _gather(target_argmax_ptr, index)
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr
        rate = rates[positions.clamp(max=rates.shape[0] - 1)]
        accepted = (_gather(uniform_probs_ptr, index) < rate) & (drafts >= 0)
    else:
        accepted = drafts == target.to(drafts.dtype)
    rows = (torch.ones(output.shape[0], dtype=torch.bool, device=output.device)
            if is_greedy_ptr is None else is_greedy_ptr.bool())
    _write_verified(output, rows, accepted, valid, count, positions, drafts, target,
                    bonus_token_ids_ptr)


def rejection_random_sample_kernel(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    bonus_token_ids_ptr,
    recovered_token_ids_ptr,
    uniform_probs_ptr,
    is_greedy_ptr,
    max_spec_len,
    vocab_size,
    synthetic_conditional_rates_ptr=None,
    NO_DRAFT_PROBS=False,
    SYNTHETIC_MODE=False,
):
    """Random verification, every request of ``output_token_ids [B, max_spec_len + 1]`` whose
    ``is_greedy`` is not set: draft ``x`` is kept when ``p(x) / q(x) >= uniform`` (``q = 1``
    without draft probabilities, never when ``q(x) = 0`` or ``x`` is a padded -1); the first
    that is not is replaced by its recovered token."""
    output = output_token_ids_ptr
    start, count, index, valid, positions = _draft_grid(cu_num_draft_tokens_ptr, max_spec_len)
    drafts = _gather(draft_token_ids_ptr, index)
    uniform = _gather(uniform_probs_ptr, index)
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr
        accepted = uniform < rates[positions.clamp(max=rates.shape[0] - 1)]
    elif target_probs_ptr.shape[0] == 0:  # no drafts in the batch
        accepted = torch.zeros_like(valid)
    else:
        rows_of = index.clamp(0, target_probs_ptr.shape[0] - 1)
        columns = drafts.long().clamp(0, vocab_size - 1)
        target_prob = target_probs_ptr[rows_of, columns]
        if NO_DRAFT_PROBS:
            draft_prob = torch.ones_like(target_prob)
        else:
            draft_prob = draft_probs_ptr[rows_of, columns]
        accepted = (draft_prob > 0) & (target_prob / draft_prob >= uniform)
    accepted &= drafts >= 0
    recovered = _gather(recovered_token_ids_ptr, index)
    _write_verified(output, ~is_greedy_ptr.bool(), accepted, valid, count, positions, drafts,
                    recovered, bonus_token_ids_ptr)


def _token_requests(cu_num_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request of each of ``num_tokens`` flattened tokens (requests own consecutive runs
    ending at ``cu_num_tokens``), clamped to the last request past the end."""
    tokens = torch.arange(num_tokens, device=cu_num_tokens.device, dtype=cu_num_tokens.dtype)
    request = torch.searchsorted(cu_num_tokens, tokens, right=True)
    return request.clamp(max=cu_num_tokens.shape[0] - 1)


def expand_kernel(
    output_ptr,
    input_ptr,
    cu_num_tokens_ptr,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
):
    """``output[t] = input[b]`` for each token ``t`` of request ``b`` (``input [B]``), with
    ``replace_from`` turned into ``replace_to``; tokens past the last request stay as they are."""
    cu = cu_num_tokens_ptr
    num_tokens = output_ptr.shape[0]
    values = input_ptr[_token_requests(cu, num_tokens)]
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    covered = torch.arange(num_tokens, device=cu.device) < cu[-1]
    output_ptr.copy_(torch.where(covered, values.to(output_ptr.dtype), output_ptr))


def sample_recovered_tokens_kernel(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    inv_q_ptr,
    vocab_size,
    BLOCK_SIZE=None,
    NO_DRAFT_PROBS=False,
    USE_FP64_GUMBEL=False,
):
    """For every draft position ``t`` (``output [num_tokens]``): the token maximising
    ``max(p - q, 0) * inv_q[b]`` (without draft probabilities, ``p`` with the draft token's
    probability removed), the first such token on ties, ``b`` the position's request."""
    num_tokens = output_token_ids_ptr.shape[0]
    if num_tokens == 0:
        return
    target = target_probs_ptr[:num_tokens]
    drafts = draft_token_ids_ptr[:num_tokens].long()
    if NO_DRAFT_PROBS:
        columns = torch.arange(target.shape[1], device=target.device)
        prob = target.masked_fill(columns == drafts[:, None], 0.0)
    else:
        prob = (target - draft_probs_ptr[:num_tokens]).clamp(min=0.0)
    inv_q = inv_q_ptr[_token_requests(cu_num_draft_tokens_ptr, num_tokens)]
    recovered = (prob * inv_q).argmax(dim=-1).clamp(max=vocab_size - 1)
    output_token_ids_ptr.copy_(recovered.to(output_token_ids_ptr.dtype))


def eagle_prepare_inputs_padded_kernel(
    cu_num_draft_tokens_ptr,
    valid_sampled_tokens_count_ptr,
    query_start_loc_gpu_ptr,
    token_indices_to_sample_ptr,
    num_rejected_tokens_gpu_ptr,
    num_reqs,
):
    """For the first ``num_reqs`` requests of a padded verification batch: the rejected drafts
    (drafts + 1 - valid sampled tokens, 0 without drafts) and the index of the last accepted
    token (the request's last query token less the rejected ones)."""
    cu = cu_num_draft_tokens_ptr[:num_reqs]
    drafts = cu - torch.cat((cu.new_zeros(1), cu[:-1]))
    valid = valid_sampled_tokens_count_ptr[:num_reqs].to(cu.dtype)
    rejected = torch.where(drafts > 0, drafts + 1 - valid, torch.zeros_like(drafts))
    last = query_start_loc_gpu_ptr[1 : num_reqs + 1].to(cu.dtype) - 1
    token_indices_to_sample_ptr[:num_reqs] = (last - rejected).to(token_indices_to_sample_ptr.dtype)
    num_rejected_tokens_gpu_ptr[:num_reqs] = rejected.to(num_rejected_tokens_gpu_ptr.dtype)


def eagle_prepare_next_token_padded_kernel(
    sampled_token_ids_ptr,
    discard_request_mask_ptr,
    backup_next_token_ids_ptr,
    next_token_ids_ptr,
    valid_sampled_tokens_count_ptr,
    vocab_size,
    num_sampled_tokens_per_req,
    num_reqs,
    stride_sampled_token_ids,
    BLOCK_SIZE_TOKENS=None,
):
    """For the first ``num_reqs`` rows of ``sampled_token_ids [B, num_sampled_tokens_per_req]``
    (rejected positions -1): the count of valid tokens and the last valid one, or the backup
    token (with count 0 for a discarded request) where there is none."""
    sampled = sampled_token_ids_ptr[:num_reqs, :num_sampled_tokens_per_req]
    valid = (sampled != -1) & (sampled < vocab_size)
    count = valid.sum(dim=1)
    positions = torch.arange(sampled.shape[1], device=sampled.device)
    last = torch.where(valid, positions, -1).amax(dim=1).clamp(min=0)
    last_token = sampled.gather(1, last[:, None]).squeeze(1)
    discarded = discard_request_mask_ptr[:num_reqs].bool()
    backup = backup_next_token_ids_ptr[:num_reqs]
    use_backup = discarded | (count == 0)
    next_token_ids_ptr[:num_reqs] = torch.where(use_backup, backup.to(last_token.dtype),
                                                last_token).to(next_token_ids_ptr.dtype)
    count = torch.where(discarded, torch.zeros_like(count), count)
    valid_sampled_tokens_count_ptr[:num_reqs] = count.to(valid_sampled_tokens_count_ptr.dtype)


def eagle_step_slot_mapping_metadata_kernel(
    positions_ptr,
    block_table_ptr,
    block_table_stride,
    seq_lens_ptr,
    out_clamped_positions_ptr,
    out_slot_mapping_ptr,
    block_size,
    max_model_len,
    n_blocks_per_req,
    PAD_ID,
    batch_size,
):
    """One EAGLE draft step for the ``batch_size`` requests: the next position (0 past
    ``max_model_len``), its KV slot (``PAD_ID`` past it) and the sequence length + 1 (1 past
    it), in place; the padded rows of ``out_slot_mapping`` (a graph's padding, up to its length)
    get ``PAD_ID``. ``positions`` may be ``out_clamped_positions`` itself."""
    position = positions_ptr[:batch_size] + 1
    exceeds = position >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(position), position)
    block = (clamped // block_size).clamp(max=n_blocks_per_req - 1)
    rows = torch.arange(batch_size, device=position.device)
    block_id = block_table_ptr[rows, block].to(clamped.dtype)
    slot = block_id * block_size + clamped % block_size
    slot = torch.where(exceeds, torch.full_like(slot, PAD_ID), slot)
    seq_len = seq_lens_ptr[:batch_size]
    new_seq_len = torch.where(exceeds, torch.ones_like(seq_len), seq_len + 1).clamp(max=max_model_len)
    out_clamped_positions_ptr[:batch_size] = clamped.to(out_clamped_positions_ptr.dtype)
    out_slot_mapping_ptr[:batch_size] = slot.to(out_slot_mapping_ptr.dtype)
    out_slot_mapping_ptr[batch_size:] = PAD_ID
    seq_lens_ptr[:batch_size] = new_seq_len


def copy_and_expand_eagle_inputs_kernel(
    target_token_ids_ptr,
    target_positions_ptr,
    next_token_ids_ptr,
    out_input_ids_ptr,
    out_positions_ptr,
    out_is_rejected_token_mask_ptr,
    out_is_masked_token_mask_ptr,
    out_new_token_indices_ptr,
    out_hidden_state_mapping_ptr,
    query_start_loc_ptr,
    query_end_loc_ptr,
    padding_token_id,
    parallel_drafting_token_id,
    total_input_tokens,
    num_padding_slots_per_request,
    shift_input_ids,
    BLOCK_SIZE_TOKENS=None,
):
    """The drafter's inputs for draft models and parallel drafting, every request of
    ``query_end_loc [B]`` (its last accepted token). Request ``b``'s output run is its accepted
    tokens (less the first with ``shift_input_ids``), the next token, the parallel-drafting
    slots and, last, one padding slot per rejected token (position 0, marked rejected);
    positions count on from the request's first input position. Also: the index of each new
    token (``[B, num_padding_slots_per_request]`` flattened) and, with ``shift_input_ids``,
    where each input token's hidden state goes."""
    slots, shift = num_padding_slots_per_request, int(bool(shift_input_ids))
    device = query_start_loc_ptr.device
    batch = query_end_loc_ptr.shape[0]
    starts = query_start_loc_ptr[:batch].long()
    next_starts = query_start_loc_ptr[1 : batch + 1].long()
    ends = query_end_loc_ptr.long()
    requests = torch.arange(batch, device=device)
    num_valid = ends - starts + 1 - shift
    out_starts = starts + requests * (slots - shift)
    num_out = total_input_tokens + batch * (slots - shift)  # the runs' total, known on the host

    out = torch.arange(num_out, device=device)
    request = (torch.searchsorted(out_starts, out, right=True) - 1).clamp(0, batch - 1)
    covered = out < next_starts[-1] + batch * (slots - shift)  # inside the last request's run
    j = out - out_starts[request]
    valid_len = num_valid[request]
    rejected = j >= valid_len + slots
    parallel = (j > valid_len) & (j < valid_len + slots)
    source = (starts[request] + shift + j).clamp(max=total_input_tokens - 1)
    tokens = torch.where(j < valid_len, target_token_ids_ptr[source].long(),
                         torch.full_like(j, padding_token_id))
    tokens = torch.where(j == valid_len, next_token_ids_ptr[request].long(), tokens)
    tokens = torch.where(parallel, torch.full_like(j, parallel_drafting_token_id), tokens)
    tokens = torch.where(rejected, torch.full_like(j, padding_token_id), tokens)
    positions = target_positions_ptr[starts[request]].long() + j
    positions = torch.where(rejected, torch.zeros_like(positions), positions)
    for buffer, values in ((out_input_ids_ptr, tokens), (out_positions_ptr, positions),
                           (out_is_rejected_token_mask_ptr, rejected),
                           (out_is_masked_token_mask_ptr, parallel)):
        buffer[:num_out] = torch.where(covered, values.to(buffer.dtype), buffer[:num_out])

    new = out_starts[:, None] + num_valid[:, None] + torch.arange(slots, device=device)
    out_new_token_indices_ptr[: batch * slots] = new.flatten().to(out_new_token_indices_ptr.dtype)
    if shift:
        inputs = torch.arange(total_input_tokens, device=device)
        owner = (torch.searchsorted(starts, inputs, right=True) - 1).clamp(0, batch - 1)
        mapping = out_starts[owner] + inputs - starts[owner]
        owned = inputs < next_starts[-1]
        out_hidden_state_mapping_ptr[:total_input_tokens] = torch.where(
            owned, mapping.to(out_hidden_state_mapping_ptr.dtype),
            out_hidden_state_mapping_ptr[:total_input_tokens])


KERNELS = {
    "vllm.v1.sample.rejection_sampler": (
        rejection_greedy_sample_kernel,
        rejection_random_sample_kernel,
        expand_kernel,
        sample_recovered_tokens_kernel,
    ),
    "vllm.v1.spec_decode.utils": (
        eagle_prepare_inputs_padded_kernel,
        eagle_prepare_next_token_padded_kernel,
        eagle_step_slot_mapping_metadata_kernel,
        copy_and_expand_eagle_inputs_kernel,
    ),
}
"""The kernels this module implements, by the vLLM module that defines each (under the same
name). DFlash's ``copy_and_expand_dflash_inputs_kernel`` is not among them: the platform refuses
DFlash."""
