"""Quantised checkpoints on the NPU: W8A8 int8 in msModelSlim's AscendV1 format and in
compressed-tensors.

How each reaches vLLM (every seam exists, with these signatures, in 0.20–0.33; the manifest
declares them):

- ``ascend`` (:mod:`.modelslim`) is registered with ``register_quantization_config`` in every
  process that may parse a config or build a model: from ``Platform.pre_register_and_update``
  (vLLM calls it before the engine config is built and before CLI arguments are parsed), from
  ``check_and_update_config`` and from the worker. ``--quantization ascend`` selects it; a
  local checkpoint with ``quant_model_description.json`` and no ``--quantization`` gets it
  automatically in ``check_and_update_config`` (vLLM's own detection reads only an HF
  ``quantization_config``, which msModelSlim removes from config.json), as vllm-ascend does.
- compressed-tensors stays vLLM's config and scheme classes; its int8 layers get the NPU kernel
  through ``register_linear_kernel(..., PlatformEnum.OOT, "int8")`` (:mod:`.compressed_tensors`)
  and its int8 experts the NPU MoE method (:mod:`.moe`).

The W8A8 math both share is :mod:`.w8a8`; the load-time checks, :mod:`.checkpoint`.

Docs: docs/design.md, "What the overlay does on the NPU".
"""

from __future__ import annotations

import logging
from pathlib import Path

from ascend_patch.npu.quantization.formats import DESCRIPTION_FILE, NAME

logger = logging.getLogger("vllm.ascend_patch")

# What each method runs on the NPU (README: "Quantised checkpoints"); anything else fails at
# load naming the layer.
SUPPORTED = {
    NAME: "msModelSlim AscendV1 (quant_model_description.json): W8A8 (static) and W8A8_DYNAMIC "
          "linear layers, FLOAT layers, mixed per layer; W8A8_DYNAMIC experts",
    "compressed-tensors": "W8A8 int8: channel or tensor weights with static per-tensor "
                          "(symmetric or zero-point) or dynamic per-token symmetric activations; "
                          "int8 experts (channel weights, dynamic per-token activations)",
}

_config_registered = False
_kernels_registered = False


def register_config() -> None:
    """Register the ``ascend`` method with vLLM's quantisation registry, once per process."""
    global _config_registered
    if _config_registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from ascend_patch.npu.quantization.modelslim import AscendModelSlimConfig

    register_quantization_config(NAME)(AscendModelSlimConfig)
    _config_registered = True


def register_kernels() -> None:
    """Give vLLM's int8 ScaledMM selection the NPU kernel, once per process (before models are
    built; it imports vLLM's kernel modules, so only where a model is)."""
    global _kernels_registered
    if _kernels_registered:
        return
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.platforms.interface import PlatformEnum

    from ascend_patch.npu.quantization.compressed_tensors import AscendInt8ScaledMMLinearKernel

    register_linear_kernel(AscendInt8ScaledMMLinearKernel, PlatformEnum.OOT, "int8")
    _kernels_registered = True


def registered() -> dict[str, object]:
    """What vLLM's registries hold for the NPU in this process (after :func:`register_config`
    and :func:`register_kernels`): is ``ascend`` a quantization method, which int8 kernels the
    out-of-tree platform gets."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.platforms.interface import PlatformEnum

    kernels = linear._POSSIBLE_INT8_KERNELS.get(PlatformEnum.OOT, [])
    return {"methods": [m for m in (NAME, "compressed-tensors") if m in QUANTIZATION_METHODS],
            "int8_kernels": [kernel.__name__ for kernel in kernels]}


def detect(vllm_config) -> None:
    """``--quantization ascend`` for a local checkpoint that has the AscendV1 description and no
    quantisation set; the engine's quantisation config is rebuilt for it."""
    model_config = vllm_config.model_config
    if model_config is None or model_config.quantization is not None:
        return
    if not (Path(model_config.model) / DESCRIPTION_FILE).is_file():
        return
    from vllm.config import VllmConfig

    model_config.quantization = NAME
    vllm_config.quant_config = VllmConfig.get_quantization_config(model_config,
                                                                  vllm_config.load_config)
    logger.info("ascend-patch: %s has %s: loading it with --quantization %s", model_config.model,
                DESCRIPTION_FILE, NAME)
