"""Plain-torch references for the int8 quantisation ops of the kernel seam (W8A8 linear layers).

Like the other references, each function enforces its torch_npu op's documented input contract and
computes the documented output; :mod:`ascend_patch.npu.kernels.npu` holds the real twins and
:mod:`ascend_patch.npu.kernels.reference` re-exports
these. Only the forms the W8A8 path uses are implemented; other documented forms (int4, int8
output, batched operands, smoothing) raise ``NotImplementedError`` naming what was asked for.

A W8A8 linear layer ``y = x @ W.T`` with int8 ``W`` [N, K] (kept as ``Wt = W.T`` [K, N], the
op's x2 layout, transposed once at load) calls them so::

    # dynamic (per-token symmetric activations, per-channel weights)
    x_q, token_scale = npu_dynamic_quant(x)                       # int8 [M, K], fp32 [M]
    y = npu_quant_matmul(x_q, Wt, weight_scale, pertoken_scale=token_scale, bias=bias,
                         output_dtype=x.dtype)                    # fp16 / bf16
    # static (per-tensor activations with a zero point, as msModelSlim calibrates them)
    x_q = npu_quantize(x, 1 / input_scale, input_offset, torch.qint8, axis=-1, div_mode=False)
    y = npu_quant_matmul(x_q, Wt, deq_scale, bias=quant_bias, output_dtype=x.dtype)

Contract sources (cited next to each check by the tag in brackets; op-plugin is Ascend/op-plugin at
517f2e7d, docs under ``docs/zh/custom_APIs/torch_npu/``, schemas in
``op_plugin/config/op_plugin_functions.yaml``; CANN docs are hicann/ops-nn):

- [DQ] ``torch_npu-npu_dynamic_quant.md``: x fp16/bf16 with more than one dim; scale =
  rowMax(|x|) / DTYPE_MAX in fp32 with x's shape minus its last dim; y = round(x / scale).
- [QUANTIZE] ``torch_npu-npu_quantize.md``: div_mode=False computes ``input * scales +
  zero_points``; scales and zero_points share input's dtype; 1-D of size 1 or the quantised axis;
  axis -2 is the second-last axis, anything above -2 the last. [QUANTIZE-ACLNN]
  ``quant/quantize/docs/aclnnQuantize.md``: the result is ``round(...)``.
- [QMM] ``torch_npu-npu_quant_matmul.md``: x1/x2 int8 ND, 2-6 dims, last dims ≤ 65535; scale
  1-D ``(1|n,)``; pertoken_scale fp32 ``(m,)``; bias 1-D ``(n,)``; table 2 (A2/A3) lists the
  dtype rows implemented here. [QMM-ACLNN] ``matmul/quant_batch_matmul_v4/docs/
  aclnnQuantMatmulV5.md``: x2 may be the transposed view of a contiguous [n, k] tensor; with
  int32 output and an int32 or no bias the scales do not take part (``out = x1 @ x2 + bias``).
  [QMM-WHEEL] the docstring in the torch-npu 2.11-2.14 wheels' ``_op_plugin_docs.py``, 表1 (A2/A3):
  fp16 output with pertoken_scale takes an int32, float16 or float32 bias (not bfloat16); the
  wheels' meta kernel (``quant_matmul_bias_dtype_check``) agrees: "When bias dtype is bfloat16,
  output_dtype must be bfloat16".

Assumptions the docs leave open: rounding is half-to-even (torch.round) and casts to int8
saturate at [-128, 127]; an all-zero row in npu_dynamic_quant gets scale 0 and zeros (its 0/0 is
undefined). NZ weight layouts are not emulated: weights stay ND, which every op here accepts.
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.contracts import check_dims, check_dtype, check_tensor, fail, require

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INT8_MAX = 127


def _saturate_int8(values: torch.Tensor) -> torch.Tensor:
    return values.round().clamp(-128, 127).to(torch.int8)


def dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None):
    """Per-token symmetric int8 quantisation: ``(y int8, scale fp32 = rowmax|x| / 127)``."""
    op = "npu_dynamic_quant"
    check_tensor(op, "input", input)
    check_dtype(op, "input", input, _HALF)  # [DQ] float16、bfloat16
    require(input.dim() > 1, op, "input", "more than 1-D", f"{input.dim()}-D")  # [DQ] 维度必须大于1
    if group_index is not None:
        raise NotImplementedError(f"{op}: group_index (MoE smoothing groups) is not implemented")
    require(dst_type in (None, torch.int8), op, "dst_type", "None or torch.int8 (quint4x2 is not "
            "implemented)", dst_type)
    values = input.float()
    if smooth_scales is not None:
        check_tensor(op, "smooth_scales", smooth_scales)
        check_dtype(op, "smooth_scales", smooth_scales, _HALF)
        # [DQ] 不使用group_index时, smooth_scales必须是一维, 元素数量与x的最后一维一致.
        require(smooth_scales.shape == (input.shape[-1],), op, "smooth_scales",
                f"shape ({input.shape[-1]},)", tuple(smooth_scales.shape))
        values = values * smooth_scales.float()
    scale = values.abs().amax(dim=-1) / _INT8_MAX
    quotient = values / torch.where(scale > 0, scale, 1).unsqueeze(-1)
    return _saturate_int8(quotient), scale


def quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    """``round(input * scales + zero_points)`` to int8 along one axis (div_mode=False)."""
    op = "npu_quantize"
    if div_mode:
        raise NotImplementedError(f"{op}: div_mode=True is not implemented; the seam multiplies "
                                  "by the reciprocal scale (div_mode=False)")
    require(dtype == torch.qint8, op, "dtype", "torch.qint8 (quint4x2 is not implemented)", dtype)
    check_tensor(op, "input", input)
    check_dtype(op, "input", input, _FLOATS)  # [QUANTIZE] A2/A3: float、float16、bfloat16
    require(isinstance(axis, int) and axis >= -2, op, "axis", "an int ≥ -2", axis)
    require(axis < input.dim(), op, "axis", f"below input's {input.dim()} dims", axis)
    quantised_axis = input.dim() - 2 if axis == -2 else input.dim() - 1
    size = input.shape[quantised_axis]
    check_tensor(op, "scales", scales)
    # [QUANTIZE] div_mode=False: scales 的数据类型需要和 input 一致, 1维时大小等于 axis 维或 1.
    require(scales.dtype == input.dtype, op, "scales", f"{input.dtype} like input", scales.dtype)
    check_dims(op, "scales", scales, 1)
    require(scales.shape[0] in (1, size), op, "scales", f"1 or {size} entries (the quantised "
            "axis)", scales.shape[0])
    shape = [1] * input.dim()
    shape[quantised_axis] = scales.shape[0]
    values = input.float() * scales.float().view(shape)
    if zero_points is not None:
        check_tensor(op, "zero_points", zero_points)
        # [QUANTIZE] zero_points 的 shape 和 dtype 需要和 scales 一致.
        require(zero_points.dtype == scales.dtype and zero_points.shape == scales.shape, op,
                "zero_points", f"{scales.dtype} of shape {tuple(scales.shape)} like scales",
                f"{zero_points.dtype} {tuple(zero_points.shape)}")
        values = values + zero_points.float().view(shape)
    return _saturate_int8(values)  # [QUANTIZE-ACLNN] out = round(...)


# [QMM] table 2 (A2/A3), int8 x1/x2, the rows without offset: output dtype -> (scale dtypes,
# bias dtypes, whether pertoken_scale is required / allowed).
_QMM_ROWS = {
    torch.float16: ((torch.float32,), (torch.int32,), "forbidden"),
    torch.bfloat16: ((torch.float32, torch.bfloat16),
                     (torch.int32, torch.bfloat16, torch.float32), "optional"),
    torch.int32: ((torch.float32, torch.bfloat16), (torch.int32,), "forbidden"),
}
# [QMM-WHEEL] 表1 column 4: fp16 output, pertoken_scale float32.
_QMM_FP16_PER_TOKEN = ((torch.float32,), (torch.int32, torch.float16, torch.float32), "required")


def quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                 group_sizes=None):
    """``x1 @ x2`` of int8 operands, dequantised: ``acc * scale (* pertoken_scale[:, None])``
    with an int32 bias added to ``acc`` or a float bias added after scaling; int32 output is
    ``acc (+ bias)``."""
    op = "npu_quant_matmul"
    if group_sizes is not None:
        raise NotImplementedError(f"{op}: group_sizes (grouped quantisation) is not implemented")
    if output_dtype in (None, torch.int8):
        raise NotImplementedError(f"{op}: int8 output (requantisation with offset) is not "
                                  "implemented; pass output_dtype float16, bfloat16 or int32")
    require(offset is None, op, "offset", "None (it is for int8 output only)", "a tensor")
    for name, tensor in (("x1", x1), ("x2", x2), ("scale", scale)):
        check_tensor(op, name, tensor)
    if x1.dtype == torch.int32:
        raise NotImplementedError(f"{op}: int32 operands (packed int4) are not implemented")
    check_dtype(op, "x1", x1, (torch.int8,))
    require(x2.dtype == x1.dtype, op, "x2", f"{x1.dtype} like x1", x2.dtype)
    if x1.dim() != 2 or x2.dim() != 2:
        raise NotImplementedError(f"{op}: only 2-D x1 and x2 are implemented (got {x1.dim()}-D "
                                  f"and {x2.dim()}-D)")
    # [QMM-ACLNN] x1: only the last two axes may be transposed; x2 (ND): likewise.
    for name, tensor in (("x1", x1), ("x2", x2)):
        require(tensor.is_contiguous() or tensor.t().is_contiguous(), op, name,
                "contiguous or the transposed view of a contiguous tensor",
                f"strides {tensor.stride()}")
    rows, inner = x1.shape
    require(x2.shape[0] == inner, op, "x2", f"shape ({inner}, n) (k of x1)", tuple(x2.shape))
    cols = x2.shape[1]
    require(inner <= limits.QMM_INNER_LIMIT and cols <= limits.QMM_INNER_LIMIT, op, "x1/x2",
            f"last dims ≤ {limits.QMM_INNER_LIMIT}", (inner, cols))
    if scale.dtype == torch.int64:
        raise NotImplementedError(f"{op}: an int64 (npu_trans_quant_param) scale is not "
                                  "implemented; pass the fp32 scale")
    check_dims(op, "scale", scale, 1)  # [QMM] scale 1维 (t,), t = 1 或 n
    require(scale.shape[0] in (1, cols), op, "scale", f"1 or {cols} entries", scale.shape[0])
    if pertoken_scale is not None:
        check_tensor(op, "pertoken_scale", pertoken_scale)
        check_dtype(op, "pertoken_scale", pertoken_scale, (torch.float32,))
        require(pertoken_scale.shape == (rows,), op, "pertoken_scale",
                f"shape ({rows},) (m of x1)", tuple(pertoken_scale.shape))
    if bias is not None:
        check_tensor(op, "bias", bias)
        require(bias.shape == (cols,), op, "bias", f"shape ({cols},)", tuple(bias.shape))

    if output_dtype == torch.float16 and pertoken_scale is not None:
        scale_dtypes, bias_dtypes, per_token = _QMM_FP16_PER_TOKEN
    elif output_dtype in _QMM_ROWS:
        scale_dtypes, bias_dtypes, per_token = _QMM_ROWS[output_dtype]
    else:
        fail(op, "output_dtype", "float16, bfloat16 or int32", output_dtype)
    check_dtype(op, "scale", scale, scale_dtypes)
    if bias is not None:
        check_dtype(op, "bias", bias, bias_dtypes)
    if per_token == "forbidden":
        require(pertoken_scale is None, op, "pertoken_scale",
                f"None for {output_dtype} output with this scale", "a tensor")

    # int8 products summed in float64 are exact for any k within the limit.
    acc = x1.double() @ x2.double()
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    if output_dtype == torch.int32:
        return acc.to(torch.int32)  # [QMM-ACLNN] the scales do not take part
    out = acc.float() * scale.float()
    if pertoken_scale is not None:
        out = out * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)

