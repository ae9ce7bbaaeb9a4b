"""The engine: what NPUWorker, NPUModelRunner, the custom ops and the sampler override or call
(verified, never patched), the model-runner glue, the settings the overlay forces and the
version seams the engine classes probe for."""

from ascend_patch.overlay.declarations import Patch, Seam, Setting
from ascend_patch.patches.platform import PLATFORM, contract, platform_hook

WORKER = "ascend_patch.npu.worker:NPUWorker"
RUNNER = "ascend_patch.npu.model_runner:NPUModelRunner"

_GPU_WORKER = "vllm/v1/worker/gpu_worker.py: the GPU worker NPUWorker subclasses"
_GPU_RUNNER = "vllm/v1/worker/gpu_model_runner.py: the V1 runner NPUModelRunner subclasses"
_OFFLOAD_AND_FREE = "ascend_patch.npu.sleep_mode:OffloadAndFree"
_REMOVE_WITH_OFFLOAD_AND_FREE = ("ascend-patch ships an NPU memory pool that unmaps and remaps device memory "
                                 "(vllm-ascend's camem allocator over aclrtMallocPhysical/aclrtMapMem)")

# Sleep mode by offload-and-free (ascend_patch.npu.sleep_mode): what it overrides and calls.
_SLEEP_MODE = [
    ("vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context", "(self, tag)",
     "the CuMem pool is CUDA-only: sleep mode frees the storages themselves", WORKER, _GPU_WORKER),
    ("vllm.v1.worker.gpu_worker:Worker.sleep", "(self, level=...)",
     "sleep mode by offload-and-free (vLLM's is the CuMem pool's unmap)", WORKER, _GPU_WORKER),
    ("vllm.v1.worker.gpu_worker:Worker.wake_up", "(self, tags=...)",
     "wake by regrowing the freed storages (vLLM's is the CuMem pool's remap)", WORKER, _GPU_WORKER),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights",
     "(self, weights_iterator=..., weights_path=..., is_checkpoint_format=...)",
     "waking from sleep level 2 reloads the freed weights from the checkpoint", _OFFLOAD_AND_FREE, _GPU_RUNNER),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model", "(self)",
     "waking from sleep captures the graphs again (the storages moved)", _OFFLOAD_AND_FREE, _GPU_RUNNER),
    ("vllm.compilation.cuda_graph:CUDAGraphWrapper.clear_all_graphs", "(cls)",
     "sleep drops every captured graph before the storages they address are freed", _OFFLOAD_AND_FREE,
     "vllm/compilation/cuda_graph.py: every CUDAGraphWrapper (NPUGraphWrapper too)"),
]

