"""Plain-torch references for the Mixture-of-Experts ops of the kernel seam.

Like the other references, each function enforces its torch_npu op's documented input contract and
computes the documented output; :mod:`ascend_patch.npu.kernels.npu` holds the real twins and
:mod:`ascend_patch.npu.kernels.reference` re-exports
these, so both backends bind the same names. Signatures (names, argument names, defaults) are the
documented torch_npu ones. Work is vectorised over tokens; grouped matmul loops over experts.

An unquantised MoE layer (dropless, all experts local) calls them in this order, with ``T`` tokens,
``E`` experts, ``k`` experts per token, hidden size ``H`` and intermediate size ``I``::

    # routing: either the plain softmax top-k ...
    y, expert_idx, _ = npu_moe_gating_top_k_softmax(router_logits, k=k)
    # ... or grouped top-k (DeepSeek-V3), see "vLLM grouped_topk" below for the argument mapping
    y, expert_idx, _ = npu_moe_gating_top_k(router_logits, k, bias=e_score_correction_bias, ...)
    # permute: rows sorted by expert, counts per expert
    expanded_x, expanded_row_idx, counts, _ = npu_moe_init_routing_v2(
        hidden_states, expert_idx, active_num=T * k, expert_num=E,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, E])
    # experts: vLLM stores w13 [E, 2I, H] and w2 [E, H, I]; the op wants [E, K, N], and a
    # transposed view is allowed, so pass w13.transpose(1, 2) and w2.transpose(1, 2) (no copy)
    gate_up = npu_grouped_matmul([expanded_x], [w13.transpose(1, 2)], group_list=counts,
                                 group_list_type=1, group_type=0, split_item=2)[0]
    hidden = kernels.swiglu(gate_up)  # npu_swiglu: silu(first half) * second half, as SiluAndMul
    down = npu_grouped_matmul([hidden], [w2.transpose(1, 2)], group_list=counts,
                              group_list_type=1, group_type=0, split_item=2)[0]
    # un-permute and combine: out[t] = sum_j y[t, j] * down[expanded_row_idx[t * k + j]]
    out = npu_moe_token_unpermute(down, expanded_row_idx, probs=y)          # bf16 rows
    out = npu_moe_finalize_routing(down, None, None, None, y, src_to_dst, None)  # fp16/fp32 rows

The combine step depends on the rows' dtype. ``npu_moe_token_unpermute`` takes init_routing_v2's
``expanded_row_idx`` as is and is what vllm-ascend uses, but every torch-npu wheel the matrix names
documents it for bf16 (2.13 and 2.14 add fp16/fp32, 2.10 and 2.11 do not): bf16 rows go there.
fp16 and fp32 rows go to ``npu_moe_finalize_routing``, documented for fp16/bf16/fp32 in every
wheel, with ``drop_pad_mode=0``, the only mode its doc names; that mode reads the index by column
(``src_to_dst[k * T + t]`` is the row of token t's slot k), so init_routing_v2's row-ordered
index is transposed first (``expanded_row_idx.view(T, k).t()``, T*k int32). Its scales come in
the rows' dtype, as unpermute's probs do. Its torch-npu doc lists the A2 series only (CANN's
aclnnMoeFinalizeRouting(V2) lists A3 too), and vllm-ascend reports accuracy problems with it in
its bf16 path (``vllm_ascend/ops/fused_moe/moe_comm_method.py``), which keeps unpermute.

Dynamic int8 (W8A8): ``npu_moe_init_routing_v2(..., quant_mode=1)`` returns int8 rows and their
fp32 per-row scales, which go to ``npu_grouped_matmul`` as ``per_token_scale`` with the weight's
per-channel ``scale`` [E, N] and ``output_dtype`` bf16 (bf16 scale) or fp16 (fp32 scale).

vLLM ``grouped_topk`` (``model_executor/layers/fused_moe/router/grouped_topk_router.py``, 0.33)
versus ``npu_moe_gating_top_k``; the integrator maps ``scoring_func`` to ``norm_type`` (softmax 0,
sigmoid 1), ``num_expert_group`` to ``group_count`` and ``topk_group`` to ``k_group``, and:

- group score: vLLM sums the top 2 of a group when ``e_score_correction_bias`` is set and takes
  the max otherwise; the op uses ``group_select_mode`` (1 top-2 sum, 0 max) whatever the bias.
  Pass ``group_select_mode=1 if bias is not None else 0`` (vllm-ascend always passes 1).
- renormalisation: vLLM divides the k weights by their sum iff ``renormalize``, for either
  scoring. The op divides (by sum + eps) iff sigmoid; for softmax ``renorm`` must be 0, so the
  weights are not renormalised. Softmax with ``renormalize``: pass ``routed_scaling_factor=1.0``,
  renormalise ``y`` in torch, then scale. Sigmoid without ``renormalize`` has no op equivalent.
- group size: the op needs ``E / group_count > 2``; vLLM groups down to 2 experts per group.
- dtypes: ``y`` comes back in ``x``'s dtype (vLLM returns fp32 weights; pass fp32 logits to
  match) and the op computes in fp32 (vLLM scores in the logits' dtype); ids are int32 in both.
- ties and order: the op's top-k is a stable descending sort (lowest expert id first among
  equals, slots sorted by score); vLLM's ``torch.topk(sorted=False)`` fixes neither. The MoE
  output does not depend on slot order.

Contract sources (cited next to each check by the tag in brackets; op-plugin is Ascend/op-plugin at
517f2e7d, docs under ``docs/zh/custom_APIs/torch_npu/``, schemas in
``op_plugin/config/op_plugin_functions.yaml``; CANN docs are hicann/ops-transformer):

- [SOFTMAX-TOPK] ``torch_npu-npu_moe_gating_top_k_softmax.md``; [SOFTMAX-TOPK-ACLNN]
  ``moe/moe_gating_top_k_softmax/docs/aclnnMoeGatingTopKSoftmax.md`` (finished rows get expert
  id ``E``).
- [SOFTMAX-TOPK-V2] the ``npu_moe_gating_top_k_softmax_v2`` docstring of the torch-npu 2.11-2.14
  wheels (``_op_plugin_docs.py``: renorm 0 is softmax then top-k, renorm 1 top-k then softmax; x
  float16/bfloat16/float32, 2-D or 3-D; 0 < k <= E, k <= 1024) and their meta kernel (outputs: y
  in x's dtype, int32 ids, and the fp32 softmax only with renorm 0 and output_softmax, else an
  empty ``[0]``).
- [GATING] ``torch_npu-npu_moe_gating_top_k.md`` (its equivalent-computation code is the
  algorithm); [GATING-ACLNN] ``moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md`` (normalisation
  rule per norm_type and renorm; no empty input).
- [INIT-V2] ``torch_npu-npu_moe_init_routing_v2.md`` (its equivalent code is the algorithm) and
  ``op_plugin/ops/opapi/MoeInitRoutingV2KernelNpuOpApi.cpp`` (output shapes); [INIT-V2-WHEEL] its
  docstring in the torch-npu 2.11-2.14 wheels' ``_op_plugin_docs.py`` ("当前仅支持" lists: drop_pad_mode
  0, expert_tokens_num_type 1 and 2, expert_tokens_num_flag True, quant_mode -1 and 1; expert_num
  in (0, 10240]) and the wheels' meta kernel (``op_plugin/meta/_meta_registrations.py``: a given
  active_expert_range "must be increasing").
- [GMM] ``torch_npu-npu_grouped_matmul.md`` (table 2 dtypes, the single-single-single row);
  [GMM-ACLNN] ``gmm/grouped_matmul/docs/aclnnGroupedMatmulV4_en.md`` (int8 → int32 row,
  per-channel scale ``[g, n]`` for a single weight tensor).
- [UNPERMUTE] the ``npu_moe_token_unpermute`` docstrings of the torch-npu wheels
  (``torch_npu/_op_plugin_docs.py``): 2.10.0.post4 and 2.11.0 have one, "permuted_tokens ...
  数据类型torch.bfloat16", probs "支持的数据类型BFLOAT16", "sorted_indices ... 数据类型torch.int64"
  (its own example passes int32); 2.13.0 and 2.14.0 keep that text and add a later one (the one
  ``help()`` shows) with float16/bfloat16/float32 tokens and probs and int32 indices, "topK_num要求
  小于等于512" on A2/A3. The index dtype is int32: the later docstring, CANN's
  ``moe/moe_token_unpermute/docs/aclnnMoeTokenUnpermute.md`` (sortedIndices INT32), the sorted
  indices ``npu_moe_token_permute`` returns for this op (int32), and init_routing_v2's
  ``expanded_row_idx`` agree; the schema (``Tensor sorted_indices``) and the meta kernel (dims
  only) name no dtype. Also ``MoeTokenUnpermuteKernelNpuOpApi.cpp``.
- [FINALIZE] ``torch_npu-npu_moe_finalize_routing.md``; [FINALIZE-WHEEL] its docstring in the
  torch-npu 2.11-2.14 wheels' ``_op_plugin_docs.py`` (drop_pad_mode "取值范围为0"; "skip2参数为None时,
  skip1参数必须也为None").

Outputs the docs leave undefined (rows past the valid count, a count tensor that was not asked
for, ``norm_out`` without ``out_flag``) are filled with NaN, or the dtype's minimum for integers,
so code that reads them fails in emulation instead of passing by luck.
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_int_list,
    check_non_empty,
    check_tensor,
    require,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _undefined(shape, dtype, device):
    """An output region the docs leave undefined: NaN, or the integer dtype's minimum."""
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)


