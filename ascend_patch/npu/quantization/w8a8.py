"""W8A8 linear layers on the kernel seam, shared by both checkpoint formats.

A format's method turns what its checkpoint stores into one NPU form, once, after loading
(:func:`finish_dynamic`, :func:`finish_static`); :func:`apply` then runs every step:

- ``weight``: int8 ``[K, N]``, contiguous ND (npu_quant_matmul's x2 is ``[k, n]``; the checkpoint
  stores ``[N, K]``). NZ is the layout the op docs recommend on A2/A3 for speed, not one they
  require; it cannot be emulated on CPU, so weights stay ND on both paths and the emulated run
  is the real one.
- ``w8a8_scale``: fp32 ``[N]``, the per-output-channel dequantisation scale: the weight scale
  (dynamic) or input scale × weight scale (static).
- ``w8a8_int_bias``: int32 ``[N]`` added to the int32 accumulator, or None: msModelSlim's
  ``quant_bias`` (float bias / scale minus the zero-point correction), or the zero-point
  correction of asymmetric static activations.
- static only: ``w8a8_input_scale`` = 1 / input scale and ``w8a8_input_offset``, ``[1]`` in the
  activation dtype, for npu_quantize (div_mode=False wants scales in the input's dtype).

Per step, dynamic: ``npu_dynamic_quant`` → ``npu_quant_matmul`` (2 launches); static:
``npu_quantize`` → ``npu_quant_matmul`` (2 launches), plus one add where the op cannot take the
float bias in the same call. fp16/bf16 activations dequantise inside the matmul. The op has no
fp32 output, so an fp32 model takes its int32 accumulator and scales it in torch (3-4 more
launches), and npu_dynamic_quant takes fp16/bf16 only, so fp32 activations get its formula
from npu_quantize (4 more launches). fp32 serving of quantised models is a verification path:
it is exact, not fast.
"""

from __future__ import annotations

import torch

from ascend_patch.npu import kernels


def _set(layer: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """A parameter the runner charges to the (emulated) HBM, replacing any old one."""
    if hasattr(layer, name):  # not a seam: our own parameters
        delattr(layer, name)
    layer.register_parameter(name, None if value is None else
                             torch.nn.Parameter(value, requires_grad=False))


def drop(layer: torch.nn.Module, *names: str) -> None:
    """Free checkpoint tensors the NPU form no longer needs."""
    for name in names:
        if hasattr(layer, name):  # not a seam: our own parameters
            delattr(layer, name)


def _to_in_out(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def finish_dynamic(layer: torch.nn.Module, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Per-channel int8 weights ``[N, K]`` with scales ``[N]``; activations per token at run time."""
    layer.w8a8_static = False
    _set(layer, "weight", _to_in_out(weight))
    _set(layer, "w8a8_scale", weight_scale.reshape(-1).float().contiguous())
    _set(layer, "w8a8_int_bias", None)


def finish_static(layer: torch.nn.Module, weight: torch.Tensor, scale: torch.Tensor,
                  input_scale: torch.Tensor, input_offset: torch.Tensor | None,
                  int_bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
    """Per-tensor activations ``x_q = round(x / input_scale + input_offset)``; ``scale`` [N] is
    the whole dequantisation scale of the int accumulator."""
    layer.w8a8_static = True
    _set(layer, "weight", _to_in_out(weight))
    _set(layer, "w8a8_scale", scale.reshape(-1).float().contiguous())
    _set(layer, "w8a8_int_bias", None if int_bias is None else int_bias.to(torch.int32).contiguous())
    _set(layer, "w8a8_input_scale", (1.0 / input_scale.reshape(1).double()).to(act_dtype))
    offset = torch.zeros(1) if input_offset is None else input_offset.reshape(1)
    _set(layer, "w8a8_input_offset", offset.to(act_dtype))


def zero_point_correction(weight: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """int32 ``-zp * sum_k W[n, k]``: ``(x_q - zp) @ W.T = x_q @ W.T - zp * rowsum(W)``."""
    return -(int(zero_point.reshape(-1)[0]) * weight.to(torch.int64).sum(dim=1)).to(torch.int32)


def apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight, scale, int_bias = layer.weight, layer.w8a8_scale, layer.w8a8_int_bias
    rows = x.reshape(-1, x.shape[-1])
    if layer.w8a8_static:
        x_q = kernels.quantize(rows, layer.w8a8_input_scale, layer.w8a8_input_offset, torch.qint8,
                               axis=-1, div_mode=False)
        token_scale = None
    else:
        x_q, token_scale = _quantize_per_token(rows)
    if x.dtype == torch.float32:
        # npu_quant_matmul outputs fp16/bf16/int32 only: the exact int32 accumulator, scaled here.
        out = kernels.quant_matmul(x_q, weight, scale, bias=int_bias,
                                   output_dtype=torch.int32).float().mul_(scale)
        if token_scale is not None:
            out.mul_(token_scale[:, None])
        if bias is not None:
            out.add_(bias)
    else:
        op_bias, later_bias = _split_bias(x.dtype, token_scale is not None, int_bias, bias)
        out = kernels.quant_matmul(x_q, weight, scale, pertoken_scale=token_scale, bias=op_bias,
                                   output_dtype=x.dtype)
        if later_bias is not None:
            out = out + later_bias
    return out.view(*x.shape[:-1], weight.shape[1])


def _quantize_per_token(rows: torch.Tensor):
    """npu_dynamic_quant's ``(round(x / s), s = rowmax|x| / 127)``. It takes fp16/bf16 only, so
    fp32 rows (a verification path) get the same formula from npu_quantize, exactly in fp32."""
    if rows.dtype != torch.float32:
        return kernels.dynamic_quant(rows)
    scale = rows.abs().amax(dim=-1) / 127
    inverse = 1 / scale.clamp(min=torch.finfo(torch.float32).tiny)
    return kernels.quantize(rows, inverse, None, torch.qint8, axis=-2, div_mode=False), scale


def _split_bias(dtype, per_token, int_bias, bias):
    """``(bias for npu_quant_matmul, bias to add after it)``: the op takes one bias, int32 or a
    float one of the dtypes its table row lists (bf16 output: bf16/fp32; fp16 output: fp32 with
    per-token scales, none without)."""
    if int_bias is not None:
        return int_bias, bias
    if bias is None or dtype == torch.bfloat16:
        return bias, None
    if per_token:
        return bias.float(), None
    return None, bias
