"""Plain-torch reference kernels: each enforces a torch_npu op's documented input contract, then
computes that op's documented output.

They run the emulated engine on CPU, so a contract violation that would only surface on hardware
(often as an opaque ACL error, sometimes as silently wrong numbers) fails here first, by name. Every
function has the signature of its ``ascend_patch.npu.kernels.npu`` twin. Tests check them against
independent math (SDPA, vLLM's native layers), never against themselves.

Attention is vectorised per sequence at least: the decode rows of a batch share one SDPA call, and
each longer query is one SDPA call over its gathered blocks.

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
- [SCATTER] ``torch_npu-npu_scatter_pa_kv_cache.md`` and the schema in
  ``op_plugin/config/op_plugin_functions.yaml``.
- [RMS] ``（beta）torch_npu-npu_rms_norm.md``; [RMS-WHEEL] its docstring in the torch-npu 2.11-2.14
  wheels' ``_op_plugin_docs.py`` ("gamma：...数据类型需要和self保持一致"; the .md's A2/A3 table also
  lists an fp32 gamma beside fp16/bf16 self, which the wheels' own doc does not allow);
  [ADD-RMS] ``torch_npu-npu_add_rms_norm.md``;
  [SWIGLU] ``（beta）torch_npu-npu_swiglu.md``.
- [ROTARY-MUL] the ``npu_rotary_mul`` docstring in the torch-npu wheels' ``torch_npu/_op_plugin_docs.py``
  (2.10.0.post4 to 2.14.0, identical: 4-D input, layouts BNSD/BSND/SBND and the cos/sin shapes
  each takes); ``op_plugin/ops/opapi/RotaryMulKernelNpuOpApi.cpp``.
- The Mixture-of-Experts ops and their sources: :mod:`.moe`; the int8 quantisation ops:
  :mod:`.quant`.
- [TOPKP] ``torch_npu-npu_top_k_top_p.md`` and the ``npu_top_k_top_p`` docstring in
  ``codegen/templates/_op_plugin_docs.py`` (algorithm; p and k may not both be None).
"""

import math
import weakref

import torch
import torch.nn.functional as F

from .contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_host,
    check_int_list,
    check_non_empty,
    check_tensor,
    fail,
    require,
)
from .fusion_attention import fusion_attention  # noqa: F401 - re-exported likewise
from .moe import (  # noqa: F401 - re-exported: the reference backend is this module's namespace
    grouped_matmul,
    moe_finalize_routing,
    moe_gating_top_k,
    moe_gating_top_k_softmax,
    moe_init_routing_v2,
    moe_token_unpermute,
)
from .paged import attend, decode_batch, gather_sequence
from .quant import dynamic_quant, quant_matmul, quantize  # noqa: F401 - re-exported likewise

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INDEX = (torch.int32, torch.int64)

