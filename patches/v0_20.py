"""Patch set v0_20: the per-backend KV-shape era (the releases: ``compat_matrix.yaml``).

Until 0.29 the V1 model runner allocates one int8 buffer per layer
(``_allocate_kv_cache_tensors``) and views it in the shape the attention
backend names (``_reshape_kv_cache_tensors`` calling ``get_kv_cache_shape``).
``AscendAttentionBackend`` names ``[blocks, 2, block_size, kv_heads,
head_size]``, block pages whose K and V halves the NPU kernels read as two contiguous
caches (``attention.kv_layout.kernel_caches``), so unlike
v0_29 nothing re-views vLLM's allocation: the KV glue only charges the layer
caches to the emulated HBM. Everything else comes from the area modules, the
same platform, engine contracts, runner glue, torch device API, settings and
seams v0_29 uses.

Other seams that move inside this range are absorbed by accepted signature
variants rather than probes: ``TopKTopPSampler(use_fp64_gumbel=)`` (0.23) and
``kernel_warmup(process_local_only=)`` (0.27). Before 0.25 ``MemorySnapshot``
asks the platform for free memory (``EmulatedNPUPlatform.mem_get_info``).
"""

from ascend_patch.overlay.declarations import Contract, Patch, Seam
from ascend_patch.patches import (attention, device_api, engine, graphs, lora, moe, platform, quant,
                                  runner_v1, spec_decode)

RUNNER = "v1"
"""The runner generation these declarations are written for (``ascend_patch.npu.runner``)."""

_KV_SHAPE = ("vllm/v1/attention/backend.py (<0.29): the runner views each layer's KV bytes in "
             "the shape AttentionBackend.get_kv_cache_shape names")

PATCHES = [
    *platform.DEVICE_SELECTION,
    *engine.ENGINE_CONTRACTS,
    *runner_v1.RUNNER_CONTRACTS,
    *attention.ATTENTION_CONTRACTS,
    *runner_v1.RUNNER_GLUE,
    *engine.KERNEL_WARMUP,
    *moe.MOE_CONTRACTS,
    *quant.QUANT_CONTRACTS,
    *attention.MLA_CONTRACTS,
    *graphs.GRAPH_MODE,
    *lora.LORA_CONTRACTS,
    *lora.MOE_LORA,
    *runner_v1.KERNEL_GLOBALS,
    *spec_decode.DRAFT_MODEL,
    attention.hybrid_promotion("kv_cache_utils", pr="vllm-project/vllm#14097"),
    Contract(
        "vllm.v1.attention.backend:AttentionBackend.get_kv_cache_shape",
        reason="AscendAttentionBackend names the Ascend [blocks, 2, block, kv_heads, head] KV layout "
               "(AscendMLABackend: [blocks, block, latent + rope], read as two planes)",
        signature=("(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=...)",),
        upstream=_KV_SHAPE,
        remove_when="this set is retired (0.29 removed the hook)",
        implementation="ascend_patch.npu.attention.backend:AscendAttentionBackend",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._reshape_kv_cache_tensors",
        reason="charge the layer KV caches (shaped by get_kv_cache_shape) to the emulated HBM",
        signature=("(self, kv_cache_raw_tensors, kernel_block_sizes)",),
        wrapper="ascend_patch.npu.runner.v1.kv_cache:reshape_kv_cache_tensors",
        upstream="NPU-only: the emulated HBM's books; " + _KV_SHAPE,
        remove_when="this set is retired",
    ),
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
        reason="NPUWorker builds NPUModelRunner(vllm_config, device) itself",
        signature=("(self, vllm_config, device)",),
        upstream="vllm/v1/worker/gpu_worker.py (<0.32) builds the runner inline in init_device",
        remove_when="this set is retired (0.32 added Worker._init_workspace_and_model_runner)",
        implementation="ascend_patch.npu.runner.worker:NPUWorker",
    ),
    Contract(
        "vllm.v1.worker.workspace:init_workspace_manager",
        reason="NPUWorker.init_device sets up vLLM's workspace before the model runner",
        signature=(
            "(device, num_ubatches=...)",
            "(device, num_ubatches=..., num_lanes=...)",  # 0.28
        ),
        upstream="vllm/v1/worker/gpu_worker.py (<0.32) sets the workspace up inline in init_device",
        remove_when="this set is retired",
        implementation="ascend_patch.npu.runner.worker:NPUWorker",
    ),
]

MANIFEST = [
    *PATCHES,
    *device_api.DEVICE_API,
    *engine.SETTINGS,
    *runner_v1.SETTINGS,
    *platform.SEAMS,
    *engine.SEAMS,
    *runner_v1.SEAMS,
    *quant.SEAMS,
    Seam("vllm.distributed.kv_transfer.kv_connector.v1.example_connector:TritonAttentionMetadata",
         "refuse ExampleConnector where it reads every cache but Triton's as [2, blocks, ...]; from "
         "0.23 it indexes blocks first, as the Ascend cache is laid out",
         until="0.23", implementation="ascend_patch.npu.distributed.kv_transfer:check_config"),
    Seam("vllm.v1.kv_offload.config:OffloadingConfig",
         "the NPU offloading spec implements the offloading interface specs built from an "
         "OffloadingConfig have (workers that store and load host chunks); KV offload is refused "
         "before, where specs hand out transfer handlers", since="0.26",
         implementation="ascend_patch.npu.distributed.kv_transfer:check_config"),
]
"""Everything the overlay changes or relies on for these releases: the loader verifies all of
it before applying any, and ``doctor``, ``probe`` and ``docs/patches.md`` list it."""
