"""The engine, runner-neutral: what NPUWorker (shared by both runner generations), the platform's
engine hooks and the custom ops override or call (verified, never patched), the settings the
overlay forces and the version seams they probe for. What one runner generation overrides is
declared in its own module (:mod:`.runner_v1`)."""

from ascend_patch.overlay.declarations import Contract, Patch, Seam, Setting
from ascend_patch.patches._declare import PLATFORM, contract, platform_hook

WORKER = "ascend_patch.npu.runner.worker:NPUWorker"

_GPU_WORKER = "vllm/v1/worker/gpu_worker.py: the GPU worker NPUWorker subclasses"
OFFLOAD_AND_FREE = "ascend_patch.npu.runner.sleep_mode:OffloadAndFree"
REMOVE_WITH_OFFLOAD_AND_FREE = ("ascend-patch ships an NPU memory pool that unmaps and remaps device memory "
                                 "(vllm-ascend's camem allocator over aclrtMallocPhysical/aclrtMapMem)")

# Sleep mode by offload-and-free (ascend_patch.npu.runner.sleep_mode): what it overrides and calls
# (the runner's reload and capture: each generation's module).
_SLEEP_MODE = [
    ("vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context", "(self, tag)",
     "the CuMem pool is CUDA-only: sleep mode frees the storages themselves", WORKER, _GPU_WORKER),
    ("vllm.v1.worker.gpu_worker:Worker.sleep", "(self, level=...)",
     "sleep mode by offload-and-free (vLLM's is the CuMem pool's unmap)", WORKER, _GPU_WORKER),
    ("vllm.v1.worker.gpu_worker:Worker.wake_up", "(self, tags=...)",
     "wake by regrowing the freed storages (vLLM's is the CuMem pool's remap)", WORKER, _GPU_WORKER),
    ("vllm.compilation.cuda_graph:CUDAGraphWrapper.clear_all_graphs", "(cls)",
     "sleep drops every captured graph before the storages they address are freed", OFFLOAD_AND_FREE,
     "vllm/compilation/cuda_graph.py: every CUDAGraphWrapper (NPUGraphWrapper too)"),
]

# What the engine classes (NPUWorker, the platform, the custom ops) override or call; verified,
# never patched.
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
               remove_when=REMOVE_WITH_OFFLOAD_AND_FREE)
      for target, signature, reason, implementation, upstream in _SLEEP_MODE),
    platform_hook("is_sleep_mode_available", "(self)", "sleep mode by offload-and-free, no device memory pool"),
    contract("vllm.v1.worker.gpu_worker:init_worker_distributed_environment",
             "(vllm_config, rank, distributed_init_method=..., local_rank=..., backend=...)",
             "NPUWorker initialises HCCL/gloo with it", implementation=WORKER, upstream=_GPU_WORKER),
    contract("vllm.v1.worker.utils:request_memory",
             ("(init_snapshot, cache_config)", "(init_snapshot, cache_config, external_weight_memory=...)"),
             "NPUWorker.init_device takes vLLM's memory baseline with it", implementation=WORKER,
             upstream="vllm/v1/worker/utils.py"),
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
]

SETTINGS = [
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
    Seam("vllm.v1.worker.gpu_worker:_num_workspace_lanes", "size vLLM's workspace lanes",
         since="0.28", implementation="ascend_patch.npu.runner.worker:NPUWorker.init_device"),
    Seam("vllm.config.parallel:ParallelConfig.assigned_physical_gpu_ids",
         "a DP rank's workers take the NPUs vLLM assigned its engine (before: the rank's "
         "ASCEND_RT_VISIBLE_DEVICES slice)", since="0.24",
         implementation="ascend_patch.npu.runner.worker:device_index"),
]


# Worker-level glue both runner generations share.
KERNEL_WARMUP = [
    Patch(
        "vllm.model_executor.warmup.kernel_warmup:kernel_warmup",
        reason="CUDA/Triton/FlashInfer kernel autotuning has nothing to tune on Ascend",
        signature=("(worker)", "(worker, *, process_local_only=...)"),  # the keyword: 0.27+
        replacement="ascend_patch.npu.runner.kernel_warmup:no_kernel_warmup",
        upstream="vllm/model_executor/warmup/kernel_warmup.py: DeepGEMM/FlashInfer/Triton "
                 "warm-up runs on every platform; vllm-project/vllm#47288",
        remove_when="kernel_warmup skips platforms that have none of those kernels",
    ),
]

# vLLM's registry of Triton-kernel overrides, through which each runner generation's NPU
# implementations take the kernels' place (V1: the spec-decode kernels, 0.31+; MRV2: all of them).
KERNEL_REGISTRY = [
    Contract(
        "vllm.platforms.interface:Platform.register_triton_kernel_overrides",
        reason="register the NPU implementations of the active runner generation's Triton kernels "
               "with vLLM's registry",
        vllm=">=0.31",
        signature=("(cls)",),
        upstream="vllm/v1/worker/worker_base.py (0.31+) calls it before any worker code runs",
        remove_when="never: vLLM's own extension point; the contract only guards its signature",
        implementation="ascend_patch.npu.platform:NPUPlatform",
    ),
    Contract(
        "vllm.triton_utils.dispatcher:register_kernels",
        reason="the registry rebinds each kernel's module global and dispatcher to its override",
        vllm=">=0.31",
        signature=("(overrides)",),
        upstream="vllm/triton_utils/dispatcher.py (0.31+)",
        remove_when="never: vLLM's own extension point; the contract only guards its signature",
        implementation="ascend_patch.npu.runner:register_triton_kernel_overrides",
    ),
]
