"""``NPUPlatform``: what ``vllm.platforms.current_platform`` becomes.

Most of the overlay's work goes through vLLM's own platform hooks, which have
been stable from 0.20 to 0.33: the attention backend, the worker class, the
device communicator and the distributed backend are all chosen here.

There are two classes with one code path. :class:`NPUPlatform` drives real
Ascend devices through torch_npu. :class:`EmulatedNPUPlatform` is the same
platform on CPU tensors: every name vLLM turns into a ``torch.device``
(``device_type``, and ``device_name`` for ``GroupCoordinator``'s
``f"{device_name}:{index}"``) names the CPU, gloo replaces HCCL, and the device
memory is the configured emulated HBM.
"""

from __future__ import annotations

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from ascend_patch import device


class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "npu"
    device_type = "npu"
    dispatch_key = "PrivateUse1"
    ray_device_key = "NPU"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"
    ray_noset_device_env_vars = ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"]
    dist_backend = "hccl"
    # torch.compile is not part of the supported path; eager for the simple fns.
    simple_compile_backend = "eager"
    emulated = False

    @classmethod
    def runtime(cls) -> device.Runtime:
        return device.runtime(emulated=cls.emulated)

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's CUDA/CPU extensions do not exist on Ascend; every op goes
        # through ascend_patch.kernels instead. Importing them only logs noise.
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return cls.runtime().device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return cls.runtime().device_uuid(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return cls.runtime().mem_get_info(device_id)[1]

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        cls.runtime().set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        cls.runtime().manual_seed_all(seed)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(cls.runtime().memory_allocated(device))

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return cls.runtime().pin_memory_available()

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{cls.__name__} supports float16, bfloat16 and float32, not {dtype}")

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return cls.runtime().num_compute_units(device_id)

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False


class EmulatedNPUPlatform(NPUPlatform):
    """The NPU platform on CPU tensors (``ASCEND_PATCH=emulate``)."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    emulated = True