def _top_k(scores, k):
    """Descending top-k by a stable sort: among equal scores the lower expert id comes first."""
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _check_int(op, arg, value):
    ok = isinstance(value, int) and not isinstance(value, bool)
    require(ok, op, arg, "an int", type(value).__name__)


# --- routing --------------------------------------------------------------------------------------


def moe_gating_top_k_softmax(x, finished=None, k=1):
    """``softmax(x)`` over experts, then its top k: ``(y, expert_idx, row_idx)``.

    ``y`` is not renormalised. ``row_idx[i, j] = j * rows + i`` ([SOFTMAX-TOPK] formula, written
    for 2-D ``x``; a 3-D ``x`` counts its rows flattened). Rows marked ``finished`` get expert id
    ``E`` in every slot ([SOFTMAX-TOPK-ACLNN]); their ``y`` is whatever the softmax gives.
    """
    op = "npu_moe_gating_top_k_softmax"
    check_tensor(op, "x", x)
    check_dims(op, "x", x, 2, 3)  # [SOFTMAX-TOPK] 2维/3维
    check_dtype(op, "x", x, _FLOATS)  # [SOFTMAX-TOPK] float16、bfloat16、float32
    experts = x.shape[-1]
    _check_int(op, "k", k)
    # [SOFTMAX-TOPK] 0 < k <= x的-1轴大小, k <= 1024.
    top = min(experts, limits.SOFTMAX_TOP_K_MAX)
    require(0 < k <= top, op, "k", f"in [1, {top}]", k)
    if finished is not None:
        check_tensor(op, "finished", finished)
        check_dtype(op, "finished", finished, (torch.bool,))  # [SOFTMAX-TOPK] bool
        require(finished.shape == x.shape[:-1], op, "finished",
                f"shape {tuple(x.shape[:-1])} (x.shape[:-1])", tuple(finished.shape))

    scores = x.reshape(-1, experts).float().softmax(dim=-1)
    y, expert_idx = _top_k(scores, k)
    if finished is not None:
        expert_idx = expert_idx.masked_fill(finished.reshape(-1, 1), experts)
    rows = scores.shape[0]
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).t()
    shape = (*x.shape[:-1], k)
    return (y.to(x.dtype).view(shape), expert_idx.to(torch.int32).view(shape),
            row_idx.reshape(shape))


