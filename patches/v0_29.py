"""Patch set v0_29: the single-buffer KV-cache era (the releases: ``compat_matrix.yaml``).

0.29 replaced per-backend ``get_kv_cache_shape`` with
``vllm.v1.worker.utils.allocate_kv_cache``: one int8 backing buffer with strided
``[blocks, heads, tokens, K|V]`` views per layer. The NPU kernels read each block's K and
V as separate halves, so this set's own glue re-views each layer's bytes as ``[blocks, 2,
tokens, heads, head_size]``
(``runner.kv_allocation.allocate_kv_cache``); everything else is shared with v0_20 through
the area modules.
"""

from ascend_patch.overlay.declarations import Contract, Patch, Seam
from ascend_patch.patches import (attention, device_api, engine, graphs, lora, moe, platform, quant,
                                  recurrent, runner_v1, spec_decode)
from ascend_patch.patches._declare import cite

RUNNER = "v1"
"""The runner generation these declarations are written for (``ascend_patch.npu.runner``)."""

NEUTRAL = [
    *platform.DEVICE_SELECTION,
    *engine.ENGINE_CONTRACTS,
    *attention.ATTENTION_CONTRACTS,
    *engine.KERNEL_WARMUP,
    *moe.MOE_CONTRACTS,
    *quant.QUANT_CONTRACTS,
    *attention.MLA_CONTRACTS,
    Contract(
        "vllm.platforms.interface:Platform.get_mla_prefill_backend_cls",
        reason="the MLA prefill backend MLAAttention builds: one that constructs on Ascend (and "
               "is never run: AscendMLAImpl runs prefills)",
        vllm=">=0.32",
        signature=("(cls, mla_selector_config)",),
        upstream="vllm/platforms/interface.py (0.32+): the default returns FLASH_ATTN for a "
                 "platform without a device capability, whose constructor asserts "
                 "flash_attn_varlen_func imports; vllm-project/vllm#56959",
        remove_when="never: vLLM's own extension point; the contract only guards its signature",
        implementation="ascend_patch.npu.platform:NPUPlatform",
    ),
    platform.LOG_WARNINGS,
    *graphs.GRAPH_MODE,
    *lora.LORA_CONTRACTS,
    *lora.FULL_LINEAR,
    *lora.MOE_LORA,
    *engine.KERNEL_REGISTRY,
    *spec_decode.DRAFT_MODEL,
    *recurrent.RECURRENT,
    attention.hybrid_promotion("kv_cache_utils", vllm="<0.33", pr="vllm-project/vllm#14097"),
    attention.hybrid_promotion("kv_cache_planning", vllm=">=0.33"),
    Patch(
        "vllm.v1.worker.utils:allocate_kv_cache",
        reason="view each layer's KV bytes as [blocks, 2, tokens, heads, head_size] block pages, "
               "whose K and V halves the NPU kernels read",
        signature=("(kv_cache_config, device, layout, kernel_block_sizes=...)",
                   "(kv_cache_config, device, layout, kernel_block_sizes=..., allocate=...)"),  # 0.34
        wrapper="ascend_patch.npu.runner.kv_allocation:allocate_kv_cache",
        upstream="vLLM 0.29 moved KV allocation to vllm/v1/worker/utils.py: one int8 buffer "
                 "with strided [blocks, heads, tokens, K|V] layer views; vllm-project/vllm#51718",
        remove_when="vLLM lets the attention backend name its per-layer layout again",
    ),
    Patch(
        "vllm.v1.worker.utils:AttentionGroup.map_kv_cache_to_kernel_blocks",
        reason="hand an Ascend page that is a kernel block already to its layer as it is "
               "(KV-cache blocks longer than 128 tokens: --block-size 256, hybrid models)",
        vllm=">=0.32",
        signature=("(self, kv_cache)",),
        wrapper="ascend_patch.npu.runner.kv_allocation:ascend_pages_are_kernel_blocks",
        upstream="vllm/v1/worker/utils.py: a cache is in kernel blocks when dim -2 of vLLM's "
                 "[B, H, N, C] view holds a kernel block's tokens, else only a compressed "
                 "cache may be re-strided; the Ascend page holds the heads there",
        remove_when="vLLM asks the attention backend whether its layer view is in kernel blocks",
    ),
    Patch(
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector:"
        "MooncakeConnectorWorker._validate_head_resharding_layout",
        reason="fail a Mooncake transfer that would split or gather an Ascend KV page by heads "
               "(its K and V halves hold heads inside tokens)",
        vllm=">=0.33",
        signature=("(self, remote_tp_size, local_regions)",),
        wrapper="ascend_patch.npu.distributed.kv_transfer:mooncake_resharding",
        upstream="vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py: "
                 "a producer and consumer of different tensor-parallel sizes exchange byte "
                 "ranges of whole heads per block, which the connector asks for with the "
                 "LBHNC layout (get_required_kvcache_layout) and vLLM drops for a backend "
                 "without it",
        remove_when="the Ascend attention backend serves a heads-outermost KV page",
    ),
    *(Contract(f"vllm.v1.kv_cache_interface:{spec}",
            reason="allocate_kv_cache's wrapper tells MLA layers (one latent per token, no K|V "
                   "split: vLLM's view kept) by their spec",
            upstream=cite("vllm/v1/kv_cache_interface.py: the KV cache specs of a kv_cache_config",
                          pr),
            remove_when="never: vLLM's spec classes; the contract only guards their presence",
            implementation="ascend_patch.npu.runner.kv_allocation:allocate_kv_cache")
      for spec, pr in (("MLAAttentionSpec", None),
                       ("UniformTypeKVCacheSpecs", "vllm-project/vllm#25101"))),
]
"""What this set changes or relies on whichever runner generation runs (v0_34 starts from it)."""

PATCHES = [*NEUTRAL, *runner_v1.RUNNER_CONTRACTS, *runner_v1.RUNNER_GLUE, *runner_v1.SPEC_DECODE_KERNELS]

NEUTRAL_MANIFEST = [
    *device_api.DEVICE_API,
    *engine.SETTINGS,
    *platform.SEAMS,
    *engine.SEAMS,
    *quant.SEAMS,
    Seam("vllm.v1.worker.gpu_worker:Worker._init_workspace_and_model_runner",
         "build the workspace and model runner through vLLM's own step", since="0.32",
         implementation="ascend_patch.npu.runner.worker:NPUWorker.init_device"),
    Seam("vllm.v1.attention.backend:AttentionBackend.get_kv_cache_shape",
         "AscendAttentionBackend defines get_kv_cache_shape only where vLLM still calls it",
         until="0.29", implementation="ascend_patch.npu.attention.backend:AscendAttentionBackend",
         pr="vllm-project/vllm#51718"),
    Seam("vllm.v1.kv_offload.cpu.common:CPULoadStoreSpec.chunk_ids",
         "the NPU offloading spec reads the host chunk count CPUOffloadingSpec sized under its name "
         "of the release (num_chunks from 0.30, num_blocks before)", since="0.30",
         implementation="ascend_patch.npu.distributed.kv_transfer.offload:NPUOffloadingSpec"),
]

MANIFEST = [*PATCHES, *NEUTRAL_MANIFEST, *runner_v1.SETTINGS, *runner_v1.SEAMS]
"""Everything the overlay changes or relies on for these releases: the loader verifies all of
it before applying any, and ``doctor``, ``probe`` and ``docs/patches.md`` list it."""
