"""Declarations shared by every patch set (vLLM 0.20–0.33).

Each declaration says what it touches, why, where our side is implemented, the
upstream code that makes it necessary and when it can go. The platform hooks have
not changed signature from 0.20 to 0.33, so one platform class serves every set.
They are *contracts*: ``NPUPlatform`` overrides them, nothing is patched, and a
signature change in a new vLLM release makes verification fail loudly instead of
leaving an override that vLLM no longer calls the same way.

The releases each set serves live in ``compat_matrix.yaml`` only; a declaration
carries ``vllm=`` just when it applies to part of its set's releases.
"""

from ascend_patch.overlay.declarations import Contract, Patch, Seam, Setting

PLATFORM = "ascend_patch.npu.platform:NPUPlatform"
WORKER = "ascend_patch.npu.worker:NPUWorker"
RUNNER = "ascend_patch.npu.model_runner:NPUModelRunner"
ATTENTION = "ascend_patch.npu.attention.backend:AscendAttentionImpl"

_PLATFORM_API = "vllm/platforms/interface.py: the out-of-tree platform interface"
_KEEP = "never: vLLM's own extension point; the contract only guards its signature"


def _platform_hook(name: str, signature: str, reason: str) -> Contract:
    return Contract(
        f"vllm.platforms.interface:Platform.{name}",
        reason=reason,
        signature=(signature,),
        upstream=_PLATFORM_API,
        remove_when=_KEEP,
        implementation=PLATFORM,
    )


def _contract(target: str, signature: str | tuple[str, ...] | None, reason: str, *,
              implementation: str, upstream: str, remove_when: str = _KEEP,
              vllm: str | None = None) -> Contract:
    """A contract; a single signature may be given bare."""
    if isinstance(signature, str):
        signature = (signature,)
    return Contract(target, reason=reason, signature=signature, upstream=upstream,
                    remove_when=remove_when, implementation=implementation, vllm=vllm)