# What the engine classes (NPUWorker, NPUModelRunner, the custom ops, the sampler) override
# or call; verified, never patched.
ENGINE_CONTRACTS = [
    platform_hook("get_attn_backend_cls", "(cls, selected_backend, attn_selector_config, num_heads=...)",
                  "attention backend selection (AscendMLABackend for use_mla)"),
    platform_hook("check_and_update_config", "(cls, vllm_config)", "worker class, block size, eager mode"),
    platform_hook("apply_config_platform_defaults", "(cls, vllm_config)", "eager mode before custom-op defaults"),
    platform_hook("import_ir_kernels", "(cls)", "register the ascend vLLM-IR implementations",
                  pr="vllm-project/vllm#38807"),
    platform_hook("get_default_ir_op_priority", "(cls, vllm_config)", "ascend IR implementations first",
                  pr="vllm-project/vllm#33825"),
    platform_hook("get_punica_wrapper", "(cls)", "PunicaWrapperNPU: LoRA adapters on the NPU path"),
    platform_hook("get_device_communicator_cls", "(cls)", "NPUCommunicator: HCCL, or gloo when emulated"),
    contract("vllm.distributed.device_communicators.base_device_communicator:DeviceCommunicatorBase.__init__",
             ("(self, cpu_group, device=..., device_group=..., unique_name=..., global_ranks=..., "
              "global_world_size=...)",
              "(self, cpu_group, device=..., device_group=..., unique_name=..., global_ranks=..., "
              "global_world_size=..., use_all2all=...)"),
             "NPUCommunicator forwards every constructor variant",
             implementation="ascend_patch.npu.distributed.communicator:NPUCommunicator",
             upstream="vllm/distributed/device_communicators/base_device_communicator.py: the "
                      "communicator base a platform's get_device_communicator_cls names",
                      pr="vllm-project/vllm#47288"),
    contract("vllm.v1.worker.gpu_worker:Worker.init_device", "(self)", "NPUWorker selects the NPU device",
             implementation=WORKER, upstream=_GPU_WORKER + " (init_device hard-codes cuda)",
             remove_when="vLLM's worker initialises the device through current_platform"),
    *(contract(target, signature, reason, implementation=implementation, upstream=upstream,
               remove_when=_REMOVE_WITH_OFFLOAD_AND_FREE)
      for target, signature, reason, implementation, upstream in _SLEEP_MODE),
    platform_hook("is_sleep_mode_available", "(self)", "sleep mode by offload-and-free, no device memory pool"),
    contract("vllm.v1.worker.gpu_worker:init_worker_distributed_environment",
             "(vllm_config, rank, distributed_init_method=..., local_rank=..., backend=...)",
             "NPUWorker initialises HCCL/gloo with it", implementation=WORKER, upstream=_GPU_WORKER),
    contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", None,
             "NPUModelRunner charges the loaded weights to the emulated HBM and puts "
             "NPUGraphWrapper where vLLM built CUDAGraphWrapper for FULL graphs", implementation=RUNNER,
             upstream="NPU-only: the emulated HBM's books (a real NPU keeps its own); " + _GPU_RUNNER
             + " (load_model wraps the model in CUDAGraphWrapper, whose capture is torch.cuda.graph)",
             remove_when="never while the emulated NPU exists"),
    contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run", None,
             "NPUModelRunner measures the profiling pass's activations", implementation=RUNNER,
             upstream="NPU-only: the emulated HBM's books (a real NPU keeps its own)",
             remove_when="never while the emulated NPU exists"),
    *(contract(f"vllm.config.model:ModelConfig.{name}", None,
               "refuse models with Mamba or linear-attention layers at start-up, naming the "
               "architecture", implementation=PLATFORM,
               upstream="vllm/config/model.py: the model's layer kinds")
      for name in ("is_attention_free", "is_hybrid", "architecture")),
    contract("vllm.model_executor.custom_op:CustomOp.register_oot",
             "(cls, _decorated_op_cls=..., name=...)", "register the NPU custom ops",
             implementation="ascend_patch.npu.ops:register",
             upstream="vllm/model_executor/custom_op.py: out-of-tree custom-op registration"),
    contract("vllm.model_executor.layers.layernorm:RMSNorm.forward_native", "(self, x, residual=...)",
             "AscendRMSNorm.forward_oot takes the same arguments",
             implementation="ascend_patch.npu.ops.layernorm:AscendRMSNorm",
             upstream="vllm/model_executor/layers/layernorm.py"),
    contract("vllm.model_executor.layers.activation:SiluAndMul.forward_native", "(x)",
             "AscendSiluAndMul.forward_oot takes the same arguments",
             implementation="ascend_patch.npu.ops.activation:AscendSiluAndMul",
             upstream="vllm/model_executor/layers/activation.py"),
    contract("vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_native",
             "(self, positions, query, key=...)", "AscendRotaryEmbedding.forward_oot takes the same arguments",
             implementation="ascend_patch.npu.ops.rotary_embedding:AscendRotaryEmbedding",
             upstream="vllm/model_executor/layers/rotary_embedding/base.py"),
    contract("vllm.model_executor.layers.rotary_embedding.mrope:MRotaryEmbedding.forward_native",
             "(self, positions, query, key=..., offsets=...)",
             "AscendMRotaryEmbedding.forward_oot takes the same arguments and falls back to it for "
             "sections npu_mrope does not take",
             implementation="ascend_patch.npu.ops.rotary_embedding:AscendMRotaryEmbedding",
             upstream="vllm/model_executor/layers/rotary_embedding/mrope.py: the Qwen VL decoders' "
                      "M-RoPE"),
    contract("vllm.model_executor.layers.attention.mm_encoder_attention:MMEncoderAttention.forward_native",
             "(self, query, key, value, cu_seqlens=..., max_seqlen=..., sequence_lengths=...)",
             "AscendMMEncoderAttention.forward_oot takes the same arguments and falls back to it "
             "for cross-attention",
             implementation="ascend_patch.npu.ops.mm_encoder_attention:AscendMMEncoderAttention",
             upstream="vllm/model_executor/layers/attention/mm_encoder_attention.py: the "
                      "multimodal encoders' attention (CustomOp mm_encoder_attn)"),
    contract("vllm.model_executor.layers.attention.mm_encoder_attention:MMEncoderAttention.__init__",
             "(self, num_heads, head_size, scale=..., num_kv_heads=..., prefix=...)",
             "AscendMMEncoderAttention is built with the same arguments",
             implementation="ascend_patch.npu.ops.mm_encoder_attention:AscendMMEncoderAttention",
             upstream="vllm/model_executor/layers/attention/mm_encoder_attention.py"),
    contract("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_native",
             "(self, logits, generators, k, p)", "forward_npu finishes sampling through it",
             implementation="ascend_patch.npu.sample.sampler:forward_npu",
             upstream="vllm/v1/sample/ops/topk_topp_sampler.py"),
    contract("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch",
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
                 "forward_native; there is no platform hook for the sampler; vllm-project/vllm#43150",
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
        replacement="ascend_patch.npu.runner.kernel_warmup:no_kernel_warmup",
        upstream="vllm/model_executor/warmup/kernel_warmup.py: DeepGEMM/FlashInfer/Triton "
                 "warm-up runs on every platform; vllm-project/vllm#47288",
        remove_when="kernel_warmup skips platforms that have none of those kernels",
    ),
    contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_kv_zero_meta", "(self)",
             "NPUModelRunner zeroes new KV blocks in the Ascend layouts (block pages, MLA latent/rope planes)",
             implementation=RUNNER,
             upstream=_GPU_RUNNER + " (KVBlockZeroer is a Triton kernel over [blocks, ...] caches)",
             remove_when="vLLM zeroes blocks through the attention backend",
             pr="vllm-project/vllm#35219"),
    contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner._zero_block_ids", "(self, block_ids)",
             "NPUModelRunner zeroes new KV blocks in the Ascend layouts (block pages, MLA latent/rope planes)",
             implementation=RUNNER,
             upstream=_GPU_RUNNER + " (KVBlockZeroer is a Triton kernel over [blocks, ...] caches)",
             remove_when="vLLM zeroes blocks through the attention backend",
             pr="vllm-project/vllm#35219"),
    Patch(
        "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
        reason="vLLM computes KV slots with a Triton kernel; the NPU path uses torch ops",
        signature=("(self, num_reqs, query_start_loc, positions)",),
        replacement="ascend_patch.npu.kv_cache:compute_slot_mapping",
        upstream="vllm/v1/worker/block_table.py: compute_slot_mapping launches a Triton kernel",
        remove_when="vLLM has a torch fallback, or triton-ascend runs the kernel on the NPU",
    ),
    contract("vllm.v1.worker.utils:request_memory",
             ("(init_snapshot, cache_config)", "(init_snapshot, cache_config, external_weight_memory=...)"),
             "NPUWorker.init_device takes vLLM's memory baseline with it", implementation=WORKER,
             upstream="vllm/v1/worker/utils.py"),
]

