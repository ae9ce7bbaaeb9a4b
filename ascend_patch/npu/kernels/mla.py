"""Multi-head latent attention (DeepSeek MLA): the contract-checked references of the NPU's MLA
kernels, and the latent attention math they share with the MLA backend's composed (fp32) path.

MLA attends over a per-token latent ``kv_c`` (``kv_lora_rank`` wide, 512 in DeepSeek-V2/V3) and a
rope key ``k_pe`` (64) shared by every head. A query head either carries the up-projected form
(``q_nope`` 128 and ``q_pe`` 64 against per-head keys ``kv_b_proj(kv_c)``: multi-head attention)
or the absorbed form (``q_nope @ W_UK`` 512 and ``q_pe`` against ``kv_c`` and ``k_pe`` themselves,
one KV head, values ``kv_c``: multi-query attention over the latent cache). Either way a score is
``scale * (q_nope . k_nope + q_rope . k_rope)``. The caches are two planes,
``[num_blocks, block_size, 1, kv_lora_rank]`` and ``[num_blocks, block_size, 1, rope]``.

Call order in the backend (``ascend_patch.npu.attention.mla``), per layer and step::

    npu_scatter_pa_kv_cache(kv_c [T, 1, 512], k_pe [T, 1, 64], kv_c_cache, k_pe_cache, slots)
    # decodes (one query token each), absorbed:
    torch_npu.atb.npu_multi_head_latent_attention(q_nope [B, N, 512], q_rope [B, N, 64],
        kv_c_cache, k_pe_cache, block_table, context_lens, N, scale, 1)
    # prefills without cached context, up-projected (D = 128):
    npu_fused_infer_attention_score(q_nope [T, N, 128], k_nope [T, N, 128], v [T, N, 128],
        query_rope=[T, N, 64], key_rope=[T, N, 64], input_layout="TND", sparse_mode=3, ...)
    # prefills behind cached context (chunked prefill, prefix-cache hits), absorbed (D = 512):
    npu_fused_infer_attention_score(q_nope [T, N, 512], kv_c_cache [nb, bs, 512], same,
        query_rope=[T, N, 64], key_rope=k_pe_cache [nb, bs, 64], block_table=...,
        input_layout="TND", sparse_mode=3, ...)

Contract sources (op-plugin is Ascend/op-plugin at 517f2e7d; docs under
``docs/zh/custom_APIs/torch_npu/``):

- [FIA] ``torch_npu-npu_fused_infer_attention_score.md``: "MLA约束", "TND布局约束",
  "PageAttention约束", ``query_rope``/``key_rope``; the schema in
  ``op_plugin/config/op_plugin_functions.yaml``.
- [ATB-MLA] ``op_plugin/python/atb/_atb_api_docs.py`` (``npu_multi_head_latent_attention``: shapes,
  dtypes, "block_size <= 128", "batch <= 8192"); the binding
  ``op_plugin/ops/atb/MultiHeadLatentAttentionAtb.cpp`` (output ``empty(q_nope.sizes(),
  q_rope.options())``; ``context_lens`` a host ``SymInt[]``); the head counts from the CANN ATB
  ``MultiLatentAttentionParam`` table (hiascend CANN 8.1.RC1.beta1, ascendtbapi
  ``ascendtb_01_0178.html``): headNum in {8, 16, 32, 64, 128}, qkScale in (0, 1], kvHeadNum 1.
- [ATB-IN] ``op_plugin/utils/custom_functions/atb/AtbCommon.cpp``: ``ParamSetter::Input`` makes
  every input contiguous itself, so ATB inputs may be strided views (at the cost of a copy).
"""

import math

import torch

from .contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_int_list,
    check_tensor,
    require,
)
from .reference import (
    _check_block_ids,
    _check_causal_mask,
    _check_tnd_lengths,
    _lengths_from_cumulative,
    no_softmax_lse,
)

_HALF = (torch.float16, torch.bfloat16)
# [FIA] MLA约束, D = 512: "要求query的N为1/2/4/8/16/32/64/128".
FIA_LATENT_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
# [ATB-MLA] MultiLatentAttentionParam.headNum.
ATB_MLA_HEADS = (8, 16, 32, 64, 128)
LATENT_DIM, ROPE_DIM, UP_PROJECTED_DIM = 512, 64, 128


