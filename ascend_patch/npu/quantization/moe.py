"""Dynamic W8A8 experts on the NPU MoE path, for both checkpoint formats.

vLLM builds an MoE layer's experts through the quant method its config returns for the layer;
a quantised method is a ``FusedMoEMethodBase`` of its own, not the CustomOp
``UnquantizedFusedMoEMethod`` that the unquantised NPU method replaces. So:

- the ``ascend`` config returns :class:`AscendW8A8MoEMethod` for a ``W8A8_DYNAMIC`` expert layer;
- compressed-tensors builds ``CompressedTensorsW8A8Int8MoEMethod`` (imported by name inside
  ``CompressedTensorsMoEMethod.get_moe_method``, 0.20–0.33), whose kernel selection finds
  nothing for an out-of-tree platform; the overlay puts
  :class:`AscendCompressedTensorsW8A8Int8MoEMethod` in its place (a declared replacement).

Both keep vLLM's weight layout and loader (int8 ``w13_weight`` [E, 2I, H] / ``w2_weight``
[E, H, I], per-channel fp32 ``*_weight_scale`` [E, N, 1]), and run monolithically like the
unquantised NPU method: NPU routing, then :func:`~ascend_patch.npu.ops.fused_moe.fused_experts`
with int8 dispatch, grouped matmuls and per-token scales.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ascend_patch.npu.ops import fused_moe
from ascend_patch.npu.quantization import checkpoint, w8a8
from ascend_patch.npu.quantization.checkpoint import UnsupportedQuantizationError

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class AscendW8A8MoEMethod(FusedMoEMethodBase):
    """Experts with per-channel int8 weights and per-token int8 activations."""

    def __init__(self, moe, prefix: str, offsets: bool) -> None:
        super().__init__(moe)
        self.prefix = prefix
        self.offsets = offsets  # msModelSlim also stores (zero) weight offsets

    @property
    def is_monolithic(self) -> bool:
        return True  # the router logits come here: routing runs on the NPU gating ops

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM kernel runs these experts

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        load = extra_weight_attrs.pop("weight_loader")
        self.prefix = layer.layer_name or self.prefix
        self.act_dtype = params_dtype
        rows = {"w13": 2 * intermediate_size_per_partition, "w2": hidden_size}
        cols = {"w13": hidden_size, "w2": intermediate_size_per_partition}
        channel = {**extra_weight_attrs, "quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
        for w in ("w13", "w2"):
            checkpoint.register(layer, f"{w}_weight", torch.empty(
                num_experts, rows[w], cols[w], dtype=torch.int8), load, self.prefix,
                (torch.int8,), **extra_weight_attrs)
            for part in ("scale", "offset") if self.offsets else ("scale",):
                checkpoint.register(layer, f"{w}_weight_{part}", torch.empty(
                    num_experts, rows[w], 1, dtype=torch.float32), load, self.prefix, _FLOATS,
                    **channel)

    def process_weights_after_loading(self, layer) -> None:
        experts = layer.w13_weight.shape[0]
        for names, shards in ((("w13_weight", "w13_weight_scale"), 2),
                              (("w2_weight", "w2_weight_scale"), 1)):
            checkpoint.require_loaded(layer, self.prefix, names, experts * shards)
        fused_moe.prepare_layer(layer, self.moe.has_bias)
        # npu_grouped_matmul: weights [E, in, out]; int8 with a bf16 scale gives bf16, with an
        # fp32 scale fp16 (the only float outputs of its int8 row).
        scale_dtype = torch.bfloat16 if self.act_dtype == torch.bfloat16 else torch.float32
        for w in ("w13", "w2"):
            weight = getattr(layer, f"{w}_weight").data
            scale = getattr(layer, f"{w}_weight_scale").data
            w8a8.drop(layer, f"{w}_weight", f"{w}_weight_scale", f"{w}_weight_offset")
            layer.register_parameter(f"{w}_weight", torch.nn.Parameter(
                weight.transpose(1, 2).contiguous(), requires_grad=False))
            layer.register_parameter(f"{w}_scale", torch.nn.Parameter(
                scale.squeeze(-1).to(scale_dtype).contiguous(), requires_grad=False))

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        weights, ids = layer.ascend_routing(x, router_logits)
        return fused_moe.fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                       layer.expert_map, scales=(layer.w13_scale, layer.w2_scale))


class AscendCompressedTensorsW8A8Int8MoEMethod(AscendW8A8MoEMethod):
    """Stands in for vLLM's ``CompressedTensorsW8A8Int8MoEMethod`` (same constructor): channel
    int8 weights and dynamic per-token int8 activations, both symmetric."""

    def __init__(self, weight_quant, input_quant, moe, layer_name=None) -> None:
        super().__init__(moe, layer_name or "an MoE layer", offsets=False)  # named at load
        from compressed_tensors.quantization import QuantizationStrategy

        supported = (weight_quant.strategy == QuantizationStrategy.CHANNEL
                     and input_quant.strategy == QuantizationStrategy.TOKEN
                     and input_quant.dynamic and weight_quant.symmetric and input_quant.symmetric)
        if not supported:
            raise UnsupportedQuantizationError(
                f"compressed-tensors int8 experts with weights {weight_quant.strategy} "
                f"(symmetric={weight_quant.symmetric}) and activations {input_quant.strategy} "
                f"(dynamic={input_quant.dynamic}, symmetric={input_quant.symmetric}); the NPU "
                "experts run channel weights with dynamic per-token activations, both symmetric")


def compressed_tensors_moe_method(original):
    """Replacement factory for vLLM's ``CompressedTensorsW8A8Int8MoEMethod``."""
    return AscendCompressedTensorsW8A8Int8MoEMethod
