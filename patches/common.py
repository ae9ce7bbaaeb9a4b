"""Declarations shared by every patch set (vLLM 0.20–0.33).

The platform hooks below have not changed signature from 0.20 to 0.33
(research/drift.md §2), so one platform class serves every set. They are
*contracts*: ``NPUPlatform`` overrides them, nothing is patched, and a
signature change in a new vLLM release makes verification fail loudly
instead of leaving an override that vLLM no longer calls the same way.
"""

from ascend_patch.patching import Patch

ALL = ">=0.20,<0.34"


def _platform_hook(name: str, signature: str, reason: str) -> Patch:
    return Patch(
        f"vllm.platforms.interface:Platform.{name}",
        reason=reason,
        vllm=ALL,
        signature=(signature,),
    )


DEVICE_SELECTION = [
    Patch(
        "vllm.platforms:resolve_current_platform_cls_qualname",
        reason="device selection: current_platform resolves to NPUPlatform, not CUDA/CPU",
        vllm=ALL,
        signature=("()",),
        wrapper="ascend_patch.loader:select_platform",
    ),
    _platform_hook("get_device_name", "(cls, device_id=...)", "device name from the NPU runtime"),
    _platform_hook("get_device_uuid", "(cls, device_id=...)", "device identity from the NPU runtime"),
    _platform_hook("get_device_total_memory", "(cls, device_id=...)", "HBM size (emulated HBM when emulating)"),
    _platform_hook("set_device", "(cls, device)", "select the NPU for this worker"),
    _platform_hook("manual_seed_all", "(cls, seed)", "seed the NPU generators"),
    _platform_hook("get_current_memory_usage", "(cls, device=...)", "memory in use on the NPU"),
    _platform_hook("is_pin_memory_available", "(cls)", "pinned host memory needs the NPU runtime"),
    _platform_hook("check_if_supports_dtype", "(cls, dtype)", "fp16/bf16/fp32 only"),
    _platform_hook("inference_mode", "(cls)", "torch.inference_mode on NPU"),
    _platform_hook("num_compute_units", "(cls, device_id=...)", "AI core count"),
    _platform_hook("support_hybrid_kv_cache", "(cls)", "hybrid (Mamba) KV cache is not supported"),
    _platform_hook("import_kernels", "(cls)", "vLLM's CUDA/CPU extensions do not exist on Ascend"),
]


def _contract(target: str, signature: str | tuple[str, ...] | None, reason: str) -> Patch:
    if isinstance(signature, str):
        signature = (signature,)
    return Patch(target, reason=reason, vllm=ALL, signature=signature)


