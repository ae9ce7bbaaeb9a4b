"""Reference kernels of the attention ops: the paged KV-cache write, npu_fused_infer_attention_score
and _npu_paged_attention. Each enforces its torch_npu op's documented input contract (the numbers
in :mod:`ascend_patch.npu.kernels.limits`), then computes that op's documented output.

They run the emulated engine on CPU, so a contract violation that would only surface on hardware
(often as an opaque ACL error, sometimes as silently wrong numbers) fails here first, by name. Every
function has the signature of its ``ascend_patch.npu.kernels.npu`` twin. Tests check them against
independent math (SDPA, vLLM's native layers), never against themselves.

Attention is vectorised per sequence at least: the decode rows of a batch share one SDPA call, and
each longer query is one SDPA call over its gathered blocks (:mod:`ascend_patch.npu.kernels.composed`,
the plain-torch attention the backend's composed path runs too).

Contract sources (cited next to each check by the tag in brackets; op-plugin is Ascend/op-plugin at
517f2e7d, docs under ``docs/zh/custom_APIs/torch_npu/``):

- [FIA] ``torch_npu-npu_fused_infer_attention_score.md``; [FIA-V2] ``..._v2.md`` (its TND section
  states the head-dim rules that v1 shares); [FA] ``torch_npu-npu_fusion_attention.md`` (the one
  page that defines the band of ``sparse_mode=4`` and its pre/next_tokens exactly); [PFA]
  ``torch_npu-npu_prompt_flash_attention.md`` (the prefill op FIA dispatches to);
  [FIA-TILING] the CANN tiling check quoted in vllm-project/vllm-ascend#9632: "When layout is
  TND, queryD, keyD and valueD must be same equal 192/128/64, or queryD and keyD equal 192 and
  valueD equal 128".
- [PA] ATB PagedAttentionOperation "规格约束", hiascend CANN 8.1.RC1 ``ascendtb_01_0186.html``, and
  its check ``KVCacheDimCheck910B`` in ascend-transformer-boost ``paged_attention_operation.cpp``;
  binding ``op_plugin/ops/atb/PagedAttentionAtb.cpp``.
- [ATB-OUT] ``op_plugin/utils/custom_functions/atb/AtbCommon.cpp``: ``ParamSetter::Output``
  hands the tensor's storage to ATB as is, so every in-place ATB output must be contiguous.
- [VA-SPEC] vllm-ascend's attention builders (``attention_v1.py``, ``mla_v1.py``: ``decode_threshold =
  1 + num_speculative_tokens``, asserted ≤ 16) and its speculative-decoding guide's FIA TND note.
- [SCATTER] ``torch_npu-npu_scatter_pa_kv_cache.md`` and the schema in
  ``op_plugin/config/op_plugin_functions.yaml``.
"""

import math
import weakref

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.composed import attend, decode_batch, gather_sequence
from ascend_patch.npu.kernels.contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_host,
    check_int_list,
    check_tensor,
    fail,
    require,
)

_HALF = (torch.float16, torch.bfloat16)
_INDEX = (torch.int32, torch.int64)

_INT_MAX = limits.FIA_UNBOUNDED_TOKENS
_MASK = limits.CAUSAL_MASK_SIZE
_CAUSAL_MASK_SHAPES = {(_MASK, _MASK), (1, _MASK, _MASK), (1, 1, _MASK, _MASK)}


# --- KV-cache write -------------------------------------------------------------------------------


def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write token ``t``'s K/V into cache slot ``slot_mapping[t]`` (cache_mode="Norm": ND)."""
    op = "npu_scatter_pa_kv_cache"
    tensors = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache}
    for name, tensor in tensors.items():
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)  # [SCATTER] 约束说明: "输入参数不支持非连续"
        # [SCATTER] key, value, key_cache, value_cache 的数据类型必须一致
        require(tensor.dtype == key.dtype, op, name, f"{key.dtype} like key", tensor.dtype)
    # [SCATTER] 场景一: key/value 3-D [batch, num_head, head_size]; the 4-D form is the compress mode.
    check_dims(op, "key", key, 3)
    check_dims(op, "value", value, 3)
    require(key.shape[:2] == value.shape[:2], op, "value", f"shape {tuple(key.shape[:2])} + (D,)",
            tuple(value.shape))
    # [SCATTER] caches "只支持4维"; with cache_mode="Norm" they are ND [num_blocks, block_size, KVH, D].
    check_dims(op, "key_cache", key_cache, 4)
    check_dims(op, "value_cache", value_cache, 4)
    require(key_cache.shape[2:] == key.shape[1:], op, "key_cache",
            f"shape (num_blocks, block_size, {key.shape[1]}, {key.shape[2]})",
            tuple(key_cache.shape))
    value_cache_shape = key_cache.shape[:2] + value.shape[1:]
    require(value_cache.shape == value_cache_shape, op, "value_cache",
            f"shape {tuple(value_cache_shape)}", tuple(value_cache.shape))

    check_tensor(op, "slot_mapping", slot_mapping)
    check_dtype(op, "slot_mapping", slot_mapping, _INDEX)  # [SCATTER] int32 / int64
    check_dims(op, "slot_mapping", slot_mapping, 1)
    check_contiguous(op, "slot_mapping", slot_mapping)  # [SCATTER] the same: every input
    require(slot_mapping.numel() == key.shape[0], op, "slot_mapping",
            f"length {key.shape[0]} (one slot per token)", slot_mapping.numel())
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel():
        # [SCATTER] 值范围 [0, num_blocks * block_size - 1], 且元素值保证不重复 (else undefined).
        low, high = slot_mapping.aminmax()
        require(0 <= low and high < num_slots, op, "slot_mapping",
                f"within [0, {num_slots - 1}]", f"range [{int(low)}, {int(high)}]")
        unique = torch.unique(slot_mapping).numel()
        require(unique == slot_mapping.numel(), op, "slot_mapping", "free of duplicates",
                f"{slot_mapping.numel() - unique} duplicate slot(s)")

    slots = slot_mapping.long()
    key_cache.view(num_slots, *key.shape[1:]).index_copy_(0, slots, key)
    value_cache.view(num_slots, *value.shape[1:]).index_copy_(0, slots, value)