# --- the math -------------------------------------------------------------------------------------


def latent_attention(q_nope, q_rope, k_nope, k_rope, value, scale, causal):
    """One sequence: ``q_* [q, N, D*]`` over ``k_* [s, KVH, D*]`` and ``value [s, KVH, Dv]`` with
    ``N`` a multiple of ``KVH``; causal aligns query row i to key position s - q + i. Computed in
    float32; returns ``[q, N, Dv]`` in the query's dtype."""
    q_len, heads = q_nope.shape[:2]
    kv_len, kv_heads = k_nope.shape[:2]
    group = heads // kv_heads
    grouped = (q_len, kv_heads, group, -1)
    scores = (torch.einsum("qkgd,skd->kgqs", q_nope.float().reshape(grouped), k_nope.float())
              + torch.einsum("qkgr,skr->kgqs", q_rope.float().reshape(grouped), k_rope.float()))
    if causal:
        rows = torch.arange(q_len, device=scores.device)[:, None] + (kv_len - q_len)
        scores = scores.masked_fill(torch.arange(kv_len, device=scores.device) > rows, float("-inf"))
    probs = (scores * scale).softmax(dim=-1)
    out = torch.einsum("kgqs,skv->qkgv", probs, value.float())
    return out.reshape(q_len, heads, -1).to(q_nope.dtype)


def gather_plane(plane, block_ids, length):
    """One sequence's rows ``[length, KVH, D]`` of a paged plane ``[num_blocks, block_size, KVH, D]``."""
    blocks = block_ids[: math.ceil(length / plane.shape[1])].long()
    return plane[blocks].reshape(-1, *plane.shape[2:])[:length]


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
    latent = kv_c_cache[ids].view(batch, width * block_size, -1).float()
    rope = k_pe_cache[ids].view(batch, width * block_size, -1).float()
    scores = (torch.einsum("bnl,bsl->bns", q_nope.float(), latent)
              + torch.einsum("bnr,bsr->bns", q_rope.float(), rope))
    visible = torch.arange(width * block_size, device=q_nope.device) < lengths[:, None]
    probs = (scores * scale).masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bns,bsl->bnl", probs, latent).to(q_nope.dtype)


# --- npu_fused_infer_attention_score, MLA form ----------------------------------------------------


