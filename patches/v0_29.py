"""Patch set for vLLM 0.29–0.33: the single-buffer KV-cache era.

0.29 replaced per-backend ``get_kv_cache_shape`` with
``vllm.v1.worker.utils.allocate_kv_cache`` and strided layer views
(research/drift.md §5); everything before that is patch set ``v0_20``.
"""

from ascend_patch.patches import common

PATCHES = [*common.DEVICE_SELECTION]
