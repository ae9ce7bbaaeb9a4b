"""Model Runner V2's input-preparation Triton kernels, for the NPU: plain torch.

vLLM 0.34 runs every model through Model Runner V2 (``vllm/v1/worker/gpu/``), which builds each
step's inputs and books each step's outputs with Triton kernels: the input batch's seven
(``input_batch.py``), a hybrid model's accepted counts (``model_states/mamba_hybrid.py``), the
staged row writes of ``buffer_utils.py`` and M-RoPE's positions (``mm/rope.py``). Without
triton-ascend the NPU runs them as what they are made of here: gathers, ``searchsorted``,
comparisons and scatters, each a generic device op (on the NPU an aclnn kernel; emulated, a CPU
op). They are registered through vLLM's kernel registry
(``vllm.triton_utils.dispatcher.register_kernels``, called from
``Platform.register_triton_kernel_overrides``) under their own names. Every function:

- takes the kernel's own parameters, by name and in order (``*_ptr`` is the tensor, the
  ``tl.constexpr`` parameters are keyword defaults), as MRV2 launches it: ``kernel[grid](...)``,
  positionally with the constexprs by keyword, or by keyword from vLLM's dispatcher;
- ignores the launch grid: it covers the rows of ``idx_mapping`` (``_apply_write_kernel``: of
  ``write_indices``), and an output indexed by token or by logit whole, masked by
  ``query_start_loc`` or ``cu_num_logits``;
- writes exactly what the kernel writes and leaves the rest of each output alone;
- never reads a device value on the host (no ``item``, no ``tolist``, no data-dependent shapes,
  no Python loop over requests), so a step keeps the host/device overlap of vLLM's CUDA path.

Scatters assume what the kernels assume: a request appears at most once among a batch's rows, and
queries do not overlap. A scatter's masked lanes (rows whose ``idx_mapping`` is negative: pipeline
parallelism's filtered rows) add zero through ``index_put_(accumulate=True)`` instead of writing,
so they cannot collide with a real write.

Two kernels take device pointer tables, which torch cannot dereference; the runner replaces the
methods that launch them instead, with the functions at the end of this module:
``FusedStagedWriter.apply`` (``_apply_write_kernel`` with ``MULTI_GROUP``: one staged tensor per
KV-cache group) by :func:`apply_staged_writes_per_tensor`, and ``PromptEmbedsState.apply``
(``_apply_prompt_embeds_kernel``: a table of per-request embedding pointers) by
:func:`apply_prompt_embeds`.

Semantics are vLLM 0.34.0's. The kernels' parameter lists and bodies are identical in 0.33.0
(``input_batch.py`` and ``model_states/prompt_embeds.py`` unchanged; ``mm/rope.py`` differs only in
host code, ``buffer_utils.py`` only in how the host stages contents). ``_post_update_kernel`` is
launched with ``num_warps=1``, a Triton launch option, which its implementation accepts as a
trailing keyword and ignores. ``tests/kernels/test_mrv2_input_kernels.py`` checks each function
against a per-request transcription of its kernel and against vectors derived by hand.
"""

from __future__ import annotations

import numpy as np
import torch


def _token_requests(query_start_loc: torch.Tensor, num_reqs: int, num_slots: int):
    """For each of a buffer's ``num_slots`` slots, rows owning consecutive runs of it from
    ``query_start_loc`` (tokens by query, or logits by ``cu_num_logits``): the row whose run holds
    it (clamped into the batch), its index within that run, and whether any run holds it. Empty
    runs hold nothing."""
    bounds = query_start_loc[: num_reqs + 1]
    slots = torch.arange(num_slots, device=bounds.device, dtype=bounds.dtype)
    request = torch.searchsorted(bounds[1:], slots, right=True).clamp_(max=num_reqs - 1)
    covered = (slots >= bounds[0]) & (slots < bounds[num_reqs])
    return request, slots - bounds[request], covered


def _query_lens(query_start_loc: torch.Tensor, num_reqs: int) -> torch.Tensor:
    return query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]