DEVICE_SELECTION = [
    Patch(
        "vllm.platforms:resolve_current_platform_cls_qualname",
        reason="device selection: current_platform resolves to NPUPlatform, not CUDA/CPU",
        signature=("()",),
        wrapper="ascend_patch.npu.platform:select_platform",
        upstream="vllm/platforms/__init__.py picks the platform from `vllm.platform_plugins` "
                 "entry points; the overlay is not a platform plugin, so the version check and "
                 "all-or-nothing verification run before the platform is chosen",
        remove_when="never while ascend-patch is an overlay (a platform plugin could not refuse "
                    "a vLLM it has not verified)",
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
    _platform_hook("support_hybrid_kv_cache", "(cls)",
                   "False: vLLM's hybrid KV-cache manager stays off, so a model mixing windowed and "
                   "full layers keeps every token's blocks (one block table) and the attention "
                   "applies the windows"),
    _platform_hook("import_kernels", "(cls)", "vLLM's CUDA/CPU extensions do not exist on Ascend"),
]

_GPU_WORKER = "vllm/v1/worker/gpu_worker.py: the GPU worker NPUWorker subclasses"
_GPU_RUNNER = "vllm/v1/worker/gpu_model_runner.py: the V1 runner NPUModelRunner subclasses"

# What the engine classes (NPUWorker, NPUModelRunner, the attention backend, the
# custom ops, the sampler) override or call; verified, never patched.
ENGINE_CONTRACTS = [
    _platform_hook("get_attn_backend_cls", "(cls, selected_backend, attn_selector_config, num_heads=...)",
                   "attention backend selection (AscendMLABackend for use_mla)"),
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
              "NPUCommunicator forwards every constructor variant",
              implementation="ascend_patch.npu.distributed.communicator:NPUCommunicator",
              upstream="vllm/distributed/device_communicators/base_device_communicator.py: the "
                       "communicator base a platform's get_device_communicator_cls names"),
    _contract("vllm.v1.worker.gpu_worker:Worker.init_device", "(self)", "NPUWorker selects the NPU device",
              implementation=WORKER, upstream=_GPU_WORKER + " (init_device hard-codes cuda)",
              remove_when="vLLM's worker initialises the device through current_platform"),
    _contract("vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context", "(self, tag)",
              "the CuMem pool is CUDA-only", implementation=WORKER, upstream=_GPU_WORKER,
              remove_when="ascend-patch supports sleep mode (an NPU memory pool)"),
    _contract("vllm.v1.worker.gpu_worker:Worker.sleep", "(self, level=...)", "sleep mode is unsupported",
              implementation=WORKER, upstream=_GPU_WORKER, remove_when="ascend-patch supports sleep mode"),
    _contract("vllm.v1.worker.gpu_worker:Worker.wake_up", "(self, tags=...)", "sleep mode is unsupported",
              implementation=WORKER, upstream=_GPU_WORKER, remove_when="ascend-patch supports sleep mode"),
    _contract("vllm.v1.worker.gpu_worker:init_worker_distributed_environment",
              "(vllm_config, rank, distributed_init_method=..., local_rank=..., backend=...)",
              "NPUWorker initialises HCCL/gloo with it", implementation=WORKER, upstream=_GPU_WORKER),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", None,
              "NPUModelRunner charges the loaded weights to the emulated HBM and puts "
              "NPUGraphWrapper where vLLM built CUDAGraphWrapper for FULL graphs", implementation=RUNNER,
              upstream="NPU-only: the emulated HBM's books (a real NPU keeps its own); " + _GPU_RUNNER
              + " (load_model wraps the model in CUDAGraphWrapper, whose capture is torch.cuda.graph)",
              remove_when="never while the emulated NPU exists"),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run", None,
              "NPUModelRunner measures the profiling pass's activations", implementation=RUNNER,
              upstream="NPU-only: the emulated HBM's books (a real NPU keeps its own)",
              remove_when="never while the emulated NPU exists"),
    _contract("vllm.v1.attention.backend:AttentionImpl.forward",
              "(self, layer, query, key, value, kv_cache, attn_metadata, output, "
              "output_scale=..., output_block_scale=...)", "the Ascend attention impl",
              implementation=ATTENTION,
              upstream="vllm/v1/attention/backend.py: the attention backend interface"),
    _contract("vllm.v1.attention.backend:AttentionImpl.__init__",
              "(self, num_heads, head_size, scale, num_kv_heads=..., alibi_slopes=..., "
              "sliding_window=..., kv_cache_dtype=..., logits_soft_cap=..., attn_type=..., "
              "kv_sharing_target_layer_name=...)",
              "the impl takes the sliding window and the logits soft-cap where vLLM's Attention "
              "passes them (positionally)", implementation=ATTENTION,
              upstream="vllm/model_executor/layers/attention/attention.py builds impl_cls(num_heads, "
                       "head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, "
                       "logits_soft_cap, attn_type, kv_sharing_target_layer_name, **extra_impl_args)"),
    *(_contract(f"vllm.config.model:ModelConfig.{name}", None,
                "refuse models with Mamba or linear-attention layers at start-up", implementation=PLATFORM,
                upstream="vllm/config/model.py: the model's layer kinds")
      for name in ("is_attention_free", "is_hybrid")),
    _contract("vllm.v1.attention.backend:AttentionMetadataBuilder.build",
              "(self, common_prefix_len, common_attn_metadata, fast_build=...)",
              "the Ascend metadata builder",
              implementation="ascend_patch.npu.attention.backend:AscendMetadataBuilder",
              upstream="vllm/v1/attention/backend.py: the attention backend interface"),
    _contract("vllm.model_executor.custom_op:CustomOp.register_oot",
              "(cls, _decorated_op_cls=..., name=...)", "register the NPU custom ops",
              implementation="ascend_patch.npu.ops:register",
              upstream="vllm/model_executor/custom_op.py: out-of-tree custom-op registration"),
    _contract("vllm.model_executor.layers.layernorm:RMSNorm.forward_native", "(self, x, residual=...)",
              "AscendRMSNorm.forward_oot takes the same arguments",
              implementation="ascend_patch.npu.ops.layernorm:AscendRMSNorm",
              upstream="vllm/model_executor/layers/layernorm.py"),
    _contract("vllm.model_executor.layers.activation:SiluAndMul.forward_native", "(x)",
              "AscendSiluAndMul.forward_oot takes the same arguments",
              implementation="ascend_patch.npu.ops.activation:AscendSiluAndMul",
              upstream="vllm/model_executor/layers/activation.py"),
    _contract("vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_native",
              "(self, positions, query, key=...)", "AscendRotaryEmbedding.forward_oot takes the same arguments",
              implementation="ascend_patch.npu.ops.rotary_embedding:AscendRotaryEmbedding",
              upstream="vllm/model_executor/layers/rotary_embedding/base.py"),
    _contract("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_native",
              "(self, logits, generators, k, p)", "forward_npu finishes sampling through it",
              implementation="ascend_patch.npu.sample.sampler:forward_npu",
              upstream="vllm/v1/sample/ops/topk_topp_sampler.py"),
    _contract("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch",
              "(logits, k, p, allow_cpu_sync=...)",
              "the sampler's path for rows whose top-k is above the NPU op's k limit",
              implementation="ascend_patch.npu.sample.sampler:filter_top_k_top_p",
              upstream="vllm/v1/sample/ops/topk_topp_sampler.py"),
]


