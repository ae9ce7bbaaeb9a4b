"""LoRA adapters on the NPU path: the punica wrapper vLLM's LoRA layers call (:mod:`.punica`),
the MoE experts' LoRA (:mod:`.moe`), and which LoRA configurations are served (:func:`check_config`).

Docs: docs/design.md, "What the overlay does on the NPU".
"""

from __future__ import annotations

from ascend_patch import release


def moe_lora_release() -> bool:
    """Whether this vLLM serves LoRA on MoE layers here: the active patch set installs the wrapper
    of FusedMoEWithLoRA (ascend_patch.npu.lora.moe) on this release (patches/lora.py, MOE_LORA)."""
    return "ascend_patch.npu.lora.moe:modular_for_lora" in release.patched


def check_config(vllm_config) -> None:
    """Refuse, in one line, a LoRA configuration the NPU path does not serve."""
    model, lora = vllm_config.model_config, vllm_config.lora_config
    if lora is None or model is None or not model.is_moe:
        return
    unsupported = {
        # vLLM's FusedMoEWithLoRA wants a modular-kernel MoE method whose experts take its
        # LoRA context: the NPU experts do on 0.28+ (ascend_patch.npu.lora.moe), unquantized.
        "LoRA on a mixture-of-experts model (vLLM 0.20-0.27, or quantized)":
        not moe_lora_release() or model.quantization is not None,
        # vLLM's fully sharded MoE LoRA gathers the rank-split shrink inside its Triton
        # path; the NPU experts' plain path does not.
        "fully sharded LoRA on a mixture-of-experts model with tensor parallelism":
        lora.fully_sharded_loras and vllm_config.parallel_config.tensor_parallel_size > 1,
    }
    for feature, requested in unsupported.items():
        if requested:
            raise NotImplementedError(f"{feature} is not supported by ascend-patch yet")
