"""The V1 runner generation (vLLM 0.20-0.33): what NPUModelRunner, the sampler hooks, the KV slot
mapping and the V1 spec-decode kernels override, call or patch, the setting that pins the V1
runner and the seams they probe for. A patch set whose ``RUNNER`` is ``"v1"`` composes this
module and no other runner module (``scripts/import_graph.py`` checks it); the runner-neutral
declarations are :mod:`.engine` and the other area modules.

vLLM's V1 runner launches Triton kernels on its speculative-decoding path (rejection sampling,
the draft model's input preparation); the NPU implementations
(``ascend_patch.npu.runner.v1.spec_decode.kernels``, plain torch) take their place by the route
each release has: the kernels' module globals up to 0.29, the warm-up dispatchers that own them
in 0.30, and vLLM's kernel registry from 0.31 (patching a global there no longer reaches the
dispatchers).
"""

from ascend_patch.overlay.declarations import Patch, Seam, Setting
from ascend_patch.patches._declare import contract
from ascend_patch.patches.engine import OFFLOAD_AND_FREE, REMOVE_WITH_OFFLOAD_AND_FREE

_MODULE = "ascend_patch.npu.runner.v1.model_runner"
MODEL_RUNNER = f"{_MODULE}:NPUModelRunner"
_SAMPLER = "ascend_patch.npu.runner.v1.sampler"
COMPUTE_SLOT_MAPPING = "ascend_patch.npu.runner.v1.slot_mapping:compute_slot_mapping"
_GPU_RUNNER = "vllm/v1/worker/gpu_model_runner.py: the V1 runner NPUModelRunner subclasses"

# What NPUModelRunner, sleep mode and the sampler override or call on the V1 runner; verified,
# never patched.
RUNNER_CONTRACTS = [
    contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", None,
             "NPUModelRunner charges the loaded weights to the emulated HBM and puts "
             "NPUGraphWrapper where vLLM built CUDAGraphWrapper for FULL graphs", implementation=MODEL_RUNNER,
             upstream="NPU-only: the emulated HBM's books (a real NPU keeps its own); " + _GPU_RUNNER
             + " (load_model wraps the model in CUDAGraphWrapper, whose capture is torch.cuda.graph)",
             remove_when="never while the emulated NPU exists"),
    contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run", None,
             "NPUModelRunner measures the profiling pass's activations", implementation=MODEL_RUNNER,
             upstream="NPU-only: the emulated HBM's books (a real NPU keeps its own)",
             remove_when="never while the emulated NPU exists"),
    *(contract(target, signature, reason, implementation=OFFLOAD_AND_FREE, upstream=_GPU_RUNNER,
               remove_when=REMOVE_WITH_OFFLOAD_AND_FREE)
      for target, signature, reason in (
          ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights",
           "(self, weights_iterator=..., weights_path=..., is_checkpoint_format=...)",
           "waking from sleep level 2 reloads the freed weights from the checkpoint"),
          ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model", "(self)",
           "waking from sleep captures the graphs again (the storages moved)"))),
    contract("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_native",
             "(self, logits, generators, k, p)", "forward_npu finishes sampling through it",
             implementation=f"{_SAMPLER}:forward_npu",
             upstream="vllm/v1/sample/ops/topk_topp_sampler.py"),
    contract("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch",
             "(logits, k, p, allow_cpu_sync=...)",
             "the sampler's path for rows whose top-k is above the NPU op's k limit",
             implementation=f"{_SAMPLER}:filter_top_k_top_p",
             upstream="vllm/v1/sample/ops/topk_topp_sampler.py"),
]