# --- attention ------------------------------------------------------------------------------------


def fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    block_table=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads,
    num_key_value_heads,
    scale,
    pre_tokens=_INT_MAX,
    next_tokens=_INT_MAX,
    input_layout="TND",
    block_size=0,
    sparse_mode=0,
):
    """TND attention over a paged cache (``block_table`` given) or over contiguous K/V, or BSH
    single-token queries (decode) over a paged cache with an optional explicit mask.

    Returns ``(attn_out, softmax_lse)`` with ``attn_out`` shaped like ``query``; the seam never
    sets ``softmax_lse_flag``, so ``softmax_lse`` is :func:`no_softmax_lse`.
    """
    op = "npu_fused_infer_attention_score"
    if input_layout == "BSH":
        return _fia_bsh_decode(op, query, key, value, atten_mask, block_table, actual_seq_lengths,
                               actual_seq_lengths_kv, num_heads, num_key_value_heads, scale,
                               pre_tokens, next_tokens, block_size, sparse_mode)
    if input_layout != "TND":
        raise NotImplementedError(f"{op}: the seam implements input_layout 'TND' and 'BSH' "
                                  f"(single-token queries) only, got {input_layout!r}")
    if sparse_mode not in (0, 3, 4):
        raise NotImplementedError(f"{op}: the seam implements sparse_mode 0 (no mask), 3 "
                                  f"(rightDownCausal) and 4 (band) only, got {sparse_mode}")

    check_tensor(op, "query", query)
    check_dims(op, "query", query, 3)  # [FIA] input_layout 表: TND query (T, Q_N, D)
    check_dtype(op, "query", query, _HALF)  # [FIA] query: float16、bfloat16
    check_contiguous(op, "query", query)  # [FIA] 不支持非连续Tensor
    tokens, heads, head_dim = query.shape
    _check_kv(op, query, key, value)
    kv_heads = _check_heads(op, heads, num_heads, num_key_value_heads, scale)

    paged = block_table is not None
    # [FIA-TILING] TND: D ∈ {64, 128, 192}; [FIA-V2] TND: "GQA和PA场景不支持V_D等于192".
    head_dims = (limits.FIA_TND_PAGED_HEAD_SIZES if paged or kv_heads != num_heads
                 else limits.FIA_TND_HEAD_SIZES)
    require(head_dim in head_dims, op, "query head dim (D)",
            " or ".join(map(str, head_dims)) + " for TND", head_dim)

    q_ends, q_lens, kv_arg = _check_tnd_lengths(op, tokens, actual_seq_lengths, actual_seq_lengths_kv)
    batch = len(q_ends)

    if paged:
        kv_lens = kv_arg
        key_cache, value_cache = _check_fia_paged(op, query, key, value, block_table, kv_lens,
                                                  kv_heads, block_size, max(q_lens))
    else:
        # [FIA] TND: actual_seq_lengths_kv is cumulative over the (T_kv, KV_N, D) key.
        check_dims(op, "key", key, 3)
        require(key.shape[1:] == (kv_heads, head_dim), op, "key",
                f"shape (T_kv, {kv_heads}, {head_dim})", tuple(key.shape))
        kv_lens = _lengths_from_cumulative(op, "actual_seq_lengths_kv", kv_arg)
        require(kv_arg[-1] == key.shape[0], op, "actual_seq_lengths_kv",
                f"cumulative, ending at key.shape[0] = {key.shape[0]}", kv_arg)

    pre, after = _band(op, sparse_mode, atten_mask, pre_tokens, next_tokens, q_lens, kv_lens)

    out = torch.zeros_like(query)  # [FIA] 基础约束: KV 为空 (S2=0) 时输出全 0.
    q_starts = [end - length for end, length in zip(q_ends, q_lens)]
    per_sequence = range(batch)
    if paged:  # all single-token queries in one batched call, the rest one call per sequence
        decodes = [i for i in range(batch) if q_lens[i] == 1 and kv_lens[i] > 0]
        if decodes and (after is None or after >= 0):  # the band's top never cuts a last row
            rows = torch.tensor([q_starts[i] for i in decodes], device=query.device)
            out[rows] = decode_batch(query[rows], key_cache, value_cache, block_table[decodes],
                                      [kv_lens[i] for i in decodes], scale, pre_tokens=pre)
            per_sequence = [i for i in range(batch) if q_lens[i] > 1]
    for i in per_sequence:
        if q_lens[i] == 0 or kv_lens[i] == 0:
            continue
        if paged:
            seq_key, seq_value = gather_sequence(key_cache, value_cache, block_table[i], kv_lens[i])
        else:
            kv_rows = slice(kv_arg[i] - kv_lens[i], kv_arg[i])
            seq_key, seq_value = key[kv_rows], value[kv_rows]
        rows = slice(q_starts[i], q_ends[i])
        out[rows] = attend(query[rows], seq_key, seq_value, scale, pre_tokens=pre, next_tokens=after)
    return out, no_softmax_lse(query)


