"""Reference of ``npu_fusion_attention`` in the TND (varlen) layout, the op encoder-only
attention runs on: every sequence's queries attend to that sequence's keys, bidirectionally, or
within a band around the diagonal.

Contract sources (the tag each check cites):

- [FA-WHEEL] the ``npu_fusion_attention`` docstring of the torch-npu wheels'
  ``torch_npu/_op_plugin_docs.py``, identical in 2.10.0.post4, 2.11.0, 2.13.0 and 2.14.0 (and
  [FA], op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md``, which says
  the same). Besides the rules checked here it says "该接口仅在训练场景下使用" (documented for
  training), "该接口暂不支持图模式, 不支持aclgraph" (the backend never issues it inside a graph
  capture) and lists the Atlas A2 training series as the supported product; vllm-ascend runs its
  encoder attention on it all the same (``attention_v1.py::_forward_encoder_attention``).
- [FA-OPAPI] op-plugin ``op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp``
  (``npu_fusion_attention``): the argument checks of the binding and the shapes of its outputs
  (attention ``[T, N, D]``, softmax max/sum ``[T, N, 8]`` fp32 in TND).
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.composed import attend
from ascend_patch.npu.kernels.contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_int_list,
    check_tensor,
    require,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT_MAX = limits.FA_UNBOUNDED_TOKENS
MAX_SEQUENCES = limits.FA_TND_MAX_SEQUENCES
MAX_TOKENS = limits.FA_TND_MAX_TOKENS
MAX_HEAD_DIM = limits.FA_MAX_HEAD_DIM
MAX_HEADS = limits.FA_MAX_HEADS
MASK_SIZE = limits.FA_MASK_SIZE


def fusion_attention(query, key, value, head_num, input_layout, *, atten_mask=None, scale=1.0,
                     pre_tockens=_INT_MAX, next_tockens=_INT_MAX, actual_seq_qlen=None,
                     actual_seq_kvlen=None, sparse_mode=0):
    """TND attention: sequence ``b``'s queries (rows ``actual_seq_qlen[b-1]:actual_seq_qlen[b]``)
    over its keys (rows of ``actual_seq_kvlen`` alike), all of them with ``sparse_mode=0`` and no
    mask, or the band of ``pre_tockens`` keys before and ``next_tockens`` after the diagonal
    (anchored at the bottom right) with ``sparse_mode=4``. Returns the attention output
    ``[T, N, D]`` (the op's first output; the seam uses no other)."""
    op = "npu_fusion_attention"
    if input_layout != "TND":
        raise NotImplementedError(f"{op}: the seam implements input_layout 'TND' only, got "
                                  f"{input_layout!r}")
    if sparse_mode not in (0, 4):
        raise NotImplementedError(f"{op}: the seam implements sparse_mode 0 (no mask) and 4 "
                                  f"(band) only, got {sparse_mode}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_tensor(op, name, tensor)
        check_dims(op, name, tensor, 3)  # [FA-WHEEL] TND: (T, N, D)
        check_dtype(op, name, tensor, _FLOATS)  # [FA-WHEEL] float16、bfloat16、float32
        # [FA-WHEEL] "输入query、key、value、pse的数据类型必须一致".
        require(tensor.dtype == query.dtype, op, name, f"{query.dtype} like query", tensor.dtype)
    # [FA-WHEEL] "输入key和value的shape必须一致".
    require(value.shape == key.shape, op, "value", f"shape {tuple(key.shape)} like key",
            tuple(value.shape))
    tokens, heads, head_dim = query.shape
    # [FA-OPAPI] head_num > 0; [FA-WHEEL] head_num 代表head个数 (the query's N), Nq in 1~256.
    require(head_num == heads, op, "head_num", f"the query's {heads} heads", head_num)
    require(1 <= heads <= MAX_HEADS, op, "query heads (N)", f"in [1, {MAX_HEADS}]", heads)
    kv_heads = key.shape[1]
    # [FA-WHEEL] "Nq/Nkv必须是非0整数".
    require(kv_heads >= 1 and heads % kv_heads == 0, op, "key heads (N)",
            f"a divisor of the query's {heads} heads", kv_heads)
    # [FA-WHEEL] Dq = Dk, 1~768.
    require(key.shape[2] == head_dim, op, "key", f"head dim {head_dim} like query", key.shape[2])
    require(1 <= head_dim <= MAX_HEAD_DIM, op, "query head dim (D)", f"in [1, {MAX_HEAD_DIM}]",
            head_dim)
    require(isinstance(scale, (int, float)), op, "scale", "a float", type(scale).__name__)

    # [FA-OPAPI] TND: actual_seq_qlen and actual_seq_kvlen "must be the same and cannot be empty";
    # [FA-WHEEL] cumulative ("表示query每个S的累加和长度"), at most 1K entries in varlen.
    q_ends = check_int_list(op, "actual_seq_qlen", actual_seq_qlen)
    kv_ends = check_int_list(op, "actual_seq_kvlen", actual_seq_kvlen)
    require(1 <= len(q_ends) <= MAX_SEQUENCES, op, "actual_seq_qlen",
            f"1 to {MAX_SEQUENCES} entries (sequences)", len(q_ends))
    require(len(kv_ends) == len(q_ends), op, "actual_seq_kvlen",
            f"{len(q_ends)} entries like actual_seq_qlen", len(kv_ends))
    q_lens = _lengths(op, "actual_seq_qlen", q_ends, tokens, "query")
    kv_lens = _lengths(op, "actual_seq_kvlen", kv_ends, key.shape[0], "key")
    # [FA-WHEEL] "T(B*S)取值范围1~1M".
    require(1 <= tokens <= MAX_TOKENS, op, "query tokens (T)", f"in [1, {MAX_TOKENS}]", tokens)
    # A query row without keys has no defined output; the op's docs only ever give it keys.
    for q_len, kv_len in zip(q_lens, kv_lens):
        require(q_len == 0 or kv_len > 0, op, "actual_seq_kvlen",
                "a key for every sequence with queries", (q_len, kv_len))

    pre, after = None, None
    if sparse_mode == 0:
        # [FA-WHEEL] "不传mask: 如果atten_mask未传入则不做mask操作, 忽略pre_tockens和next_tockens".
        require(atten_mask is None, op, "atten_mask", "None with sparse_mode=0 (the seam has no "
                "custom-mask path)", "a tensor")
    else:
        pre, after = _band(op, atten_mask, pre_tockens, next_tockens, q_lens, kv_lens)

    out = torch.empty_like(query)
    for q_end, q_len, kv_end, kv_len in zip(q_ends, q_lens, kv_ends, kv_lens):
        if q_len == 0:  # [FA-WHEEL] "支持actual_seq_qlen中某个Batch上的S长度为0"
            continue
        rows, keys = slice(q_end - q_len, q_end), slice(kv_end - kv_len, kv_end)
        out[rows] = attend(query[rows], key[keys], value[keys], scale, pre_tokens=pre,
                           next_tokens=after)
    return out


def _lengths(op, arg, ends, total, tensor):
    previous = 0
    for end in ends:
        require(end >= previous, op, arg, "cumulative (non-negative and non-decreasing)", ends)
        previous = end
    require(ends[-1] == total, op, arg, f"cumulative, ending at {tensor}.shape[0] = {total}", ends)
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def _check_band_mask(op, atten_mask):
    """[FA-WHEEL] atten_mask: "数据类型支持bool、uint8", "varlen场景只支持SS格式" (in TND the
    compressed mask is (2048, 2048), nothing wider), and sparse_mode 4 takes the
    "优化后的压缩下三角矩阵(2048*2048)": nonzero (masked) exactly above the diagonal."""
    require(atten_mask is not None, op, "atten_mask",
            f"the {MASK_SIZE}×{MASK_SIZE} causal mask with sparse_mode=4", None)
    check_tensor(op, "atten_mask", atten_mask)
    check_dtype(op, "atten_mask", atten_mask, (torch.bool, torch.uint8))
    require(tuple(atten_mask.shape) == (MASK_SIZE, MASK_SIZE), op, "atten_mask",
            f"({MASK_SIZE}, {MASK_SIZE}) (varlen takes the SS form only)", tuple(atten_mask.shape))
    check_contiguous(op, "atten_mask", atten_mask)
    upper = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device).triu(1)
    require(torch.equal(atten_mask != 0, upper), op, "atten_mask",
            "nonzero exactly above the diagonal (torch.triu(ones, 1))", "another pattern")


def _band(op, atten_mask, pre_tockens, next_tockens, q_lens, kv_lens):
    """[FA-WHEEL] sparse_mode 4: "代表band场景, 即计算pre_tockens和next_tockens之间的部分, 参数
    起点为右下角, pre_tockens和next_tockens之间需要有交集. atten_mask为优化后的压缩下三角矩阵
    (2048*2048)"; its example builds that mask as ``np.triu(np.ones([2048, 2048]), k=1)``. Query
    row i of a sequence of q queries over s keys sees keys i + s - q - pre ... i + s - q + next.
    Returns (pre, next), None for an unbounded side."""
    _check_band_mask(op, atten_mask)
    for name, tokens in (("pre_tockens", pre_tockens), ("next_tockens", next_tockens)):
        require(isinstance(tokens, int) and not isinstance(tokens, bool), op, name, "an int",
                type(tokens).__name__)
    if pre_tockens < 0 or next_tockens < 0:
        raise NotImplementedError(f"{op}: the seam implements bands that hold the diagonal "
                                  f"(pre_tockens, next_tockens ≥ 0), got {pre_tockens}, "
                                  f"{next_tockens}")
    # [FA-WHEEL] varlen: "atten_mask输入不支持补pad，即atten_mask中不能存在某一行全1的场景": the
    # first query row (diagonal s - q) sees a key when s - q + next_tockens ≥ 0, and then all do.
    for q_len, kv_len in zip(q_lens, kv_lens):
        require(q_len == 0 or kv_len - q_len + next_tockens >= 0, op, "actual_seq_kvlen",
                "long enough that every query row's band holds a key", (q_len, kv_len))
    return (None if pre_tockens >= _INT_MAX else pre_tockens,
            None if next_tockens >= _INT_MAX else next_tockens)
