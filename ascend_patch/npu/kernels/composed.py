"""Attention over a paged KV cache, and LoRA's per-row adapter matmul, in plain torch ops.

Shared by the reference kernels, which compute the documented output of the NPU's
fused attention ops after checking their contracts, and by the attention backend's
composed path, which runs what no fused kernel takes (fp32 models, soft-capped
logits, some head sizes) with these same generic ops (they run on the NPU as
ordinary kernels). Caches are ``[num_blocks, block_size, kv_heads, head_size]``.

Which keys a query row sees is a band around its diagonal, as the NPU ops define it
(``sparse_mode=4``, anchored at the bottom right): query row ``i`` of a sequence with
``q`` queries over ``s`` keys sits at key position ``d = s - q + i`` and sees keys ``j``
with ``d - pre_tokens <= j <= d + next_tokens``; ``None`` leaves a side unbounded.
Causal attention is ``next_tokens=0``; a sliding window of ``W`` keys (vLLM's and
Hugging Face's ``sliding_window``: the query's own key and the ``W - 1`` before it)
adds ``pre_tokens=W - 1``.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


def gather_sequence(key_cache, value_cache, block_ids, length):
    """One sequence's K/V, [length, KVH, D], gathered from [nb, bs, KVH, D] caches."""
    blocks = block_ids[: math.ceil(length / key_cache.shape[1])].long()
    heads_dim = key_cache.shape[2:]
    return (key_cache[blocks].reshape(-1, *heads_dim)[:length],
            value_cache[blocks].reshape(-1, *heads_dim)[:length])


def band(q_len, kv_len, pre_tokens, next_tokens, device):
    """[q_len, kv_len] bool, True where query row i may see key j (the band above), or None
    when nothing is masked."""
    if pre_tokens is None and (next_tokens is None or next_tokens >= q_len - 1):
        return None  # even the first row's band reaches the last key
    offset = torch.arange(kv_len, device=device) - (
        torch.arange(q_len, device=device)[:, None] + (kv_len - q_len))
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if next_tokens is not None:
        allowed &= offset <= next_tokens
    if pre_tokens is not None:
        allowed &= offset >= -pre_tokens
    return allowed


def attend(query, key, value, scale, *, pre_tokens=None, next_tokens=None, soft_cap=None):
    """One sequence: query [q, N, D] over key/value [s, KVH, D] within the band -> [q, N, D]."""
    q_len, kv_len = query.shape[0], key.shape[0]
    causal = pre_tokens is None and next_tokens == 0 and q_len == kv_len
    allowed = None if causal else band(q_len, kv_len, pre_tokens, next_tokens, query.device)
    out = softmax_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                            allowed, scale, soft_cap, causal=causal)
    return out.transpose(0, 1)


