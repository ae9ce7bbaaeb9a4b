"""Device selection and the platform hooks: how ``current_platform`` becomes ``NPUPlatform``.

The platform hooks have not changed signature from 0.20 to 0.33, so one platform class serves
every set. They are *contracts*: ``NPUPlatform`` overrides them, nothing is patched, and a
signature change in a new vLLM release makes verification fail loudly instead of leaving an
override that vLLM no longer calls the same way.

Each declaration says what it touches, why, where our side is implemented, the upstream code
that makes it necessary and when it can go. The releases each set serves live in
``compat_matrix.yaml`` only; a declaration carries ``vllm=`` just when it applies to part of its
set's releases.
"""

from ascend_patch.overlay.declarations import Patch, Seam
from ascend_patch.patches._declare import PLATFORM, contract, platform_hook

DEVICE_SELECTION = [
    Patch(
        "vllm.platforms:resolve_current_platform_cls_qualname",
        reason="device selection: current_platform resolves to NPUPlatform, not CUDA/CPU",
        signature=("()",),
        wrapper="ascend_patch.npu.platform:select_platform",
        upstream="vllm/platforms/__init__.py picks the platform from `vllm.platform_plugins` "
                 "entry points; the overlay is not a platform plugin, so the version check and "
                 "all-or-nothing verification run before the platform is chosen; vllm-project/vllm#11602",
        remove_when="never while ascend-patch is an overlay (a platform plugin could not refuse "
                    "a vLLM it has not verified)",
    ),
    platform_hook("get_device_name", "(cls, device_id=...)", "device name from the NPU runtime"),
    platform_hook("get_device_uuid", "(cls, device_id=...)", "device identity from the NPU runtime"),
    platform_hook("get_device_total_memory", "(cls, device_id=...)", "HBM size (emulated HBM when emulating)"),
    platform_hook("set_device", "(cls, device)", "select the NPU for this worker"),
    platform_hook("manual_seed_all", "(cls, seed)", "seed the NPU generators",
                  pr="vllm-project/vllm#38468"),
    platform_hook("get_current_memory_usage", "(cls, device=...)", "memory in use on the NPU"),
    platform_hook("is_pin_memory_available", "(cls)", "pinned host memory needs the NPU runtime"),
    platform_hook("check_if_supports_dtype", "(cls, dtype)", "fp16/bf16/fp32 only"),
    platform_hook("inference_mode", "(cls)", "torch.inference_mode on NPU"),
    platform_hook("num_compute_units", "(cls, device_id=...)", "AI core count",
                  pr="vllm-project/vllm#35042"),
    platform_hook("support_hybrid_kv_cache", "(cls)",
                  "True: vLLM's hybrid KV-cache manager gives a model mixing windowed and full "
                  "layers a KV-cache group per layer of its pattern, and the windowed groups free the blocks "
                  "before their windows (the attention hides those keys)"),
    platform_hook("import_kernels", "(cls)", "vLLM's CUDA/CPU extensions do not exist on Ascend"),
]

LOG_WARNINGS = contract(
    "vllm.platforms.interface:Platform.log_warnings", "(cls)",
    "log ascend-patch's activation line once vLLM has configured logging in the process",
    implementation=PLATFORM, upstream="vllm/logger.py (0.33+): configure_logging calls "
    "current_platform.log_warnings() right after it configures logging in each process",
    vllm=">=0.33",
)

# Names that appear inside the 0.20-0.33 range; the NPU wing probes for them at run time.
SEAMS = [
    Seam("vllm.config.kernel:IrOpPriorityConfig.fused_add_rms_norm",
         "put the ascend fused_add_rms_norm first", since="0.21",
         implementation="ascend_patch.npu.platform:NPUPlatform.get_default_ir_op_priority",
         pr="vllm-project/vllm#36823"),
]
