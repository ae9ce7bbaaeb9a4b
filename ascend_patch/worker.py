"""``NPUWorker`` and ``NPUModelRunner``: vLLM's own GPU worker and V1 model runner on
the NPU device.

Both subclass vLLM's classes and override only what is device-specific:

- ``init_device``: upstream hard-codes ``cuda``. Ours selects the NPU (or the CPU
  behind the emulated NPU), initialises the distributed environment with the
  platform's backend, seeds, takes vLLM's memory baseline, then builds the model
  runner through vLLM's own ``_init_workspace_and_model_runner`` (0.32+) or the
  same two steps on older releases;
- ``_make_model_runner``: always the V1 runner (Model Runner V2 is unsupported);
- the model runner charges loaded weights to the emulated HBM and measures the
  profiling pass's activations, so vLLM's unmodified ``determine_available_memory``
  sizes the KV cache from real numbers.

Everything else — scheduling glue, input preparation, sampling, KV-cache
binding, memory profiling — is vLLM's code.
"""

from __future__ import annotations

import contextlib
import gc

import torch
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from ascend_patch import custom_ops, loader


class NPUModelRunner(GPUModelRunner):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        runtime = current_platform.runtime()
        if current_platform.emulated:
            # CPU tensors are not device memory: the weights are what loading
            # placed on the emulated NPU, so charge exactly those bytes.
            model = self.get_model()
            tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                       for t in (*model.parameters(), *model.buffers())}
            runtime.charge("weights", sum(tensors.values()), model)
            self.model_memory_usage = sum(tensors.values())

    def profile_run(self, *args, **kwargs):
        with current_platform.runtime().track_activations():
            return super().profile_run(*args, **kwargs)

    def _init_kv_zero_meta(self) -> None:
        # vLLM's KVBlockZeroer is a Triton kernel over [blocks, ...] caches; the
        # Ascend layout is [2, blocks, ...], zeroed with one index_fill per layer.
        context = self.compilation_config.static_forward_context
        caches = {}
        for group in self.kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                kv = getattr(context.get(name), "kv_cache", None)
                if isinstance(kv, torch.Tensor):
                    caches[kv.data_ptr()] = kv
        self._ascend_kv_caches = list(caches.values())

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids or not getattr(self, "_ascend_kv_caches", None):
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for kv in self._ascend_kv_caches:
            ratio = kv.shape[1] // self.kv_cache_config.num_blocks  # kernel blocks per block
            kernel_ids = (ids[:, None] * ratio + torch.arange(ratio, device=self.device)).flatten()
            kv.index_fill_(1, kernel_ids, 0)


class NPUWorker(Worker):
    def __init__(self, *args, **kwargs) -> None:
        loader.require_active_in_this_process()
        custom_ops.register()
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        if current_platform.emulated:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device(f"npu:{self.local_rank}")
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
        if hasattr(Worker, "_init_workspace_and_model_runner"):  # vLLM 0.32+
            self._init_workspace_and_model_runner()
        else:
            from vllm.v1.worker import gpu_worker
            from vllm.v1.worker.workspace import init_workspace_manager

            num_ubatches = 2 if self.parallel_config.enable_dbo else 1
            if hasattr(gpu_worker, "_num_workspace_lanes"):  # vLLM 0.28+
                lanes = gpu_worker._num_workspace_lanes(self.vllm_config, False)
                init_workspace_manager(self.device, num_ubatches, lanes)
            else:
                init_workspace_manager(self.device, num_ubatches)
            self.model_runner = self._make_model_runner()

    def _make_model_runner(self) -> NPUModelRunner:
        return NPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        # vLLM's CuMem pool (sleep mode) is CUDA-only.
        return contextlib.nullcontext()

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("sleep mode is not supported on Ascend by ascend-patch")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError("sleep mode is not supported on Ascend by ascend-patch")