def decode_batch(query, key_cache, value_cache, block_table, lengths, scale, *, pre_tokens=None,
                 masked=None, soft_cap=None):
    """Batched single-token attention, query [B, N, D] over [nb, bs, KVH, D] caches -> [B, N, D].

    Row b sees keys ``[lengths[b] - 1 - pre_tokens, lengths[b])`` (all of them when
    ``pre_tokens`` is None), minus those ``masked`` ([B, ≥ span] bool, True = hidden) hides.
    The GQA group is folded into the query-length axis (no causal structure within one token),
    so the K/V heads are never repeated; one attention call serves the whole batch.
    """
    batch, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    lengths = torch.tensor(lengths, device=query.device)
    blocks_used = (lengths + block_size - 1) // block_size
    width = int(blocks_used.max())
    in_use = torch.arange(width, device=query.device) < blocks_used[:, None]
    ids = block_table[:, :width].long().masked_fill(~in_use, 0)  # unused columns may be stale
    span = width * block_size
    keys = key_cache[ids].view(batch, span, kv_heads, head_dim).transpose(1, 2)
    values = value_cache[ids].view(batch, span, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(span, device=query.device)
    visible = positions < lengths[:, None]
    if pre_tokens is not None:
        visible &= positions >= (lengths - 1 - pre_tokens)[:, None]
    if masked is not None:
        visible &= ~masked[:, :span].bool()
    keys, values = (_only_visible(t, visible[:, None, :, None]) for t in (keys, values))
    out = softmax_attention(query.view(batch, kv_heads, heads // kv_heads, head_dim), keys, values,
                            visible[:, None, None, :], scale, soft_cap)
    return out.reshape(batch, heads, head_dim)


def _only_visible(rows, visible):
    """Gathered cache rows with every position its query cannot see zeroed. The NPU kernels read
    a sequence's own tokens only; a gather of whole blocks also reads the rest of its last block
    and null-block padding, whose bytes may be anything (padded tokens' K/V land in the null
    block), and a masked NaN would still turn its zero weight into NaN."""
    return rows.masked_fill(~visible, 0)


def softmax_attention(query, key, value, allowed, scale, soft_cap=None, causal=False):
    """``softmax(cap(scale * q kᵀ) masked) v`` for query [..., N, q, D] over key/value
    [..., KVH, s, D] (N a multiple of KVH), with ``cap(x) = soft_cap * tanh(x / soft_cap)``
    when ``soft_cap`` is set (Gemma 2's attention logit soft-capping, which SDPA lacks)."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, is_causal=causal, scale=scale,
            enable_gqa=key.shape[-3] != query.shape[-3],
        )
    group = query.shape[-3] // key.shape[-3]
    key = key.repeat_interleave(group, dim=-3)
    value = value.repeat_interleave(group, dim=-3)
    scores = (query @ key.transpose(-1, -2)).float() * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1).to(value.dtype) @ value


# --- multi-head latent attention (fp32 over the latent cache) -----------------------------------


def prefill_attention(query, key, value, query_ends, kv_ends, scale, causal):
    """A TND batch: ``query [T, N, D]`` over contiguous ``key [T_kv, N, D]`` and ``value
    [T_kv, N, V]`` with cumulative lengths, each sequence on its own (causal aligns its query row i
    to key s - q + i), in float32. Returns the output ``[T, N, V]`` in the query's dtype (zero
    rows for a sequence without keys) and the float32 log-sum-exp of each row's scaled scores
    ``[T, N, 1]`` (-inf there)."""
    tokens, heads = query.shape[:2]
    out = query.new_zeros(tokens, heads, value.shape[2])
    lse = torch.full((tokens, heads, 1), float("-inf"), device=query.device)
    q_start = kv_start = 0
    for q_end, kv_end in zip(query_ends, kv_ends):
        q_len, kv_len = q_end - q_start, kv_end - kv_start
        if q_len and kv_len:
            scores = torch.einsum("qnd,snd->nqs", query[q_start:q_end].float(),
                                  key[kv_start:kv_end].float()) * scale
            if causal:
                rows = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
                scores = scores.masked_fill(torch.arange(kv_len, device=query.device) > rows,
                                            float("-inf"))
            row_lse = scores.logsumexp(dim=-1, keepdim=True)
            out[q_start:q_end] = torch.einsum("nqs,snv->qnv", (scores - row_lse).exp(),
                                              value[kv_start:kv_end].float())
            lse[q_start:q_end] = row_lse.transpose(0, 1)
        q_start, kv_start = q_end, kv_end
    return out, lse


def latent_decode(q_nope, q_rope, kv_c_cache, k_pe_cache, block_table, lengths, scale):
    """Single-token absorbed queries ``[B, N, L]``/``[B, N, R]`` over the latent planes, every
    sequence in one batched computation; returns ``[B, N, L]``."""
    batch = q_nope.shape[0]
    block_size = kv_c_cache.shape[1]
    lengths = torch.tensor(lengths, device=q_nope.device)
    blocks_used = (lengths + block_size - 1) // block_size
    width = int(blocks_used.max())
    in_use = torch.arange(width, device=q_nope.device) < blocks_used[:, None]
    ids = block_table[:, :width].long().masked_fill(~in_use, 0)  # unused columns may be stale
    visible = torch.arange(width * block_size, device=q_nope.device) < lengths[:, None]
    latent, rope = (_only_visible(cache[ids].view(batch, width * block_size, -1).float(),
                                  visible[:, :, None]) for cache in (kv_c_cache, k_pe_cache))
    scores = (torch.einsum("bnl,bsl->bns", q_nope.float(), latent)
              + torch.einsum("bnr,bsr->bns", q_rope.float(), rope))
    probs = (scores * scale).masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bns,bsl->bnl", probs, latent).to(q_nope.dtype)


class SlotRows(NamedTuple):
    """Each row's LoRA adapter slot, as :func:`gathered_matmul` reads it: computed once per step."""

    slot: torch.Tensor  # [T] int64, a row without an adapter read as slot 0
    unassigned: torch.Tensor  # [T, 1] bool: the rows without an adapter (index -1)

    def first(self, count: int) -> "SlotRows":
        return SlotRows(self.slot[:count], self.unassigned[:count])

    def refresh_(self, indices: torch.Tensor) -> None:
        """Rewrite in place from ``indices`` (as long as these rows): a captured graph reads
        these tensors, so a new step's slots must land in them, not in new ones."""
        self.slot.copy_(indices.clamp(min=0))
        self.unassigned.copy_((indices < 0).unsqueeze(1))


def slot_rows(indices: torch.Tensor) -> SlotRows:
    """vLLM's per-row LoRA indices (-1: no adapter) as :class:`SlotRows`."""
    return SlotRows(indices.long().clamp(min=0), (indices < 0).unsqueeze(1))


def slot_weights_(out: torch.Tensor, indices: torch.Tensor, slots: torch.Tensor) -> None:
    """``out`` [T, S, 1] float32 rewritten in place: 1 at each row's adapter slot (``slots`` is
    ``arange(S)``), 0 elsewhere and for every slot of a row without an adapter (index -1)."""
    out.copy_((indices.unsqueeze(1) == slots).unsqueeze(2))


def lora_deltas(x, lora_as, lora_bs, weights) -> list:
    """Each row's ``(x[t] @ A_i[s]ᵀ) @ B_i[s]ᵀ`` per slice ``i``, for the row's slot ``s``
    (unscaled): ``x`` [T, K] float32, ``lora_as`` [S, R_i, K], ``lora_bs`` [S, N_i, R_i],
    ``weights`` [T, S, 1] from :func:`slot_weights_` -> per slice [T, N_i] in B's dtype, 0 for rows
    without an adapter. One shrink for all slices (their A's stacked along the rank) meets every
    slot in one float32 einsum (as vLLM's own LoRA paths keep it), the weights keep each row's own
    slot, and one expand per slice contracts slots and rank at once: no gather or mask."""
    stacked = lora_as[0] if len(lora_as) == 1 else torch.cat(lora_as, dim=1)
    shrunk = (torch.einsum("tk,srk->tsr", x, stacked.float()) * weights).to(lora_bs[0].dtype)
    deltas, start = [], 0
    for lora_b in lora_bs:
        rank = lora_b.shape[2]
        deltas.append(torch.einsum("tsr,snr->tn", shrunk[:, :, start: start + rank], lora_b))
        start += rank
    return deltas


def expert_lora_pairs(slots, experts, experts_per_slot: int, remote: bool = False):
    """Each routed copy's row in the (slot, expert)-flattened adapter weights, -1 for copies
    without an adapter (``slots`` -1) or, with ``remote``, routed to another rank's expert
    (``experts`` -1)."""
    pairs = torch.where(slots >= 0, slots * experts_per_slot + experts, -1)
    return torch.where(experts >= 0, pairs, -1) if remote else pairs


def expert_lora_deltas(x, lora_as, lora_bs, pairs, top_k: int = 1, scale=None) -> list:
    """MoE LoRA: each routed copy's ``(x @ A_i[s, e]ᵀ) @ B_i[s, e]ᵀ`` per slice ``i``, for the
    copy's adapter slot ``s`` and expert ``e`` (``pairs`` [C] from :func:`expert_lora_pairs`):
    ``x`` [C / top_k, K] (one row per token, shared by its ``top_k`` copies), ``lora_as``
    [S, E, R, K], ``lora_bs`` [S, E, N_i, R] -> per slice [C, N_i], 0 for copies without a pair;
    ``scale`` [C] weighs each copy. Each copy takes its own pair of A and B by one index_select
    each (C x R x (K + N) elements, no host read), so it meets only its own expert."""
    keep = pairs >= 0
    rows = pairs.clamp(min=0)
    weight = keep if scale is None else torch.where(keep, scale, 0)
    if weight.dtype != x.dtype:  # einsum takes one dtype (the routing weights may be fp32)
        weight = weight.to(x.dtype)
    deltas = []
    for lora_a, lora_b in zip(lora_as, lora_bs):
        a = lora_a.flatten(0, 1).index_select(0, rows)
        shrunk = torch.einsum("tk,tjrk->tjr", x, a.view(x.shape[0], top_k, *a.shape[1:]))
        shrunk = shrunk.reshape(-1, a.shape[1]) * weight.unsqueeze(1)
        deltas.append(torch.einsum("cr,cnr->cn", shrunk,
                                   lora_b.flatten(0, 1).index_select(0, rows)))
    return deltas


def gathered_matmul(x, weight, rows: SlotRows):
    """LoRA's per-row matmul: row ``t`` of ``x`` [T, K] times its adapter slot's
    ``weight[slot[t]]ᵀ`` (``weight`` [slots, N, K]) -> [T, N], zero for rows without an adapter.
    Every row meets every slot in one einsum and keeps its own slot's product: no per-row copy
    of the weights and no host read of the indices (vLLM's slots are max_loras, few). Shared by
    the BGMV reference and the LoRA wrapper's plain path, which runs on the NPU as ordinary
    kernels where npu_batch_gather_matmul_ does not apply."""
    every = torch.einsum("tk,snk->tsn", x, weight)
    picked = every.gather(1, rows.slot.view(-1, 1, 1).expand(-1, 1, every.shape[2])).squeeze(1)
    return picked.masked_fill(rows.unassigned, 0)
