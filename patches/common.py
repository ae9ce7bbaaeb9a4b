"""Declarations shared by every patch set (vLLM 0.20–0.33).

The platform hooks below have not changed signature from 0.20 to 0.33
(research/drift.md §2), so one platform class serves every set. They are
*contracts*: ``NPUPlatform`` overrides them, nothing is patched, and a
signature change in a new vLLM release makes verification fail loudly
instead of leaving an override that vLLM no longer calls the same way.
"""

from ascend_patch import loader
from ascend_patch.patching import Patch

ALL = ">=0.20,<0.34"


def _platform_hook(name: str, signature: str, reason: str) -> Patch:
    return Patch(
        f"vllm.platforms.interface:Platform.{name}",
        reason=reason,
        vllm=ALL,
        signature=(signature,),
    )


DEVICE_SELECTION = [
    Patch(
        "vllm.platforms:resolve_current_platform_cls_qualname",
        reason="device selection: current_platform resolves to NPUPlatform, not CUDA/CPU",
        vllm=ALL,
        signature=("()",),
        wrapper=loader.select_platform,
    ),
    _platform_hook("get_device_name", "(cls, device_id=...)", "device name from the NPU runtime"),
    _platform_hook("get_device_uuid", "(cls, device_id=...)", "device identity from the NPU runtime"),
    _platform_hook("get_device_total_memory", "(cls, device_id=...)", "HBM size (emulated HBM when emulating)"),
    _platform_hook("set_device", "(cls, device)", "select the NPU for this worker"),
    _platform_hook("manual_seed_all", "(cls, seed)", "seed the NPU generators"),
    _platform_hook("get_current_memory_usage", "(cls, device=...)", "memory in use on the NPU"),
    _platform_hook("is_pin_memory_available", "(cls)", "pinned host memory needs the NPU runtime"),
    _platform_hook("check_if_supports_dtype", "(cls, dtype)", "fp16/bf16/fp32 only"),
    _platform_hook("inference_mode", "(cls)", "torch.inference_mode on NPU"),
    _platform_hook("num_compute_units", "(cls, device_id=...)", "AI core count"),
    _platform_hook("support_hybrid_kv_cache", "(cls)", "hybrid (Mamba) KV cache is not supported"),
    _platform_hook("import_kernels", "(cls)", "vLLM's CUDA/CPU extensions do not exist on Ascend"),
]