def moe_gating_top_k_softmax_v2(x, *, k=1, finished=None, renorm=0, output_softmax=False):
    """``(y, expert_idx, softmax)``: renorm 0 is :func:`moe_gating_top_k_softmax`'s top k of the
    softmax; renorm 1 the softmax of the top k logits, which is that top k renormalised to sum to
    1 (the softmax is monotonic, so both pick the same experts) [SOFTMAX-TOPK-V2]. ``softmax`` is
    the whole fp32 softmax with renorm 0 and ``output_softmax``, else empty."""
    op = "npu_moe_gating_top_k_softmax_v2"
    check_tensor(op, "x", x)
    check_dims(op, "x", x, 2, 3)
    check_dtype(op, "x", x, _FLOATS)
    experts = x.shape[-1]
    _check_int(op, "k", k)
    top = min(experts, limits.SOFTMAX_TOP_K_MAX)
    require(0 < k <= top, op, "k", f"in [1, {top}]", k)
    _check_int(op, "renorm", renorm)
    require(renorm in (0, 1), op, "renorm", "0 (softmax, then top-k) or 1 (top-k, then softmax)",
            renorm)
    require(isinstance(output_softmax, bool), op, "output_softmax", "a bool",
            type(output_softmax).__name__)
    if finished is not None:  # the v2 docstring gives no rule for finished rows' ids
        raise NotImplementedError(f"{op}: finished rows are not implemented")

    logits = x.reshape(-1, experts).float()
    scores = logits.softmax(dim=-1)
    y, expert_idx = _top_k(scores, k)
    if renorm == 1:
        y = logits.gather(-1, expert_idx).softmax(dim=-1)
    shape = (*x.shape[:-1], k)
    full = renorm == 0 and output_softmax
    softmax = scores.view(x.shape) if full else torch.empty(0, dtype=torch.float32, device=x.device)
    return y.to(x.dtype).view(shape), expert_idx.to(torch.int32).view(shape), softmax


def moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
                     group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                     out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """Grouped top-k routing: ``(y, expert_idx, norm_out)`` ([GATING] equivalent code).

    ``norm_out`` = softmax (norm_type 0) or sigmoid (1) of ``x`` in fp32. Selection uses
    ``norm_out + bias``: the ``k_group`` best of ``group_count`` groups (group score = max, or sum
    of the top 2 with ``group_select_mode=1``), then the best ``k`` experts inside them. ``y`` is
    gathered from the unbiased ``norm_out``, divided by ``sum + eps`` for sigmoid only
    ([GATING-ACLNN]: softmax is renormalised only with renorm=1, which torch_npu does not accept),
    then multiplied by ``routed_scaling_factor``.
    """
    op = "npu_moe_gating_top_k"
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError(f"{op}: hash routing (input_ids/tid2eid) is not implemented")
    check_tensor(op, "x", x)
    check_dims(op, "x", x, 2)  # [GATING] 2D
    check_dtype(op, "x", x, _FLOATS)
    check_non_empty(op, "x", x)  # [GATING-ACLNN] 输入不支持空Tensor
    experts = x.shape[1]
    require(experts <= limits.GATING_MAX_EXPERTS, op, "x",
            f"at most {limits.GATING_MAX_EXPERTS} experts (last dim)", experts)
    for name, value in (("k", k), ("k_group", k_group), ("group_count", group_count),
                        ("group_select_mode", group_select_mode), ("renorm", renorm),
                        ("norm_type", norm_type)):
        _check_int(op, name, value)
    # [GATING] group_count > 0, E 能被整除且结果大于 2, 按 32 对齐后乘 group_count ≤ 2048.
    require(group_count > 0 and experts % group_count == 0, op, "group_count",
            f"a positive divisor of the expert count {experts}", group_count)
    group_size = experts // group_count
    require(group_size > 2, op, "group_count", "a grouping with more than 2 experts per group",
            f"{group_count} groups of {group_size}")
    aligned = -(-group_size // 32) * 32 * group_count
    require(aligned <= limits.GATING_MAX_EXPERTS, op, "group_count",
            f"a grouping whose 32-aligned size is ≤ {limits.GATING_MAX_EXPERTS}",
            f"{group_count} groups of {group_size} ({aligned} aligned)")
    require(1 <= k_group <= group_count, op, "k_group", f"in [1, {group_count}]", k_group)
    # [GATING] 1 <= k <= x_shape[-1] / group_count * k_group.
    require(1 <= k <= group_size * k_group, op, "k", f"in [1, {group_size * k_group}] "
            f"(experts per group × k_group)", k)
    require(group_select_mode in (0, 1), op, "group_select_mode", "0 (max) or 1 (top-2 sum)",
            group_select_mode)
    require(renorm == 0, op, "renorm", "0 (the only value supported)", renorm)
    require(norm_type in (0, 1), op, "norm_type", "0 (softmax) or 1 (sigmoid)", norm_type)
    require(isinstance(out_flag, bool), op, "out_flag", "a bool", type(out_flag).__name__)
    if bias is not None:
        check_tensor(op, "bias", bias)
        # [GATING] bias: 1D, shape 与 x 最后一维相等, 数据类型与 x 一致.
        require(bias.shape == (experts,) and bias.dtype == x.dtype, op, "bias",
                f"{x.dtype} of shape ({experts},)", f"{bias.dtype} {tuple(bias.shape)}")

    logits = x.float()
    norm_out = logits.softmax(dim=-1) if norm_type == 0 else logits.sigmoid()
    selection = norm_out if bias is None else norm_out + bias.float()
    if group_count > 1:
        grouped = selection.view(-1, group_count, group_size)
        if group_select_mode == 0:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        _, chosen = _top_k(group_scores, k_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        selection = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, experts)
    _, expert_idx = _top_k(selection, k)
    y = norm_out.gather(1, expert_idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    if not out_flag:
        norm_out = _undefined(norm_out.shape, torch.float32, x.device)
    return y.to(x.dtype), expert_idx.to(torch.int32), norm_out


# --- permute --------------------------------------------------------------------------------------

def moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                        expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                        expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                        active_expert_range=[], row_idx_type=0):
    """Sort the ``N*K`` (token, slot) pairs by expert and gather their rows (dropless mode).

    Returns ``(expanded_x, expanded_row_idx, expert_tokens_count_or_cumsum, expanded_scale)``.
    Only pairs whose expert lies in ``active_expert_range`` (default ``[0, expert_num)``) are
    valid: they fill the first ``available`` rows, in expert order and, within an expert, in
    (token, slot) order. ``expanded_row_idx`` with ``row_idx_type=0`` maps pair ``t*K + j`` to its
    row (-1 if not valid); with 1 it lists the pairs of rows ``0..available-1``. Counts are int64
    over the active range. ``quant_mode=1`` quantises each row to int8 with
    ``scale = rowmax|x (* smooth scale)| / 127`` returned as ``expanded_scale``.
    """
    op = "npu_moe_init_routing_v2"
    # [INIT-V2-WHEEL] the modes the op supports today (its meta kernel takes more, for formats
    # later CANN releases add); key_value counts are documented but not emulated.
    require(drop_pad_mode == 0, op, "drop_pad_mode", "0 (dropless, the only mode supported)",
            drop_pad_mode)
    require(quant_mode in (-1, 1), op, "quant_mode", "-1 (none) or 1 (dynamic int8), the modes "
            "supported", quant_mode)
    require(expert_tokens_num_flag is True, op, "expert_tokens_num_flag", "True (the only value "
            "supported)", expert_tokens_num_flag)
    require(expert_tokens_num_type in (1, 2), op, "expert_tokens_num_type", "1 (count) or 2 "
            "(key_value), the modes supported", expert_tokens_num_type)
    if expert_tokens_num_type == 2:
        raise NotImplementedError(f"{op}: expert_tokens_num_type=2 (key_value) is not implemented; "
                                  "use 1 (count)")
    require(row_idx_type in (0, 1), op, "row_idx_type", "0 (gather) or 1 (scatter)", row_idx_type)

    check_tensor(op, "x", x)
    check_dims(op, "x", x, 2)  # [INIT-V2] x: 2维 (NUM_ROWS, H)
    check_dtype(op, "x", x, (*_FLOATS, torch.int8))
    check_tensor(op, "expert_idx", expert_idx)
    check_dims(op, "expert_idx", expert_idx, 2)  # [INIT-V2] (NUM_ROWS, K), int32
    check_dtype(op, "expert_idx", expert_idx, (torch.int32,))
    rows_in, hidden = x.shape
    require(expert_idx.shape[0] == rows_in, op, "expert_idx", f"{rows_in} rows like x",
            expert_idx.shape[0])
    top_k = expert_idx.shape[1]
    pairs = rows_in * top_k

    # [INIT-V2-WHEEL] expert_num: (0, 10240]; the default -1 only works with an explicit range,
    # whose end must not exceed it anyway, so it is required.
    _check_int(op, "expert_num", expert_num)
    require(0 < expert_num <= limits.INIT_ROUTING_MAX_EXPERTS, op, "expert_num",
            f"in (0, {limits.INIT_ROUTING_MAX_EXPERTS}] (pass the expert count)",
            expert_num)
    expert_range = check_int_list(op, "active_expert_range", active_expert_range)
    if not expert_range:
        expert_range = [0, expert_num]
    # [INIT-V2] [expert_start, expert_end): 值大于等于 0, expert_end 不大于 expert_num; not empty
    # ([INIT-V2-WHEEL] meta: "must be increasing").
    require(len(expert_range) == 2 and 0 <= expert_range[0] < expert_range[1] <= expert_num, op,
            "active_expert_range", f"[start, end) with 0 ≤ start < end ≤ expert_num={expert_num}",
            expert_range)
    start, end = expert_range
    # [INIT-V2] dropless: active_num ≥ -1; -1 and 0 mean all rows.
    _check_int(op, "active_num", active_num)
    require(active_num >= -1, op, "active_num", "≥ -1", active_num)
    if 0 < active_num < pairs:
        raise NotImplementedError(f"{op}: active_num={active_num} below NUM_ROWS*K={pairs} (the "
                                  "Active scenario) is not implemented; pass -1, 0 or NUM_ROWS*K")
    if pairs:
        # [INIT-V2] 专家id不能超过专家数; ids outside the active range, negative ones too, are
        # left out (the equivalent code sorts them last).
        high = int(expert_idx.max())
        require(high <= expert_num, op, "expert_idx", f"expert ids ≤ expert_num={expert_num}",
                f"max {high}")

    quantised = quant_mode == 1
    if quantised:
        require(x.dtype != torch.int8, op, "x", "a float tensor with quant_mode=1 (the doc calls "
                "the output of an int8 x meaningless)", x.dtype)
    require(offset is None, op, "offset", "None without static quantisation", "a tensor")
    if scale is not None:
        check_tensor(op, "scale", scale)
        check_dtype(op, "scale", scale, (torch.float32,))  # [INIT-V2] scale: float32
        # [INIT-V2] non-quant: (NUM_ROWS,); dynamic: (expert_end - expert_start, H) or (1, H).
        shapes = [(end - start, hidden), (1, hidden)] if quantised else [(rows_in,)]
        require(tuple(scale.shape) in shapes, op, "scale", " or ".join(map(str, shapes)),
                tuple(scale.shape))

    flat_experts = expert_idx.reshape(-1).long()
    valid = (flat_experts >= start) & (flat_experts < end)
    available = int(valid.sum())
    sort_key = torch.where(valid, flat_experts, end)  # invalid pairs sort last
    order = sort_key.sort(stable=True).indices[:available]
    source_rows = order // top_k

    device = x.device
    if row_idx_type == 0:
        expanded_row_idx = torch.full((pairs,), -1, dtype=torch.int32, device=device)
        expanded_row_idx[order] = torch.arange(available, dtype=torch.int32, device=device)
    else:
        expanded_row_idx = _undefined((pairs,), torch.int32, device)
        expanded_row_idx[:available] = order.to(torch.int32)

    counts = torch.bincount(flat_experts[valid] - start, minlength=end - start)

    rows = x[source_rows]
    expanded_scale = _undefined((pairs,), torch.float32, device)
    if quantised:
        values = rows.float()
        if scale is not None:
            values = values * (scale if scale.shape[0] == 1 else scale[flat_experts[order] - start])
        row_scale = values.abs().amax(dim=-1) / 127
        # An all-zero row has scale 0; the docs leave 0/0 open, the reference writes zeros.
        quotient = values / torch.where(row_scale > 0, row_scale, 1)[:, None]
        rows = quotient.round().clamp(-128, 127).to(torch.int8)
        expanded_scale[:available] = row_scale
    elif scale is not None:
        expanded_scale[:available] = scale[source_rows]
    expanded_x = _undefined((pairs, hidden), rows.dtype, device)
    expanded_x[:available] = rows
    return expanded_x, expanded_row_idx, counts, expanded_scale


# --- grouped matmul -------------------------------------------------------------------------------

# [GMM] table 2, int8 rows: scale dtype -> the output dtype it dequantises to.
_INT8_SCALE_OUTPUT = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}


def grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                   antiquant_offset=None, per_token_scale=None, group_list=None,
                   activation_input=None, activation_quant_scale=None,
                   activation_quant_offset=None, split_item=0, group_type=None,
                   group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """The MoE form ("single-single-single", M-axis groups): ``[x @ weight[g] per row group]``.

    ``x`` = ``[x (M, K)]``, ``weight`` = ``[w (E, K, N)]`` (a transposed view is fine), row group
    ``g`` is given by ``group_list`` (counts with type 1, cumsum with type 0). Float inputs give
    ``x``'s dtype; int8 gives int32 (no scales, ``output_dtype=torch.int32``) or
    ``acc * scale[g] (* per_token_scale[row])`` in bf16 (bf16 scale) or fp16 (fp32 scale).
    Returns a one-tensor list ``[y (M, N)]``. ``tuning_config`` is a tiling hint: accepted, unused.
    """
    op = "npu_grouped_matmul"
    for name, tensors in (("x", x), ("weight", weight)):
        ok = isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor)
                                                        for t in tensors)
        require(ok, op, name, "a list of tensors", type(tensors).__name__)
        require(1 <= len(tensors) <= limits.GMM_MAX_TENSORS, op, name,
                f"1 to {limits.GMM_MAX_TENSORS} tensors", len(tensors))
    if len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3:
        raise NotImplementedError(f"{op}: only the MoE form is implemented: one 2-D x, one 3-D "
                                  f"weight [E, K, N] (got {len(x)} x, {len(weight)} weight of "
                                  f"{weight[0].dim()}-D)")
    if antiquant_scale is not None or antiquant_offset is not None:
        raise NotImplementedError(f"{op}: weight-only (antiquant) quantisation is not implemented")
    if bias is not None:
        raise NotImplementedError(f"{op}: bias is not implemented for a 3-D weight (the doc gives "
                                  "1-D bias per weight tensor, not the per-expert layout)")
    (inputs,), (weights,) = x, weight
    # [GMM] 单单单 (group_type 0): split_item 2/3, weight 3-D, x and y 2-D, group_list required.
    require(group_type == 0, op, "group_type", "0 (M-axis groups) for a 3-D weight", group_type)
    require(split_item in (2, 3), op, "split_item", "2 or 3 (single output) for a 3-D weight",
            split_item)
    for name, value in (("offset", offset), ("activation_input", activation_input),
                        ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset)):
        require(value is None, op, name, "None (the only value supported)", "a value")
    if tuning_config is not None:
        check_int_list(op, "tuning_config", tuning_config)

    check_dims(op, "x[0]", inputs, 2)
    check_contiguous(op, "x[0]", inputs)  # [GMM] x 不支持转置
    check_dtype(op, "x[0]", inputs, (*_FLOATS, torch.int8))
    require(weights.dtype == inputs.dtype, op, "weight[0]", f"{inputs.dtype} like x[0]",
            weights.dtype)
    # [GMM] 支持weight转置: [E, K, N] stored as is or as its [E, N, K] transpose, nothing else.
    require(weights.is_contiguous() or weights.transpose(1, 2).is_contiguous(), op, "weight[0]",
            "contiguous, or the transpose(1, 2) view of a contiguous [E, N, K] tensor",
            f"strides {weights.stride()}")
    rows, inner = inputs.shape
    experts, weight_inner, cols = weights.shape
    require(weight_inner == inner, op, "weight[0]", f"shape (E, {inner}, N) (K of x[0])",
            tuple(weights.shape))
    require(inner < limits.GMM_INNER_LIMIT and cols < limits.GMM_INNER_LIMIT, op, "K and N", f"below {limits.GMM_INNER_LIMIT}",
            (inner, cols))

    counts = _group_sizes(op, group_list, group_list_type, experts, rows)
    quantised = inputs.dtype == torch.int8
    scale_tensor, token_scale, out_dtype = _check_quant_args(
        op, quantised, inputs, scale, per_token_scale, output_dtype, experts, cols, rows)
    require(isinstance(act_type, int) and 0 <= act_type <= 5 and act_type != 3, op, "act_type",
            "0, 1, 2, 4 or 5", act_type)
    if act_type:
        require(token_scale is not None, op, "act_type", "0 without per-token quantisation",
                act_type)
        raise NotImplementedError(f"{op}: the fused activation act_type={act_type} is not "
                                  "implemented")

    # int8 products summed in float64 are exact for any K below the inner limit.
    accumulate = torch.float64 if quantised else torch.float32
    out = torch.empty(rows, cols, dtype=accumulate, device=inputs.device)
    first = 0
    for expert, count in enumerate(counts):
        if count:
            group = slice(first, first + count)
            out[group] = inputs[group].to(accumulate) @ weights[expert].to(accumulate)
        first += count
    if scale_tensor is not None:
        group_ids = torch.repeat_interleave(torch.arange(experts, device=inputs.device),
                                            torch.tensor(counts, device=inputs.device))
        out = out.float() * scale_tensor.float()[group_ids]
        if token_scale is not None:
            out = out * token_scale[:, None]
    return [out.to(out_dtype)]