def fused_infer_attention_score_decode(query, key, value, *, atten_mask, block_table,
                                       actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                       scale, block_size, attention_out, softmax_lse,
                                       workspace=None):
    """``npu_fused_infer_attention_score.out`` for one-token BSH queries over the paged cache with
    an explicit (B, KV_S) mask: the BSH decode of :func:`fused_infer_attention_score`, written
    into ``attention_out`` (``softmax_lse`` is not computed: no flag)."""
    op = "npu_fused_infer_attention_score.out"
    out, _ = fused_infer_attention_score(
        query, key, value, atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, input_layout="BSH",
        block_size=block_size)
    check_out_form(op, query, attention_out, softmax_lse, workspace)
    attention_out.copy_(out)
    return attention_out, softmax_lse


def fused_infer_attention_score_verify(query, key, value, *, atten_mask, block_table,
                                       actual_seq_lengths, actual_seq_lengths_kv, num_heads,
                                       num_key_value_heads, scale, block_size, sparse_mode,
                                       attention_out, softmax_lse, pre_tokens=_INT_MAX,
                                       next_tokens=_INT_MAX, workspace=None):
    """``npu_fused_infer_attention_score.out`` for speculative verification rows: TND queries of
    at most 16 rows per sequence over the paged cache, causal (``sparse_mode=3``) or in a
    windowed layer the band (``sparse_mode=4``), written into ``attention_out``
    (``softmax_lse`` is not computed: no flag)."""
    op = "npu_fused_infer_attention_score.out"
    _check_verify_rows(op, actual_seq_lengths, sparse_mode)
    out, _ = fused_infer_attention_score(
        query, key, value, atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout="TND",
        block_size=block_size, sparse_mode=sparse_mode)
    check_out_form(op, query, attention_out, softmax_lse, workspace)
    attention_out.copy_(out)
    return attention_out, softmax_lse


def fused_infer_attention_score_verify_workspace(query, key, value, *, atten_mask, block_table,
                                                 actual_seq_lengths, actual_seq_lengths_kv,
                                                 num_heads, num_key_value_heads, scale,
                                                 block_size, sparse_mode, pre_tokens=_INT_MAX,
                                                 next_tokens=_INT_MAX):
    """``_npu_fused_infer_attention_score_get_max_workspace`` for that call: a byte buffer, after
    the call's contract checks."""
    _check_verify_rows("_npu_fused_infer_attention_score_get_max_workspace", actual_seq_lengths,
                       sparse_mode)
    fused_infer_attention_score(
        query, key, value, atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout="TND",
        block_size=block_size, sparse_mode=sparse_mode)
    return torch.empty(0, dtype=torch.uint8, device=query.device)


def _check_verify_rows(op, actual_seq_lengths, sparse_mode) -> None:
    # The masked verification form: [VA-SPEC] 1 + k ≤ 16 rows per sequence.
    require(sparse_mode in (3, 4), op, "sparse_mode",
            "3 (rightDownCausal) or 4 (band) for verification rows", sparse_mode)
    ends = check_int_list(op, "actual_seq_lengths", actual_seq_lengths)
    rows = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    require(all(1 <= n <= limits.FIA_VERIFY_MAX_QUERY for n in rows), op, "actual_seq_lengths",
            f"1 to {limits.FIA_VERIFY_MAX_QUERY} query rows per sequence (verification rows)", rows)


