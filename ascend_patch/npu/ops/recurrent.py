"""The composed path of vLLM's recurrent layers (Mamba-2 mixers, gated DeltaNet): what vLLM
launches as Triton kernels, in the generic torch ops of :mod:`ascend_patch.npu.kernels.recurrence`.

Each function takes the arguments of the vLLM function it stands in for (the patches in
``patches/recurrent.py`` install it under that name) and writes the same outputs and state
slots. No torch_npu op takes these layers as vLLM builds them: npu_fused_causal_conv1d has a
fixed width of 3, no bias and no activation (Ascend 950 only), while vLLM's convolutions are
width 4 with bias and SiLU; torch_npu has no selective-scan (SSD) op; npu_chunk_gated_delta_rule
takes head dims of 128 only. The gated delta rule's decode runs npu_recurrent_gated_delta_rule
(kernel seam) where its dtypes allow (bf16), the composed recurrence otherwise. They run per sequence,
with the sequence boundaries read to the host once per call; the platform says so at start-up
in one line naming the layers.

State slots: a sequence's conv/SSM state lives in the slot vLLM's state index names (a block of
the hybrid KV-cache manager's Mamba group); a padded row names slot ``-1`` (PAD_SLOT_ID) or the
null block (0) and is skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import recurrence

_PAD_SLOT_ID = -1
_NULL_BLOCK_ID = 0


def instead(original):
    """The replacement of the vLLM function ``original``: this module's function of its name."""
    return globals()[original.__name__]


def _skipped(slot: int, null_block_id: int = _NULL_BLOCK_ID) -> bool:
    return slot in (_PAD_SLOT_ID, null_block_id)


def _slots(indices: torch.Tensor | None, count: int) -> list[int]:
    """The state slot of each sequence: column 0 of a ``[batch, blocks]`` index (without
    speculative decoding every decode keeps one state block)."""
    if indices is None:
        return list(range(count))
    if indices.dim() == 2:
        indices = indices[:, 0]
    return indices[:count].tolist()


def _one_token_per_row(op, x, num_accepted_tokens, query_start_loc) -> None:
    """The decode forms take one token per sequence: speculative decoding (several tokens per
    row, accepted counts) is refused at start-up for these models, so this only guards it."""
    rows = None if query_start_loc is None else query_start_loc.shape[0] - 1
    if num_accepted_tokens is not None or x.dim() not in (2, 3) or rows not in (None, x.shape[0]):
        raise NotImplementedError(f"ascend-patch: the composed {op} takes one token per "
                                  "sequence (no speculative decoding)")


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                     has_initial_state=None, activation="silu", pad_slot_id=_PAD_SLOT_ID,
                     null_block_id=_NULL_BLOCK_ID, metadata=None, validate_data=False):
    """``vllm...mamba.ops.causal_conv1d.causal_conv1d_fn``: x ``[dim, tokens]`` of concatenated
    sequences; each sequence starts from its conv state where ``has_initial_state`` says so
    (zeros otherwise) and leaves its last ``width - 1`` inputs there. Returns ``[dim, tokens]``."""
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    slots = _slots(cache_indices, len(starts) - 1)
    initial = [False] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    width = weight.shape[1]
    for seq, (begin, end) in enumerate(zip(starts, starts[1:])):
        slot = slots[seq]
        if begin == end or slot == pad_slot_id:
            continue
        state = conv_states[slot, :, : width - 1]
        before = state if initial[seq] else torch.zeros_like(state)
        y, after = recurrence.causal_conv1d(x[:, begin:end], weight, bias, before, activation)
        out[:, begin:end] = y.to(out.dtype)
        state.copy_(after.to(state.dtype))
    return out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                         conv_state_indices=None, num_accepted_tokens=None,
                         query_start_loc=None, max_query_len=-1, null_block_id=_NULL_BLOCK_ID,
                         validate_data=False, out=None):
    """``vllm...mamba.ops.causal_conv1d.causal_conv1d_update``: one decode token per row,
    x ``[batch, dim]``; each row's conv state shifts by that token. Returns ``[batch, dim]``."""
    _one_token_per_row("causal_conv1d_update", x, num_accepted_tokens, query_start_loc)
    result = torch.zeros_like(x) if out is None else out
    width = weight.shape[1]
    for row, slot in enumerate(_slots(conv_state_indices, x.shape[0])):
        if _skipped(slot, null_block_id):
            continue
        state = conv_state[slot, :, : width - 1]
        y, after = recurrence.causal_conv1d(x[row, :, None], weight, bias, state, activation)
        result[row] = y[:, 0].to(result.dtype)
        state.copy_(after.to(state.dtype))
    return result