def _group_sizes(op, group_list, group_list_type, experts, rows):
    """[GMM] group_list: an int64 1-D Tensor, one entry per expert (≤ 1024 groups); type 0 is a
    non-negative non-decreasing cumsum ending at x's rows, type 1 non-negative counts summing to
    them (and not of length 1). Returns the per-group row counts on the host."""
    check_tensor(op, "group_list", group_list)
    check_dtype(op, "group_list", group_list, (torch.int64,))
    if group_list_type == 2:
        raise NotImplementedError(f"{op}: group_list_type=2 ([E, 2] index/size pairs, int8 only) "
                                  "is not implemented")
    require(group_list_type in (0, 1), op, "group_list_type", "0 (cumsum), 1 (counts) or 2",
            group_list_type)
    check_dims(op, "group_list", group_list, 1)
    require(group_list.numel() == experts, op, "group_list",
            f"{experts} entries (one per expert of weight[0])", group_list.numel())
    require(1 <= experts <= limits.GMM_MAX_GROUPS, op, "group_list",
            f"1 to {limits.GMM_MAX_GROUPS} groups", experts)
    values = group_list.tolist()
    if group_list_type == 0:
        steps = [b - a for a, b in zip([0, *values], values)]
        require(min(steps) >= 0, op, "group_list", "a non-negative, non-decreasing cumsum (type 0)",
                values)
        require(values[-1] == rows, op, "group_list", f"a cumsum ending at x[0].shape[0] = {rows}",
                values)
        return steps
    require(experts != 1, op, "group_list", "longer than 1 with group_list_type=1", values)
    require(min(values) >= 0, op, "group_list", "non-negative counts (type 1)", values)
    require(sum(values) == rows, op, "group_list", f"counts summing to x[0].shape[0] = {rows}",
            f"{values} (sum {sum(values)})")
    return values