# [FIA] "sparse_mode=2/3/4时: shape必须为(2048, 2048)或(1, 2048, 2048)或(1, 1, 2048, 2048)".
_CAUSAL_MASK_SIZE = 2048
# [FIA] pre_tokens/next_tokens default: 2147483647 (unbounded).
_INT_MAX = 2147483647
_CAUSAL_MASK_SHAPES = {(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)}


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
    head_dims = (64, 128) if paged or kv_heads != num_heads else (64, 128, 192)
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
    require(1 <= num_heads <= 256, op, "num_heads", "in [1, 256]", num_heads)
    # [FIA] num_key_value_heads: 0 means num_heads; num_heads 能被整除, 比值 ≤ 64.
    kv_heads = num_key_value_heads or num_heads
    require(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, op, "num_key_value_heads",
            f"a divisor of num_heads={num_heads} with ratio ≤ 64", num_key_value_heads)
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
    require(head_dim <= 512 and head_dim * query.element_size() % 16 == 0, op, "query head dim (D)",
            "≤ 512 and 16-byte aligned", head_dim)
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
        require(0 <= length <= 262144, op, "actual_seq_lengths_kv", "in [0, 262144]", length)
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
    require(cache_block_size % 16 == 0, op, "block_size (key_cache.shape[1])", "a multiple of 16",
            cache_block_size)
    require(head_size <= 576, op, "head_size", "≤ 576", head_size)
    if head_size > 256:
        require(cache_block_size <= 128, op, "block_size (key_cache.shape[1])",
                "≤ 128 when head_size > 256", cache_block_size)

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
    require(key.shape[2] == kv_heads * head_dim and key.shape[2] <= 65535, op, "key",
            f"a paged cache (num_blocks, block_size, {kv_heads}*{head_dim})", tuple(key.shape))
    require(isinstance(block_size, int) and block_size == key.shape[1], op, "block_size",
            f"key.shape[1] = {key.shape[1]}", block_size)
    # [FIA] PageAttention约束: Q_S > 1 → block_size in [128, 512], a multiple of 128;
    # Q_S = 1 → non-zero, ≤ 512; [FIA] TND (D ≠ 512): block_size a multiple of 16.
    if max_q_len > 1:
        require(block_size % 128 == 0 and 128 <= block_size <= 512, op, "block_size",
                "a multiple of 128 in [128, 512] when a query is longer than 1", block_size)
    else:
        require(block_size % 16 == 0 and 16 <= block_size <= 512, op, "block_size",
                "a multiple of 16 in [16, 512] for decode", block_size)
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
    require(1 <= batch <= 4096, op, "actual_seq_lengths", "1 to 4096 entries (TND batch)", batch)
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
    size = _CAUSAL_MASK_SIZE
    upper = torch.ones(size, size, dtype=torch.bool, device=atten_mask.device).triu(1)
    require(torch.equal(atten_mask.reshape(size, size) != 0, upper), op, "atten_mask",
            "nonzero exactly above the diagonal (torch.triu(ones, 1))", "another pattern")
    _verified_mask = (weakref.ref(atten_mask), version)


# --- norms and activation -------------------------------------------------------------------------

def rms_norm(self, gamma, epsilon=1e-6):
    """``y = x / sqrt(mean(x²) + eps) * gamma`` over gamma's trailing dims; returns (y, rstd)."""
    op = "npu_rms_norm"
    check_tensor(op, "self", self)
    check_tensor(op, "gamma", gamma)
    check_dims(op, "self", self, 2, 8)  # [RMS] self: shape 支持 2-8 维
    check_dtype(op, "self", self, _FLOATS)  # [RMS-WHEEL] float16、bfloat16、float32
    require(gamma.dtype == self.dtype, op, "gamma", f"{self.dtype} like self", gamma.dtype)  # [RMS-WHEEL]
    _check_trailing(op, "gamma", gamma, self)  # [RMS] gamma_shape = self_shape[n:]
    return _rms(self.float(), gamma, epsilon, self.dtype)


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """``x = x1 + x2``; returns ``(rms_norm(x) * gamma, rstd, x)``: x is the new residual."""
    op = "npu_add_rms_norm"
    for name, tensor in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        check_tensor(op, name, tensor)
        check_non_empty(op, name, tensor)  # [ADD-RMS] 不支持空Tensor
    check_dims(op, "x1", x1, 1, 8)  # [ADD-RMS] 1-8 维
    check_dtype(op, "x1", x1, _FLOATS)  # [ADD-RMS] float32、float16、bfloat16
    # [ADD-RMS] x = x1 + x2 element-wise; gamma 数据类型与 x1 一致, shape 为 x1 的后几维.
    require(x2.shape == x1.shape and x2.dtype == x1.dtype, op, "x2",
            f"{x1.dtype} of shape {tuple(x1.shape)} like x1", f"{x2.dtype} {tuple(x2.shape)}")
    require(gamma.dtype == x1.dtype, op, "gamma", f"{x1.dtype} like x1", gamma.dtype)
    _check_trailing(op, "gamma", gamma, x1)
    total = x1.float() + x2.float()
    y, rstd = _rms(total, gamma, epsilon, x1.dtype)
    return y, rstd, total.to(x1.dtype)


def _check_trailing(op, arg, gamma, x):
    require(1 <= gamma.dim() <= x.dim() and gamma.shape == x.shape[x.dim() - gamma.dim():], op, arg,
            f"trailing dims of {tuple(x.shape)}", tuple(gamma.shape))


