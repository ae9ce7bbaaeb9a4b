"""Patch set v0_29: the single-buffer KV-cache era (the releases: ``compat_matrix.yaml``).

0.29 replaced per-backend ``get_kv_cache_shape`` with
``vllm.v1.worker.utils.allocate_kv_cache``: one int8 backing buffer with strided
``[blocks, heads, tokens, K|V]`` views per layer. The NPU kernels read separate K and
V planes, so this set's own glue re-views each layer's bytes
(``kv_cache.allocate_kv_cache``); everything else is shared with v0_20 through
:mod:`.common`.
"""

from ascend_patch.overlay.declarations import Contract, Patch, Seam
from ascend_patch.patches import common, spec_decode

PATCHES = [
    *common.DEVICE_SELECTION,
    *common.ENGINE_CONTRACTS,
    *common.RUNNER_GLUE,
    *common.MOE_CONTRACTS,
    *common.QUANT_CONTRACTS,
    *common.MLA_CONTRACTS,
    Contract(
        "vllm.platforms.interface:Platform.get_mla_prefill_backend_cls",
        reason="the MLA prefill backend MLAAttention builds: one that constructs on Ascend (and "
               "is never run: AscendMLAImpl runs prefills)",
        vllm=">=0.32",
        signature=("(cls, mla_selector_config)",),
        upstream="vllm/platforms/interface.py (0.32+): the default returns FLASH_ATTN for a "
                 "platform without a device capability, whose constructor asserts "
                 "flash_attn_varlen_func imports",
        remove_when="never: vLLM's own extension point; the contract only guards its signature",
        implementation="ascend_patch.npu.platform:NPUPlatform",
    ),
    *common.GRAPH_MODE,
    *spec_decode.SPEC_DECODE,
    common.hybrid_promotion("kv_cache_utils", vllm="<0.33"),
    common.hybrid_promotion("kv_cache_planning", vllm=">=0.33"),
    Patch(
        "vllm.v1.worker.utils:allocate_kv_cache",
        reason="view each layer's KV bytes as the separate K/V planes the NPU kernels read",
        signature=("(kv_cache_config, device, layout, kernel_block_sizes=...)",),
        wrapper="ascend_patch.npu.kv_cache:allocate_kv_cache",
        upstream="vLLM 0.29 moved KV allocation to vllm/v1/worker/utils.py: one int8 buffer "
                 "with strided [blocks, heads, tokens, K|V] layer views",
        remove_when="vLLM lets the attention backend name its per-layer layout again",
    ),
    *(Contract(f"vllm.v1.kv_cache_interface:{spec}",
            reason="allocate_kv_cache's wrapper tells MLA layers (one latent per token, no K|V "
                   "split: vLLM's view kept) by their spec",
            upstream="vllm/v1/kv_cache_interface.py: the KV cache specs of a kv_cache_config",
            remove_when="never: vLLM's spec classes; the contract only guards their presence",
            implementation="ascend_patch.npu.kv_cache:allocate_kv_cache")
      for spec in ("MLAAttentionSpec", "UniformTypeKVCacheSpecs")),
]

MANIFEST = [
    *PATCHES,
    *common.DEVICE_API,
    *common.SETTINGS,
    *common.SEAMS,
    Seam("vllm.v1.worker.gpu_worker:Worker._init_workspace_and_model_runner",
         "build the workspace and model runner through vLLM's own step", since="0.32",
         implementation="ascend_patch.npu.worker:NPUWorker.init_device"),
    Seam("vllm.v1.attention.backend:AttentionBackend.get_kv_cache_shape",
         "AscendAttentionBackend defines get_kv_cache_shape only where vLLM still calls it",
         until="0.29", implementation="ascend_patch.npu.attention.backend:AscendAttentionBackend"),
]
"""Everything the overlay changes or relies on for these releases: the loader verifies all of
it before applying any, and ``doctor``, ``probe`` and ``docs/patches.md`` list it."""
