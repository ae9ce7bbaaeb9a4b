"""The V1 runner's KV caches on vLLM 0.20-0.28, where the runner shapes each layer's buffer itself
(``_reshape_kv_cache_tensors``): what they take is charged to the emulated HBM.

A module of its own, importing nothing of vLLM's runner: the wrapper is resolved while
``vllm.v1.worker.gpu_model_runner`` is still being imported, so it cannot live beside
``NPUModelRunner``.
"""

from __future__ import annotations

from ascend_patch.npu.runner import kv_allocation


def reshape_kv_cache_tensors(wrapped, instance, args, kwargs):
    """Wrapper of ``GPUModelRunner._reshape_kv_cache_tensors`` (vLLM 0.20–0.28).

    Charges here rather than at allocation: the raw buffers' tensors die once
    vLLM has viewed them, the layer caches returned here live with the engine.
    """
    caches = wrapped(*args, **kwargs)
    kv_allocation.charge(caches)
    return caches