def _rms(x, gamma, epsilon, dtype):
    """rstd is fp32 and keeps the normalised dims as 1s ([ADD-RMS] x1 (2,3,4,8), gamma (8) →
    rstd (2,3,4,1))."""
    dims = tuple(range(-gamma.dim(), 0))
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(dtype), rstd


def swiglu(self, dim=-1):
    """``silu(A) * B`` where A, B are the first and second halves of ``self`` along ``dim``."""
    op = "npu_swiglu"
    check_tensor(op, "self", self)
    check_dims(op, "self", self, 1, 8)  # [SWIGLU] 1-8 维
    check_dtype(op, "self", self, _FLOATS)  # [SWIGLU] float32、float16、bfloat16
    check_contiguous(op, "self", self)  # [SWIGLU] 不支持非连续的Tensor
    check_non_empty(op, "self", self)  # [SWIGLU] 不支持空Tensor
    rank = self.dim()
    require(-rank <= dim < rank, op, "dim", f"in [{-rank}, {rank - 1}]", dim)
    # [SWIGLU] shape 必须在 dim 对应维度上可被 2 整除.
    require(self.shape[dim] % 2 == 0, op, "self", f"even-sized on dim {dim}", tuple(self.shape))
    first, second = self.float().chunk(2, dim=dim)
    return (F.silu(first) * second).to(self.dtype)


# --- rotary embedding -----------------------------------------------------------------------------


# [ROTARY-MUL] 约束说明, jit_compile=False (the A2/A3 path): the input's layout is BNSD, BSND or
# SBND, and r1/r2 "对应input layout的支持情况" take these shapes (1: a broadcast axis).
_ROTARY_FACTORS = {
    "half": {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"),
             "SBND": ("S11D", "SB1D", "SBND")},
    "interleave": {"BNSD": ("11SD",), "BSND": ("1S1D",), "SBND": ("S11D",)},
}


def rotary_mul(self, r1, r2, rotary_mode="half"):
    """``x * r1 + rotate(x) * r2``; "half" rotates halves (NeoX), "interleave" pairs (GPT-J)."""
    op = "npu_rotary_mul"
    # [ROTARY-MUL] binding: rotary_mode must be "half" or "interleave".
    require(rotary_mode in ("half", "interleave"), op, "rotary_mode", "'half' or 'interleave'",
            repr(rotary_mode))
    check_tensor(op, "self", self)
    # [ROTARY-MUL] 参数说明: input, cos, sin "4维Tensor" (the wheel's doc, torch-npu 2.10-2.14);
    # a 3-D [T, N, D] query must be viewed as one of the 4-D layouts first.
    check_dims(op, "self", self, 4)
    check_dtype(op, "self", self, _FLOATS)
    head_dim = self.shape[-1]
    # [ROTARY-MUL] jit_compile=False: D < 896 且为 2 的倍数.
    require(head_dim % 2 == 0 and head_dim < 896, op, "self", "an even last dim below 896",
            head_dim)
    check_tensor(op, "r1", r1)
    check_tensor(op, "r2", r2)
    # [ROTARY-MUL] "r2: 同r1" (and the CANN tiling: "cos shape and sin shape should be equal").
    require(r2.shape == r1.shape, op, "r2", f"shape {tuple(r1.shape)} like r1", tuple(r2.shape))
    readings = _rotary_layouts(op, self, r1, rotary_mode)
    # [ROTARY-MUL] half: "B, N < 1000"; interleave: "B * N < 1000". The op has no layout
    # argument: it reads the layout off the factors' broadcast axes, and a shape several
    # layouts explain computes the same product, so one reading within the limits suffices.
    within = [(layout, b, n) for layout, b, n in readings
              if (b < 1000 and n < 1000 if rotary_mode == "half" else b * n < 1000)]
    limit = "B and N below 1000" if rotary_mode == "half" else "B * N below 1000"
    require(bool(within), op, "self", f"{limit} in {rotary_mode} mode",
            ", ".join(f"{layout} with B={b}, N={n}" for layout, b, n in readings))
    for name, factor in (("r1", r1), ("r2", r2)):
        check_dtype(op, name, factor, _FLOATS)  # mixed dtypes are cast to self's by the binding
        # [ROTARY-MUL] r1、r2 数据范围 [-1, 1].
        if factor.numel():
            low, high = factor.aminmax()
            require(-1 <= low and high <= 1, op, name, "within [-1, 1]",
                    f"range [{float(low)}, {float(high)}]")
    x = self.float()
    cos, sin = r1.to(self.dtype).float(), r2.to(self.dtype).float()
    if rotary_mode == "half":
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * cos + rotated * sin).to(self.dtype)