def _dt(dt, dt_bias, dt_softplus, dt_limit=(0.0, float("inf"))):
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _skip(D, x):
    """Mamba-2's ``D x`` skip connection, D ``[heads]`` or ``[heads, head_dim]``."""
    if D is None:
        return 0.0
    D = D.float()
    return x.float() * (D[:, None] if D.dim() == 1 else D)


def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens,
                                     last_chunk_indices, seq_idx, out, D=None, z=None,
                                     dt_bias=None, initial_states=None, dt_softplus=False,
                                     dt_limit=(0.0, float("inf")),
                                     return_intermediate_states=False, state_dtype=None,
                                     final_states_out=None, final_state_indices=None):
    """``vllm...mamba.ops.ssd_combined.mamba_chunk_scan_combined_varlen``: Mamba-2's chunked
    prefill over vLLM's chunks (``cu_chunk_seqlens``, each in sequence ``seq_idx``), the state
    carried from chunk to chunk of a sequence. Writes ``out``; returns the final states
    (``[batch, H, P, N]``), the per-chunk states when asked, or None once written to
    ``final_states_out[final_state_indices]``."""
    if z is not None:
        raise NotImplementedError("ascend-patch: the composed SSD scan takes no gate z")
    bounds = cu_chunk_seqlens.tolist()
    owners = seq_idx.tolist()
    batch = cu_seqlens.shape[0] - 1
    heads, head_dim, d_state = x.shape[1], x.shape[2], B.shape[2]
    states = torch.zeros(batch, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    if initial_states is not None:
        states.copy_(initial_states)
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)
    chunk_states = []
    for chunk, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        seq = owners[chunk]
        y, states[seq] = recurrence.ssd_chunk(x[begin:end], dt[begin:end], A, B[begin:end],
                                              C[begin:end], states[seq])
        out[begin:end] = (y + _skip(D, x[begin:end])).to(out.dtype)
        chunk_states.append(states[seq].clone())
    dtype = state_dtype or x.dtype
    if return_intermediate_states:
        return torch.stack(chunk_states).to(dtype)
    if final_states_out is not None:
        final_states_out[final_state_indices] = states.to(final_states_out.dtype)
        return None
    return states.to(dtype)


def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                           state_batch_indices=None, dst_state_batch_indices=None,
                           null_block_id=_NULL_BLOCK_ID, out=None, num_accepted_tokens=None,
                           cu_seqlens=None, is_blackwell=False):
    """``vllm...mamba.ops.ssu_dispatch.selective_state_update``: one Mamba-2 decode token per
    row, x ``[batch, H, P]`` with dt/A/D/dt_bias broadcast per head dim as vLLM passes them;
    each row's SSM state advances in place, ``out`` gets ``y``."""
    _one_token_per_row("selective_state_update", x, num_accepted_tokens, cu_seqlens)
    if z is not None or (dst_state_batch_indices is not None
                         and dst_state_batch_indices is not state_batch_indices):
        raise NotImplementedError("ascend-patch: the composed selective_state_update updates "
                                  "each state in place and takes no gate z")
    # vLLM expands dt, dt_bias, A and D along the head dim (stride 0): one value per head.
    dt = _dt(dt[..., 0], dt_bias[..., 0], dt_softplus)
    A = A[:, 0, 0]
    for row, slot in enumerate(_slots(state_batch_indices, x.shape[0])):
        if _skipped(slot, null_block_id):
            continue
        y, after = recurrence.ssm_step(x[row], dt[row], A, B[row], C[row], state[slot])
        out[row] = (y + _skip(D[:, 0], x[row])).to(out.dtype)
        state[slot] = after.to(state.dtype)


