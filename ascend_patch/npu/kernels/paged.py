"""Attention over a paged KV cache in plain torch ops.

Shared by the reference kernels, which compute the documented output of the NPU's
fused attention ops after checking their contracts, and by the attention backend's
composed path, which runs fp32 models with these same generic ops (they run on the
NPU as ordinary kernels). Caches are ``[num_blocks, block_size, kv_heads, head_size]``.
"""

import math

import torch
import torch.nn.functional as F


def gather_sequence(key_cache, value_cache, block_ids, length):
    """One sequence's K/V, [length, KVH, D], gathered from [nb, bs, KVH, D] caches."""
    blocks = block_ids[: math.ceil(length / key_cache.shape[1])].long()
    heads_dim = key_cache.shape[2:]
    return (key_cache[blocks].reshape(-1, *heads_dim)[:length],
            value_cache[blocks].reshape(-1, *heads_dim)[:length])


def attend(query, key, value, scale, causal):
    """One sequence: query [q, N, D] over key/value [s, KVH, D]; causal aligns query row i to key
    position s - q + i (sparse_mode=3, rightDownCausal)."""
    q_len, kv_len = query.shape[0], key.shape[0]
    mask, is_causal = None, False
    if causal and q_len > 1:
        if q_len == kv_len:
            is_causal = True
        else:
            rows = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
            mask = torch.arange(kv_len, device=query.device) <= rows
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
        attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(0, 1)


def decode_batch(query, key_cache, value_cache, block_table, lengths, scale):
    """Batched single-token attention, query [B, N, D] over [nb, bs, KVH, D] caches -> [B, N, D].

    The GQA group is folded into the query-length axis (no causal structure within one token), so
    the K/V heads are never repeated; one SDPA call serves the whole batch.
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
    visible = torch.arange(span, device=query.device) < lengths[:, None]
    out = F.scaled_dot_product_attention(
        query.view(batch, kv_heads, heads // kv_heads, head_dim), keys, values,
        attn_mask=visible[:, None, None, :], scale=scale,
    )
    return out.reshape(batch, heads, head_dim)