def check_out_form(op, query, attention_out, softmax_lse, workspace) -> None:
    """The ``.out`` form's own arguments: ``attention_out`` like the query (its output without
    ``softmax_lse_flag``), contiguous; ``softmax_lse`` a tensor (not written without the flag);
    ``workspace`` the byte buffer ``_npu_fused_infer_attention_score_get_max_workspace`` gave."""
    check_tensor(op, "attention_out", attention_out)
    require(attention_out.shape == query.shape and attention_out.dtype == query.dtype, op,
            "attention_out", f"{query.dtype} of shape {tuple(query.shape)}",
            f"{attention_out.dtype} {tuple(attention_out.shape)}")
    check_contiguous(op, "attention_out", attention_out)
    check_tensor(op, "softmax_lse", softmax_lse)
    if workspace is not None:
        check_tensor(op, "workspace", workspace)
        check_dtype(op, "workspace", workspace, (torch.uint8,))
        check_dims(op, "workspace", workspace, 1)


def fused_infer_attention_score_decode_workspace(query, key, value, *, atten_mask, block_table,
                                                 actual_seq_lengths_kv, num_heads,
                                                 num_key_value_heads, scale, block_size):
    """``_npu_fused_infer_attention_score_get_max_workspace`` for that call: a byte buffer (its
    size is the op's business), after the call's contract checks on what the query reads: host
    arguments and tensor shapes, never device data. The mask's values are the launch's to check:
    a graph computes them before its launch, after the replay's update has asked for this
    buffer, so here they are still the previous replay's."""
    fused_infer_attention_score(
        query, key, value, atten_mask=torch.zeros_like(atten_mask), block_table=block_table,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, input_layout="BSH",
        block_size=block_size)
    return torch.empty(0, dtype=torch.uint8, device=query.device)


def no_softmax_lse(query):
    """FIA's ``softmax_lse`` with ``softmax_lse_flag=False``: an empty fp32 tensor of shape (0,).
    The op allocates it so (op-plugin ``FusedInferAttentionScoreKernelNpuOpApi.cpp``:
    ``apply_tensor_without_format({0}, Float)``) and its meta kernel returns it so
    (torch-npu 2.11-2.14 ``op_plugin/meta/_meta_registrations.py``, ``torch.empty([0], ...)``),
    which is what tracing sees; [FIA]'s "shape为[1]的值为0的Tensor" is out of date."""
    return torch.empty(0, dtype=torch.float32, device=query.device)


def _check_kv(op, query, key, value):
    for name, tensor in (("key", key), ("value", value)):
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)
        # The seam passes no (anti)quant scales, so K/V must carry the query's float dtype.
        require(tensor.dtype == query.dtype, op, name, f"{query.dtype} like query", tensor.dtype)
    # [FIA] 通用基础约束: key与value的shape必须完全一致.
    require(value.shape == key.shape, op, "value", f"shape {tuple(key.shape)} like key",
            tuple(value.shape))


def _check_heads(op, heads, num_heads, num_key_value_heads, scale):
    """Returns the KV head count."""
    # [FIA] num_heads 与 query 的 N 轴一致; N ≤ 256.
    require(num_heads == heads, op, "num_heads", f"the query's {heads} heads", num_heads)
    require(1 <= num_heads <= limits.FIA_MAX_HEADS, op, "num_heads",
            f"in [1, {limits.FIA_MAX_HEADS}]", num_heads)
    # [FIA] num_key_value_heads: 0 means num_heads; num_heads 能被整除, 比值 ≤ 64.
    kv_heads = num_key_value_heads or num_heads
    require(num_heads % kv_heads == 0 and num_heads // kv_heads <= limits.FIA_MAX_GQA_RATIO, op,
            "num_key_value_heads",
            f"a divisor of num_heads={num_heads} with ratio ≤ {limits.FIA_MAX_GQA_RATIO}",
            num_key_value_heads)
    require(isinstance(scale, (int, float)), op, "scale", "a float", type(scale).__name__)
    return kv_heads