# --- gated DeltaNet (Qwen3-Next) ----------------------------------------------------------------


def _l2norm(x):
    """FLA's l2norm: ``x / sqrt(sum(x^2) + 1e-6)`` over the head dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _gates(A_log, a, b, dt_bias, threshold=20.0):
    """The gated delta rule's decay (log space) and write strength from the layer's inputs:
    ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), threshold=threshold)
    return g, torch.sigmoid(b.float())


def fused_post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim,
                         apply_l2norm=True, output_g_exp=False):
    """``vllm.third_party.flash_linear_attention.ops.fused_post_conv_prep``: the convolved
    ``[L, q|k|v]`` split into heads (q, k L2-normalised when asked) and the gates."""
    tokens = conv_output.shape[0]
    key_dim = num_k_heads * head_k_dim
    q, k, v = conv_output.split([key_dim, key_dim, conv_output.shape[1] - 2 * key_dim], dim=-1)
    q = q.reshape(tokens, num_k_heads, head_k_dim)
    k = k.reshape(tokens, num_k_heads, head_k_dim)
    if apply_l2norm:
        q, k = _l2norm(q).to(conv_output.dtype), _l2norm(k).to(conv_output.dtype)
    g, beta = _gates(A_log, a, b, dt_bias)
    return (q.contiguous(), k.contiguous(), v.reshape(tokens, -1, head_v_dim).contiguous(),
            g.exp() if output_g_exp else g, beta)


