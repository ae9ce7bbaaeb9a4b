"""Declarations of LoRA (``ascend_patch.npu.lora``), shared by both patch sets: what
``PunicaWrapperNPU`` subclasses, overrides and calls of vLLM's punica interface (verified, never
patched). ``Platform.get_punica_wrapper`` names it (:mod:`.engine`)."""

from ascend_patch.patches.platform import contract

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