def _band(op, sparse_mode, atten_mask, pre_tokens, next_tokens, q_lens, kv_lens):
    """The (pre_tokens, next_tokens) band a TND call computes, None for an unbounded side.

    [FIA] sparse_mode=3 ignores pre/next_tokens (rightDownCausal: next_tokens 0); 4 is the band
    between them, anchored at the bottom right ([FA] ``torch_npu-npu_fusion_attention.md``:
    "sparse_mode为4时, 代表band场景, 即计算pre_tockens和next_tockens之间的部分, 参数起点为右下角,
    pre_tockens和next_tockens之间需要有交集"; its worked example builds the equivalent full mask
    as triu(ones, next+1) + tril(ones, -pre-1): row i sees keys i - pre ... i + next); 0 without a
    mask ignores them ([FIA-V2] "sparse_mode=0时, atten_mask如果为None, 则忽略入参pre_tokens、
    next_tokens"). Both 3 and 4 read the optimised 2048×2048 lower-triangular mask.
    """
    if sparse_mode == 0:
        require(atten_mask is None, op, "atten_mask", "None with sparse_mode=0 in TND (the seam "
                "has no custom-mask path)", "a tensor")
        return None, None
    _check_causal_mask(op, atten_mask, sparse_mode)
    if sparse_mode == 3:
        pre, after = None, 0
    else:
        for name, tokens in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
            require(isinstance(tokens, int) and not isinstance(tokens, bool), op, name, "an int",
                    type(tokens).__name__)
        # [FIA] pre_tokens/next_tokens: "Q_S=1时无效", and sparse_mode "Q_S = 1且不带rope输入时
        # 无效": a batch of single-token queries (the decode branch) would silently lose the band.
        require(max(q_lens) > 1, op, "sparse_mode", "3 or 0 when every query is one token long "
                "(sparse_mode and pre/next_tokens are ignored for Q_S = 1)", sparse_mode)
        require(pre_tokens + next_tokens >= 0, op, "pre_tokens + next_tokens",
                "≥ 0 (the band must not be empty)", pre_tokens + next_tokens)
        pre = None if pre_tokens >= _INT_MAX else pre_tokens
        after = None if next_tokens >= _INT_MAX else next_tokens
    # A row whose band holds no key is "行无效" (its output is not defined without row-invalid
    # correction). [FIA-V2] names when that happens under band: "pre_tokens<0或每个batch
    # next_tokens+actual_seq_kvlen-actual_seq_qlen<0"; rightDownCausal is next_tokens 0.
    require(pre is None or pre >= 0, op, "pre_tokens", "≥ 0 (the last query row would see no "
            "key)", pre)
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len and after is not None:
            least = "the query length" if after == 0 else f"the query length - next_tokens ({after})"
            require(after + kv_len - q_len >= 0, op, "actual_seq_lengths_kv",
                    f"≥ {least} of each sequence under sparse_mode={sparse_mode}", (q_len, kv_len))
    return pre, after


def _fia_bsh_decode(op, query, key, value, atten_mask, block_table, actual_seq_lengths,
                    actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, pre_tokens,
                    next_tokens, block_size, sparse_mode):
    """BSH, Q_S = 1 over a paged cache: the decode (IncreFlashAttention) branch, with an optional
    (B, KV_S) mask. Returns (out [B, 1, H], softmax_lse)."""
    check_tensor(op, "query", query)
    check_dims(op, "query", query, 3)  # [FIA] BSH query (B, Q_S, H)
    check_dtype(op, "query", query, _HALF)
    check_contiguous(op, "query", query)
    batch, q_s, hidden = query.shape
    if q_s != 1 or block_table is None:
        raise NotImplementedError(f"{op}: the seam implements BSH for single-token queries over a "
                                  f"paged cache only, got Q_S={q_s}, block_table "
                                  f"{'given' if block_table is not None else 'None'}")
    _check_kv(op, query, key, value)
    # [FIA] BSH: H = N × D.
    require(hidden % num_heads == 0, op, "num_heads", f"a divisor of H={hidden}", num_heads)
    head_dim = hidden // num_heads
    kv_heads = _check_heads(op, num_heads, num_heads, num_key_value_heads, scale)
    # [FIA] 各轴取值范围: D ≤ 512, float16/bfloat16 16 字节对齐.
    require(head_dim <= limits.FIA_DECODE_MAX_HEAD_SIZE
            and head_dim * query.element_size() % limits.FIA_HEAD_ALIGN_BYTES == 0, op,
            "query head dim (D)", f"≤ {limits.FIA_DECODE_MAX_HEAD_SIZE} and "
            f"{limits.FIA_HEAD_ALIGN_BYTES}-byte aligned", head_dim)
    # [FIA] "Q_S = 1且不带rope输入时, sparse_mode参数无效"; pre/next_tokens "Q_S=1时无效": a window
    # must come as an explicit mask, so the seam refuses values the op would silently ignore.
    require(sparse_mode == 0 and pre_tokens == _INT_MAX and next_tokens == _INT_MAX, op,
            "sparse_mode/pre_tokens/next_tokens", "their defaults for a single-token query (the "
            "op ignores them; pass the mask instead)", (sparse_mode, pre_tokens, next_tokens))
    # [FIA] Q_S=1: "actual_seq_lengths: 非TND布局时该参数无效".
    require(actual_seq_lengths is None, op, "actual_seq_lengths", "None for BSH decode",
            actual_seq_lengths)
    # [FIA] actual_seq_lengths_kv: 非TND布局时传入长度为1/≥batch; PageAttention 场景下必须传入.
    kv_arg = check_int_list(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    require(len(kv_arg) == 1 or len(kv_arg) >= batch, op, "actual_seq_lengths_kv",
            f"1 or ≥ {batch} entries (the batch)", len(kv_arg))
    kv_lens = kv_arg[:batch] if len(kv_arg) > 1 else kv_arg * batch
    # [FIA] Q_S = 1: KV_S ≤ 262144.
    for length in kv_lens:
        require(0 <= length <= limits.FIA_DECODE_MAX_KV_LEN, op, "actual_seq_lengths_kv",
                f"in [0, {limits.FIA_DECODE_MAX_KV_LEN}]", length)
    queries = query.view(batch, num_heads, head_dim)
    key_cache, value_cache = _check_fia_paged(op, queries, key, value, block_table, kv_lens,
                                              kv_heads, block_size, 1)
    masked = None
    if atten_mask is not None:
        masked = _check_decode_mask(op, atten_mask, batch, block_table.shape[1] * block_size,
                                    kv_lens)

    out = torch.zeros_like(queries)  # [FIA] KV 为空 (S2=0) 时输出全 0.
    rows = [b for b in range(batch) if kv_lens[b] > 0]
    if rows:
        index = torch.tensor(rows, device=query.device)
        out[index] = decode_batch(queries[index], key_cache, value_cache, block_table[rows],
                                  [kv_lens[b] for b in rows], scale,
                                  masked=None if masked is None else masked[rows])
    return out.view(batch, 1, hidden), no_softmax_lse(query)


def _check_decode_mask(op, atten_mask, batch, width, kv_lens):
    """[FIA] atten_mask with sparse_mode 0 and Q_S = 1: bool/int8/uint8, contiguous, (B, KV_S) or
    (1, 1, KV_S), (B, 1, 1, KV_S), (1, 1, 1, KV_S); 1 hides a key. Returns it as [B, KV_S] bool."""
    check_tensor(op, "atten_mask", atten_mask)
    check_dtype(op, "atten_mask", atten_mask, (torch.bool, torch.int8, torch.uint8))
    check_contiguous(op, "atten_mask", atten_mask)
    shape = tuple(atten_mask.shape)
    kv_s = shape[-1] if shape else 0
    shapes = {(batch, kv_s), (1, 1, kv_s), (batch, 1, 1, kv_s), (1, 1, 1, kv_s)}
    require(shape in shapes, op, "atten_mask", f"(B, KV_S) with B = {batch}, or (1, 1, KV_S), "
            f"(B, 1, 1, KV_S), (1, 1, 1, KV_S)", shape)
    # [FIA] PageAttention: "Q_S = 1时开启atten_mask (sparse_mode非2/3/4): atten_mask最后一维 ≥
    # block_table第二维 × block_size".
    require(kv_s >= width, op, "atten_mask", f"a last dim ≥ {width} (block_table columns × "
            "block_size)", kv_s)
    masked = atten_mask.reshape(-1, kv_s).expand(batch, kv_s).bool()
    # [PFA] sparse_mode 0: "不支持传入的mask矩阵中参与计算的部分整行为1的情况".
    for row, length in enumerate(kv_lens):
        if length:
            require(not bool(masked[row, :length].all()), op, "atten_mask",
                    "to leave each sequence at least one of its keys", f"row {row} all masked")
    return masked


def paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                    block_table, context_lens, out, workspace=None):
    """Pure decode: each sequence's one query token attends to its whole context; fills ``out``."""
    op = "_npu_paged_attention"
    lengths = _check_paged_attention(op, query, key_cache, value_cache, num_kv_heads, num_heads,
                                     block_table, context_lens, out)
    if workspace is not None:
        # [PA] binding: the workspace is a byte buffer from _npu_paged_attention_get_workspace.
        check_tensor(op, "workspace", workspace)
        check_dtype(op, "workspace", workspace, (torch.uint8,))
        check_dims(op, "workspace", workspace, 1)
    out.copy_(decode_batch(query, key_cache, value_cache, block_table, lengths, scale_value))


