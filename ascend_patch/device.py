"""Device runtime behind the platform: a real NPU, or the emulated one.

The platform, worker and allocator ask this module about the device (name,
memory, seeding, streams) and never branch on the mode themselves. The real
runtime forwards to :mod:`ascend_patch.kernels.npu`, the only module that
talks to torch_npu; the emulated runtime answers for a CPU-backed NPU whose
memory is the configured emulated HBM.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Protocol

import torch

from ascend_patch import env


class Runtime(Protocol):
    def device_name(self, index: int) -> str: ...
    def device_uuid(self, index: int) -> str: ...
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]: ...
    def memory_allocated(self, device: object = None) -> int: ...
    def set_device(self, device: torch.device) -> None: ...
    def manual_seed_all(self, seed: int) -> None: ...
    def pin_memory_available(self) -> bool: ...
    def num_compute_units(self, index: int) -> int: ...


class EmulatedRuntime:
    """A CPU-backed NPU with ``ASCEND_PATCH_EMULATED_HBM`` bytes of device memory.

    CPU tensors are not device memory, so the emulated device keeps its own
    books: whoever places something "on the device" (weights, KV cache)
    charges it with :meth:`charge`, and the free memory vLLM's profiler sees
    is HBM minus those charges.
    """

    def __init__(self, hbm_bytes: int):
        self.hbm_bytes = hbm_bytes
        self._charged: dict[str, int] = {}
        self._lock = threading.Lock()

    def charge(self, owner: str, nbytes: int) -> None:
        with self._lock:
            in_use = sum(v for k, v in self._charged.items() if k != owner)
            if in_use + nbytes > self.hbm_bytes:
                raise torch.OutOfMemoryError(
                    f"emulated NPU out of memory: {owner} needs {nbytes / 2**30:.2f} GiB, "
                    f"{(self.hbm_bytes - in_use) / 2**30:.2f} GiB of "
                    f"{self.hbm_bytes / 2**30:.2f} GiB free "
                    "(raise ASCEND_PATCH_EMULATED_HBM)"
                )
            self._charged[owner] = nbytes

    def release(self, owner: str) -> None:
        with self._lock:
            self._charged.pop(owner, None)

    def memory_allocated(self, device: object = None) -> int:
        with self._lock:
            return sum(self._charged.values())

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return self.hbm_bytes - self.memory_allocated(), self.hbm_bytes

    def device_name(self, index: int) -> str:
        return f"Ascend NPU (emulated on CPU, {self.hbm_bytes / 2**30:.1f} GiB HBM)"

    def device_uuid(self, index: int) -> str:
        return f"emulated-npu-{index}"

    def set_device(self, device: torch.device) -> None:
        return None  # one CPU; nothing to select

    def manual_seed_all(self, seed: int) -> None:
        return None  # torch.manual_seed, called just before, seeds the CPU

    def pin_memory_available(self) -> bool:
        return False  # pinning needs an accelerator runtime

    def num_compute_units(self, index: int) -> int:
        return os.cpu_count() or 1


class NpuRuntime:
    """Real Ascend devices, through :mod:`ascend_patch.kernels.npu`."""

    def __init__(self) -> None:
        from ascend_patch.kernels import npu

        self._npu = npu

    def device_name(self, index: int) -> str:
        return self._npu.device_name(index)

    def device_uuid(self, index: int) -> str:
        return self._npu.device_uuid(index)

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return self._npu.mem_get_info(index)

    def memory_allocated(self, device: object = None) -> int:
        return self._npu.max_memory_allocated(device)

    def set_device(self, device: torch.device) -> None:
        self._npu.set_device(device)

    def manual_seed_all(self, seed: int) -> None:
        self._npu.manual_seed_all(seed)

    def pin_memory_available(self) -> bool:
        return True

    def num_compute_units(self, index: int) -> int:
        return self._npu.num_compute_units(index)


@functools.cache
def runtime(emulated: bool) -> Runtime:
    return EmulatedRuntime(env.emulated_hbm_bytes()) if emulated else NpuRuntime()