def fused_infer_attention_score_mla(
    query,
    key,
    value,
    *,
    query_rope,
    key_rope,
    atten_mask=None,
    block_table=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads,
    num_key_value_heads,
    scale,
    input_layout="TND",
    block_size=0,
    sparse_mode=0,
):
    """``npu_fused_infer_attention_score`` with ``query_rope``/``key_rope`` (the MLA form), TND:

    - D = 128: up-projected queries over contiguous per-head ``key``/``value`` ``[T_kv, KVH, 128]``
      and ``key_rope [T_kv, KVH, 64]``, both length lists cumulative;
    - D = 512: absorbed queries over the paged latent cache, ``key`` and ``value`` both
      ``[num_blocks, block_size, 512]`` and ``key_rope [num_blocks, block_size, 64]``, one KV
      head, per-sequence KV lengths.

    Returns ``(attn_out [T, N, Dv], softmax_lse)``, ``softmax_lse`` the empty tensor of
    ``reference.no_softmax_lse`` (the seam never sets ``softmax_lse_flag``; D = 512 does not
    support it).
    """
    op = "npu_fused_infer_attention_score"
    if input_layout != "TND":
        raise NotImplementedError(f"{op}: the seam implements the MLA form in input_layout='TND' "
                                  f"only, got {input_layout!r}")
    if sparse_mode not in (0, 3):
        raise NotImplementedError(f"{op}: the seam implements sparse_mode 0 (no mask) and 3 "
                                  f"(rightDownCausal) only, got {sparse_mode}")
    tensors = {"query": query, "key": key, "value": value, "query_rope": query_rope,
               "key_rope": key_rope}
    for name, tensor in tensors.items():
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)  # [FIA] query/key/value/query_rope: 不支持非连续
    check_dims(op, "query", query, 3)  # [FIA] TND: (T, Q_N, D)
    check_dtype(op, "query", query, _HALF)  # [FIA] query_rope: float16、bfloat16, like query
    tokens, heads, head_dim = query.shape
    for name in ("key", "value", "query_rope", "key_rope"):
        # [FIA] MLA约束: query_rope 的 dtype 与 query 一致, key_rope 与 key 一致; no quant scales.
        require(tensors[name].dtype == query.dtype, op, name, f"{query.dtype} like query",
                tensors[name].dtype)
    # [FIA] MLA约束: query 的 D 仅支持 512 或 128.
    require(head_dim in (LATENT_DIM, UP_PROJECTED_DIM), op, "query head dim (D)",
            "512 or 128 in the MLA form", head_dim)
    # [FIA] query_rope: shape 中 D 为 64, 其余维度与 query 一致.
    require(query_rope.shape == (tokens, heads, ROPE_DIM), op, "query_rope",
            f"shape {(tokens, heads, ROPE_DIM)}", tuple(query_rope.shape))
    require(value.shape == key.shape, op, "value", f"shape {tuple(key.shape)} like key",
            tuple(value.shape))  # [FIA] 通用基础约束: key与value的shape必须完全一致
    require(num_heads == heads, op, "num_heads", f"query.shape[1] = {heads}", num_heads)
    require(isinstance(scale, (int, float)), op, "scale", "a float", type(scale).__name__)

    q_ends, q_lens, kv_arg = _check_tnd_lengths(op, tokens, actual_seq_lengths, actual_seq_lengths_kv)
    batch = len(q_ends)

    if head_dim == LATENT_DIM:
        latent_key, kv_lens = _check_latent_paged(op, query, key, key_rope, block_table, kv_arg,
                                                  num_key_value_heads, block_size, max(q_lens))
        latent_rope = key_rope.unsqueeze(2)
    else:
        kv_heads, kv_lens = _check_up_projected(op, query, key, key_rope, block_table, kv_arg,
                                                num_key_value_heads)

    if sparse_mode == 3:
        _check_causal_mask(op, atten_mask, sparse_mode)
        # rightDownCausal aligns each query to the end of its KV; a longer query would leave
        # whole rows masked, whose output the docs do not define.
        for q_len, kv_len in zip(q_lens, kv_lens):
            require(q_len <= kv_len, op, "actual_seq_lengths_kv",
                    "≥ the query length of each sequence under sparse_mode=3", (q_len, kv_len))
    else:
        require(atten_mask is None, op, "atten_mask", "None with sparse_mode=0 (the seam has no "
                "custom-mask path)", "a tensor")

    out = query.new_zeros(tokens, heads, value.shape[-1])  # [FIA] S2 = 0: 输出全 0
    for i in range(batch):
        if q_lens[i] == 0 or kv_lens[i] == 0:
            continue
        rows = slice(q_ends[i] - q_lens[i], q_ends[i])
        if head_dim == LATENT_DIM:
            k_nope = gather_plane(latent_key, block_table[i], kv_lens[i])
            k_rope = gather_plane(latent_rope, block_table[i], kv_lens[i])
            v = k_nope
        else:
            kv_rows = slice(kv_arg[i] - kv_lens[i], kv_arg[i])
            k_nope, k_rope, v = key[kv_rows], key_rope[kv_rows], value[kv_rows]
        out[rows] = latent_attention(query[rows], query_rope[rows], k_nope, k_rope, v, scale,
                                     causal=sparse_mode == 3)
    return out, no_softmax_lse(query)


