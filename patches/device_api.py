"""The torch device API vLLM's GPU worker and V1 model runner call directly (torch.cuda streams
and events, the torch.accelerator memory API): each name replaced by the active device runtime's
stand-in (``ascend_patch.npu.device_api``)."""

from ascend_patch.overlay.declarations import Patch
from ascend_patch.patches._declare import cite

_TORCH_DEVICE_API = ("vLLM's GPU worker and V1 model runner call torch.cuda streams/events and the "
                     "torch.accelerator memory API directly (vllm/v1/worker/gpu_model_runner.py, "
                     "gpu_worker.py, vllm/utils/mem_utils.py)")


def _device_api(target: str, reason: str, modes: tuple[str, ...] = ("npu", "emulate"),
                pr: str | None = None) -> Patch:
    return Patch(
        target,
        reason=reason,
        replacement="ascend_patch.npu.device_api:stand_in",
        upstream=cite(_TORCH_DEVICE_API, pr),
        remove_when="vLLM reaches streams, events and memory through current_platform (or "
                    "torch.accelerator through the NPU's PrivateUse1 backend)",
        implementation="ascend_patch.npu.device:Runtime.device_api",
        modes=modes,
        rebind=False,  # torch's own modules keep their references
    )


_EMULATED = ("emulate",)
# torch.accelerator's unified memory API (torch 2.8).
_UNIFIED_MEMORY = ("empty_cache", "memory_stats", "memory_reserved", "memory_allocated",
                   "max_memory_allocated", "reset_peak_memory_stats")
DEVICE_API = [
    *(_device_api(f"torch.cuda:{name}", "streams/events on the NPU (in-order no-ops when emulated)")
      for name in ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream",
                   "synchronize")),
    _device_api("torch.accelerator:get_memory_info", "free/total device memory from the NPU (or the "
                "emulated HBM)", pr="pytorch/pytorch#156812"),
    *(_device_api(f"torch.accelerator:{name}", "the emulated NPU's device and memory books", _EMULATED,
                  pr="pytorch/pytorch#152932" if name in _UNIFIED_MEMORY else None)
      for name in ("synchronize", "empty_cache", "empty_host_cache", "current_device_index",
                   "set_device_index", "device_index", "current_stream", "set_stream",
                   "memory_stats", "memory_reserved", "memory_allocated", "max_memory_allocated",
                   "reset_peak_memory_stats")),
    _device_api("torch:Event", "torch.Event on the emulated NPU's single in-order stream", _EMULATED),
]
