"""vLLM's kernel warm-up on the NPU, for both runner generations: nothing to tune."""


def no_kernel_warmup(original):
    """Replacement of ``vllm.model_executor.warmup.kernel_warmup.kernel_warmup``."""

    def kernel_warmup(worker, *, process_local_only=False):
        return None  # no JIT-compiled CUDA/Triton kernels to tune on the NPU path

    return kernel_warmup