# Model-runner glue whose targets keep one signature (or gain only what the
# wrapper forwards) from 0.20 to 0.33; both patch sets use it as is.
RUNNER_GLUE = [
    Patch(
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.__init__",
        reason="route top-k/top-p sampling through npu_top_k_top_p instead of forward_native",
        signature=(
            "(self, logprobs_mode=...)",
            "(self, logprobs_mode=..., use_fp64_gumbel=...)",  # 0.23+
        ),
        wrapper="ascend_patch.npu.sample.sampler:init_wrapper",
        upstream="vllm/v1/sample/ops/topk_topp_sampler.py: __init__ gives out-of-tree platforms "
                 "forward_native; there is no platform hook for the sampler",
        remove_when="vLLM dispatches TopKTopPSampler to a platform (forward_oot) implementation",
    ),
    Patch(
        "vllm.v1.worker.gpu_input_batch:InputBatch._make_sampling_metadata",
        reason="hand the sampler the host copy of top_k, so it routes rows between npu_top_k_top_p "
               "(k ≤ 1024) and vLLM's torch path without a per-step device sync",
        signature=("(self)",),
        wrapper="ascend_patch.npu.sample.sampler:attach_host_top_k",
        upstream="vllm/v1/worker/gpu_input_batch.py: SamplingMetadata.top_k is a device tensor "
                 "copied from InputBatch.top_k_cpu (k = vocab size for requests without top-k); "
                 "the host copy never reaches TopKTopPSampler.forward",
        remove_when="vLLM dispatches TopKTopPSampler to a platform implementation that is given "
                    "the host sampling parameters",
    ),
    Patch(
        "vllm.model_executor.warmup.kernel_warmup:kernel_warmup",
        reason="CUDA/Triton/FlashInfer kernel autotuning has nothing to tune on Ascend",
        signature=("(worker)", "(worker, *, process_local_only=...)"),  # the keyword: 0.27+
        replacement="ascend_patch.npu.model_runner:no_kernel_warmup",
        upstream="vllm/model_executor/warmup/kernel_warmup.py: DeepGEMM/FlashInfer/Triton "
                 "warm-up runs on every platform",
        remove_when="kernel_warmup skips platforms that have none of those kernels",
    ),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_kv_zero_meta", "(self)",
              "NPUModelRunner zeroes new KV blocks in the Ascend [2, blocks, ...] layout",
              implementation=RUNNER,
              upstream=_GPU_RUNNER + " (KVBlockZeroer is a Triton kernel over [blocks, ...] caches)",
              remove_when="vLLM zeroes blocks through the attention backend"),
    _contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner._zero_block_ids", "(self, block_ids)",
              "NPUModelRunner zeroes new KV blocks in the Ascend [2, blocks, ...] layout",
              implementation=RUNNER,
              upstream=_GPU_RUNNER + " (KVBlockZeroer is a Triton kernel over [blocks, ...] caches)",
              remove_when="vLLM zeroes blocks through the attention backend"),
    Patch(
        "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
        reason="vLLM computes KV slots with a Triton kernel; the NPU path uses torch ops",
        signature=("(self, num_reqs, query_start_loc, positions)",),
        replacement="ascend_patch.npu.kv_cache:compute_slot_mapping",
        upstream="vllm/v1/worker/block_table.py: compute_slot_mapping launches a Triton kernel",
        remove_when="vLLM has a torch fallback, or triton-ascend runs the kernel on the NPU",
    ),
    _contract("vllm.v1.worker.utils:request_memory",
              ("(init_snapshot, cache_config)", "(init_snapshot, cache_config, external_weight_memory=...)"),
              "NPUWorker.init_device takes vLLM's memory baseline with it", implementation=WORKER,
              upstream="vllm/v1/worker/utils.py"),
]

_GRAPH_WRAPPER = "ascend_patch.npu.compilation.acl_graph:NPUGraphWrapper"
_CUDA_GRAPH = ("vllm/compilation/cuda_graph.py: CUDAGraphWrapper, which vLLM's runner builds for FULL "
               "graphs and NPUGraphWrapper subclasses (its capture and replay are torch.cuda's)")
_REMOVE_WITH_WRAPPER = "vLLM captures graphs through the platform (torch.accelerator graphs)"