def paged_attention_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                              block_table, context_lens, out):
    """The workspace ``_npu_paged_attention`` needs for these arguments: a byte buffer
    (``_npu_paged_attention_get_workspace``; its size is ATB's business, none here)."""
    _check_paged_attention("_npu_paged_attention_get_workspace", query, key_cache, value_cache,
                           num_kv_heads, num_heads, block_table, context_lens, out)
    return torch.empty(0, dtype=torch.uint8, device=query.device)


def _check_paged_attention(op, query, key_cache, value_cache, num_kv_heads, num_heads, block_table,
                           context_lens, out) -> list[int]:
    check_tensor(op, "query", query)
    check_dims(op, "query", query, 3)  # [PA] query [num_tokens, num_heads, head_size]
    check_dtype(op, "query", query, _HALF)  # [PA] float16 (bf16 on A2/A3; 310P is fp16 only)
    tokens, heads, head_size = query.shape
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(op, name, cache)
        check_dims(op, name, cache, 4)  # [PA] [num_blocks, block_size, kv_head_num, head_size]
        require(cache.dtype == query.dtype, op, name, f"{query.dtype} like query", cache.dtype)
    require(value_cache.shape == key_cache.shape, op, "value_cache",
            f"shape {tuple(key_cache.shape)} like key_cache", tuple(value_cache.shape))
    num_blocks, cache_block_size, cache_kv_heads, cache_head_size = key_cache.shape

    # [PA] headNum > 0; kvHeadNum ≥ 0 (0 means headNum); headNum % kvHeadNum == 0.
    require(num_heads == heads, op, "num_heads", f"query.shape[1] = {heads}", num_heads)
    kv_heads = num_kv_heads or num_heads
    require(num_kv_heads >= 0 and num_heads % kv_heads == 0, op, "num_kv_heads",
            f"0 or a divisor of num_heads={num_heads}", num_kv_heads)
    require(cache_kv_heads == kv_heads, op, "key_cache", f"{kv_heads} KV heads on dim 2",
            cache_kv_heads)
    require(cache_head_size == head_size, op, "key_cache", f"head size {head_size} like query",
            cache_head_size)
    # [PA] 规格约束: "因硬件限制, block_size % 16 == 0". On A2/A3 in the plain mode this binding
    # selects, head_size ≤ 576 and block_size ≤ 128 once head_size > 256 (KVCacheDimCheck910B);
    # the (0, 256] and block_size * head_size ≤ 128*128 limits bind only on 310P and in the
    # compression, parallel-decode and quantised modes, none of which the seam uses.
    require(cache_block_size % limits.PA_BLOCK_ALIGN == 0, op, "block_size (key_cache.shape[1])",
            f"a multiple of {limits.PA_BLOCK_ALIGN}", cache_block_size)
    require(head_size <= limits.PA_MAX_HEAD_SIZE, op, "head_size", f"≤ {limits.PA_MAX_HEAD_SIZE}",
            head_size)
    if head_size > limits.PA_LARGE_HEAD_SIZE:
        require(cache_block_size <= limits.PA_LARGE_HEAD_MAX_BLOCK_SIZE, op,
                "block_size (key_cache.shape[1])", f"≤ {limits.PA_LARGE_HEAD_MAX_BLOCK_SIZE} when "
                f"head_size > {limits.PA_LARGE_HEAD_SIZE}", cache_block_size)

    check_tensor(op, "block_table", block_table)
    check_dtype(op, "block_table", block_table, (torch.int32,))  # [PA] blockTables int32
    check_dims(op, "block_table", block_table, 2)  # [PA] [num_tokens, max_num_blocks_per_query]
    require(block_table.shape[0] == tokens, op, "block_table", f"{tokens} rows (one per token)",
            block_table.shape[0])
    check_tensor(op, "context_lens", context_lens)
    check_dtype(op, "context_lens", context_lens, (torch.int32,))  # [PA] contextLens int32
    check_dims(op, "context_lens", context_lens, 1)  # [PA] contextLens [num_tokens]
    # Host lengths: AtbCommon.cpp passes CPU inputs to ATB as host data, which PagedAttention
    # reads (paged_attention_operation.cpp: inTensor[4].hostData); hence vllm-ascend re-binds
    # them on every graph replay.
    check_host(op, "context_lens", context_lens)
    require(context_lens.numel() == tokens, op, "context_lens", f"{tokens} entries",
            context_lens.numel())
    lengths = context_lens.tolist()
    capacity = block_table.shape[1] * cache_block_size
    for length in lengths:
        require(1 <= length <= capacity, op, "context_lens",
                f"in [1, {capacity}] (block_table columns × block_size)", length)
    _check_block_ids(op, block_table, lengths, cache_block_size, num_blocks)

    check_tensor(op, "out", out)
    require(out.shape == query.shape and out.dtype == query.dtype, op, "out",
            f"{query.dtype} of shape {tuple(query.shape)}", f"{out.dtype} {tuple(out.shape)}")
    check_contiguous(op, "out", out)  # [ATB-OUT]
    return lengths