# FLA's chunk length: the chunked form's tiles (the result does not depend on it).
_GDN_CHUNK = 64


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None, chunk_indices=None,
                           chunk_offsets=None, use_qk_l2norm_in_kernel=False, core_attn_out=None):
    """``vllm.third_party.flash_linear_attention.ops.chunk_gated_delta_rule``: the chunked
    prefill of the gated delta rule over ``[1, T, ...]`` packed sequences (``cu_seqlens``),
    each from its ``initial_state`` row ``[N, HV, V, K]``. Returns ``(o [1, T, HV, V], final
    states [N, HV, V, K] or None)``."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    out = torch.empty_like(v) if core_attn_out is None else core_attn_out
    heads, v_dim, k_dim = v.shape[2], v.shape[3], k.shape[3]
    finals = torch.empty(len(bounds) - 1, heads, v_dim, k_dim, dtype=torch.float32, device=v.device)
    for seq, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        state = (torch.zeros(heads, v_dim, k_dim, device=v.device) if initial_state is None
                 else initial_state[seq].float())
        for start in range(begin, end, _GDN_CHUNK):
            stop = min(start + _GDN_CHUNK, end)
            o, state = recurrence.gated_delta_chunk(q[0, start:stop], k[0, start:stop],
                                                    v[0, start:stop], g[0, start:stop],
                                                    beta[0, start:stop], state, scale)
            out[0, start:stop] = o.to(out.dtype)
        finals[seq] = state
    dtype = v.dtype if initial_state is None else initial_state.dtype
    return out, finals.to(dtype) if output_final_state else None


def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0,
                                           scale=None, initial_state=None,
                                           inplace_final_state=True, cu_seqlens=None,
                                           ssm_state_indices=None, num_accepted_tokens=None,
                                           use_qk_l2norm_in_kernel=False, is_kda=False):
    """``vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating_delta_rule_update``:
    the gated delta rule's decode, one token per sequence of ``[1, T, ...]`` inputs, the gates
    computed from ``a``/``b``, each sequence's state read from and written back to
    ``initial_state[ssm_state_indices[n]]``. Returns ``(o [1, T, HV, V], the state cache)``."""
    if (not inplace_final_state or num_accepted_tokens is not None or is_kda or beta != 1.0
            or (cu_seqlens is not None and cu_seqlens.shape[0] - 1 != q.shape[1])):
        raise NotImplementedError("ascend-patch: the composed gated-delta decode takes one token "
                                  "per sequence, its state updated in place (no speculative "
                                  "decoding, no KDA)")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    g, strength = _gates(A_log, a, b, dt_bias, threshold)
    out = torch.zeros_like(v)
    out[0] = _gated_delta_decode(q[0], k[0], v[0], g, strength, initial_state,
                                 _slots(ssm_state_indices, q.shape[1]), scale)
    return out, initial_state


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale,
                                                   initial_state, out, ssm_state_indices,
                                                   use_qk_l2norm_in_kernel=False):
    """``vllm.third_party.flash_linear_attention.ops.fused_recurrent_gated_delta_rule_packed_decode``
    (vLLM's default decode when no request prefills): one convolved ``[B, q|k|v]`` token per
    sequence, into ``out`` ``[B, 1, HV, V]``; each state advances in place."""
    v_dim, k_dim = initial_state.shape[-2:]
    k_heads = (mixed_qkv.shape[1] - A_log.shape[0] * v_dim) // (2 * k_dim)
    q, k, v, g, strength = fused_post_conv_prep(mixed_qkv, a, b, A_log, dt_bias, k_heads, k_dim,
                                                v_dim, apply_l2norm=use_qk_l2norm_in_kernel)
    out[:, 0] = _gated_delta_decode(q, k, v, g, strength, initial_state,
                                    _slots(ssm_state_indices, mixed_qkv.shape[0]), scale)
    return out, initial_state


def gather_initial_states(state, indices, has_initial_state):
    """``vllm.model_executor.layers.mamba.ops.gather_initial_states`` (0.34): the state rows
    ``state[indices[i]]`` a prefill starts from, zeros where ``has_initial_state[i]`` is false
    (a new sequence, whose slot holds another's leftovers)."""
    rows = state.index_select(0, torch.where(has_initial_state, indices, 0).long())
    return rows.masked_fill(~has_initial_state.view(-1, *(1,) * (state.dim() - 1)), 0)


def scatter_states(state, src, indices):
    """``vllm.model_executor.layers.mamba.ops.scatter_states`` (0.34): ``state[indices] = src``
    in place (a prefill's final states into their slots, distinct per sequence)."""
    state.index_copy_(0, indices.long(), src.to(state.dtype))


def _gated_delta_decode(q, k, v, g, beta, states, slots, scale):
    """One gated-delta-rule token per row (q/k ``[B, H, K]``, v ``[B, HV, V]``, gates
    ``[B, HV]``), each row's state ``states[slot]`` advanced in place; padded rows get zeros.
    bf16 rows and states run npu_recurrent_gated_delta_rule (its dtypes: bf16 only), others
    the composed recurrence."""
    out = torch.zeros_like(v)
    rows = [row for row, slot in enumerate(slots) if not _skipped(slot)]
    if not rows:
        return out
    if all(t.dtype == torch.bfloat16 for t in (q, k, v, states)):
        index = torch.tensor(rows, device=v.device)
        out[index] = kernels.recurrent_gated_delta_rule(
            q[index].contiguous(), k[index].contiguous(), v[index].contiguous(), states,
            beta=beta[index].to(torch.bfloat16), scale=float(scale),
            actual_seq_lengths=torch.ones(len(rows), dtype=torch.int32, device=v.device),
            ssm_state_indices=torch.tensor([slots[row] for row in rows], dtype=torch.int32,
                                           device=v.device),
            g=g[index].float())
        return out
    for row in rows:
        o, state = recurrence.gated_delta_step(q[row], k[row], v[row], g[row], beta[row],
                                               states[slots[row]], scale)
        out[row] = o.to(out.dtype)
        states[slots[row]] = state.to(states.dtype)
    return out