def _check_quant_args(op, quantised, inputs, scale, per_token_scale, output_dtype, experts, cols,
                      rows):
    """[GMM] table 2 dtype rows. Returns ``(scale, per_token_scale, output dtype)``."""
    scale_tensor = _single(op, "scale", scale)
    token_scale = _single(op, "per_token_scale", per_token_scale)
    if not quantised:
        require(scale_tensor is None and token_scale is None, op, "scale/per_token_scale",
                f"None for {inputs.dtype} x (no quantisation)", "a tensor")
        require(output_dtype in (None, inputs.dtype), op, "output_dtype",
                f"None or {inputs.dtype} like x[0]", output_dtype)
        return None, None, inputs.dtype
    if scale_tensor is None:
        # [GMM-ACLNN] int8 x and weight without scales give the int32 accumulator.
        require(token_scale is None, op, "per_token_scale", "None without scale", "a tensor")
        require(output_dtype == torch.int32, op, "output_dtype",
                "torch.int32 for int8 inputs without scale", output_dtype)
        return None, None, torch.int32
    if scale_tensor.dtype == torch.int64:
        raise NotImplementedError(f"{op}: int64 (npu_trans_quant_param) scale with int8 output is "
                                  "not implemented")
    check_dtype(op, "scale[0]", scale_tensor, tuple(_INT8_SCALE_OUTPUT))
    # [GMM-ACLNN] per-channel scale for a single weight tensor: [g, n].
    require(scale_tensor.shape == (experts, cols), op, "scale[0]", f"shape ({experts}, {cols}) "
            "(per expert and output channel)", tuple(scale_tensor.shape))
    expected = _INT8_SCALE_OUTPUT[scale_tensor.dtype]
    require(output_dtype == expected, op, "output_dtype",
            f"{expected} with a {scale_tensor.dtype} scale", output_dtype)
    if token_scale is not None:
        check_dtype(op, "per_token_scale[0]", token_scale, (torch.float32,))
        require(token_scale.shape == (rows,), op, "per_token_scale[0]",
                f"shape ({rows},) (one per row of x[0])", tuple(token_scale.shape))
    return scale_tensor, token_scale, expected


def _single(op, arg, tensors):
    """An optional list holding the one tensor of the single-weight form."""
    if tensors is None:
        return None
    ok = isinstance(tensors, (list, tuple)) and len(tensors) == 1 and \
        isinstance(tensors[0], torch.Tensor)
    require(ok, op, arg, "None or a list of one tensor (one weight tensor)",
            type(tensors).__name__)
    return tensors[0]


# --- combine --------------------------------------------------------------------------------------


def moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                        restore_shape=None):
    """``out[t] = sum_j probs[t, j] * permuted_tokens[sorted_indices[t * k + j]]`` ([UNPERMUTE]).

    ``sorted_indices`` is init_routing_v2's ``expanded_row_idx`` (gather layout): a permutation of
    the permuted rows. Without ``probs``, ``k = 1`` and rows are only reordered.
    """
    op = "npu_moe_token_unpermute"
    # [UNPERMUTE] paddedMode: 目前仅支持 false; restoreShape: 目前仅支持 nullptr.
    require(padded_mode is False, op, "padded_mode", "False (the only mode supported)",
            padded_mode)
    require(restore_shape is None, op, "restore_shape", "None (padded mode is unsupported)",
            restore_shape)
    check_tensor(op, "permuted_tokens", permuted_tokens)
    check_dims(op, "permuted_tokens", permuted_tokens, 2)
    # [UNPERMUTE] bf16 tokens and probs: the envelope every torch-npu wheel the matrix names
    # documents (2.10/2.11: bf16 only); int32 indices (2.13/2.14, CANN, npu_moe_token_permute).
    check_dtype(op, "permuted_tokens", permuted_tokens, (torch.bfloat16,))
    check_tensor(op, "sorted_indices", sorted_indices)
    check_dims(op, "sorted_indices", sorted_indices, 1)
    check_dtype(op, "sorted_indices", sorted_indices, (torch.int32,))
    pairs, hidden = permuted_tokens.shape
    require(sorted_indices.numel() == pairs, op, "sorted_indices",
            f"{pairs} entries (one per permuted row)", sorted_indices.numel())
    top_k = 1
    if probs is not None:
        check_tensor(op, "probs", probs)
        check_dims(op, "probs", probs, 2)  # [UNPERMUTE] probs (tokens_num, topK_num)
        check_dtype(op, "probs", probs, (torch.bfloat16,))
        top_k = probs.shape[1]
        require(1 <= top_k <= limits.UNPERMUTE_MAX_TOP_K and probs.numel() == pairs, op, "probs",
                f"shape (tokens, k) with tokens * k = {pairs} and k ≤ {limits.UNPERMUTE_MAX_TOP_K}",
                tuple(probs.shape))
    if pairs:
        # [UNPERMUTE] sortedIndices: 取值范围 [0, tokens_num * topK_num - 1], 且没有重复索引.
        low, high = (int(v) for v in sorted_indices.aminmax())
        require(0 <= low and high < pairs, op, "sorted_indices", f"within [0, {pairs - 1}]",
                f"range [{low}, {high}]")
        unique = torch.unique(sorted_indices).numel()
        require(unique == pairs, op, "sorted_indices", "free of duplicates",
                f"{pairs - unique} duplicate index(es)")

    gathered = permuted_tokens[sorted_indices.long()].float().view(-1, top_k, hidden)
    if probs is not None:
        gathered = gathered * probs.float()[..., None]
    return gathered.sum(dim=1).to(permuted_tokens.dtype)


def moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                         expanded_src_to_dst_row, expert_for_source_row, drop_pad_mode=0):
    """``out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src[i, k]] + bias[e[i, k]])``.

    ``src[i, k]`` is ``expanded_src_to_dst_row[k * N + i]`` (``drop_pad_mode=0``, the column layout
    of init_routing v1). Missing skips, bias or scales (None) drop their terms; without scales
    ``K = 1``.
    """
    op = "npu_moe_finalize_routing"
    # [FINALIZE-WHEEL] drop_pad_mode: 取值范围为0 (the column layout of init_routing v1).
    require(drop_pad_mode == 0, op, "drop_pad_mode", "0 (the only value supported)", drop_pad_mode)
    rows_name = "expanded_permuted_rows"
    check_tensor(op, rows_name, expanded_permuted_rows)
    check_dims(op, rows_name, expanded_permuted_rows, 2)  # [FINALIZE] (NUM_ROWS * K, H)
    check_dtype(op, rows_name, expanded_permuted_rows, _FLOATS)
    dtype = expanded_permuted_rows.dtype
    pairs, hidden = expanded_permuted_rows.shape
    check_tensor(op, "expanded_src_to_dst_row", expanded_src_to_dst_row)
    check_dims(op, "expanded_src_to_dst_row", expanded_src_to_dst_row, 1)
    check_dtype(op, "expanded_src_to_dst_row", expanded_src_to_dst_row, (torch.int32,))
    require(expanded_src_to_dst_row.numel() == pairs, op, "expanded_src_to_dst_row",
            f"{pairs} entries (NUM_ROWS * K)", expanded_src_to_dst_row.numel())

    def check_float(name, tensor, shape):
        # [FINALIZE] skip1/skip2/bias/scales: 数据类型要求与 expanded_permuted_rows 一致.
        require(tensor.dtype == dtype and tuple(tensor.shape) == shape, op, name,
                f"{dtype} of shape {shape}", f"{tensor.dtype} {tuple(tensor.shape)}")

    top_k = 1
    if scales is not None:
        check_tensor(op, "scales", scales)
        check_dims(op, "scales", scales, 2)  # [FINALIZE] scales (NUM_ROWS, K)
        top_k = scales.shape[1]
        require(top_k > 0 and scales.numel() == pairs, op, "scales",
                f"(N, K) with N * K = {pairs}", tuple(scales.shape))
        check_float("scales", scales, tuple(scales.shape))
    tokens = pairs // top_k
    # [FINALIZE-WHEEL] skip2参数为None时, skip1参数必须也为None.
    require(skip2 is not None or skip1 is None, op, "skip1", "None when skip2 is None", "a tensor")
    for name, skip in (("skip1", skip1), ("skip2", skip2)):
        if skip is not None:
            check_tensor(op, name, skip)
            check_float(name, skip, (tokens, hidden))
    if expert_for_source_row is not None:
        check_tensor(op, "expert_for_source_row", expert_for_source_row)
        check_dtype(op, "expert_for_source_row", expert_for_source_row, (torch.int32,))
        require(tuple(expert_for_source_row.shape) == (tokens, top_k), op,
                "expert_for_source_row", f"shape ({tokens}, {top_k})",
                tuple(expert_for_source_row.shape))
    if bias is not None:
        require(expert_for_source_row is not None, op, "expert_for_source_row",
                "a tensor when bias is given (it picks each slot's bias row)", None)
        check_tensor(op, "bias", bias)
        check_dims(op, "bias", bias, 2)  # [FINALIZE] bias (E, H)
        check_float("bias", bias, (bias.shape[0], hidden))
        if expert_for_source_row.numel():
            low, high = (int(v) for v in expert_for_source_row.aminmax())
            require(0 <= low and high < bias.shape[0], op, "expert_for_source_row",
                    f"within [0, {bias.shape[0] - 1}] (bias rows)", f"range [{low}, {high}]")
    if pairs:
        # [FINALIZE] drop_pad_mode 0: 取值范围 [0, NUM_ROWS * K - 1].
        low, high = (int(v) for v in expanded_src_to_dst_row.aminmax())
        require(0 <= low and high < pairs, op, "expanded_src_to_dst_row",
                f"within [0, {pairs - 1}]", f"range [{low}, {high}]")

    index = expanded_src_to_dst_row.long().view(top_k, tokens).t()
    contributions = expanded_permuted_rows.float()[index]  # (N, K, H)
    if bias is not None:
        contributions = contributions + bias.float()[expert_for_source_row.long()]
    if scales is not None:
        contributions = contributions * scales.float()[..., None]
    out = contributions.sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(dtype)