def _lengths_from_cumulative(op, arg, ends):
    previous = 0
    for end in ends:
        require(end >= previous, op, arg, "cumulative (non-negative and non-decreasing)", ends)
        previous = end
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def _check_fia_paged(op, query, key, value, block_table, kv_lens, kv_heads, block_size, max_q_len):
    """Checks of [FIA] "PageAttention约束" for a TND query; returns the caches as [nb, bs, KVH, D]."""
    head_dim = query.shape[2]
    check_tensor(op, "block_table", block_table)
    check_dtype(op, "block_table", block_table, (torch.int32,))  # [FIA] block_table: int32
    check_dims(op, "block_table", block_table, 2)  # [FIA] 二维 [B, maxBlockNumPerSeq]
    require(block_table.shape[0] == len(kv_lens), op, "block_table",
            f"{len(kv_lens)} rows (one per sequence)", block_table.shape[0])
    # [FIA] cache layout BnBsH (blocknum, block_size, KV_N*D); KV_N*D > 65535 is rejected.
    check_dims(op, "key", key, 3)
    require(key.shape[2] == kv_heads * head_dim and key.shape[2] <= limits.FIA_MAX_KV_HIDDEN, op, "key",
            f"a paged cache (num_blocks, block_size, {kv_heads}*{head_dim})", tuple(key.shape))
    require(isinstance(block_size, int) and block_size == key.shape[1], op, "block_size",
            f"key.shape[1] = {key.shape[1]}", block_size)
    # [FIA] PageAttention约束: Q_S > 1 → block_size in [128, 512], a multiple of 128;
    # Q_S = 1 → non-zero, ≤ 512; [FIA] TND (D ≠ 512): block_size a multiple of 16.
    align = limits.FIA_PREFILL_BLOCK_ALIGN if max_q_len > 1 else limits.FIA_DECODE_BLOCK_ALIGN
    require(block_size % align == 0 and align <= block_size <= limits.FIA_MAX_BLOCK_SIZE, op,
            "block_size", f"a multiple of {align} in [{align}, {limits.FIA_MAX_BLOCK_SIZE}]"
            + (" when a query is longer than 1" if max_q_len > 1 else " for decode"), block_size)
    # Paged TND reads one kv length per sequence: [FIA] derives each batch's block count from
    # actual_seq_lengths_kv and block_size ("blocknum ≥ 各batch block数之和"), [FIA-V2] calls it
    # "每个batch的实际长度" for the paged case, and vllm-ascend passes seq_lens_list here.
    capacity = block_table.shape[1] * block_size
    for length in kv_lens:
        require(0 <= length <= capacity, op, "actual_seq_lengths_kv",
                f"per-sequence lengths in [0, {capacity}] with a paged cache", kv_lens)
    num_blocks = key.shape[0]
    needed = sum(math.ceil(length / block_size) for length in kv_lens)
    require(needed <= num_blocks, op, "key", f"≥ {needed} blocks (the sum over sequences)",
            num_blocks)
    _check_block_ids(op, block_table, kv_lens, block_size, num_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return key.view(shape), value.view(shape)


def _check_block_ids(op, block_table, lengths, block_size, num_blocks):
    """[PA] blockTables 中元素的值须在 [0, num_blocks) 之间 (for the blocks a sequence uses)."""
    used = torch.tensor([math.ceil(length / block_size) for length in lengths])
    width = int(used.max()) if len(lengths) else 0
    if width == 0:
        return
    ids = block_table[:, :width]
    in_use = torch.arange(width) < used[:, None].to(ids.device)
    bad = ((ids < 0) | (ids >= num_blocks)) & in_use
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        fail(op, "block_table", f"block ids in [0, {num_blocks})",
             f"{int(ids[row, col])} at [{row}, {col}]")


# The last mask that passed the content check, as (weak reference, tensor version).
_verified_mask = (None, -1)



def _check_tnd_lengths(op, tokens, actual_seq_lengths, actual_seq_lengths_kv):
    """The TND host lengths: cumulative query ends, their lengths, and the KV list as given."""
    # [FIA] actual_seq_lengths: TND 时必须传入, 元素为累加和 (后值 ≥ 前值, 非负), 个数即 batch (≤ 4096).
    q_ends = check_int_list(op, "actual_seq_lengths", actual_seq_lengths)
    batch = len(q_ends)
    require(1 <= batch <= limits.FIA_TND_MAX_BATCH, op, "actual_seq_lengths",
            f"1 to {limits.FIA_TND_MAX_BATCH} entries (TND batch)", batch)
    q_lens = _lengths_from_cumulative(op, "actual_seq_lengths", q_ends)
    # [FIA] TND: T 为所有 batch 的 S 累加和.
    require(q_ends[-1] == tokens, op, "actual_seq_lengths",
            f"cumulative, ending at query.shape[0] = {tokens}", q_ends)
    kv_arg = check_int_list(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    require(len(kv_arg) == batch, op, "actual_seq_lengths_kv",
            f"{batch} entries like actual_seq_lengths", len(kv_arg))
    return q_ends, q_lens, kv_arg

def _check_causal_mask(op, atten_mask, sparse_mode):
    """[FIA] sparse_mode 3 and 4 need the optimised 2048×2048 mask (bool/int8/uint8, ND, contiguous),
    "需用户保证为下三角": nonzero (masked) exactly above the diagonal. The content is verified once
    per tensor version, since the backend passes one shared mask every step."""
    global _verified_mask
    require(atten_mask is not None, op, "atten_mask",
            f"the 2048×2048 causal mask with sparse_mode={sparse_mode}", None)
    check_tensor(op, "atten_mask", atten_mask)
    check_dtype(op, "atten_mask", atten_mask, (torch.bool, torch.int8, torch.uint8))
    require(tuple(atten_mask.shape) in _CAUSAL_MASK_SHAPES, op, "atten_mask",
            "(2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048)", tuple(atten_mask.shape))
    check_contiguous(op, "atten_mask", atten_mask)
    # Inference tensors have no version counter: their content is checked on every call.
    version = None if atten_mask.is_inference() else atten_mask._version
    verified_ref, verified_version = _verified_mask
    if version is not None and verified_ref is not None and verified_ref() is atten_mask \
            and verified_version == version:
        return
    size = _MASK
    upper = torch.ones(size, size, dtype=torch.bool, device=atten_mask.device).triu(1)
    require(torch.equal(atten_mask.reshape(size, size) != 0, upper), op, "atten_mask",
            "nonzero exactly above the diagonal (torch.triu(ones, 1))", "another pattern")
    _verified_mask = (weakref.ref(atten_mask), version)
