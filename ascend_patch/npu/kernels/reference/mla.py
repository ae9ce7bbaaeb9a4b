"""Multi-head latent attention (DeepSeek MLA): the contract-checked references of the NPU's MLA
kernels. The latent attention math they compute is the MLA backend's composed (fp32) path too
(:mod:`ascend_patch.npu.kernels.composed`); their limits are in :mod:`ascend_patch.npu.kernels.limits`.

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
    # decodes in engines with FULL graphs, and speculative verification rows (S = 1 + k each,
    # causal), absorbed, in the .out form a graph replay re-issues:
    npu_fused_infer_attention_score.out(q_nope [B, N, S, 512], kv_c_cache, kv_c_cache,
        query_rope=q_rope [B, N, S, 64], key_rope=k_pe_cache, input_layout="BNSD",
        sparse_mode=0 (S = 1) or 3 (S > 1, with the 2048 mask), ...)
    # prefills, fresh or behind cached context, up-projected from the latent rows gathered out
    # of the cache (vLLM's own MLA prefill layout: q_nope ++ q_pe against k_nope ++ k_pe):
    npu_fused_infer_attention_score(q [T, N, 192], k [T_kv, N, 192], v [T_kv, N, 128],
        input_layout="TND", sparse_mode=3, ...)

Contract sources (op-plugin is Ascend/op-plugin at 517f2e7d; docs under
``docs/zh/custom_APIs/torch_npu/``):

- [FIA] ``torch_npu-npu_fused_infer_attention_score.md``: "MLA约束", "TND布局约束",
  "PageAttention约束", ``softmax_lse``; the schema in ``op_plugin/config/op_plugin_functions.yaml``.
- [FIA-WHEEL] the op's docstring as the torch-npu wheels ship it (``torch_npu/_op_plugin_docs.py``,
  the same text in 2.10.0.post4, 2.11.0, 2.13.0 and 2.14.0), which is narrower than [FIA]:
  "query_rope和key_rope参数约束" (with rope and sparse ≠ 4: query S 1-16, N 32/64/128, D 512, key N 1,
  layouts BSH/BSND/BNSD, PageAttention with block_size 16 or 128) and "TND场景下query、key、value
  输入的综合限制" (T ≤ 65536; N 8/16/32/64/128 with Q_N = K_N = V_N; Q_D = K_D = 192, V_D 128 or 192;
  bfloat16 only; sparse 0 without a mask or 3 with one). A call must satisfy both texts.
- [ATB-MLA] ``op_plugin/python/atb/_atb_api_docs.py`` (``npu_multi_head_latent_attention``: shapes,
  dtypes, "block_size <= 128", "batch <= 8192"); the binding
  ``op_plugin/ops/atb/MultiHeadLatentAttentionAtb.cpp`` (output ``empty(q_nope.sizes(),
  q_rope.options())``; ``context_lens`` a host ``SymInt[]``); the head counts from the CANN ATB
  ``MultiLatentAttentionParam`` table (hiascend CANN 8.1.RC1.beta1, ascendtbapi
  ``ascendtb_01_0178.html``): headNum in {8, 16, 32, 64, 128}, qkScale in (0, 1], kvHeadNum 1.
- [ATB-IN] ``op_plugin/utils/custom_functions/atb/AtbCommon.cpp``: ``ParamSetter::Input`` makes
  every input contiguous itself, so ATB inputs may be strided views (at the cost of a copy).
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.composed import latent_decode, prefill_attention
from ascend_patch.npu.kernels.contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_int_list,
    check_tensor,
    require,
)

from .attention import (
    _check_block_ids,
    _check_causal_mask,
    _check_tnd_lengths,
    _lengths_from_cumulative,
    check_out_form,
    no_softmax_lse,
)

_HALF = (torch.float16, torch.bfloat16)


# --- npu_fused_infer_attention_score, the MLA prefill form ----------------------------------------


def fused_infer_attention_score_mla(
    query,
    key,
    value,
    *,
    query_rope=None,
    key_rope=None,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads,
    num_key_value_heads,
    scale,
    input_layout="TND",
    sparse_mode=0,
    softmax_lse_flag=False,
):
    """``npu_fused_infer_attention_score`` as MLA prefills run it: TND without rope inputs, query
    and key ``q_nope ++ q_pe`` / ``k_nope ++ k_pe`` (192), value 128 (or 192), contiguous
    ``[T_kv, N, D]`` K/V with cumulative lengths, causal (``sparse_mode=3``) or unmasked (0).

    Returns ``(attn_out [T, N, V_D], softmax_lse)``: ``softmax_lse`` is ``[T, N, 1]`` float32, the
    log-sum-exp of each row's scaled scores, when ``softmax_lse_flag``; else the empty tensor of
    ``reference.no_softmax_lse``.

    The op's rope (MLA) branch, which takes the absorbed form over a paged latent cache, is not
    implemented; its documented limits are still checked, so a call outside them fails by name.
    """
    op = "npu_fused_infer_attention_score"
    if query_rope is not None or key_rope is not None:
        _check_rope_branch(op, query, query_rope, key_rope, input_layout, num_heads)
        raise NotImplementedError(f"{op}: the seam implements the MLA prefill without rope "
                                  "inputs (q_nope ++ q_pe, k_nope ++ k_pe) only")
    if input_layout != "TND":
        raise NotImplementedError(f"{op}: the seam implements the MLA prefill in input_layout "
                                  f"'TND' only, got {input_layout!r}")
    if sparse_mode not in (0, 3):  # [FIA-WHEEL] TND: sparse 0 without a mask, or 3 with one
        raise NotImplementedError(f"{op}: the seam implements sparse_mode 0 (no mask) and 3 "
                                  f"(rightDownCausal) only, got {sparse_mode}")
    tensors = {"query": query, "key": key, "value": value}
    for name, tensor in tensors.items():
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)  # [FIA] query/key/value: 不支持非连续
        check_dims(op, name, tensor, 3)  # [FIA] TND: (T, N, D)
        check_dtype(op, name, tensor, (torch.bfloat16,))  # [FIA-WHEEL] TND: 数据类型仅支持BFLOAT16
    tokens, heads, head_dim = query.shape
    for name, rows in (("query", tokens), ("key", key.shape[0])):
        require(rows <= limits.FIA_TND_MAX_TOKENS, op, name, f"at most {limits.FIA_TND_MAX_TOKENS} tokens (T) "
                "in TND", rows)
    require(num_heads == heads, op, "num_heads", f"query.shape[1] = {heads}", num_heads)
    require(heads in limits.FIA_TND_MLA_HEADS, op, "num_heads", "8, 16, 32, 64 or 128 in TND", heads)
    # [FIA-WHEEL] TND: Q_N、K_N、V_N相等 (num_key_value_heads 0 means num_heads).
    require((num_key_value_heads or heads) == heads == key.shape[1] == value.shape[1], op,
            "num_key_value_heads", f"{heads} like num_heads, with key and value of {heads} heads",
            (num_key_value_heads, key.shape[1], value.shape[1]))
    dims = (head_dim, value.shape[2])
    require(key.shape[2] == head_dim and dims in limits.FIA_TND_MLA_HEAD_DIMS, op, "head dims (Q_D, K_D, V_D)",
            "(192, 192, 128) or (192, 192, 192) in TND without rope",
            (head_dim, key.shape[2], value.shape[2]))
    require(value.shape[0] == key.shape[0], op, "value", f"{key.shape[0]} tokens like key",
            value.shape[0])
    require(isinstance(scale, (int, float)), op, "scale", "a float", type(scale).__name__)
    require(isinstance(softmax_lse_flag, bool), op, "softmax_lse_flag", "a bool",
            type(softmax_lse_flag).__name__)

    q_ends, q_lens, kv_ends = _check_tnd_lengths(op, tokens, actual_seq_lengths,
                                                  actual_seq_lengths_kv)
    kv_lens = _lengths_from_cumulative(op, "actual_seq_lengths_kv", kv_ends)
    require(kv_ends[-1] == key.shape[0], op, "actual_seq_lengths_kv",
            f"cumulative, ending at key.shape[0] = {key.shape[0]}", kv_ends)
    if sparse_mode == 3:
        _check_causal_mask(op, atten_mask, sparse_mode)
        # [FIA-WHEEL] TND: "当sparse=3时, 要求每个batch单独的actual_seq_lengths <
        # actual_seq_lengths_kv". Equal lengths (a prefill with nothing cached) are what
        # vllm-ascend passes for every fresh prefill on this form, and [FIA] sets no such bound,
        # so the check is ≤: a longer query would leave whole rows masked.
        for q_len, kv_len in zip(q_lens, kv_lens):
            require(q_len <= kv_len, op, "actual_seq_lengths_kv",
                    "≥ the query length of each sequence under sparse_mode=3", (q_len, kv_len))
    else:
        require(atten_mask is None, op, "atten_mask", "None with sparse_mode=0 in TND", "a tensor")

    # [FIA] S2 = 0 (a sequence without keys): 输出全 0.
    out, lse = prefill_attention(query, key, value, q_ends, kv_ends, scale, sparse_mode == 3)
    return out, lse if softmax_lse_flag else no_softmax_lse(query)


def _check_rope_branch(op, query, query_rope, key_rope, input_layout, num_heads):
    """The documented limits of the op's rope (MLA) branch: [FIA] MLA约束 gives query D 512 or
    128; [FIA-WHEEL] query_rope约束 (sparse ≠ 4) gives only D 512, for query S 1-16 and 32, 64 or
    128 heads in BSH, BSND or BNSD (so TND is outside it, and so is the D = 128 form)."""
    require(query_rope is not None and key_rope is not None, op, "query_rope/key_rope",
            "both given or both None", "one of them")  # [FIA] 必须同时配置或同时不配置
    check_tensor(op, "query", query)
    head_dim = query.shape[-1] // num_heads if input_layout == "BSH" else query.shape[-1]
    require(head_dim == limits.LATENT_DIM, op, "query head dim (D) with query_rope",
            "512 (the torch-npu wheels document no other with rope)", head_dim)
    require(input_layout in limits.FIA_ROPE_LAYOUTS, op, "input_layout",
            "BSH, BSND or BNSD with query_rope (query D = 512)", input_layout)
    seq_axis = 2 if input_layout == "BNSD" else 1  # (B, N, S, D); (B, S, N, D) and (B, S, H)
    require(query.shape[seq_axis] <= limits.FIA_ROPE_MAX_QUERY, op, "query",
            f"at most {limits.FIA_ROPE_MAX_QUERY} tokens per sequence (S) with query_rope",
            query.shape[seq_axis])
    require(num_heads in limits.FIA_ROPE_HEADS, op, "num_heads", "32, 64 or 128 with query_rope", num_heads)


# --- npu_fused_infer_attention_score, the MLA decode form (.out, captured in graphs) ---------------


def fused_infer_attention_score_mla_decode(query, key, value, *, query_rope, key_rope, block_table,
                                           actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                           scale, input_layout, block_size, attention_out,
                                           softmax_lse, atten_mask=None, sparse_mode=0,
                                           workspace=None):
    """``npu_fused_infer_attention_score.out`` in its rope (MLA) branch, S absorbed query tokens
    per sequence over the paged latent cache: query ``[B, N, S, 512]`` and query_rope
    ``[B, N, S, 64]`` (BNSD), key = value the latent cache ``[num_blocks, block_size, 512]`` and
    key_rope ``[num_blocks, block_size, 64]`` (BnBsH, one KV head), host KV lengths. One token
    (a decode) without a mask; 2-16 (speculative verification rows, the sequence's last S)
    causal, ``sparse_mode=3`` (rightDownCausal: row i sees the first ``kv_len - S + 1 + i``
    keys). Writes ``attention_out`` ``[B, N, S, 512]``; ``softmax_lse`` is not computed."""
    op = "npu_fused_infer_attention_score.out"
    lengths = _check_mla_decode(op, query, key, value, query_rope, key_rope, block_table,
                                actual_seq_lengths_kv, num_heads, num_key_value_heads, scale,
                                input_layout, block_size, atten_mask, sparse_mode)
    check_out_form(op, query, attention_out, softmax_lse, workspace)  # value D 512 = query D
    batch, heads, rows = query.shape[:3]
    blocks, size = key.shape[:2]
    # Each query row on its own: the causal row i of a sequence is a decode over its first
    # kv_len - S + 1 + i keys.
    row_lengths = [length - rows + 1 + i for length in lengths for i in range(rows)]
    out = latent_decode(query.transpose(1, 2).reshape(batch * rows, heads, -1),
                        query_rope.transpose(1, 2).reshape(batch * rows, heads, -1),
                        key.view(blocks, size, 1, -1), key_rope.view(blocks, size, 1, -1),
                        block_table.repeat_interleave(rows, 0), row_lengths, scale)
    attention_out.copy_(out.view(batch, rows, heads, -1).transpose(1, 2))
    return attention_out, softmax_lse


def fused_infer_attention_score_mla_decode_workspace(query, key, value, *, query_rope, key_rope,
                                                     block_table, actual_seq_lengths_kv,
                                                     num_heads, num_key_value_heads, scale,
                                                     input_layout, block_size, atten_mask=None,
                                                     sparse_mode=0):
    """``_npu_fused_infer_attention_score_get_max_workspace`` for the MLA decode call: a byte
    buffer (its size is the op's business, none here), after the same contract checks."""
    _check_mla_decode("_npu_fused_infer_attention_score_get_max_workspace", query, key, value,
                      query_rope, key_rope, block_table, actual_seq_lengths_kv, num_heads,
                      num_key_value_heads, scale, input_layout, block_size, atten_mask,
                      sparse_mode)
    return torch.empty(0, dtype=torch.uint8, device=query.device)


def _check_mla_decode(op, query, key, value, query_rope, key_rope, block_table,
                      actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, input_layout,
                      block_size, atten_mask, sparse_mode) -> list[int]:
    """[FIA-WHEEL] query_rope约束 (sparse ≠ 4) and its sparse rule for the rope branch ("Q_S等于1时
    支持sparse=0且不传mask…, Q_S大于1时支持sparse=3…且传入mask"), the layout the seam uses, and
    [FIA] PageAttention约束; returns the KV lengths."""
    for name, tensor in (("query", query), ("key", key), ("value", value),
                         ("query_rope", query_rope), ("key_rope", key_rope)):
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)  # [FIA] 不支持非连续
        check_dtype(op, name, tensor, _HALF)
        # [FIA-WHEEL] query_rope/key_rope: 数据类型与query/key一致; no antiquant: K/V as query.
        require(tensor.dtype == query.dtype, op, name, f"{query.dtype} like query", tensor.dtype)
    require(input_layout == "BNSD", op, "input_layout", "'BNSD' (the seam's MLA decode layout)",
            input_layout)
    check_dims(op, "query", query, 4)  # BNSD (B, N, S, D)
    batch, heads, q_s, head_dim = query.shape
    _check_rope_branch(op, query, query_rope, key_rope, input_layout, num_heads)
    if q_s == 1:
        require(sparse_mode == 0 and atten_mask is None, op, "sparse_mode",
                "0 without atten_mask for one query token (S = 1)",
                (sparse_mode, "a mask" if atten_mask is not None else None))
    else:  # the seam takes the causal rows only (not the band, sparse 4: BSND with 128 heads)
        require(sparse_mode == 3, op, "sparse_mode",
                f"3 (rightDownCausal) with the mask for {q_s} query tokens (S > 1)", sparse_mode)
        _check_causal_mask(op, atten_mask, sparse_mode)
    require(num_heads == heads, op, "num_heads", f"query.shape[1] = {heads}", num_heads)
    require(query_rope.shape == (batch, heads, q_s, limits.ROPE_DIM), op, "query_rope",
            f"shape {(batch, heads, q_s, limits.ROPE_DIM)} (B, N, S as query, D 64)",
            tuple(query_rope.shape))
    require(isinstance(scale, (int, float)), op, "scale", "a float", type(scale).__name__)
    # [FIA-WHEEL] key N 1, D 512, key_rope D 64; [FIA] PageAttention: BnBsH (blocknum, block_size, H).
    require(num_key_value_heads == 1, op, "num_key_value_heads", "1 with query_rope",
            num_key_value_heads)
    check_dims(op, "key", key, 3)
    num_blocks, cache_block = key.shape[:2]
    require(key.shape[2] == limits.LATENT_DIM, op, "key",
            f"a paged cache (num_blocks, block_size, {limits.LATENT_DIM})", tuple(key.shape))
    require(value.shape == key.shape, op, "value", f"shape {tuple(key.shape)} like key",
            tuple(value.shape))
    require(key_rope.shape == (num_blocks, cache_block, limits.ROPE_DIM), op, "key_rope",
            f"shape {(num_blocks, cache_block, limits.ROPE_DIM)}", tuple(key_rope.shape))
    require(block_size == cache_block and block_size in limits.FIA_ROPE_BLOCK_SIZES, op,
            "block_size", f"key.shape[1] = {cache_block}, 16 or 128 with query_rope", block_size)
    check_tensor(op, "block_table", block_table)
    check_dtype(op, "block_table", block_table, (torch.int32,))
    check_dims(op, "block_table", block_table, 2)
    require(block_table.shape[0] == batch, op, "block_table", f"{batch} rows (one per sequence)",
            block_table.shape[0])
    # [FIA] non-TND: actual_seq_lengths_kv "1 or ≥ batch" entries; PageAttention 场景下必须传入.
    lengths = check_int_list(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    require(len(lengths) == batch, op, "actual_seq_lengths_kv", f"{batch} entries (the batch)",
            len(lengths))
    capacity = block_table.shape[1] * block_size
    for length in lengths:
        require(1 <= length <= capacity, op, "actual_seq_lengths_kv",
                f"in [1, {capacity}] (block_table columns × block_size)", length)
        # Causal rows are the sequence's last S: fewer keys would leave whole rows masked.
        require(length >= q_s, op, "actual_seq_lengths_kv",
                f"at least the {q_s} query tokens of each sequence under sparse_mode=3", length)
    _check_block_ids(op, block_table, lengths, block_size, num_blocks)
    return lengths


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
    require(latent == limits.LATENT_DIM, op, "q_nope", "[num_tokens, num_heads, 512]",
            tuple(q_nope.shape))
    require(q_rope.shape == (tokens, heads, limits.ROPE_DIM), op, "q_rope",
            f"shape {(tokens, heads, limits.ROPE_DIM)} ([num_tokens, num_heads, 64])", tuple(q_rope.shape))
    # [ATB-MLA] 'krope_ctkv': ctkv [num_blocks, block_size, kv_heads, 512], k_rope [.., 64].
    check_dims(op, "ctkv", ctkv, 4)
    num_blocks, block_size, cache_heads = ctkv.shape[:3]
    require(ctkv.shape[3] == limits.LATENT_DIM, op, "ctkv", "[num_blocks, block_size, kv_heads, 512]",
            tuple(ctkv.shape))
    require(k_rope.shape == (num_blocks, block_size, cache_heads, limits.ROPE_DIM), op, "k_rope",
            f"shape {(num_blocks, block_size, cache_heads, limits.ROPE_DIM)}", tuple(k_rope.shape))
    require(block_size <= limits.ATB_MLA_MAX_BLOCK_SIZE, op, "block_size (ctkv.shape[1])",
            f"≤ {limits.ATB_MLA_MAX_BLOCK_SIZE}", block_size)
    # [ATB-MLA] MultiLatentAttentionParam: headNum {8,16,32,64,128}, kvHeadNum 1, qkScale (0, 1].
    require(q_headnum == heads, op, "q_headnum", f"q_nope.shape[1] = {heads}", q_headnum)
    require(heads in limits.ATB_MLA_HEADS, op, "q_headnum", "8, 16, 32, 64 or 128", heads)
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
    require(tokens <= limits.ATB_MLA_MAX_BATCH, op, "batch", f"≤ {limits.ATB_MLA_MAX_BATCH}", tokens)  # [ATB-MLA] 规格约束
    capacity = block_tables.shape[1] * block_size
    for length in lengths:
        require(1 <= length <= capacity, op, "context_lens",
                f"in [1, {capacity}] (block_tables columns × block_size)", length)
    _check_block_ids(op, block_tables, lengths, block_size, num_blocks)
    return latent_decode(q_nope, q_rope, ctkv, k_rope, block_tables, lengths, qk_scale)