def _check_latent_paged(op, query, key, key_rope, block_table, kv_lens, num_key_value_heads,
                        block_size, max_q_len):
    """[FIA] MLA约束 and TND布局约束 for query D = 512 over a paged latent cache; returns the key
    as ``[num_blocks, block_size, 1, 512]`` and the per-sequence KV lengths."""
    heads = query.shape[1]
    if block_table is None:
        raise NotImplementedError(f"{op}: the seam implements the D = 512 MLA form over a paged "
                                  "cache only")
    require(heads in FIA_LATENT_HEADS, op, "num_heads", "1, 2, 4, 8, 16, 32, 64 or 128 with "
            "query D = 512", heads)
    # [FIA] key_rope: 要求key的N=1、D=512; KV 排布 BnBsH (blocknum, block_size, KV_N*D).
    require(num_key_value_heads == 1, op, "num_key_value_heads", "1 with query D = 512",
            num_key_value_heads)
    check_dims(op, "key", key, 3)
    require(key.shape[2] == LATENT_DIM, op, "key", "a paged latent cache (num_blocks, block_size, "
            "512)", tuple(key.shape))
    require(key_rope.shape == key.shape[:2] + (ROPE_DIM,), op, "key_rope",
            f"shape {tuple(key.shape[:2]) + (ROPE_DIM,)}", tuple(key_rope.shape))
    require(isinstance(block_size, int) and block_size == key.shape[1], op, "block_size",
            f"key.shape[1] = {key.shape[1]}", block_size)
    # [FIA] MLA约束 D = 512: PageAttention block_size 为 16 的倍数、≤ 1024; PageAttention约束:
    # Q_S > 1 须为 128 的倍数, 128 到 512. Both hold for what the seam passes.
    require(block_size % 16 == 0 and 16 <= block_size <= 1024, op, "block_size",
            "a multiple of 16 up to 1024 (MLA, D = 512)", block_size)
    if max_q_len > 1:
        require(block_size % 128 == 0 and block_size <= 512, op, "block_size",
                "a multiple of 128 in [128, 512] when a query is longer than 1", block_size)
    check_tensor(op, "block_table", block_table)
    check_dtype(op, "block_table", block_table, (torch.int32,))  # [FIA] block_table: int32
    check_dims(op, "block_table", block_table, 2)  # [FIA] [B, maxBlockNumPerSeq]
    require(block_table.shape[0] == len(kv_lens), op, "block_table",
            f"{len(kv_lens)} rows (one per sequence)", block_table.shape[0])
    # [FIA] TND, D = 512, PageAttention: actual_seq_lengths_kv 长度 = kv batch 数, 值 ≤ KV_S.
    capacity = block_table.shape[1] * block_size
    for length in kv_lens:
        require(0 <= length <= capacity, op, "actual_seq_lengths_kv",
                f"per-sequence lengths in [0, {capacity}] with a paged cache", kv_lens)
    needed = sum(math.ceil(length / block_size) for length in kv_lens)
    require(needed <= key.shape[0], op, "key", f"≥ {needed} blocks (the sum over sequences)",
            key.shape[0])  # [FIA] blocknum ≥ 各batch block数之和
    _check_block_ids(op, block_table, kv_lens, block_size, key.shape[0])
    return key.unsqueeze(2), kv_lens


def _check_up_projected(op, query, key, key_rope, block_table, kv_arg, num_key_value_heads):
    """[FIA] TND布局约束, query D ≠ 512 with rope: Q_D = K_D = V_D = 128, K/V ``[T_kv, KVH, D]``
    with cumulative lengths; returns the KV head count and the per-sequence KV lengths."""
    heads = query.shape[1]
    if block_table is not None:
        raise NotImplementedError(f"{op}: the seam implements the D = 128 MLA form over "
                                  "contiguous K/V only")
    require(heads <= 256, op, "num_heads", "≤ 256", heads)  # [FIA] N ≤ 256
    kv_heads = num_key_value_heads or heads
    # [FIA] num_key_value_heads: num_heads 能被整除, 比值 ≤ 64.
    require(heads % kv_heads == 0 and heads // kv_heads <= 64, op, "num_key_value_heads",
            f"a divisor of num_heads={heads} with ratio ≤ 64", num_key_value_heads)
    check_dims(op, "key", key, 3)
    # [FIA] 有rope: Q_D、K_D、V_D = 128.
    require(key.shape[1:] == (kv_heads, UP_PROJECTED_DIM), op, "key",
            f"shape (T_kv, {kv_heads}, 128)", tuple(key.shape))
    # [FIA] key_rope: shape 中 D 为 64, 其余维度与 key 一致.
    require(key_rope.shape == key.shape[:2] + (ROPE_DIM,), op, "key_rope",
            f"shape {tuple(key.shape[:2]) + (ROPE_DIM,)}", tuple(key_rope.shape))
    kv_lens = _lengths_from_cumulative(op, "actual_seq_lengths_kv", kv_arg)
    require(kv_arg[-1] == key.shape[0], op, "actual_seq_lengths_kv",
            f"cumulative, ending at key.shape[0] = {key.shape[0]}", kv_arg)
    return kv_heads, kv_lens


# --- torch_npu.atb.npu_multi_head_latent_attention ------------------------------------------------


