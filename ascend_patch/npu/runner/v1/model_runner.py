"""``NPUModelRunner``: vLLM's V1 model runner on the NPU device.

It overrides only what is device-specific: what every generation's NPU runner adds
(:class:`~ascend_patch.npu.runner.device_runner.NPURunnerMixin`: path reports, the emulated
HBM's books); new KV blocks are
zeroed in the Ascend layouts (block pages, MLA latent/rope planes) instead of by vLLM's
Triton kernel; FULL graphs are captured and replayed by :class:`NPUGraphWrapper` where
vLLM builds its ``CUDAGraphWrapper``.
"""

from __future__ import annotations

from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper
from ascend_patch.npu.runner.device_runner import NPURunnerMixin
from ascend_patch.npu.runner.kv_zeroing import AscendKVBlockZeroer


class NPUModelRunner(NPURunnerMixin, GPUModelRunner):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if type(self.model) is CUDAGraphWrapper:
            # vLLM wraps the model for FULL graphs in CUDAGraphWrapper itself, whose capture is
            # torch.cuda.graph: the NPU's wrapper takes its place, with the same runnable and mode.
            wrapper = self.model
            self.model = NPUGraphWrapper(wrapper.runnable, self.vllm_config, wrapper.runtime_mode,
                                         wrapper.cudagraph_options)

    def _init_kv_zero_meta(self) -> None:
        # vLLM's KVBlockZeroer is a Triton kernel over [blocks, ...] caches: the Ascend layouts'
        # zeroer instead (one index_fill per cache plane).
        self._ascend_kv_zeroer = AscendKVBlockZeroer(self.compilation_config.static_forward_context,
                                                     self.kv_cache_config, self.device)

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        zeroer = getattr(self, "_ascend_kv_zeroer", None)  # not a seam: ours, set with the caches
        if zeroer is not None:
            zeroer.zero_block_ids(block_ids)

