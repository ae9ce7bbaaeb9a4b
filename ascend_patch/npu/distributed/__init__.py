"""Device collectives on the NPU (HCCL, or gloo when emulated)."""


def check_config(vllm_config) -> None:
    """Refuse data-parallel MoE in one line: vLLM dispatches the experts' tokens across DP ranks
    through the expert group's all-to-all manager (``get_ep_all2all_manager``), and the NPU
    communicator builds none, so vLLM would fail there with a bare AssertionError."""
    model = vllm_config.model_config
    if model is not None and model.is_moe and vllm_config.parallel_config.data_parallel_size > 1:
        raise NotImplementedError(
            "data-parallel MoE (--data-parallel-size > 1 with a mixture-of-experts model) is not "
            "supported by ascend-patch yet: the NPU communicator has no expert all-to-all manager")
