"""Patch set for vLLM 0.29–0.33: the single-buffer KV-cache era.

0.29 replaced per-backend ``get_kv_cache_shape`` with
``vllm.v1.worker.utils.allocate_kv_cache``: one int8 backing buffer with strided
``[blocks, heads, tokens, K|V]`` views per layer (research/drift.md §5). The NPU
kernels read separate K and V planes, so this set's own glue re-views each layer's
bytes (``kv_cache.allocate_kv_cache``); everything else is shared with v0_20
through :mod:`.common`. Seams that move inside the range are feature-probed where
they are used: ``Worker._init_workspace_and_model_runner`` (0.32+) in
``NPUWorker.init_device``, ``seq_lens_cpu_upper_bound`` in the metadata builder.
"""

from ascend_patch.patches import common
from ascend_patch.patching import Patch

RANGE = ">=0.29,<0.34"

PATCHES = [
    *common.DEVICE_SELECTION,
    *common.ENGINE_CONTRACTS,
    *common.RUNNER_GLUE,
    Patch(
        "vllm.v1.worker.utils:allocate_kv_cache",
        reason="view each layer's KV bytes as the separate K/V planes the NPU kernels read",
        vllm=RANGE,
        signature=("(kv_cache_config, device, layout, kernel_block_sizes=...)",),
        wrapper="ascend_patch.kv_cache:allocate_kv_cache",
    ),
]
