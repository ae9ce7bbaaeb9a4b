"""compressed-tensors W8A8 int8 on the NPU, through vLLM's own config and scheme classes.

vLLM maps an int8 W8A8 layer to ``CompressedTensorsW8A8Int8``, whose ``create_weights`` asks
``init_int8_linear_kernel`` for a kernel: the first class in ``_POSSIBLE_INT8_KERNELS[platform]``
that supports the layer. The table has no out-of-tree entry, hence "Failed to find a kernel that
can implement the ScaledMM linear layer" on the NPU. vLLM's seam for that is
``register_linear_kernel(kernel, PlatformEnum.OOT, "int8")`` (0.20–0.33):
:class:`AscendInt8ScaledMMLinearKernel` runs the layer on npu_quant_matmul. Supported: per-channel
or per-tensor weights (symmetric, as vLLM's int8 scheme has them) with static per-tensor
activations, symmetric or with a zero point (npu_quantize takes the zero point; its
correction is an int32 bias of the matmul), or dynamic per-token symmetric activations
(npu_dynamic_quant). Dynamic asymmetric activations are not: npu_dynamic_quant is symmetric.

Anything else the checkpoint asks for (W4A16, W4A8, FP8, MXFP/NVFP4, 2:4 sparsity, ...) fails
when the layer is built, naming the layer and vLLM's scheme: :func:`check_scheme` wraps
``CompressedTensorsConfig.get_scheme`` and :func:`check_moe_method` wraps
``CompressedTensorsMoEMethod.get_moe_method``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    Int8ScaledMMLinearKernel,
)

from ascend_patch.npu.quantization import w8a8
from ascend_patch.npu.quantization.checkpoint import UnsupportedQuantizationError, where

_ASYMMETRIC_DYNAMIC = ("dynamic per-token activations with a zero point (npu_dynamic_quant "
                       "quantises symmetrically)")


class AscendInt8ScaledMMLinearKernel(Int8ScaledMMLinearKernel):
    """vLLM's int8 ScaledMM kernel interface on npu_dynamic_quant / npu_quantize and
    npu_quant_matmul."""

    @classmethod
    def is_supported(cls, compute_capability=None):
        return True, None  # registered for the out-of-tree (NPU) platform only

    @classmethod
    def can_implement(cls, c):
        if not c.is_static_input_scheme and not c.input_symmetric:
            return False, _ASYMMETRIC_DYNAMIC
        return True, None

    def process_weights_after_loading(self, layer) -> None:
        weight, weight_scale, input_scale, input_zero_point, _ = self._get_layer_params(layer)
        weight = weight.data
        scale = weight_scale.data.reshape(-1).float()
        if not self.config.is_channelwise:
            # One scale per logical partition (q, k, v...): per output channel for the op.
            widths = torch.tensor(layer.logical_widths, device=scale.device)
            scale = scale.expand(len(widths)).repeat_interleave(widths)
        if self.config.is_static_input_scheme:
            zero_point = input_zero_point.data if input_zero_point is not None else None
            correction = None if zero_point is None else w8a8.zero_point_correction(
                weight, zero_point)
            w8a8.finish_static(layer, weight, input_scale.data.reshape(-1)[:1].float() * scale,
                               input_scale.data.reshape(-1)[:1].float(), zero_point, correction,
                               layer.params_dtype)
        else:
            w8a8.finish_dynamic(layer, weight, scale)
        w8a8.drop(layer, *self.layer_param_names[1:])

    def apply_weights(self, layer, x, bias=None):
        return w8a8.apply(layer, x, bias)


def check_scheme(wrapped, instance, args, kwargs):
    """Wrapper of ``CompressedTensorsConfig.get_scheme``: a scheme the NPU cannot run fails
    here, naming the layer, instead of deep inside vLLM's kernel selection."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Int8,
    )

    layer_name = kwargs.get("layer_name", args[1] if len(args) > 1 else None)
    try:
        scheme = wrapped(*args, **kwargs)
    except (NotImplementedError, ValueError) as exc:
        raise UnsupportedQuantizationError(f"{where(layer_name)}: {exc}") from exc
    if scheme is None:
        return None
    if not isinstance(scheme, CompressedTensorsW8A8Int8):
        _refuse(layer_name, type(scheme).__name__)
    if not scheme.is_static_input_scheme and not scheme.input_symmetric:
        _refuse(layer_name, f"{type(scheme).__name__} with {_ASYMMETRIC_DYNAMIC}")
    return scheme


def check_moe_method(original):
    """Replacement factory for ``CompressedTensorsMoEMethod.get_moe_method`` (a staticmethod):
    the same, except that a method the NPU cannot run fails naming the layer."""
    get_moe_method = original.__func__

    def checked_get_moe_method(quant_config, layer, layer_name):
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        from ascend_patch.npu.quantization.moe import AscendW8A8MoEMethod

        try:
            method = get_moe_method(quant_config, layer, layer_name)
        except (NotImplementedError, ValueError, RuntimeError) as exc:
            raise UnsupportedQuantizationError(f"{where(layer_name)}: {exc}") from exc
        if not isinstance(method, (AscendW8A8MoEMethod, UnquantizedFusedMoEMethod)):
            _refuse(layer_name, type(method).__name__)
        return method

    return staticmethod(checked_get_moe_method)


def _refuse(layer_name, scheme: str):
    raise UnsupportedQuantizationError(
        f"{where(layer_name)} is quantised with compressed-tensors scheme {scheme}; ascend-patch "
        "runs W8A8 int8 (CompressedTensorsW8A8Int8, channel or tensor weights with static or "
        "dynamic symmetric activations) on the NPU")
