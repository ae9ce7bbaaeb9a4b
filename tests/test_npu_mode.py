"""The real-NPU mode's wiring, with a stand-in torch_npu (there is no NPU here).

A recording stand-in module answers as torch_npu would on a machine with one NPU.
This checks what can be checked without hardware: that ``auto``/``npu`` activate
when torch_npu sees a device, that the platform is the real ``NPUPlatform``, that the
kernel seam switches to torch_npu, and that vLLM's ``torch.cuda`` stream/event calls
are pointed at ``torch_npu.npu``. It proves nothing about the hardware itself.
"""

from __future__ import annotations

import pytest

from tests.helpers.process import clean_env, run_json

STAND_IN = """
import importlib.machinery, json, sys, types

class Recorder:
    def __init__(self, name):
        self.name = name
    def __call__(self, *args, **kwargs):
        return self.name

def recording_class(name):
    # A class, as torch_npu's are: vLLM 0.34 annotates module globals with `torch.cuda.Stream | None`.
    return type(name, (), {"__new__": lambda cls, *args, **kwargs: f"torch_npu.npu.{name}"})

npu = types.SimpleNamespace(
    is_available=lambda: True, device_count=lambda: 1,
    Stream=recording_class("Stream"), Event=recording_class("Event"),
    **{name: Recorder(f"torch_npu.npu.{name}") for name in (
        "current_stream", "default_stream", "stream", "set_stream", "synchronize", "mem_get_info")},
)
torch_npu = types.ModuleType("torch_npu")
torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
torch_npu.__version__ = "2.13.0"
torch_npu.npu = npu
sys.modules["torch_npu"] = torch_npu

import torch
from vllm.platforms import current_platform
from ascend_patch.npu import kernels
from ascend_patch.overlay import loader
print(json.dumps({
    "platform": type(current_platform).__name__,
    "mode": loader.current().mode,
    "mode_reason": loader.current().mode_reason,
    "kernels": kernels.active_backend(),
    "device_type": current_platform.device_type,
    "dist_backend": current_platform.dist_backend,
    "cuda_stream": torch.cuda.Stream(),
    "cuda_event": torch.cuda.Event(),
    "memory_info": torch.accelerator.get_memory_info(),
}))
"""


@pytest.mark.parametrize("mode", ["auto", "npu"])
def test_a_visible_npu_activates_the_real_platform(mode):
    result = run_json(STAND_IN, env=clean_env(ASCEND_PATCH=mode))
    assert result["platform"] == "NPUPlatform"
    assert result["mode"] == "npu"
    assert result["mode_reason"] == f"ASCEND_PATCH={mode} and torch_npu 2.13.0 sees 1 NPU(s)"
    assert result["kernels"] == "npu"
    assert (result["device_type"], result["dist_backend"]) == ("npu", "hccl")
    assert result["cuda_stream"] == "torch_npu.npu.Stream"
    assert result["cuda_event"] == "torch_npu.npu.Event"
    assert result["memory_info"] == "torch_npu.npu.mem_get_info"


MRV2_STAND_IN = STAND_IN.split("import torch\n", 1)[0] + """
import importlib
import vllm
import vllm.v1.worker.gpu_worker as gpu_worker
from vllm.platforms import current_platform
from vllm.triton_utils.dispatcher import KernelOverride
from vllm.utils import platform_utils
from vllm.v1.worker.gpu import buffer_utils
from ascend_patch.npu.runner.v2 import kernels

current_platform.register_triton_kernel_overrides()
launches = {}
for name in kernels.implementations():
    module, _, attr = name.rpartition(".")
    launches[name] = type(getattr(importlib.import_module(module), attr)).__name__
print(json.dumps({
    "pin_memory": platform_utils.is_pin_memory_available(),
    "uva_seen_by_mrv2": buffer_utils.is_uva_available(),
    "worker_gate": gpu_worker.HAS_TRITON,
    "launches": launches,
}))
"""


@pytest.mark.mrv2_only
def test_model_runner_v2_on_an_npu_takes_explicit_copies_and_no_triton_launch():
    """On a real NPU pinned memory is available, so stock vLLM would pick UvaBuffer (and raise
    asking torch for a device view of host memory); the emulator has no pinned memory and would
    take the fallback silently. This checks the NPU-mode decision itself: MRV2 sees no UVA, its
    worker's Triton gate is open, and every kernel the NPU runner implements launches through
    vLLM's override, not Triton."""
    result = run_json(MRV2_STAND_IN, env=clean_env(ASCEND_PATCH="npu"))
    assert result["pin_memory"] is True
    assert result["uva_seen_by_mrv2"] is False
    assert result["worker_gate"] is True
    assert result["launches"] and set(result["launches"].values()) == {"KernelOverride"}