# What the engine classes (NPUWorker, NPUModelRunner, the attention backend, the
# custom ops, the sampler) override or call; verified, never patched.
ENGINE_CONTRACTS = [
    _platform_hook("get_attn_backend_cls", "(cls, selected_backend, attn_selector_config, num_heads=...)",
                   "attention backend selection"),
    _platform_hook("check_and_update_config", "(cls, vllm_config)", "worker class, block size, eager mode"),
    _platform_hook("apply_config_platform_defaults", "(cls, vllm_config)", "eager mode before custom-op defaults"),
    _platform_hook("import_ir_kernels", "(cls)", "register the ascend vLLM-IR implementations"),
    _platform_hook("get_default_ir_op_priority", "(cls, vllm_config)", "ascend IR implementations first"),
    _platform_hook("get_punica_wrapper", "(cls)", "LoRA is unsupported"),
    _platform_hook("get_device_communicator_cls", "(cls)", "NPUCommunicator: HCCL, or gloo when emulated"),
    _contract("vllm.distributed.device_communicators.base_device_communicator:DeviceCommunicatorBase.__init__",
              ("(self, cpu_group, device=..., device_group=..., unique_name=..., global_ranks=..., "
               "global_world_size=...)",
               "(self, cpu_group, device=..., device_group=..., unique_name=..., global_ranks=..., "
               "global_world_size=..., use_all2all=...)"),
              "NPUCommunicator forwards every constructor variant"),
    _contract("vllm.v1.worker.gpu_worker:Worker.init_device", "(self)", "NPUWorker selects the NPU device"),
    _contract("vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context", "(self, tag)",
              "the CuMem pool is CUDA-only"),
    _contract("vllm.v1.worker.gpu_worker:Worker.sleep", "(self, level=...)", "sleep mode is unsupported"),
    _contract("vllm.v1.worker.gpu_worker:Worker.wake_up", "(self, tags=...)", "sleep mode is unsupported"),
    _contract("vllm.v1.worker.gpu_worker:init_worker_distributed_environment",
              "(vllm_config, rank, distributed_init_method=..., local_rank=..., backend=...)",
              "NPUWorker initialises HCCL/gloo with it"),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", None,
              "NPUModelRunner charges the loaded weights to the emulated HBM"),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run", None,
              "NPUModelRunner measures the profiling pass's activations"),
    _contract("vllm.v1.attention.backend:AttentionImpl.forward",
              "(self, layer, query, key, value, kv_cache, attn_metadata, output, "
              "output_scale=..., output_block_scale=...)", "the Ascend attention impl"),
    _contract("vllm.v1.attention.backend:AttentionMetadataBuilder.build",
              "(self, common_prefix_len, common_attn_metadata, fast_build=...)",
              "the Ascend metadata builder"),
    _contract("vllm.model_executor.custom_op:CustomOp.register_oot",
              "(cls, _decorated_op_cls=..., name=...)", "register the NPU custom ops"),
    _contract("vllm.model_executor.layers.layernorm:RMSNorm.forward_native", "(self, x, residual=...)",
              "AscendRMSNorm.forward_oot takes the same arguments"),
    _contract("vllm.model_executor.layers.activation:SiluAndMul.forward_native", "(x)",
              "AscendSiluAndMul.forward_oot takes the same arguments"),
    _contract("vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_native",
              "(self, positions, query, key=...)", "AscendRotaryEmbedding.forward_oot takes the same arguments"),
    _contract("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_native",
              "(self, logits, generators, k, p)", "forward_npu finishes sampling through it"),
    _contract("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch",
              "(logits, k, p, allow_cpu_sync=...)", "the sampler's fallback above the NPU op's k limit"),
]


def no_kernel_warmup(original):
    def kernel_warmup(worker, *, process_local_only=False):
        return None  # no JIT-compiled CUDA/Triton kernels to tune on the NPU path

    return kernel_warmup


# Model-runner glue whose targets keep one signature (or gain only what the
# wrapper forwards) from 0.20 to 0.33; both patch sets use it as is.
RUNNER_GLUE = [
    Patch(
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.__init__",
        reason="route top-k/top-p sampling through npu_top_k_top_p instead of forward_native",
        vllm=ALL,
        signature=(
            "(self, logprobs_mode=...)",
            "(self, logprobs_mode=..., use_fp64_gumbel=...)",  # 0.23+
        ),
        wrapper="ascend_patch.sampler:init_wrapper",
    ),
    Patch(
        "vllm.model_executor.warmup.kernel_warmup:kernel_warmup",
        reason="CUDA/Triton/FlashInfer kernel autotuning has nothing to tune on Ascend",
        vllm=ALL,
        signature=("(worker)", "(worker, *, process_local_only=...)"),  # the keyword: 0.27+
        replacement=no_kernel_warmup,
    ),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_kv_zero_meta", "(self)",
              "NPUModelRunner zeroes new KV blocks in the Ascend [2, blocks, ...] layout"),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner._zero_block_ids", "(self, block_ids)",
              "NPUModelRunner zeroes new KV blocks in the Ascend [2, blocks, ...] layout"),
    Patch(
        "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
        reason="vLLM computes KV slots with a Triton kernel; the NPU path uses torch ops",
        vllm=ALL,
        signature=("(self, num_reqs, query_start_loc, positions)",),
        replacement="ascend_patch.kv_cache:compute_slot_mapping",
    ),
    _contract("vllm.v1.worker.utils:request_memory",
              ("(init_snapshot, cache_config)", "(init_snapshot, cache_config, external_weight_memory=...)"),
              "NPUWorker.init_device takes vLLM's memory baseline with it"),
]
