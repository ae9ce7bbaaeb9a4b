"""``PunicaWrapperNPU``: what ``Platform.get_punica_wrapper`` names on the NPU path.

vLLM's LoRA layers hand every adapter matmul to the platform's punica wrapper, with the adapters'
weights stacked by slot (``lora_a`` [slots, 1, R, H], ``lora_b`` [slots, 1, N, R], slots =
max_loras) and each token's slot in ``token_lora_indices`` (-1: the base model). Here:

- a linear layer's slices (``add_lora_linear``) take torch_npu's BGMV op,
  ``npu_batch_gather_matmul_`` (shrink and expand in one launch per slice), where its documented
  limits admit them (:func:`ascend_patch.npu.kernels.limits.bgmv_takes`: fp16, dims multiples of
  16, rank 16-128, a slice narrower than the layer's output);
- everything else (bf16 and fp32 models, a slice that is the whole output, the embedding, the
  logits, the classifier head, the separate shrink and expand of fully sharded layers) runs plain
  torch (a linear layer's slices :func:`ascend_patch.npu.kernels.composed.lora_deltas`, the others
  :func:`~ascend_patch.npu.kernels.composed.gathered_matmul`), which runs on the NPU as ordinary
  kernels: torch_npu has no other LoRA op (vllm-ascend compiles its own bgmv/sgmv).

Both read per-token slot indices only: vLLM's prefill metadata (``compute_meta``: a
``unique_consecutive`` and host reads of its result every prefill step, the step that crashed
``aclnnUniqueConsecutive`` in vllm-ascend#10626) is never built, so a step's metadata is host-to-device
copies into fixed buffers and no host read, as on vLLM's CUDA path (its ``LoRAKernelMeta`` sorts on
the device). Those buffers, and the slots derived from them once per step, are rewritten in place
(:func:`refresh_slots`): a FULL decode graph captured once reads each replay's adapters. The interface is vLLM's ``PunicaWrapperBase`` of 0.20-0.33; ``apply_lora_full_linear``
is abstract from 0.31 and answered on every release. MoE layers (vLLM 0.28+: the hooks
:class:`ascend_patch.npu.lora.moe.NPUExperts` calls) take ``add_lora_w13``/``add_lora_w2`` in
plain torch (:func:`~ascend_patch.npu.kernels.composed.expert_lora_deltas`); the alignment
metadata vLLM's Triton kernels use (``moe_lora_align_block_size``) is never built.
"""

from __future__ import annotations

import torch
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.composed import (
    expert_lora_deltas,
    expert_lora_pairs,
    gathered_matmul,
    lora_deltas,
    slot_rows,
    slot_weights_,
)


def refresh_slots(wrapper: "PunicaWrapperNPU") -> None:
    """The step's slot buffers from vLLM's per-token and per-request indices, in place."""
    wrapper._token_slots_int32.copy_(wrapper._token_lora_indices)
    slot_weights_(wrapper._token_weights, wrapper._token_lora_indices, wrapper._slots)
    wrapper._token_rows.refresh_(wrapper._token_lora_indices)
    wrapper._request_rows.refresh_(wrapper._sampler_indices)


def _write(out, delta, add_inputs) -> None:
    """``delta`` added into (``add_inputs``) or copied over ``out``'s leading columns, cut to the
    narrower of the two (vocab paddings of adapter and model may differ)."""
    width = min(out.shape[1], delta.shape[1])
    # In place on the view: `out[:, :w] += d` would write the sum back with one more copy.
    columns = out[:, :width]
    if add_inputs:
        columns.add_(delta[:, :width].to(out.dtype))
    else:
        columns.copy_(delta[:, :width])


