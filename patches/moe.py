"""Mixture of Experts: the unquantized MoE method replaced, through CustomOp.register_oot, by
one that routes and runs the experts on the NPU ops."""

from ascend_patch.patches._declare import contract

_MOE = "vllm.model_executor.layers.fused_moe"
_MOE_METHOD = "ascend_patch.npu.ops.fused_moe:AscendUnquantizedFusedMoEMethod"
_MOE_UPSTREAM = (f"{_MOE.replace('.', '/')}/oracle/unquantized.py: an out-of-tree platform gets "
                 "the OOT backend, no kernel, and must run the experts itself")

# The unquantized MoE method vLLM builds for every MoE layer, replaced through
# CustomOp.register_oot by one that routes and runs the experts on the NPU ops.
MOE_CONTRACTS = [
    contract(f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.__init__", "(self, moe)",
             "the NPU MoE method is built like vLLM's", implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    contract(f"{_MOE}.oracle.unquantized:select_unquantized_moe_backend", "(moe_config)",
             "gives out-of-tree platforms the OOT backend: no vLLM kernel to set up",
             implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    contract(f"{_MOE}.fused_moe_method_base:FusedMoEMethodBase.is_monolithic", None,
             "the runner hands a monolithic method the router logits: routing runs on the NPU",
             implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    contract(f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.apply_monolithic",
             "(self, layer, x, router_logits, input_ids=...)",
             "route, dispatch, run and combine the experts through the kernel seam",
             implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    contract(f"{_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.process_weights_after_loading",
             "(self, layer)", "expert weights to the grouped-matmul [experts, in, out] layout, once",
             implementation=_MOE_METHOD, upstream=_MOE_UPSTREAM),
    contract(f"{_MOE}.router.grouped_topk_router:grouped_topk",
             ("(hidden_states, gating_output, topk, renormalize, num_expert_group=..., "
              "topk_group=..., scoring_func=..., routed_scaling_factor=..., "
              "e_score_correction_bias=...)",
              "(hidden_states, gating_output, topk, renormalize, num_expert_group=..., "
              "topk_group=..., scoring_func=..., routed_scaling_factor=..., "
              "e_score_correction_bias=..., is_padding=...)"),  # 0.34: padded rows' routing
             "routes, as vLLM's GroupedTopKRouter does, the grouped layers npu_moe_gating_top_k "
             "cannot take (2 or fewer experts per group, sigmoid weights without renormalisation)",
             implementation="ascend_patch.npu.ops.fused_moe:Routing",
             upstream=f"{_MOE.replace('.', '/')}/router/grouped_topk_router.py: vLLM's grouped "
                      "top-k in torch (DeepSeek-V2/V3), called by name by GroupedTopKRouter",
             remove_when="the NPU gating op takes every grouping and normalisation vLLM's "
                         "grouped top-k does", pr="vllm-project/vllm#30623"),
]
