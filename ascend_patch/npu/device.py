"""Device runtime behind the platform: the :class:`Runtime` interface and the real NPU's.

The platform, worker, model runner and allocator ask the runtime about the device (which device,
name, memory, seeding, the weights' bytes) and never branch on the mode themselves: the real NPU
is :class:`NpuRuntime`, the emulated one :class:`ascend_patch.npu.emulation.runtime.EmulatedRuntime`.

vLLM's GPU worker and V1 model runner, which the overlay reuses, call
``torch.cuda.Stream/Event/current_stream`` and the ``torch.accelerator`` memory
API directly. :meth:`Runtime.device_api` gives the stand-ins the manifest's device-API
patches install: ``torch.npu``'s (through :mod:`ascend_patch.npu.kernels.npu`, the only module
that talks to torch_npu) on real hardware, the emulated NPU's otherwise.

Docs: docs/reference.md, "Modes".
"""

from __future__ import annotations

import contextlib
import functools
from typing import Protocol

import torch

from ascend_patch import env, release


class Runtime(Protocol):
    def device_name(self, index: int) -> str: ...
    def device_uuid(self, index: int) -> str: ...
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]: ...
    def memory_allocated(self, device: object = None) -> int: ...
    def set_device(self, device: torch.device) -> None: ...
    def manual_seed_all(self, seed: int) -> None: ...
    def pin_memory_available(self) -> bool: ...
    def num_compute_units(self, index: int) -> int: ...
    def charge(self, what: str, nbytes: int, lifetime: object) -> None: ...
    def charge_storages(self, what: str, storages: list[torch.UntypedStorage], lifetime: object) -> None: ...
    def track_activations(self) -> contextlib.AbstractContextManager: ...
    def device_api(self) -> dict[str, object]: ...
    def graphs(self): ...
    def worker_device(self, local_rank: int) -> torch.device: ...
    def charge_weights(self, model: torch.nn.Module) -> int | None: ...


class NpuRuntime:
    """Real Ascend devices, through :mod:`ascend_patch.npu.kernels.npu`.

    Not run on hardware by this project: it follows torch_npu's documented API.
    """

    def __init__(self) -> None:
        from ascend_patch.npu.kernels import npu

        self._npu = npu

    def device_name(self, index: int) -> str:
        return self._npu.device_name(index)

    def device_uuid(self, index: int) -> str:
        return self._npu.device_uuid(index)

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return self._npu.mem_get_info(index)

    def memory_allocated(self, device: object = None) -> int:
        # As vLLM's CUDA platform measures it: the peak since a reset made just now.
        return self._npu.current_memory_usage(device)

    def set_device(self, device: torch.device) -> None:
        self._npu.set_device(device)

    def manual_seed_all(self, seed: int) -> None:
        self._npu.manual_seed_all(seed)

    def pin_memory_available(self) -> bool:
        return True

    def num_compute_units(self, index: int) -> int:
        return self._npu.num_compute_units(index)

    def charge(self, what: str, nbytes: int, lifetime: object) -> None:
        return None  # the device's own allocator keeps these books

    def charge_storages(self, what: str, storages: list[torch.UntypedStorage], lifetime: object) -> None:
        return None  # the device's own allocator keeps these books

    def track_activations(self):
        return contextlib.nullcontext()  # torch.npu memory stats measure the real peak

    def device_api(self) -> dict[str, object]:
        """torch.npu's counterparts of the torch device API vLLM calls, by patch target."""
        return {**{f"torch.cuda:{name}": value for name, value in self._npu.cuda_api().items()},
                "torch.accelerator:get_memory_info": self._npu.mem_get_info}

    def worker_device(self, local_rank: int) -> torch.device:
        return torch.device(f"npu:{local_rank}")

    def charge_weights(self, model: torch.nn.Module) -> None:
        return None  # the device's allocator counted them; vLLM measured the load

    def graphs(self):
        """The graph API: torch_npu.npu (NPUGraph, graph, graph_pool_handle, ExternalEvent, the
        task-group calls, streams)."""
        return self._npu.graph_api()


@functools.cache
def runtime(emulated: bool) -> Runtime:
    if not emulated:
        return NpuRuntime()
    from ascend_patch.npu.emulation.runtime import EmulatedRuntime

    return EmulatedRuntime(env.emulated_hbm_bytes())


def active_runtime() -> Runtime:
    """The runtime of the mode the loader decided (usable before vLLM's platform exists)."""
    if release.mode is None:
        raise RuntimeError("ascend-patch is not active in this process: no device mode was decided")
    return runtime(emulated=release.mode == "emulate")


def current_runtime() -> Runtime:
    from vllm.platforms import current_platform

    return current_platform.runtime()
