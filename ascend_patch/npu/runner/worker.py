"""``NPUWorker``: vLLM's own GPU worker on the NPU device, shared by both runner generations.

It overrides only what is device-specific:

- ``init_device``: upstream hard-codes ``cuda``. Ours selects the NPU (or the CPU
  behind the emulated NPU), initialises the distributed environment with the
  platform's backend, seeds, takes vLLM's memory baseline, then builds the model
  runner through vLLM's own ``_init_workspace_and_model_runner`` (0.32+) or the
  same two steps on older releases;
- ``_make_model_runner``: the NPU runner of the generation the active patch set declares
  (:func:`ascend_patch.npu.runner.model_runner_cls`), imported on first use;
- sleep mode: offload-and-free (:mod:`ascend_patch.npu.runner.sleep_mode`) in place of vLLM's
  CuMem pool, which is CUDA-only and skipped.

Everything else — scheduling glue, input preparation, sampling, KV-cache
binding, memory profiling — is vLLM's code.

Docs: docs/contributing.md, "Repository layout"; docs/distributed.md, "Sleep mode".
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from ascend_patch import env
from ascend_patch.npu import ops, quantization
from ascend_patch.npu import runner
from ascend_patch.npu.platform import NPUPlatform
from ascend_patch.npu.runner.sleep_mode import OffloadAndFree

logger = logging.getLogger("vllm.ascend_patch")


def require_npu_platform() -> None:
    """Fail loudly in a process vLLM started for the NPU platform when the overlay is not
    active in it (wrong environment, ``ASCEND_PATCH`` differs, no ``.pth``): running on
    stock vLLM there would give errors far from the cause, or wrong output."""
    if isinstance(current_platform, NPUPlatform):
        return
    raise RuntimeError(
        f"ascend-patch is not active in this vLLM process (pid {os.getpid()}): its platform is "
        f"{type(current_platform).__name__} and ASCEND_PATCH={env.raw('ASCEND_PATCH') or 'auto'}. "
        "Every process of an engine (EngineCore, workers, Ray actors) must run in an environment "
        "with ascend-patch installed and the same ASCEND_PATCH setting; `ascend-patch doctor` "
        "run there says why it is not"
    )


def device_index(parallel_config, local_rank: int) -> int:
    """The visible NPU ordinal of a worker. vLLM up to 0.23 narrows ``ASCEND_RT_VISIBLE_DEVICES``
    to each data-parallel rank's devices (the local rank is then the ordinal); 0.24+ leaves the
    variable alone and hands the rank its physical devices in ``assigned_physical_gpu_ids``, which
    only the CUDA worker applies: without this, every DP rank of a host would run on NPU 0."""
    assigned = getattr(parallel_config, "assigned_physical_gpu_ids", None)  # seam: vLLM 0.24+
    if assigned is None:
        return local_rank
    from vllm.platforms.interface import set_assigned_physical_gpu_ids

    set_assigned_physical_gpu_ids(assigned)
    return NPUPlatform.logical_device_id_to_visible_device_id(local_rank)


class NPUWorker(Worker):
    def __init__(self, *args, **kwargs) -> None:
        require_npu_platform()
        ops.register()
        quantization.register_config()
        quantization.register_kernels()
        super().__init__(*args, **kwargs)
        self._offload_and_free: OffloadAndFree | None = None

    def init_device(self) -> None:
        index = device_index(self.parallel_config, self.local_rank)
        self.device = current_platform.runtime().worker_device(index)
        current_platform.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        # The same baseline the CUDA path takes; determine_available_memory reads both.
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        if hasattr(Worker, "_init_workspace_and_model_runner"):  # seam: vLLM 0.32+
            self._init_workspace_and_model_runner()
        else:
            from vllm.v1.worker import gpu_worker
            from vllm.v1.worker.workspace import init_workspace_manager

            num_ubatches = 2 if self.parallel_config.enable_dbo else 1
            if hasattr(gpu_worker, "_num_workspace_lanes"):  # seam: vLLM 0.28+
                lanes = gpu_worker._num_workspace_lanes(self.vllm_config, False)
                init_workspace_manager(self.device, num_ubatches, lanes)
            else:
                init_workspace_manager(self.device, num_ubatches)
            self.model_runner = self._make_model_runner()

    def _make_model_runner(self):
        return runner.model_runner_cls()(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        # vLLM's CuMem pool (sleep mode) is CUDA-only.
        return contextlib.nullcontext()

    def sleep(self, level: int = 1) -> None:
        if self._offload_and_free is None:
            self._offload_and_free = OffloadAndFree(self.model_runner)
        free_before = current_platform.runtime().mem_get_info()[0]
        self._offload_and_free.sleep(level)
        free, total = current_platform.runtime().mem_get_info()
        logger.info("Sleep mode (level %d) freed %.3f GiB of NPU memory, %.3f GiB still in use",
                    level, (free - free_before) / 2**30, (total - free) / 2**30)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self._offload_and_free is not None:
            self._offload_and_free.wake_up(tags)