# ACL graphs: the platform's static-graph hooks and what NPUGraphWrapper builds on.
GRAPH_MODE = [
    _platform_hook("support_static_graph_mode", "(cls)",
                   "graph mode: vLLM settles the CUDA-graph mode and its capture sizes"),
    _platform_hook("get_static_graph_wrapper_cls", "(cls)",
                   "the PIECEWISE backend wraps each compiled piece in NPUGraphWrapper"),
    _platform_hook("get_global_graph_pool", "(self)",
                   "the graphs' shared pool, from NPUPlatform.graph_pool_handle (the device runtime's)"),
    _platform_hook("opaque_attention_op", "(cls)",
                   "under torch.compile attention is one opaque op: the PIECEWISE split point"),
    _contract("vllm.compilation.cuda_graph:CUDAGraphWrapper.__init__",
              "(self, runnable, vllm_config, runtime_mode, cudagraph_options=...)",
              "NPUGraphWrapper is built like it and keeps its state (runnable, mode, pool, entries)",
              implementation=_GRAPH_WRAPPER, upstream=_CUDA_GRAPH, remove_when=_REMOVE_WITH_WRAPPER),
    _contract("vllm.compilation.cuda_graph:CUDAGraphWrapper.clear_graphs", "(self)",
              "vLLM clears every wrapper's graphs through it; NPUGraphWrapper drops its updates too",
              implementation=_GRAPH_WRAPPER, upstream=_CUDA_GRAPH, remove_when=_REMOVE_WITH_WRAPPER),
    _contract("vllm.compilation.cuda_graph:CUDAGraphEntry", None,
              "NPUGraphWrapper keeps one entry per batch descriptor, as vLLM's wrapper does",
              implementation=_GRAPH_WRAPPER, upstream=_CUDA_GRAPH, remove_when=_REMOVE_WITH_WRAPPER),
    _contract("vllm.compilation.monitor:validate_cudagraph_capturing_enabled", "()",
              "NPUGraphWrapper captures only while vLLM allows captures", implementation=_GRAPH_WRAPPER,
              upstream="vllm/compilation/monitor.py", remove_when=_REMOVE_WITH_WRAPPER),
    _contract("vllm.forward_context:ForwardContext.cudagraph_runtime_mode", None,
              "each step's graph mode, which NPUGraphWrapper dispatches on", implementation=_GRAPH_WRAPPER,
              upstream="vllm/forward_context.py", remove_when=_REMOVE_WITH_WRAPPER),
    _contract("vllm.forward_context:ForwardContext.batch_descriptor", None,
              "each step's padded batch, the key of its graph", implementation=_GRAPH_WRAPPER,
              upstream="vllm/forward_context.py", remove_when=_REMOVE_WITH_WRAPPER),
    _contract("vllm.v1.attention.backend:AttentionMetadataBuilder.get_cudagraph_support",
              "(cls, vllm_config, kv_cache_spec)",
              "FULL graphs for single-token decode on the fused kernels, none for composed fp32 "
              "attention", implementation="ascend_patch.npu.attention.backend:AscendMetadataBuilder",
              upstream="vllm/v1/attention/backend.py: the attention backend interface"),
    Patch(
        "vllm.distributed.parallel_state:graph_capture",
        reason="capture on the NPU's own stream without the CUDA communicators' capture contexts",
        signature=("(device)", "(device, graph_capture_context=...)"),  # the context: 0.26-0.30
        replacement="ascend_patch.npu.distributed.graph_capture:npu_graph_capture",
        upstream="vllm/distributed/parallel_state.py: GroupCoordinator.graph_capture asserts a "
                 "group's device communicator is CUDA's or XPU's (0.22+) and enters their "
                 "custom all-reduce capture",
        remove_when="GroupCoordinator.graph_capture asks the device communicator for its context",
    ),
    _contract("vllm.distributed.parallel_state:GraphCaptureContext", None,
              "the capture context graph_capture yields",
              implementation="ascend_patch.npu.distributed.graph_capture:graph_capture",
              upstream="vllm/distributed/parallel_state.py"),
]


def hybrid_promotion(module: str, vllm: str | None = None) -> Contract:
    """vLLM's promotion of sliding-window KV specs to full attention when the hybrid manager is
    off, which the attention backend relies on (it moved to kv_cache_planning.py in 0.33)."""
    return Contract(
        f"vllm.v1.core.{module}:unify_hybrid_kv_cache_specs",
        reason="with support_hybrid_kv_cache False, windowed layers beside full ones keep every "
               "token's blocks; the attention applies the windows itself",
        vllm=vllm,
        signature=("(kv_cache_spec)",),
        upstream=f"vllm/v1/core/{module}.py: SlidingWindowSpec -> FullAttentionSpec when both kinds "
                 "are present (a uniformly windowed model keeps its SlidingWindowSpec)",
        remove_when="ascend-patch supports the hybrid KV-cache manager",
        implementation=ATTENTION,
    )


_MOE = "vllm.model_executor.layers.fused_moe"
_MOE_METHOD = "ascend_patch.npu.ops.fused_moe:AscendUnquantizedFusedMoEMethod"
_MOE_UPSTREAM = (f"{_MOE.replace('.', '/')}/oracle/unquantized.py: an out-of-tree platform gets "
                 "the OOT backend, no kernel, and must run the experts itself")

