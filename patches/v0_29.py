"""Patch set for vLLM 0.29–0.33: the single-buffer KV-cache era.

0.29 replaced per-backend ``get_kv_cache_shape`` with
``vllm.v1.worker.utils.allocate_kv_cache`` and strided layer views
(research/drift.md §5); everything before that is patch set ``v0_20``.
"""

from ascend_patch.patches import common
from ascend_patch.patching import Patch

RANGE = ">=0.29,<0.34"


def _no_kernel_warmup(original):
    def kernel_warmup(worker, *, process_local_only=False):
        return None  # no JIT-compiled CUDA/Triton kernels to tune on the NPU path

    return kernel_warmup


PATCHES = [
    *common.DEVICE_SELECTION,
    *common.ENGINE_CONTRACTS,
    Patch(
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.__init__",
        reason="route top-k/top-p sampling through npu_top_k_top_p instead of forward_native",
        vllm=RANGE,
        signature=("(self, logprobs_mode=..., use_fp64_gumbel=...)",),
        wrapper="ascend_patch.sampler:init_wrapper",
    ),
    Patch(
        "vllm.v1.worker.utils:allocate_kv_cache",
        reason="view each layer's KV bytes as the separate K/V planes the NPU kernels read",
        vllm=RANGE,
        signature=("(kv_cache_config, device, layout, kernel_block_sizes=...)",),
        wrapper="ascend_patch.kv_cache:allocate_kv_cache",
    ),
    Patch(
        "vllm.model_executor.warmup.kernel_warmup:kernel_warmup",
        reason="CUDA/Triton/FlashInfer kernel autotuning has nothing to tune on Ascend",
        vllm=RANGE,
        signature=("(worker, *, process_local_only=...)",),
        replacement=_no_kernel_warmup,
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_kv_zero_meta",
        reason="NPUModelRunner zeroes new KV blocks in the Ascend [2, blocks, ...] layout",
        vllm=RANGE,
        signature=("(self)",),
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._zero_block_ids",
        reason="NPUModelRunner zeroes new KV blocks in the Ascend [2, blocks, ...] layout",
        vllm=RANGE,
        signature=("(self, block_ids)",),
    ),
    Patch(
        "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
        reason="vLLM computes KV slots with a Triton kernel; the NPU path uses torch ops",
        vllm=RANGE,
        signature=("(self, num_reqs, query_start_loc, positions)",),
        replacement="ascend_patch.kv_cache:compute_slot_mapping",
    ),
    Patch(
        "vllm.v1.worker.utils:request_memory",
        reason="NPUWorker.init_device takes vLLM's memory baseline with it",
        vllm=RANGE,
        signature=(
            "(init_snapshot, cache_config)",
            "(init_snapshot, cache_config, external_weight_memory=...)",
        ),
    ),
]
