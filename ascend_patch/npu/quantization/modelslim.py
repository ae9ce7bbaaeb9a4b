"""The ``ascend`` quantisation method: msModelSlim's AscendV1 checkpoints.

msModelSlim (``AscendV1Saver``, ``msmodelslim/core/quant_service/modelslim_v1/save/ascendv1.py``
and ``docs/zh/user_guide/quantization_formats/ascendv1.md``) writes ``quant_model_description.json``
beside ``quant_model_weights*.safetensors``: global keys (``version``, ``model_quant_type``,
``group_size``, ``metadata``, ...) and, for every checkpoint tensor, its type (``W8A8``,
``W8A8_DYNAMIC``, ``FLOAT``, ...). A layer's type is that of its ``.weight``; the other tensors
of a quantised ``nn.Linear`` share it (its float ``bias`` is listed as ``FLOAT``):

- ``W8A8_DYNAMIC``: ``weight`` int8 [N, K], ``weight_scale`` and ``weight_offset`` fp32 [N, 1]
  (the offset is 0: symmetric); activations are quantised per token at run time.
- ``W8A8`` (static): ``weight`` int8 [N, K] (symmetric per channel), ``input_scale`` and
  ``input_offset`` fp32 [1] (per-tensor, asymmetric: ``x_q = round(x / input_scale +
  input_offset)``), ``deq_scale`` [N] = input_scale × weight_scale, fp32 when the model is
  bf16 and otherwise fp32 bits stored as int64, and ``quant_bias`` int32 [N] =
  ``round(bias / deq_scale - input_offset × rowsum(weight))``: ``y = (x_q @ W.T + quant_bias)
  × deq_scale``.
- MoE experts (``experts.{e}.{gate,up,down}_proj``): ``W8A8_DYNAMIC`` as above, per expert.

vLLM finds the description through :meth:`get_config_filenames` (locally, or with a hub
checkpoint's other ``*.json``). Fused layers (``qkv_proj``, ``gate_up_proj``) look up their
shards through the model's ``packed_modules_mapping``; shards must agree. ``FLOAT`` layers run
vLLM's unquantised methods. Any other type fails at start-up naming the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from ascend_patch.npu.quantization import checkpoint
from ascend_patch.npu.quantization.checkpoint import UnsupportedQuantizationError
from ascend_patch.npu.quantization.formats import DESCRIPTION_FILE, NAME

LINEAR_TYPES = ("W8A8", "W8A8_DYNAMIC")
MOE_TYPES = ("W8A8_DYNAMIC",)
_SUPPORTED = "W8A8 and W8A8_DYNAMIC linear layers, W8A8_DYNAMIC experts and FLOAT layers"


def _moe_layer_types() -> tuple[type, ...]:
    from vllm.model_executor.layers import fused_moe

    if hasattr(fused_moe, "RoutedExperts"):  # seam: vLLM 0.22+ (FusedMoE before)
        return (fused_moe.RoutedExperts,)
    return (fused_moe.FusedMoE,)


class AscendModelSlimConfig(QuantizationConfig):
    """msModelSlim AscendV1 checkpoints on the NPU (``--quantization ascend``)."""

    def __init__(self, description: dict[str, Any]) -> None:
        super().__init__()
        self.description = description

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the NPU platform reports no CUDA capability; nothing to compare

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [DESCRIPTION_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendModelSlimConfig:
        if not isinstance(config, dict) or not any(isinstance(v, str) and k.endswith(".weight")
                                                   for k, v in config.items()):
            raise checkpoint.QuantizedCheckpointError(
                f"{DESCRIPTION_FILE} describes no weights: not an msModelSlim AscendV1 description")
        return cls(config)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        # Layer classes imported here: the config is also registered where no model is built.
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        from ascend_patch.npu.quantization.linear import AscendW8A8LinearMethod

        if isinstance(layer, LinearBase):
            quant_type = self._layer_type(prefix, self._shards(prefix))
            if quant_type == "FLOAT":
                return UnquantizedLinearMethod()
            self._require(quant_type, LINEAR_TYPES, prefix)
            return AscendW8A8LinearMethod(prefix, static=quant_type == "W8A8")
        if isinstance(layer, _moe_layer_types()):
            experts = [f"{prefix}.{e}.{p}" for e in range(layer.global_num_experts)
                       for p in ("gate_proj", "up_proj", "down_proj")]
            quant_type = self._layer_type(prefix, experts)
            if quant_type == "FLOAT":
                return None  # vLLM builds its unquantised method (the NPU one, registered OOT)
            self._require(quant_type, MOE_TYPES, prefix)
            from ascend_patch.npu.quantization.moe import AscendW8A8MoEMethod

            return AscendW8A8MoEMethod(layer.moe_config, prefix, offsets=True)
        if isinstance(layer, VocabParallelEmbedding):
            quant_type = self.description.get(f"{prefix}.weight", "FLOAT")
            if quant_type != "FLOAT":
                self._require(quant_type, (), prefix)
        return None

    def _shards(self, prefix: str) -> list[str]:
        parent, _, proj = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(proj)
        if not shards:
            return [prefix]
        return [f"{parent}.{shard}" if parent else shard for shard in shards]

    def _layer_type(self, prefix: str, modules: list[str]) -> str:
        types = {}
        for module in modules:
            key = f"{module}.weight"
            if key not in self.description:
                raise checkpoint.QuantizedCheckpointError(
                    f"{checkpoint.where(prefix)}: {DESCRIPTION_FILE} does not describe {key}")
            types[module] = self.description[key]
        if len(set(types.values())) > 1:
            raise UnsupportedQuantizationError(
                f"{checkpoint.where(prefix)}: its parts are quantised differently ({types}); a "
                "fused layer runs one scheme")
        return next(iter(types.values()))

    @staticmethod
    def _require(quant_type: str, supported: tuple[str, ...], prefix: str) -> None:
        if quant_type not in supported:
            raise UnsupportedQuantizationError(
                f"{checkpoint.where(prefix)} is quantised as {quant_type} ({DESCRIPTION_FILE}); "
                f"ascend-patch runs {_SUPPORTED} on the NPU")