class PunicaWrapperNPU(PunicaWrapperBase):
    def __init__(self, max_num_batched_tokens: int, max_batches: int, device, **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device)
        # Rows past a step's mapping (a padded batch) read these: the base model, never a slot
        # out of range.
        for buffer in (self._token_lora_indices, self._sampler_indices):
            buffer.fill_(-1)
        self._token_slots_int32 = torch.full((max_num_batched_tokens,), -1, dtype=torch.int32,
                                             device=device)  # BGMV's indices are int32
        self._token_rows = slot_rows(self._token_lora_indices)
        self._request_rows = slot_rows(self._sampler_indices)
        self._slots = self._token_weights = None  # sized by the first step's slots

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        # Once per step, for every layer's call: the slots as the NPU op and the plain path read
        # them, written into the same buffers every step (vLLM's base metadata is copied into
        # fixed buffers too), so that a replayed decode graph reads this step's adapters.
        self._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)
        if self._token_weights is None:  # the first step, before any capture
            # One weight per slot of the stacked adapters (vLLM's max_loras here is slots + 1).
            slots = len(lora_index_to_id)
            self._slots = torch.arange(slots, device=self.device)
            self._token_weights = torch.zeros(self._token_lora_indices.shape[0], slots, 1,
                                              device=self.device)
        refresh_slots(self)

    def _token_slots(self, rows: int):
        return self._token_rows.first(rows)

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        """``y[i] += scale * x @ lora_a_stacked[i]`` per token's slot, for each slice ``i``."""
        x = x.view(-1, x.shape[-1])
        slots = self._token_slots(x.shape[0])
        for out, weight in zip(y, lora_a_stacked):
            out += scale * gathered_matmul(x.to(out.dtype), weight[:, 0].to(out.dtype), slots)

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True,
                   **kwargs):
        """``y[:, offset : offset + slice_i] += x[i] @ lora_b_stacked[i]`` per token's slot."""
        flat = y.view(-1, y.shape[-1])
        offset = offset_start
        for rows, weight, size in zip(x, lora_b_stacked, output_slices):
            self._expand_into(flat[:, offset: offset + size], rows, weight, add_inputs)
            offset += size

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        self._expand_into(y, x, lora_b_stacked, add_inputs)

    def _expand_into(self, out, rows, weight, add_inputs, slots=None):
        slots = self._token_slots(rows.shape[0]) if slots is None else slots
        _write(out, gathered_matmul(rows.to(weight.dtype), weight[:, 0], slots), add_inputs)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *,
                        buffer=None, **kwargs):
        """``y[:, slice_i] += scale * (x @ A_i) @ B_i`` per token's slot: one BGMV launch per slice
        the op takes, plain torch for the others."""
        x = x.view(-1, x.shape[-1])
        flat = y.view(-1, y.shape[-1])
        plain, offset = [], 0
        for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
            if limits.bgmv_takes(x.dtype, x.shape[1], lora_a.shape[2], size, flat.shape[1]):
                kernels.batch_gather_matmul_(flat, x, lora_b, self._token_slots_int32[: x.shape[0]],
                                             lora_a, scale=scale, y_offset=offset,
                                             y_slice_size=size)
            else:
                plain.append((lora_a[:, 0], lora_b[:, 0], flat[:, offset: offset + size]))
            offset += size
        if plain:  # one shrink for the layer's plain slices, one expand each
            lora_as, lora_bs, columns = zip(*plain)
            deltas = lora_deltas(x.float(), lora_as, lora_bs, self._token_weights[: x.shape[0]])
            for out, delta in zip(columns, deltas):
                out.add_(delta, alpha=scale)  # scaled in the add

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None,
                        **kwargs):
        """``y += scale * (x @ A) @ B`` per logits row's request slot (``sampler_indices``)."""
        flat, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        slots = self._request_rows.first(x.shape[0])
        shrunk = scale * gathered_matmul(x.float(), lora_a_stacked[:, 0].float(), slots)
        self._expand_into(flat, shrunk, lora_b_stacked, True, slots)

    def apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        """A classifier head's rows replaced by their request's adapter head (vLLM 0.31+)."""
        weight = weight_stacked.reshape(weight_stacked.shape[0], *weight_stacked.shape[-2:])
        adapter_y = gathered_matmul(x.float(), weight.float(), self._request_rows.first(x.shape[0]))
        y.copy_(self._select_full_linear_output(y, adapter_y, bias_stacked, module_enabled))

    def _pairs(self, topk_ids, expert_map, experts_per_slot, token_lora_mapping):
        """Each routed copy's (slot, local expert) row (row ``t * k + j``: token t's j-th
        expert), -1 without an adapter or on another rank."""
        slots = (self._token_lora_indices[: topk_ids.shape[0]] if token_lora_mapping is None
                 else token_lora_mapping)
        experts = topk_ids
        if expert_map is not None:
            # index_select, not expert_map[ids]: no host sync (see ops.fused_moe.fused_experts).
            experts = expert_map.index_select(0, topk_ids.flatten().long()).view(topk_ids.shape)
        return expert_lora_pairs(slots.unsqueeze(1), experts, experts_per_slot,
                                 remote=expert_map is not None).flatten()

    @staticmethod
    def _add(out, deltas, add_inputs):
        """The slices' deltas side by side into ``out``'s columns."""
        start = 0
        for delta in deltas:
            _write(out[:, start:], delta, add_inputs)
            start += delta.shape[1]

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights,
                     expert_map, w1, w2, num_tokens, top_k_num, max_loras, adapter_enabled,
                     local_num_experts, top_k, num_slices, fully_sharded, use_tuned_config,
                     add_inputs=True, token_lora_mapping=None):
        """``y[t, j, slice_i] += (x[t] @ A_i[s, e]ᵀ) @ B_i[s, e]ᵀ`` for token t's slot s and
        its j-th expert e (vLLM's MoE interface; a disabled slot's weights are zeros)."""
        pairs = self._pairs(topk_ids, expert_map, lora_a_stacked[0].shape[1], token_lora_mapping)
        deltas = expert_lora_deltas(x, lora_a_stacked, lora_b_stacked, pairs, top_k_num)
        self._add(y.view(-1, y.shape[-1]), deltas, add_inputs)
        # Handed back to add_lora_w2 in place of vLLM's block alignment: the copies' pairs.
        return None, pairs, None, token_lora_mapping

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights,
                    sorted_token_ids_lora, expert_ids_lora, num_tokens_post_padded_lora,
                    token_lora_mapping, num_tokens, w1, w2, top_k_num, max_loras,
                    adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config,
                    add_inputs=True):
        """``y[t, j] += w[t, j] * (x[t * k + j] @ A[s, e]ᵀ) @ B[s, e]ᵀ``, weighted by the routing
        weight as vLLM's (the down projection's rows are weighted before the sum); the copies'
        (slot, expert) pairs are ``expert_ids_lora``, as :meth:`add_lora_w13` returned them."""
        (delta,) = expert_lora_deltas(x, lora_a_stacked, lora_b_stacked, expert_ids_lora,
                                      scale=topk_weights.flatten())
        self._add(y.view(-1, y.shape[-1]), [delta], add_inputs)