# Model-runner glue whose targets keep one signature (or gain only what the
# wrapper forwards) from 0.20 to 0.33; both V1 patch sets use it as is.
RUNNER_GLUE = [
    Patch(
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.__init__",
        reason="route top-k/top-p sampling through npu_top_k_top_p instead of forward_native",
        signature=(
            "(self, logprobs_mode=...)",
            "(self, logprobs_mode=..., use_fp64_gumbel=...)",  # 0.23+
        ),
        wrapper=f"{_SAMPLER}:init_wrapper",
        upstream="vllm/v1/sample/ops/topk_topp_sampler.py: __init__ gives out-of-tree platforms "
                 "forward_native; there is no platform hook for the sampler; vllm-project/vllm#43150",
        remove_when="vLLM dispatches TopKTopPSampler to a platform (forward_oot) implementation",
    ),
    Patch(
        "vllm.v1.worker.gpu_input_batch:InputBatch._make_sampling_metadata",
        reason="hand the sampler the host copy of top_k, so it routes rows between npu_top_k_top_p "
               "(k ≤ 1024) and vLLM's torch path without a per-step device sync",
        signature=("(self)",),
        wrapper=f"{_SAMPLER}:attach_host_top_k",
        upstream="vllm/v1/worker/gpu_input_batch.py: SamplingMetadata.top_k is a device tensor "
                 "copied from InputBatch.top_k_cpu (k = vocab size for requests without top-k); "
                 "the host copy never reaches TopKTopPSampler.forward",
        remove_when="vLLM dispatches TopKTopPSampler to a platform implementation that is given "
                    "the host sampling parameters",
    ),
    *(contract(f"vllm.v1.worker.gpu_model_runner:GPUModelRunner.{method}", signature,
               "NPUModelRunner zeroes new KV blocks in the Ascend layouts (block pages, MLA latent/rope planes)",
               implementation=MODEL_RUNNER,
               upstream=_GPU_RUNNER + " (KVBlockZeroer is a Triton kernel over [blocks, ...] caches)",
               remove_when="vLLM zeroes blocks through the attention backend",
               pr="vllm-project/vllm#35219")
      for method, signature in (("_init_kv_zero_meta", "(self)"), ("_zero_block_ids", "(self, block_ids)"))),
    Patch(
        "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
        reason="vLLM computes KV slots with a Triton kernel; the NPU path uses torch ops",
        signature=("(self, num_reqs, query_start_loc, positions)",),
        replacement=COMPUTE_SLOT_MAPPING,
        upstream="vllm/v1/worker/block_table.py: compute_slot_mapping launches a Triton kernel",
        remove_when="vLLM has a torch fallback, or triton-ascend runs the kernel on the NPU",
    ),
]

SETTINGS = [
    Setting(
        "VLLM_USE_V2_MODEL_RUNNER", "0",
        reason="the sets of these releases are written for the V1 runner: pin it in every "
               "process vLLM starts (Model Runner V2, vllm/v1/worker/gpu/, is runner_v2's)",
        upstream="vllm/config/vllm.py use_v2_model_runner: 0.29+ picks V2 whenever Triton "
                 "imports, which triton-ascend makes true on Ascend; vllm-project/vllm#25266",
        remove_when="the V1-runner sets are retired (vLLM 0.34 removed the V1 runner)",
    ),
]

# Names that appear inside the 0.20-0.33 range; the V1 runner's glue probes for them at run time.
SEAMS = [
    Seam("vllm.v1.worker.block_table:SlotMappingMode", "skip slot mapping where vLLM asks for none",
         since="0.26", implementation=COMPUTE_SLOT_MAPPING,
         pr="vllm-project/vllm#40996"),
]

_INSTALL = "ascend_patch.npu.runner.v1.spec_decode.install"
_KERNELS = {
    "vllm.v1.sample.rejection_sampler": (
        "rejection_greedy_sample_kernel", "rejection_random_sample_kernel", "expand_kernel",
        "sample_recovered_tokens_kernel"),
    "vllm.v1.spec_decode.utils": (
        "eagle_prepare_inputs_padded_kernel", "eagle_prepare_next_token_padded_kernel",
        "eagle_step_slot_mapping_metadata_kernel", "copy_and_expand_eagle_inputs_kernel"),
}
_NO_TRITON = ("the speculative-decoding path launches Triton kernels (kernel[grid](...)); "
              "without Triton on the NPU they are plain functions and the launch raises")
_REMOVE = "triton-ascend runs vLLM's spec-decode kernels on the NPU"

KERNEL_GLOBALS = [
    Patch(
        f"{module}:{kernel}",
        reason="run the NPU implementation (plain torch) where vLLM launches this Triton kernel",
        vllm="<0.30",
        replacement=f"{_INSTALL}:npu_kernel",
        implementation=f"ascend_patch.npu.runner.v1.spec_decode.kernels:{kernel}",
        upstream=f"vllm/{module.removeprefix('vllm.').replace('.', '/')}.py (<0.30): {_NO_TRITON}",
        remove_when=_REMOVE,
    )
    for module, kernels in _KERNELS.items() for kernel in kernels
]

KERNEL_OWNERS = [
    Patch(
        "vllm.model_executor.warmup.jit_warmup_triton_helper:triton_kernel_dispatcher_with_warmup",
        reason="a dispatcher built for a spec-decode kernel launches its NPU implementation",
        vllm="==0.30.*",
        signature=("(*, warmup_inputs, kernel=...)",),
        wrapper=f"{_INSTALL}:dispatcher_with_npu_kernel",
        upstream="vllm 0.30 model_executor/warmup/jit_warmup_triton_helper.py: each kernel is owned "
                 "by a dispatcher built at import, which launches owner.kernel, not the module "
                 "global; " + _NO_TRITON,
        remove_when="this set no longer serves 0.30, or " + _REMOVE,
    ),
]


SPEC_DECODE_KERNELS = [*KERNEL_GLOBALS, *KERNEL_OWNERS]
