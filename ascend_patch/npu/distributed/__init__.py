"""Device collectives on the NPU (HCCL, or gloo when emulated), and which parallel configurations
the NPU path serves (:func:`check_config`).

Docs: docs/distributed.md, "Multi-device and multi-node".
"""

# vLLM's all-gather/reduce-scatter expert all-to-all (its config turns ``naive`` into it).
AGRS_BACKEND = "allgather_reducescatter"


def check_config(vllm_config) -> None:
    """Refuse, in one line, expert-parallel load balancing, and an expert all-to-all backend the NPU communicator cannot build: with
    data parallelism the MoE layers dispatch their tokens through the expert group's all-to-all
    manager, and only vLLM's all-gather/reduce-scatter one runs on the device group's collectives."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.enable_eplb:
        raise NotImplementedError("expert-parallel load balancing (EPLB) is not supported by ascend-patch yet")
    if (model is not None and model.is_moe and parallel.data_parallel_size > 1
            and parallel.all2all_backend != AGRS_BACKEND):
        raise NotImplementedError(
            f"--all2all-backend {parallel.all2all_backend} is not supported on Ascend by ascend-patch "
            f"(a CUDA/ROCm kernel): data-parallel MoE runs on {AGRS_BACKEND}")