# The unquantized MoE method vLLM builds for every MoE layer, replaced through
# CustomOp.register_oot by one that routes and runs the experts on the NPU ops.
MOE_CONTRACTS = [
    _contract(f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.__init__", "(self, moe)",
              "the NPU MoE method is built like vLLM's", implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    _contract(f"{_MOE}.oracle.unquantized:select_unquantized_moe_backend", "(moe_config)",
              "gives out-of-tree platforms the OOT backend: no vLLM kernel to set up",
              implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    _contract(f"{_MOE}.fused_moe_method_base:FusedMoEMethodBase.is_monolithic", None,
              "the runner hands a monolithic method the router logits: routing runs on the NPU",
              implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    _contract(f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.apply_monolithic",
              "(self, layer, x, router_logits, input_ids=...)",
              "route, dispatch, run and combine the experts through the kernel seam",
              implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    _contract(f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.process_weights_after_loading",
              "(self, layer)", "expert weights to the grouped-matmul [experts, in, out] layout, once",
              implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    _contract(f"{_MOE}.router.grouped_topk_router:grouped_topk",
              "(hidden_states, gating_output, topk, renormalize, num_expert_group=..., "
              "topk_group=..., scoring_func=..., routed_scaling_factor=..., "
              "e_score_correction_bias=...)",
              "routes, as vLLM's GroupedTopKRouter does, the grouped layers npu_moe_gating_top_k "
              "cannot take (2 or fewer experts per group, sigmoid weights without renormalisation)",
              implementation="ascend_patch.npu.ops.fused_moe:Routing",
              upstream=f"{_MOE.replace('.', '/')}/router/grouped_topk_router.py: vLLM's grouped "
                       "top-k in torch (DeepSeek-V2/V3), called by name by GroupedTopKRouter",
              remove_when="the NPU gating op takes every grouping and normalisation vLLM's "
                          "grouped top-k does"),
]

_QUANT = "vllm.model_executor.layers.quantization"
_CT = f"{_QUANT}.compressed_tensors"
_CT_MOE = f"{_CT}.compressed_tensors_moe"
_INT8_KERNELS = "vllm.model_executor.kernels.linear"
_SCALED_MM = f"{_INT8_KERNELS}.scaled_mm.ScaledMMLinearKernel"
_QUANTIZATION = "ascend_patch.npu.quantization"
_MODELSLIM = f"{_QUANTIZATION}.modelslim:AscendModelSlimConfig"
_ASCEND_LINEAR = f"{_QUANTIZATION}.linear:AscendW8A8LinearMethod"
_INT8_KERNEL = f"{_QUANTIZATION}.compressed_tensors:AscendInt8ScaledMMLinearKernel"
_W8A8_MOE = f"{_QUANTIZATION}.moe:AscendW8A8MoEMethod"
_QUANT_API = (f"{_QUANT.replace('.', '/')}/__init__.py and base_config.py: out-of-tree "
              "quantization configs and their methods")
_INT8_API = (f"{_INT8_KERNELS.replace('.', '/')}/__init__.py: int8 ScaledMM kernels are chosen "
             "from _POSSIBLE_INT8_KERNELS[platform], which has no out-of-tree entry")
_CT_MOE_API = (f"{_CT_MOE.replace('.', '/')}/compressed_tensors_moe.py: get_moe_method imports "
               "CompressedTensorsW8A8Int8MoEMethod by name when it builds an int8 expert layer; "
               "its kernel selection has nothing for an out-of-tree platform")

# Quantised checkpoints: the `ascend` (msModelSlim AscendV1) method registered with vLLM's
# quantization registry, the NPU int8 kernel registered for vLLM's compressed-tensors scheme,
# the NPU method for int8 experts, and unsupported schemes refused by layer.
QUANT_CONTRACTS = [
    _platform_hook("pre_register_and_update", "(cls, parser=...)",
                   "register the `ascend` quantization method before vLLM builds its config"),
    _contract(f"{_QUANT}:register_quantization_config", "(quantization)",
              "the `ascend` method joins vLLM's quantization registry (--quantization ascend)",
              implementation=f"{_QUANTIZATION}:register_config", upstream=_QUANT_API),
    *(_contract(f"{_QUANT}.base_config:QuantizationConfig.{name}", signature,
                "AscendModelSlimConfig implements the quantization-config interface",
                implementation=_MODELSLIM, upstream=_QUANT_API)
      for name, signature in (("get_quant_method", "(self, layer, prefix)"),
                              ("get_config_filenames", "()"), ("from_config", "(cls, config)"),
                              ("get_supported_act_dtypes", "(self)"),
                              ("get_min_capability", "(cls)"))),
    _contract("vllm.config.vllm:VllmConfig.get_quantization_config", "(model_config, load_config)",
              "a checkpoint detected as AscendV1 gets its quantization config rebuilt",
              implementation=f"{_QUANTIZATION}:detect",
              upstream="vllm/config/model.py _verify_quantization detects a method only from an "
                       "HF quantization_config, which msModelSlim removes from config.json",
              remove_when="vLLM lets a quantization method detect its checkpoint by its files"),
    *(_contract(f"vllm.model_executor.layers.linear:LinearMethodBase.{name}", signature,
                "AscendV1 W8A8 / W8A8_DYNAMIC linear layers", implementation=_ASCEND_LINEAR,
                upstream="vllm/model_executor/layers/linear.py: the linear-method interface")
      for name, signature in (
          ("create_weights", "(self, layer, input_size_per_partition, output_partition_sizes, "
                             "input_size, output_size, params_dtype, **extra_weight_attrs)"),
          ("apply", "(self, layer, x, bias=...)"))),
    _contract(f"{_INT8_KERNELS}:register_linear_kernel", "(kernel_class, platform, kernel_type=...)",
              "the NPU int8 kernel for PlatformEnum.OOT", implementation=f"{_QUANTIZATION}:register_kernels",
              upstream=_INT8_API),
    _contract(f"{_INT8_KERNELS}:init_int8_linear_kernel",
              ("(is_channelwise, is_static_input_scheme, input_symmetric, module_name)",
               "(is_channelwise, is_static_input_scheme, input_symmetric, module_name, "
               "is_fused_module=...)"),  # 0.33
              "vLLM's int8 scheme builds the chosen kernel from its config and parameter names",
              implementation=_INT8_KERNEL, upstream=_INT8_API),
    *(_contract(f"{_SCALED_MM}:{name}", signature, "the int8 ScaledMM kernel interface",
                implementation=_INT8_KERNEL, upstream=_INT8_API)
      for name, signature in (
          ("ScaledMMLinearKernel.__init__", "(self, c, layer_param_names)"),
          ("ScaledMMLinearKernel.is_supported", "(cls, compute_capability=...)"),
          ("ScaledMMLinearKernel.can_implement", "(cls, c)"),
          ("ScaledMMLinearKernel.process_weights_after_loading", "(self, layer)"),
          ("ScaledMMLinearKernel.apply_weights", "(self, layer, x, bias=...)"),
          ("Int8ScaledMMLinearKernel._get_layer_params", "(self, layer)"))),
    _contract(f"{_CT}.schemes.compressed_tensors_w8a8_int8:CompressedTensorsW8A8Int8.__init__",
              "(self, strategy, is_static_input_scheme, input_symmetric)",
              "check_scheme reads the int8 scheme's is_static_input_scheme and input_symmetric",
              implementation=f"{_QUANTIZATION}.compressed_tensors:check_scheme",
              upstream=f"{_CT.replace('.', '/')}/schemes/compressed_tensors_w8a8_int8.py"),
    Patch(
        f"{_CT}.compressed_tensors:CompressedTensorsConfig.get_scheme",
        reason="a compressed-tensors scheme the NPU cannot run (W4A16, W4A8, FP8, MXFP/NVFP4, "
               "dynamic asymmetric int8) fails when the layer is built, naming layer and scheme",
        signature=("(self, layer, layer_name=...)",),
        wrapper=f"{_QUANTIZATION}.compressed_tensors:check_scheme",
        upstream=f"{_CT.replace('.', '/')}/compressed_tensors.py: an unsupported scheme fails "
                 "later, in kernel selection, without naming the layer",
        remove_when="vLLM names the layer when no kernel implements its scheme",
    ),
    Patch(
        f"{_CT_MOE}.compressed_tensors_moe:CompressedTensorsMoEMethod.get_moe_method",
        reason="an expert scheme the NPU cannot run fails when the layer is built, naming it",
        signature=("(quant_config, layer, layer_name)",),
        replacement=f"{_QUANTIZATION}.compressed_tensors:check_moe_method",
        upstream=_CT_MOE_API,
        remove_when="vLLM names the layer when no MoE kernel implements its scheme",
    ),
    Patch(
        f"{_CT_MOE}.compressed_tensors_moe_w8a8_int8:CompressedTensorsW8A8Int8MoEMethod",
        reason="compressed-tensors int8 experts run on the NPU MoE ops (vLLM's method finds no "
               "int8 MoE kernel for an out-of-tree platform)",
        replacement=f"{_QUANTIZATION}.moe:compressed_tensors_moe_method",
        implementation=f"{_QUANTIZATION}.moe:AscendCompressedTensorsW8A8Int8MoEMethod",
        upstream=_CT_MOE_API,
        remove_when="vLLM's int8 MoE backend selection admits an out-of-tree platform's kernel",
    ),
    _contract(f"{_CT_MOE}.compressed_tensors_moe_w8a8_int8:CompressedTensorsW8A8Int8MoEMethod.__init__",
              "(self, weight_quant, input_quant, moe, layer_name=...)",
              "the NPU method stands in with the same constructor",
              implementation=f"{_QUANTIZATION}.moe:AscendCompressedTensorsW8A8Int8MoEMethod",
              upstream=_CT_MOE_API),
    *(_contract(f"{_MOE}.fused_moe_method_base:FusedMoEMethodBase.{name}", signature,
                "the W8A8 expert method implements vLLM's MoE-method interface (monolithic)",
                implementation=_W8A8_MOE, upstream=f"{_MOE.replace('.', '/')}/fused_moe_method_base.py")
      for name, signature in (
          ("__init__", "(self, moe)"),
          ("create_weights", "(self, layer, num_experts, hidden_size, "
                             "intermediate_size_per_partition, params_dtype, **extra_weight_attrs)"),
          ("get_fused_moe_quant_config", "(self, layer)"),
          ("apply_monolithic", "(self, layer, x, router_logits, input_ids=...)"))),
]

_MLA_LAYER = "vllm.model_executor.layers.attention.mla_attention"
_MLA_IMPL = "ascend_patch.npu.attention.mla:AscendMLAImpl"
_MLA_INTERFACE = ("vllm/v1/attention/backend.py: MLAAttentionImpl, the interface vLLM's MLAAttention "
                  "layer (model_executor/layers/attention/mla_attention.py) drives")
_MLA_PREFILL = ("vllm/v1/attention/backends/mla/prefill/selector.py (0.21+): MLAAttention.__init__ "
                "builds a prefill backend whatever its impl, FLASH_ATTN when the platform has no "
                "device capability, and that constructor asserts flash_attn_varlen_func imports")

# Multi-head latent attention (DeepSeek): vLLM's MLAAttention layer keeps projections, rotary,
# the decode-first split and the W_UK/W_UV absorption; AscendMLABackend (chosen by
# NPUPlatform.get_attn_backend_cls for use_mla) supplies the cache and the attention.
MLA_CONTRACTS = [
    _contract("vllm.v1.attention.backend:MLAAttentionImpl.__init__",
              "(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, "
              "kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, "
              "q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, "
              "v_head_dim, kv_b_proj, indexer=..., q_pad_num_heads=...)",
              "MLAAttention builds the Ascend MLA impl with these keywords", implementation=_MLA_IMPL,
              upstream=_MLA_INTERFACE),
    _contract("vllm.v1.attention.backend:MLAAttentionImpl.do_kv_cache_update",
              ("(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)",
               "(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, "
               "skip_scale=...)"),  # skip_scale: 0.33
              "the MLA cache write: npu_scatter_pa_kv_cache into the latent and rope planes "
              "(vLLM's default calls CUDA concat_and_cache_mla)", implementation=_MLA_IMPL,
              upstream=_MLA_INTERFACE),
    _contract("vllm.v1.attention.backend:MLAAttentionImpl.forward_mqa",
              "(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)",
              "decodes (queries absorbed by the layer): npu_multi_head_latent_attention",
              implementation=_MLA_IMPL, upstream=_MLA_INTERFACE),
    _contract("vllm.v1.attention.backend:MLAAttentionImpl.forward_mha",
              ("(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output)",
               "(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, "
               "output_scale=...)"),  # output_scale: 0.24+
              "prefills, fresh or behind cached context: their latent rows read out of the cache, "
              "up-projected with kv_b_proj and attended by npu_fused_infer_attention_score in "
              "TND without rope inputs (Q/K 192, V 128)", implementation=_MLA_IMPL,
              upstream=_MLA_INTERFACE),
    _contract(f"{_MLA_LAYER}:MLAAttention.forward_impl", None,
              "splits the decode-first batch by the counts AscendMLAMetadata carries "
              "(num_actual_tokens, num_decodes, num_decode_tokens, num_prefills, decode)",
              implementation="ascend_patch.npu.attention.mla:AscendMLAMetadata",
              upstream=f"{_MLA_LAYER.replace('.', '/')}.py"),
    _contract("vllm.v1.attention.backend:AttentionMetadataBuilder.reorder_batch_threshold", None,
              "AscendMLAMetadataBuilder sets 1: the runner orders each batch decode-first",
              implementation="ascend_patch.npu.attention.mla:AscendMLAMetadataBuilder",
              upstream="vllm/v1/worker/gpu_model_runner.py reorders by the builders' threshold"),
    _contract("vllm.forward_context:get_forward_context", "()",
              "the MLA impl finds its layer (no_compile_layers) and the step's metadata "
              "(attn_metadata) there: forward_mha and do_kv_cache_update are not given them",
              implementation=_MLA_IMPL, upstream="vllm/forward_context.py"),
    Patch(
        "vllm.v1.attention.backends.mla.prefill.selector:get_mla_prefill_backend",
        reason="MLAAttention gets a prefill backend that constructs on Ascend (and is never run: "
               "AscendMLAImpl runs prefills)",
        vllm=">=0.21,<0.32",
        signature=("(vllm_config)",),
        replacement="ascend_patch.npu.attention.mla_prefill:select_prefill_backend",
        upstream=_MLA_PREFILL,
        remove_when="every supported release has Platform.get_mla_prefill_backend_cls (0.32+)",
    ),
    _contract("vllm.v1.attention.backends.mla.prefill.base:MLAPrefillBackend.__init__",
              "(self, num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
              "v_head_dim, vllm_config)", "AscendMLAPrefillBackend constructs like vLLM's",
              implementation="ascend_patch.npu.attention.mla_prefill:AscendMLAPrefillBackend",
              upstream=_MLA_PREFILL, vllm=">=0.21"),
]

_TORCH_DEVICE_API = ("vLLM's GPU worker and V1 model runner call torch.cuda streams/events and the "
                     "torch.accelerator memory API directly (vllm/v1/worker/gpu_model_runner.py, "
                     "gpu_worker.py, vllm/utils/mem_utils.py)")


def _device_api(target: str, reason: str, modes: tuple[str, ...] = ("npu", "emulate")) -> Patch:
    return Patch(
        target,
        reason=reason,
        replacement=DeviceApi(target),
        upstream=_TORCH_DEVICE_API,
        remove_when="vLLM reaches streams, events and memory through current_platform (or "
                    "torch.accelerator through the NPU's PrivateUse1 backend)",
        implementation="ascend_patch.npu.device:Runtime.device_api",
        modes=modes,
        rebind=False,  # torch's own modules keep their references
    )


class DeviceApi:
    """Replacement factory for a torch device API: the active device runtime's stand-in
    (``ascend_patch.npu.device``), chosen when the patch is applied."""

    def __init__(self, target: str):
        self.target = target

    def __call__(self, original):
        from ascend_patch.npu import device

        return device.active_runtime().device_api()[self.target]


_EMULATED = ("emulate",)
DEVICE_API = [
    *(_device_api(f"torch.cuda:{name}", "streams/events on the NPU (in-order no-ops when emulated)")
      for name in ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream",
                   "synchronize")),
    _device_api("torch.accelerator:get_memory_info", "free/total device memory from the NPU (or the "
                "emulated HBM)"),
    *(_device_api(f"torch.accelerator:{name}", "the emulated NPU's device and memory books", _EMULATED)
      for name in ("synchronize", "empty_cache", "empty_host_cache", "current_device_index",
                   "set_device_index", "device_index", "current_stream", "set_stream",
                   "memory_stats", "memory_reserved", "memory_allocated", "max_memory_allocated",
                   "reset_peak_memory_stats")),
    _device_api("torch:Event", "torch.Event on the emulated NPU's single in-order stream", _EMULATED),
]

SETTINGS = [
    Setting(
        "VLLM_USE_V2_MODEL_RUNNER", "0",
        reason="Model Runner V2 (vllm/v1/worker/gpu/) is not supported: pin the V1 runner in "
               "every process vLLM starts",
        upstream="vllm/config/vllm.py use_v2_model_runner: 0.29+ picks V2 whenever Triton "
                 "imports, which triton-ascend makes true on Ascend",
        remove_when="ascend-patch supports Model Runner V2",
    ),
    Setting(
        "VLLM_WORKER_MULTIPROC_METHOD", "spawn",
        reason="workers must be spawned: a forked child cannot use an initialised NPU runtime, and "
               "a spawned one gets the overlay from the .pth",
        upstream="vllm/utils/system_utils.py _maybe_force_spawn forks unless CUDA is initialised",
        remove_when="never on Ascend (torch_npu refuses forked children)",
    ),
]

# Names that appear inside the 0.20-0.33 range; the NPU wing probes for them at run time.
SEAMS = [
    Seam("vllm.ir.ops:fused_add_rms_norm", "the ascend IR implementation of fused_add_rms_norm",
         since="0.21", implementation="ascend_patch.npu.ops.ir:register"),
    Seam("vllm.config.kernel:IrOpPriorityConfig.fused_add_rms_norm",
         "put the ascend fused_add_rms_norm first", since="0.21",
         implementation="ascend_patch.npu.platform:NPUPlatform.get_default_ir_op_priority"),
    Seam("vllm.v1.worker.block_table:SlotMappingMode", "skip slot mapping where vLLM asks for none",
         since="0.26", implementation="ascend_patch.npu.kv_cache:compute_slot_mapping"),
    Seam("vllm.v1.worker.gpu_worker:_num_workspace_lanes", "size vLLM's workspace lanes",
         since="0.28", implementation="ascend_patch.npu.worker:NPUWorker.init_device"),
    Seam("vllm.model_executor.layers.fused_moe:RoutedExperts",
         "recognise an expert layer (before 0.22 the class is FusedMoE)", since="0.22",
         implementation="ascend_patch.npu.quantization.modelslim:AscendModelSlimConfig.get_quant_method"),
]
