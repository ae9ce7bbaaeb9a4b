"""``NPUModelRunner``: vLLM's V1 model runner on the NPU device.

It overrides only what is device-specific: once the model is loaded it logs which
attention layers run composed rather than fused and which MoE layers route with vLLM's
grouped top-k rather than the NPU gating op, and why; loaded weights are charged to the emulated
HBM and the profiling pass's activations are measured, so vLLM's unmodified
``determine_available_memory`` sizes the KV cache from real numbers; new KV blocks are
zeroed in the Ascend layouts (block pages, MLA latent/rope planes) instead of by vLLM's
Triton kernel; FULL graphs are captured and replayed by :class:`NPUGraphWrapper` where
vLLM builds its ``CUDAGraphWrapper``.
"""

from __future__ import annotations

import torch
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.platforms import current_platform
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ascend_patch.npu.attention.backend import report_attention_paths
from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper
from ascend_patch.npu.ops.fused_moe import report_routing
from ascend_patch.npu.runner import kv_allocation


class NPUModelRunner(GPUModelRunner):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        report_attention_paths(self.compilation_config.static_forward_context,
                               self.model_config.dtype, self.model_config.model)
        report_routing(self.get_model(), self.model_config.model)
        charged = current_platform.runtime().charge_weights(self.get_model())
        if charged is not None:  # the emulated HBM's figure replaces vLLM's host-side one
            self.model_memory_usage = charged
        if type(self.model) is CUDAGraphWrapper:
            # vLLM wraps the model for FULL graphs in CUDAGraphWrapper itself, whose capture is
            # torch.cuda.graph: the NPU's wrapper takes its place, with the same runnable and mode.
            wrapper = self.model
            self.model = NPUGraphWrapper(wrapper.runnable, self.vllm_config, wrapper.runtime_mode,
                                         wrapper.cudagraph_options)

    def profile_run(self, *args, **kwargs):
        with current_platform.runtime().track_activations():
            return super().profile_run(*args, **kwargs)

    def _init_kv_zero_meta(self) -> None:
        # vLLM's KVBlockZeroer is a Triton kernel over [blocks, ...] caches. Each Ascend
        # cache is zeroed with one index_fill per plane of [blocks, ...]: a standard layer's
        # whole cache ([blocks, 2, ...], K and V halves in each block), or the MLA latent and
        # rope planes.
        from ascend_patch.npu.attention.mla import AscendMLAImpl, latent_planes

        context = self.compilation_config.static_forward_context
        planes = {}
        for group in self.kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                layer = context.get(name)
                kv = getattr(layer, "kv_cache", None)  # not a seam: not every layer caches
                if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                    continue
                if isinstance(getattr(layer, "impl", None), AscendMLAImpl):  # not a seam: ours
                    layer_planes = latent_planes(kv, layer.impl.kv_lora_rank)
                else:
                    layer_planes = (kv,)
                planes.update((plane.data_ptr(), plane) for plane in layer_planes)
        self._ascend_kv_planes = list(planes.values())

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids or not getattr(self, "_ascend_kv_planes", None):  # not a seam: ours
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for plane in self._ascend_kv_planes:
            ratio = plane.shape[0] // self.kv_cache_config.num_blocks  # kernel blocks per block
            kernel_ids = (ids[:, None] * ratio + torch.arange(ratio, device=self.device)).flatten()
            plane.index_fill_(0, kernel_ids, 0)


def no_kernel_warmup(original):
    """Replacement of ``vllm.model_executor.warmup.kernel_warmup.kernel_warmup``."""

    def kernel_warmup(worker, *, process_local_only=False):
        return None  # no JIT-compiled CUDA/Triton kernels to tune on the NPU path

    return kernel_warmup


def reshape_kv_cache_tensors(wrapped, instance, args, kwargs):
    """Wrapper of ``GPUModelRunner._reshape_kv_cache_tensors`` (vLLM 0.20–0.28).

    Charges here rather than at allocation: the raw buffers' tensors die once
    vLLM has viewed them, the layer caches returned here live with the engine.
    """
    caches = wrapped(*args, **kwargs)
    kv_allocation.charge(caches)
    return caches
