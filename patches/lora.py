"""Declarations of LoRA (``ascend_patch.npu.lora``), shared by both patch sets: what
``PunicaWrapperNPU`` subclasses, overrides and calls of vLLM's punica interface (verified, never
patched). ``Platform.get_punica_wrapper`` names it (:mod:`.engine`)."""

from ascend_patch.overlay.declarations import Patch
from ascend_patch.patches._declare import contract

_WRAPPER = "ascend_patch.npu.lora.punica:PunicaWrapperNPU"
_BASE = "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase"
_UPSTREAM = ("vllm/lora/punica_wrapper/punica_base.py: the punica interface vLLM's LoRA layers "
             "call, which a platform's get_punica_wrapper implements")
_KEEP = "never: vLLM's own extension point; the contract only guards its signature"

# method -> (signature, what our side does with it)
_METHODS = {
    "__init__": ("(self, max_num_batched_tokens, max_batches, device, **kwargs)",
                 "the base allocates the per-token and per-request slot buffers the wrapper reads"),
    "_update_base_metadata": ("(self, mapping, lora_index_to_id, max_loras, vocab_size)",
                              "the step's slot indices, copied into the fixed buffers (no host read)"),
    "update_metadata": ("(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)",
                        "overridden: the base's prefill metadata (compute_meta's host reads) is never "
                        "built; the slot buffers a decode graph reads are rewritten in place"),
    "add_shrink": ("(self, y, x, lora_a_stacked, scale, **kwargs)", "implemented: plain torch"),
    "add_expand": ("(self, y, x, lora_b_stacked, output_slices, offset_start=..., add_inputs=..., "
                   "**kwargs)", "implemented: plain torch"),
    "add_lora_embedding": ("(self, y, x, lora_b_stacked, add_inputs=..., **kwargs)",
                           "implemented: plain torch"),
    "add_lora_linear": ("(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, "
                        "buffer=..., **kwargs)",
                        "implemented: npu_batch_gather_matmul_ where it applies, plain torch elsewhere"),
    "add_lora_logits": ("(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=..., **kwargs)",
                        "implemented: plain torch"),
}

LORA_CONTRACTS = [
    *(contract(f"{_BASE}.{method}", signature, f"PunicaWrapperNPU: {reason}", implementation=_WRAPPER,
               upstream=_UPSTREAM, remove_when=_KEEP)
      for method, (signature, reason) in _METHODS.items()),
    # The graphs vLLM captures per size with LoRA, which the capture-size stream budget counts.
    contract("vllm.lora.utils:get_captured_lora_counts", "(max_loras, specialize)",
             "called: the active-adapter counts vLLM's cudagraph dispatcher captures per size",
             implementation="ascend_patch.npu.compilation.acl_graph:lora_cases",
             upstream="vllm/v1/cudagraph_dispatcher.py _get_lora_cases: one graph per size without "
                      "adapters (cudagraph_specialize_lora) and one per get_captured_lora_counts entry",
             remove_when=_KEEP),
]

# Abstract from 0.31 (added in 0.28-0.31: absent in 0.30): the classifier heads' full linear.
FULL_LINEAR = [
    contract(f"vllm.lora.punica_wrapper.punica_base:{owner}.{method}", signature, f"PunicaWrapperNPU: {reason}", implementation=_WRAPPER,
             upstream=_UPSTREAM, remove_when=_KEEP, vllm=">=0.31")
    for owner, method, signature, reason in (
        ("PunicaWrapperABC", "apply_lora_full_linear",
         "(self, y, x, weight_stacked, bias_stacked, module_enabled)", "implemented: plain torch"),
        ("PunicaWrapperBase", "_select_full_linear_output", "(self, y, adapter_y, bias_stacked, module_enabled)",
         "called: the rows whose adapter enables the head take its output"),
    )
]

# LoRA on MoE layers (0.28+): vLLM's FusedMoEWithLoRA wants a modular-kernel method whose experts
# mix in LoRAExpertsMixin; the NPU MoE method turns modular just before vLLM wraps the layer.
_MOE_LORA = "ascend_patch.npu.lora.moe"
_MOE_LORA_UPSTREAM = ("vllm/lora/layers/fused_moe.py: FusedMoEWithLoRA asserts a non-monolithic "
                      "method whose kernel's experts support LoRA (Triton's, moe_backend='triton')")
MOE_LORA = [
    Patch("vllm.lora.layers.fused_moe:FusedMoEWithLoRA.__init__",
          reason="make the NPU MoE method modular (NPU routing on the runner's router, NPUExperts "
                 "with LoRAExpertsMixin) before vLLM checks and wraps the layer",
          vllm=">=0.28", signature=("(self, base_layer)",),
          wrapper=f"{_MOE_LORA}:modular_for_lora", upstream=_MOE_LORA_UPSTREAM,
          remove_when="vLLM picks a platform's LoRA-capable MoE experts (the OOT backend gets none)"),
    *(contract(target, signature, reason, implementation=f"{_MOE_LORA}:NPUExperts",
               upstream=_MOE_LORA_UPSTREAM, remove_when=_KEEP, vllm=">=0.28")
      for target, signature, reason in (
          ("vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin:LoRAExpertsMixin"
           ".apply_w13_lora", None, "NPUExperts adds the gate/up LoRA delta through it"),
          ("vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin:LoRAExpertsMixin"
           ".apply_w2_lora", None, "NPUExperts adds the down LoRA delta through it"),
          ("vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEExpertsModular.apply",
           None, "NPUExperts: the NPU experts in vLLM's modular-kernel form"),
          ("vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter._compute_routing",
           None, "NPURouter: the runner routes a modular NPU layer on the NPU gating op"),
      )),
    *(contract(f"{_BASE}.{method}", signature, f"PunicaWrapperNPU: {reason}", implementation=_WRAPPER,
               upstream=_UPSTREAM, remove_when=_KEEP, vllm=">=0.28")
      for method, signature, reason in (
          ("add_lora_w13", None, "implemented: plain torch, per routed copy"),
          ("add_lora_w2", None, "implemented: plain torch, per routed copy, routing-weighted"),
      )),
]
