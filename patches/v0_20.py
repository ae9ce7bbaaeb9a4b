"""Patch set for vLLM 0.20–0.28: the per-backend KV-shape era.

Until 0.29 the V1 model runner allocates one int8 buffer per layer
(``_allocate_kv_cache_tensors``) and views it in the shape the attention
backend names (``_reshape_kv_cache_tensors`` calling ``get_kv_cache_shape``).
``AscendAttentionBackend`` names ``[2, blocks, block_size, kv_heads,
head_size]``, the separate K and V planes the NPU kernels read, so unlike
v0_29 nothing re-views vLLM's allocation: the KV glue only charges the layer
caches to the emulated HBM. Everything else comes from :mod:`.common`, the
same platform, engine contracts and runner glue v0_29 uses.

The seams that move inside this range are feature-probed where they are used,
so one set serves every 0.20–0.28 release:

- 0.21: the ``fused_add_rms_norm`` IR op and its priority field
  (``custom_ops``, ``NPUPlatform.get_default_ir_op_priority``);
- 0.23: ``TopKTopPSampler(use_fp64_gumbel=)`` (forwarded by the wrapper);
- before 0.25: ``MemorySnapshot`` asks the platform for free memory
  (``EmulatedNPUPlatform.mem_get_info``);
- 0.26: ``BlockTable.slot_mapping_mode`` (``kv_cache.compute_slot_mapping``);
- 0.27: ``kernel_warmup(process_local_only=)`` (the replacement takes it);
- 0.28: workspace lanes (``NPUWorker.init_device``).
"""

from ascend_patch.patches import common
from ascend_patch.patching import Patch

RANGE = ">=0.20,<0.29"

PATCHES = [
    *common.DEVICE_SELECTION,
    *common.ENGINE_CONTRACTS,
    *common.RUNNER_GLUE,
    Patch(
        "vllm.v1.attention.backend:AttentionBackend.get_kv_cache_shape",
        reason="AscendAttentionBackend names the Ascend [2, blocks, block, kv_heads, head] KV layout",
        vllm=RANGE,
        signature=("(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=...)",),
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._reshape_kv_cache_tensors",
        reason="charge the layer KV caches (shaped by get_kv_cache_shape) to the emulated HBM",
        vllm=RANGE,
        signature=("(self, kv_cache_raw_tensors, kernel_block_sizes)",),
        wrapper="ascend_patch.kv_cache:reshape_kv_cache_tensors",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
        reason="NPUWorker builds NPUModelRunner(vllm_config, device) itself",
        vllm=RANGE,
        signature=("(self, vllm_config, device)",),
    ),
    Patch(
        "vllm.v1.worker.workspace:init_workspace_manager",
        reason="NPUWorker.init_device sets up vLLM's workspace before the model runner",
        vllm=RANGE,
        signature=(
            "(device, num_ubatches=...)",
            "(device, num_ubatches=..., num_lanes=...)",  # 0.28
        ),
    ),
]