def multi_head_latent_attention(q_nope, q_rope, ctkv, k_rope, block_tables, context_lens,
                                q_headnum, qk_scale, kv_headnum):
    """Paged MLA decode, ``cache_mode`` 'krope_ctkv': each token's query attends to its whole
    context, keys ``ctkv ++ k_rope`` (576), values ``ctkv`` (512). Returns ``[T, N, 512]`` in
    ``q_rope``'s dtype (the binding allocates the output so)."""
    op = "npu_multi_head_latent_attention"
    for name, tensor in (("q_nope", q_nope), ("q_rope", q_rope), ("ctkv", ctkv),
                         ("k_rope", k_rope)):
        check_tensor(op, name, tensor)
        # [ATB-MLA] q_nope/ctkv: float16/bf16/int8 (int8 only in 'int8_nzcache', which the seam
        # does not use), q_rope/k_rope: float16/bf16; one dtype throughout.
        check_dtype(op, name, tensor, _HALF)
        require(tensor.dtype == q_nope.dtype, op, name, f"{q_nope.dtype} like q_nope", tensor.dtype)
    check_dims(op, "q_nope", q_nope, 3)  # [ATB-MLA] q_nope [num_tokens, num_heads, 512]
    tokens, heads, latent = q_nope.shape
    require(latent == LATENT_DIM, op, "q_nope", "[num_tokens, num_heads, 512]",
            tuple(q_nope.shape))
    require(q_rope.shape == (tokens, heads, ROPE_DIM), op, "q_rope",
            f"shape {(tokens, heads, ROPE_DIM)} ([num_tokens, num_heads, 64])", tuple(q_rope.shape))
    # [ATB-MLA] 'krope_ctkv': ctkv [num_blocks, block_size, kv_heads, 512], k_rope [.., 64].
    check_dims(op, "ctkv", ctkv, 4)
    num_blocks, block_size, cache_heads = ctkv.shape[:3]
    require(ctkv.shape[3] == LATENT_DIM, op, "ctkv", "[num_blocks, block_size, kv_heads, 512]",
            tuple(ctkv.shape))
    require(k_rope.shape == (num_blocks, block_size, cache_heads, ROPE_DIM), op, "k_rope",
            f"shape {(num_blocks, block_size, cache_heads, ROPE_DIM)}", tuple(k_rope.shape))
    require(block_size <= 128, op, "block_size (ctkv.shape[1])", "≤ 128", block_size)
    # [ATB-MLA] MultiLatentAttentionParam: headNum {8,16,32,64,128}, kvHeadNum 1, qkScale (0, 1].
    require(q_headnum == heads, op, "q_headnum", f"q_nope.shape[1] = {heads}", q_headnum)
    require(heads in ATB_MLA_HEADS, op, "q_headnum", "8, 16, 32, 64 or 128", heads)
    require(kv_headnum == 1 and cache_heads == 1, op, "kv_headnum", "1 (and ctkv.shape[2] = 1)",
            (kv_headnum, cache_heads))
    require(isinstance(qk_scale, (int, float)) and 0 < qk_scale <= 1, op, "qk_scale",
            "a float in (0, 1]", qk_scale)

    check_tensor(op, "block_tables", block_tables)
    check_dtype(op, "block_tables", block_tables, (torch.int32,))  # [ATB-MLA] int32
    check_dims(op, "block_tables", block_tables, 2)  # [batch, max_num_blocks_per_query]
    require(block_tables.shape[0] == tokens, op, "block_tables", f"{tokens} rows (one per query)",
            block_tables.shape[0])
    lengths = check_int_list(op, "context_lens", context_lens)  # [ATB-MLA] int类型数组 (host)
    require(len(lengths) == tokens, op, "context_lens", f"{tokens} entries", len(lengths))
    require(tokens <= 8192, op, "batch", "≤ 8192", tokens)  # [ATB-MLA] 规格约束
    capacity = block_tables.shape[1] * block_size
    for length in lengths:
        require(1 <= length <= capacity, op, "context_lens",
                f"in [1, {capacity}] (block_tables columns × block_size)", length)
    _check_block_ids(op, block_tables, lengths, block_size, num_blocks)
    return latent_decode(q_nope, q_rope, ctkv, k_rope, block_tables, lengths, qk_scale)