SETTINGS = [
    Setting(
        "VLLM_USE_V2_MODEL_RUNNER", "0",
        reason="Model Runner V2 (vllm/v1/worker/gpu/) is not supported: pin the V1 runner in "
               "every process vLLM starts",
        upstream="vllm/config/vllm.py use_v2_model_runner: 0.29+ picks V2 whenever Triton "
                 "imports, which triton-ascend makes true on Ascend; vllm-project/vllm#25266",
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
         since="0.21", implementation="ascend_patch.npu.ops.ir:register",
         pr="vllm-project/vllm#36823"),
    Seam("vllm.v1.worker.block_table:SlotMappingMode", "skip slot mapping where vLLM asks for none",
         since="0.26", implementation="ascend_patch.npu.kv_cache:compute_slot_mapping",
         pr="vllm-project/vllm#40996"),
    Seam("vllm.v1.worker.gpu_worker:_num_workspace_lanes", "size vLLM's workspace lanes",
         since="0.28", implementation="ascend_patch.npu.worker:NPUWorker.init_device"),
    Seam("vllm.config.parallel:ParallelConfig.assigned_physical_gpu_ids",
         "a DP rank's workers take the NPUs vLLM assigned its engine (before: the rank's "
         "ASCEND_RT_VISIBLE_DEVICES slice)", since="0.24",
         implementation="ascend_patch.npu.worker:device_index"),
]
