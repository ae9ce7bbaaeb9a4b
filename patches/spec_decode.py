"""Declarations of speculative decoding (ngram, draft_model), shared by both patch sets.

vLLM's V1 runner launches Triton kernels on its speculative-decoding path (rejection sampling,
the draft model's input preparation); the NPU implementations
(``ascend_patch.npu.spec_decode.kernels``, plain torch) take their place by the route each release
has: the kernels' module globals up to 0.29, the warm-up dispatchers that own them in 0.30, and
vLLM's kernel registry from 0.31 (patching a global there no longer reaches the dispatchers).
"""

from ascend_patch.overlay.declarations import Contract, Patch

_INSTALL = "ascend_patch.npu.spec_decode.install"
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
        implementation=f"ascend_patch.npu.spec_decode.kernels:{kernel}",
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

KERNEL_REGISTRY = [
    Contract(
        "vllm.platforms.interface:Platform.register_triton_kernel_overrides",
        reason="register the NPU implementations of the spec-decode kernels with vLLM's registry",
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
        implementation=f"{_INSTALL}:register",
    ),
]

DRAFT_MODEL = [
    Contract(
        "vllm.platforms.interface:Platform.check_runner_kv_caches_multi_layer",
        reason="a draft model's layers share the target's layer indices: the NPU runner never "
               "indexes its flat KV list by layer, so the platform allows it",
        vllm=">=0.28",
        signature=("(cls)",),
        upstream="vllm/v1/worker/utils.py bind_kv_cache (0.28+) asks the platform when two KV "
                 "layers share an index; the default raises",
        remove_when="never: vLLM's own extension point; the contract only guards its signature",
        implementation="ascend_patch.npu.platform:NPUPlatform",
    ),
]

SPEC_DECODE = [*KERNEL_GLOBALS, *KERNEL_OWNERS, *KERNEL_REGISTRY, *DRAFT_MODEL]