def _set_where(output: torch.Tensor, covered: torch.Tensor, values: torch.Tensor) -> None:
    output.copy_(torch.where(covered, values.to(output.dtype), output))


def _add_at(target: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    target.index_put_(index, values.to(target.dtype), accumulate=True)


def _set_at(target: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor,
            written: torch.Tensor) -> None:
    """``target[index] = values`` where ``written``; elsewhere (a filtered row, a lane past the
    batch, whose index may repeat a written one) add zero, so it never undoes a real write. The
    written indices must be distinct, as the kernels' are."""
    _add_at(target, index, torch.where(written, values.to(target.dtype) - target[index], 0))


def _prepare_prefill_inputs_kernel(
    input_ids_ptr,
    next_prefill_tokens_ptr,
    next_prefill_tokens_stride,
    num_lookahead,
    idx_mapping_ptr,
    query_start_loc_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prefill_lens_ptr,
    num_computed_tokens_ptr,
    BLOCK_SIZE=None,
    LOOKAHEAD_BLOCK=None,
):
    """For each batch row still in its prefill (``num_computed < prefill_len`` of its request
    ``r``): its query slots of ``input_ids`` get ``all_token_ids[r, num_computed + j]``, and
    ``next_prefill_tokens[k, r]`` (``k < num_lookahead``) the prompt token after the chunk at
    offset ``k``, 0 past the prefill. Other rows are left alone."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    rows = idx_mapping_ptr
    num_computed = num_computed_tokens_ptr[rows]
    prefill_len = prefill_lens_ptr[rows]
    prefilling = num_computed < prefill_len
    width = all_token_ids_ptr.shape[1]

    request, j, covered = _token_requests(query_start_loc_ptr, num_reqs, input_ids_ptr.shape[0])
    column = (num_computed[request] + j).clamp_(0, width - 1)
    tokens = all_token_ids_ptr[rows[request], column]
    _set_where(input_ids_ptr, covered & prefilling[request], tokens)

    if num_lookahead == 0:
        return
    lookahead = torch.arange(num_lookahead, device=rows.device)
    position = (num_computed + _query_lens(query_start_loc_ptr, num_reqs))[:, None] + lookahead
    tokens = all_token_ids_ptr[rows[:, None], position.clamp(0, width - 1)]
    tokens = torch.where(position < prefill_len[:, None], tokens, 0)
    target = (lookahead[None, :], rows[:, None])  # next_prefill_tokens is [num_lookahead, max_reqs]
    current = next_prefill_tokens_ptr[target]
    next_prefill_tokens_ptr.index_put_(
        target, torch.where(prefilling[:, None], tokens.to(current.dtype), current))


def _prepare_pos_seq_lens_kernel(
    pos_ptr,
    seq_lens_ptr,
    idx_mapping_ptr,
    query_start_loc_ptr,
    num_computed_tokens_ptr,
    max_num_reqs,
    BLOCK_SIZE=None,
):
    """Batch row ``b`` of request ``r``: ``seq_lens[b] = num_computed[r] + query_len`` and its
    query slots of ``pos`` count on from ``num_computed[r]``; ``seq_lens[num_reqs:max_num_reqs]``
    is zeroed (FULL graphs' padded rows)."""
    num_reqs = idx_mapping_ptr.shape[0]
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    if num_reqs == 0:
        return
    num_computed = num_computed_tokens_ptr[idx_mapping_ptr]
    seq_lens_ptr[:num_reqs] = (num_computed + _query_lens(query_start_loc_ptr, num_reqs)).to(
        seq_lens_ptr.dtype)
    request, j, covered = _token_requests(query_start_loc_ptr, num_reqs, pos_ptr.shape[0])
    _set_where(pos_ptr, covered, num_computed[request] + j)


def _combine_sampled_and_draft_tokens_kernel(
    input_ids_ptr,
    idx_mapping_ptr,
    last_sampled_tokens_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    prefill_len_ptr,
    draft_tokens_ptr,
    draft_tokens_stride,
    cu_num_logits_ptr,
    logits_indices_ptr,
    BLOCK_SIZE=None,
    NUM_NEW_SAMPLED_TOKENS=1,
):
    """Batch row ``b`` (request ``r``) owns ``n = cu_num_logits[b+1] - cu_num_logits[b]`` logits,
    the last ``n`` slots of its query: their indices go to ``logits_indices``. A row past its
    prefill (``seq_lens[b] > prefill_len[r]``) then takes, in those slots, its last sampled token
    (first slot, with ``NUM_NEW_SAMPLED_TOKENS`` 1, unless that slot is still a prompt position)
    followed by its drafts ``draft_tokens[r, :n - NUM_NEW_SAMPLED_TOKENS]``."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    rows = idx_mapping_ptr
    cu_logits = cu_num_logits_ptr[: num_reqs + 1]
    num_logits = cu_logits[1:] - cu_logits[:-1]
    window_start = query_start_loc_ptr[1 : num_reqs + 1] - num_logits
    # Lanes are the logits (MRV2 sizes logits_indices to the batch's logits): logit k of row b
    # sits at window_start[b] + k, the only slots the kernel writes in input_ids.
    row, k, covered = _token_requests(cu_logits, num_reqs, logits_indices_ptr.shape[0])
    position = window_start[row] + k
    _set_where(logits_indices_ptr, covered, position)

    num_draft_columns = draft_tokens_ptr.shape[-1]
    if NUM_NEW_SAMPLED_TOKENS == 0 and num_draft_columns == 0:
        return  # nothing to write: no sampled token, no drafts
    # A row's first logit written: none before its prefill's end (num_logits: past them all);
    # the sampled token's slot only once it is past the prompt.
    seq_len = seq_lens_ptr[:num_reqs]
    prefill_len = prefill_len_ptr[rows]
    first_written = torch.where(seq_len - num_logits >= prefill_len, 0, NUM_NEW_SAMPLED_TOKENS)
    first_written = torch.where(seq_len > prefill_len, first_written, num_logits)
    # Row b's tokens by logit: its last sampled token (with NUM_NEW_SAMPLED_TOKENS 1), its drafts.
    columns = []
    if NUM_NEW_SAMPLED_TOKENS > 0:
        columns.append(last_sampled_tokens_ptr.view(-1)[rows][:, None])
    if num_draft_columns:
        columns.append(draft_tokens_ptr[rows])
    table = torch.cat(columns, dim=1) if len(columns) > 1 else columns[0]
    tokens = table[row, k.clamp(0, table.shape[1] - 1)]
    written = covered & (k >= first_written[row])
    _set_at(input_ids_ptr, (position.clamp_(0, input_ids_ptr.shape[0] - 1),), tokens, written)


def _get_num_sampled_and_rejected_kernel(
    num_sampled_ptr,
    num_rejected_ptr,
    seq_lens_ptr,
    cu_num_logits_ptr,
    idx_mapping_ptr,
    prefill_len_ptr,
):
    """Batch row ``b``: a chunked prefill (``seq_lens[b] < prefill_len[r]``) sampled and rejected
    nothing; otherwise the rejected are its logits less its sampled tokens."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    chunked = seq_lens_ptr[:num_reqs] < prefill_len_ptr[idx_mapping_ptr]
    num_sampled = num_sampled_ptr[:num_reqs].masked_fill(chunked, 0)
    num_sampled_ptr[:num_reqs] = num_sampled
    num_logits = cu_num_logits_ptr[1 : num_reqs + 1] - cu_num_logits_ptr[:num_reqs]
    num_rejected_ptr[:num_reqs] = (num_logits - num_sampled).masked_fill(chunked, 0).to(
        num_rejected_ptr.dtype)


def _post_update_kernel(
    idx_mapping_ptr,
    num_computed_tokens_ptr,
    last_sampled_tokens_ptr,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    sampled_tokens_ptr,
    sampled_tokens_stride,
    num_sampled_ptr,
    num_rejected_ptr,
    query_start_loc_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    total_len_ptr,
    draft_tokens_ptr,
    draft_tokens_out_ptr,
    num_draft_tokens,
    num_warps=None,  # Triton launch option MRV2's post_update passes; nothing to do with it here
):
    """After sampling, batch row ``b`` of request ``r >= 0`` (negative rows are skipped): its
    drafts (if given) become ``draft_tokens_out[r]``; its ``n = num_sampled[b]`` sampled tokens
    are appended to ``all_token_ids[r]`` at ``total_len[r]`` and counted in
    ``output_bin_counts[r]`` (if given), the last becomes ``last_sampled_tokens[r]`` and
    ``total_len[r]`` grows by ``n``; ``num_computed_tokens[r]`` grows by the query length (0
    without ``query_start_loc``) less ``num_rejected[b]``."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    valid = idx_mapping_ptr >= 0
    rows = idx_mapping_ptr.clamp(min=0)

    if draft_tokens_ptr is not None and num_draft_tokens > 0:
        drafts = draft_tokens_ptr.view(-1)[: num_reqs * num_draft_tokens].view(num_reqs, -1)
        columns = torch.arange(num_draft_tokens, device=rows.device)
        _set_at(draft_tokens_out_ptr.view(-1, num_draft_tokens), (rows[:, None], columns),
                drafts, valid[:, None])

    num_sampled = num_sampled_ptr[:num_reqs]
    sampled = sampled_tokens_ptr[:num_reqs]
    total_len = total_len_ptr[rows]
    positions = torch.arange(sampled.shape[1], device=rows.device)
    appended = valid[:, None] & (positions < num_sampled[:, None])
    columns = (total_len[:, None] + positions).clamp_(0, all_token_ids_ptr.shape[1] - 1)
    _set_at(all_token_ids_ptr, (rows[:, None], columns), sampled, appended)
    if output_bin_counts_ptr is not None:
        tokens = sampled.clamp(0, output_bin_counts_ptr.shape[1] - 1)
        _add_at(output_bin_counts_ptr, (rows[:, None], tokens), appended)

    any_sampled = valid & (num_sampled > 0)
    last = sampled.gather(1, (num_sampled[:, None] - 1).clamp_(min=0)).squeeze(1)
    _set_at(last_sampled_tokens_ptr.view(-1), (rows,), last, any_sampled)
    _add_at(total_len_ptr, (rows,), torch.where(any_sampled, num_sampled, 0))

    query_len = 0 if query_start_loc_ptr is None else _query_lens(query_start_loc_ptr, num_reqs)
    delta = query_len - num_rejected_ptr[:num_reqs]
    _add_at(num_computed_tokens_ptr, (rows,), torch.where(valid, delta, 0))


def _post_update_num_computed_tokens_kernel(
    idx_mapping_ptr,
    num_computed_tokens_ptr,
    query_start_loc_ptr,
):
    """``num_computed_tokens[r] += query_len`` for each batch row's request ``r``."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    _add_at(num_computed_tokens_ptr, (idx_mapping_ptr,), _query_lens(query_start_loc_ptr, num_reqs))


def _expand_idx_mapping_kernel(
    idx_mapping_ptr,
    expanded_idx_mapping_ptr,
    expanded_local_pos_ptr,
    cu_num_logits_ptr,
    BLOCK_SIZE=None,
):
    """Each logit of batch row ``b`` (``cu_num_logits[b]`` to ``cu_num_logits[b+1]``) gets the
    row's request ``idx_mapping[b]`` and its index among the row's logits."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    request, local, covered = _token_requests(cu_num_logits_ptr, num_reqs,
                                              expanded_idx_mapping_ptr.shape[0])
    _set_where(expanded_idx_mapping_ptr, covered, idx_mapping_ptr[request])
    _set_where(expanded_local_pos_ptr, covered, local)


def _scatter_num_accepted_kernel(
    idx_mapping_ptr,
    num_sampled_ptr,
    num_accepted_ptr,
):
    """A hybrid model's books after a step: ``num_accepted[r] = max(num_sampled[b], 1)`` for
    batch row ``b`` of request ``r >= 0`` (a chunked prefill samples nothing, and one is the
    recurrent layers' neutral count)."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    _set_at(num_accepted_ptr, (idx_mapping_ptr.clamp(min=0),),
            num_sampled_ptr[:num_reqs].clamp(min=1), idx_mapping_ptr >= 0)


def _fill_num_accepted_kernel(
    idx_mapping_ptr,
    num_accepted_ptr,
    num_sampled,
):
    """``num_accepted[r] = num_sampled`` (a host integer) for each batch row's request
    ``r >= 0``."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    _set_at(num_accepted_ptr, (idx_mapping_ptr.clamp(min=0),),
            torch.full_like(idx_mapping_ptr, num_sampled), idx_mapping_ptr >= 0)


def _apply_write_kernel(
    output_ptr,
    output_stride,
    write_indices_ptr,
    write_starts_ptr,
    write_contents_ptr,
    write_cu_lens_ptr,
    write_group_ids_ptr,
    BLOCK_SIZE=None,
    MULTI_GROUP=False,
):
    """The staged writes of a ``StagedWriteTensor``: write ``w`` copies contents
    ``cu_lens[w-1]:cu_lens[w]`` into row ``indices[w]`` of ``output`` from column
    ``starts[w]`` (flat, as the kernel's pointer arithmetic: ``row * output_stride + start``).
    ``MULTI_GROUP`` launches pass a table of device pointers, which torch cannot follow: the
    runner replaces ``FusedStagedWriter.apply`` with :func:`apply_staged_writes_per_tensor`."""
    if MULTI_GROUP:
        raise RuntimeError(
            "ascend-patch: _apply_write_kernel with MULTI_GROUP takes device pointers; the NPU "
            "runner applies each group's writes through FusedStagedWriter.apply's replacement")
    num_writes = write_indices_ptr.shape[0]
    if num_writes == 0:
        return
    # MRV2 uploads exactly the staged contents (cu_lens[-1] elements), so every element is
    # written; two writes to one element race in the kernel and here one of them wins.
    cu_lens = write_cu_lens_ptr[:num_writes].long()
    element = torch.arange(write_contents_ptr.shape[0], device=cu_lens.device)
    write = torch.searchsorted(cu_lens, element, right=True)
    content_start = torch.cat((cu_lens.new_zeros(1), cu_lens[:-1]))
    offset = write_indices_ptr.long() * output_stride + write_starts_ptr - content_start
    flat = output_ptr.view(-1)
    flat.index_put_((offset[write] + element,), write_contents_ptr.to(flat.dtype))


def _prepare_rope_positions_kernel(
    positions_ptr,
    positions_stride,
    prefill_positions_ptr,
    prefill_positions_stride0,
    prefill_positions_stride1,
    prefill_delta_ptr,
    idx_mapping_ptr,
    query_start_loc_ptr,
    prefill_lens_ptr,
    num_computed_tokens_ptr,
    BLOCK_SIZE=None,
    NUM_DIMS=None,
):
    """M-RoPE positions ``positions [NUM_DIMS, slots]`` (dimension ``d`` at ``d *
    positions_stride``): batch row ``b`` of request ``r``, query slot ``j``, position ``p =
    num_computed[r] + j``: in its prefill, the staged ``prefill_positions`` at ``r * stride0 + d *
    stride1 + p``; after it, ``p + prefill_delta[r]`` in every dimension."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    rows = idx_mapping_ptr
    num_computed = num_computed_tokens_ptr[rows]
    prefilling = (num_computed < prefill_lens_ptr[rows])
    slots = positions_ptr.view(-1)[: NUM_DIMS * positions_stride].view(NUM_DIMS, positions_stride)
    request, j, covered = _token_requests(query_start_loc_ptr, num_reqs, positions_stride)
    position = (num_computed[request] + j).long()
    row = rows[request]
    dims = torch.arange(NUM_DIMS, device=rows.device)[:, None]
    staged = prefill_positions_ptr.view(-1)
    source = row * prefill_positions_stride0 + dims * prefill_positions_stride1 + position
    from_prefill = staged[source.clamp_(0, staged.shape[0] - 1)]
    decoded = position + prefill_delta_ptr[row]
    _set_where(slots, covered, torch.where(prefilling[request], from_prefill, decoded))


KERNELS = {
    "vllm.v1.worker.gpu.input_batch": (
        _prepare_prefill_inputs_kernel,
        _prepare_pos_seq_lens_kernel,
        _combine_sampled_and_draft_tokens_kernel,
        _get_num_sampled_and_rejected_kernel,
        _post_update_kernel,
        _post_update_num_computed_tokens_kernel,
        _expand_idx_mapping_kernel,
    ),
    "vllm.v1.worker.gpu.model_states.mamba_hybrid": (_scatter_num_accepted_kernel,
                                                     _fill_num_accepted_kernel),
    "vllm.v1.worker.gpu.buffer_utils": (_apply_write_kernel,),
    "vllm.v1.worker.gpu.mm.rope": (_prepare_rope_positions_kernel,),
}
"""The kernels this module implements, by the vLLM module that defines each (under the same
name). ``model_states.prompt_embeds._apply_prompt_embeds_kernel`` is not among them: it takes a
pointer table (see :func:`apply_prompt_embeds`)."""


def apply_prompt_embeds(state, input_batch, num_computed_tokens, inputs_embeds) -> None:
    """Replacement of ``vllm.v1.worker.gpu.model_states.prompt_embeds.PromptEmbedsState.apply``
    (same parameters): batch row ``b`` whose request has prompt embeddings still to consume
    overlays rows ``num_computed + j`` (``j`` below its query length and the embeddings' end) of
    them onto ``inputs_embeds[query_start + j]``, except where its is-token-ids mask is set.

    The Triton kernel finds each request's embeddings through a table of device pointers; here
    the host holds the tensors (``state.gpu_tensors``, by request id) and cuts each row's slice
    with the batch's host mirror of ``num_computed_tokens`` (``input_batch.num_computed_tokens_np``),
    which equals the device value for a request still in its prompt (no drafts are scheduled
    during a prefill; rejections only ever lower a decode's count), so the device tensor is not
    read. One ``cat`` per step gathers the slices: no launch per request."""
    if not state.gpu_tensors:
        return
    num_reqs = input_batch.num_reqs
    starts = input_batch.query_start_loc_np[:num_reqs]
    query_lens = input_batch.num_scheduled_tokens[:num_reqs]
    computed = input_batch.num_computed_tokens_np[:num_reqs]
    overlays = []  # (embeds, mask, first row, rows, first destination): host bookkeeping only
    for b, req_id in enumerate(input_batch.req_ids[:num_reqs]):
        held = state.gpu_tensors.get(req_id)
        if held is None:
            continue
        embeds, mask = held
        begin = int(computed[b])
        rows = min(int(query_lens[b]), embeds.shape[0] - begin)
        if rows > 0:
            overlays.append((embeds, mask, begin, rows, int(starts[b])))
    if not overlays:
        return
    no_mask = inputs_embeds.new_zeros(max(rows for _, _, _, rows, _ in overlays),
                                      dtype=torch.uint8)
    source = torch.cat([embeds[begin : begin + rows] for embeds, _, begin, rows, _ in overlays])
    is_token_id = torch.cat([no_mask[:rows] if mask is None else mask[begin : begin + rows]
                             for _, mask, begin, rows, _ in overlays]).bool()
    destinations = [np.arange(start, start + rows) for _, _, _, rows, start in overlays]
    destination = torch.from_numpy(np.concatenate(destinations)).to(inputs_embeds.device,
                                                                     non_blocking=True)
    current = inputs_embeds.index_select(0, destination)
    inputs_embeds.index_copy_(0, destination,
                              torch.where(is_token_id[:, None], current, source.to(current.dtype)))


def npu_prompt_embeds(original):
    """Replacement factory of ``PromptEmbedsState.apply``: :func:`apply_prompt_embeds`."""
    return apply_prompt_embeds
