"""``EmulatedNPUPlatform``: the NPU platform on CPU tensors (``ASCEND_PATCH=emulate``).

One code path with :class:`ascend_patch.npu.platform.NPUPlatform`: every name vLLM turns into a
``torch.device`` (``device_type``, and ``device_name`` for ``GroupCoordinator``'s
``f"{device_name}:{index}"``) names the CPU, gloo replaces HCCL, the kernels are the
contract-checking references, and the device memory is the configured emulated HBM.
"""

from __future__ import annotations

from ascend_patch.npu.platform import NPUPlatform


class EmulatedNPUPlatform(NPUPlatform):
    """The NPU platform on CPU tensors (``ASCEND_PATCH=emulate``)."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    emulated = True
    kernel_backend = "reference"

    @classmethod
    def mem_get_info(cls, device=None) -> tuple[int, int]:
        # vLLM before 0.25 reads free/total device memory from the platform, which
        # would otherwise look for it in torch.cpu.
        return cls.runtime().mem_get_info()