def _rotary_layouts(op, x, factor, rotary_mode):
    """The layouts of ``x`` whose documented factor shapes ``factor`` has, as (layout, B, N)."""
    readings = []
    for layout, patterns in _ROTARY_FACTORS[rotary_mode].items():
        sizes = {**dict(zip(layout, x.shape)), "1": 1}
        shapes = [tuple(sizes[axis] for axis in pattern) for pattern in patterns]
        if tuple(factor.shape) in shapes:
            readings.append((layout, sizes["B"], sizes["N"]))
    allowed = "; ".join(f"{layout}: {', '.join(patterns)}"
                        for layout, patterns in _ROTARY_FACTORS[rotary_mode].items())
    require(bool(readings), op, "r1", f"one of {rotary_mode} mode's cos/sin layouts for the input "
            f"{tuple(x.shape)} ({allowed})", tuple(factor.shape))
    return readings


# --- sampling -------------------------------------------------------------------------------------


def top_k_top_p(logits, p=None, k=None):
    """Mask logits outside each row's top-k and then top-p set to -inf ([TOPKP] algorithm)."""
    op = "npu_top_k_top_p"
    require(p is not None or k is not None, op, "p/k", "at least one of p and k", "both None")
    check_tensor(op, "logits", logits)
    check_dims(op, "logits", logits, 2)  # [TOPKP] 维数支持 2 维
    check_dtype(op, "logits", logits, _FLOATS)
    rows, vocab = logits.shape
    if p is not None:
        check_tensor(op, "p", p)
        check_dims(op, "p", p, 1)
        # [TOPKP] p: 数据类型需要与 logits 一致, shape 与 logits 的第一维相同, 值域 [0, 1].
        require(p.dtype == logits.dtype, op, "p", f"{logits.dtype} like logits", p.dtype)
        require(p.numel() == rows, op, "p", f"{rows} entries (logits.shape[0])", p.numel())
        if rows:
            low, high = p.aminmax()
            require(0 <= low and high <= 1, op, "p", "within [0, 1]",
                    f"range [{float(low)}, {float(high)}]")
    if k is not None:
        check_tensor(op, "k", k)
        check_dims(op, "k", k, 1)
        # [TOPKP] k: int32, 值域 [1, 1024], 最大值 ≤ logits.size(1), shape 与 logits 的第一维相同.
        check_dtype(op, "k", k, (torch.int32,))
        require(k.numel() == rows, op, "k", f"{rows} entries (logits.shape[0])", k.numel())
        if rows:
            low, high = (int(v) for v in k.aminmax())
            require(1 <= low and high <= 1024, op, "k", "within [1, 1024]",
                    f"range [{low}, {high}]")
            require(high <= vocab, op, "k", f"≤ vocab size {vocab}", high)

    # [TOPKP] 1: stable ascending sort; 2-4: drop values below the k-th largest; 5-8: softmax,
    # cumulative sum from the smallest, drop where it is ≤ 1 - p but keep the largest; 9: unsort.
    values, order = logits.sort(dim=-1, stable=True)
    if k is not None:
        threshold = values.gather(1, (vocab - k.long())[:, None])
        values = values.masked_fill(values < threshold, float("-inf"))
    if p is not None:
        cumulative = values.float().softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - p.float())[:, None]
        drop[:, -1] = False
        values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)


# --- multi-head latent attention ------------------------------------------------------------------
# Imported last: the MLA references (kernels/mla.py) reuse this module's paged-cache checks.
from .mla import (  # noqa: E402,F401 - re-exported like the MoE references
    fused_infer_attention_score_mla,
    multi_head_latent_attention,
)
