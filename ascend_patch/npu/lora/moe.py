"""LoRA on mixture-of-experts layers (vLLM 0.28-0.33).

vLLM's ``FusedMoEWithLoRA`` takes a non-monolithic MoE method whose modular kernel's experts
class mixes in ``LoRAExpertsMixin`` (on CUDA: Triton's experts and the Triton ``fused_moe_lora``
kernels), swaps the layer's method for ``FusedMoEModularMethod`` over that kernel, and hands the
experts each step's ``MoELoRAContext``. The NPU MoE method is monolithic (the router logits come
to it), so :func:`modular_for_lora` turns a layer's method modular just before vLLM wraps the
layer, keeping every launch the monolithic path makes:

- routing: :class:`NPURouter`, the runner's router, calls the layer's NPU gating op
  (:class:`~ascend_patch.npu.ops.fused_moe.Routing`), as the monolithic path does;
- experts: :class:`NPUExperts`, vLLM's modular-kernel form of
  :func:`~ascend_patch.npu.ops.fused_moe.fused_experts` (``npu_moe_init_routing_v2``,
  ``npu_grouped_matmul``, ``npu_swiglu``, the combine op), whose two LoRA hooks call the
  mixin's ``apply_w13_lora``/``apply_w2_lora``, i.e. the punica wrapper's ``add_lora_w13``/
  ``add_lora_w2`` (plain torch: torch_npu has no MoE LoRA op), on the token-major rows vLLM's
  interface defines: the gate/up delta is added to the grouped matmul's rows through the
  dispatch's row index, the down delta (weighted by the routing weights, as vLLM's is) to the
  combined output.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from ascend_patch.npu.ops.fused_moe import AscendUnquantizedFusedMoEMethod, fused_experts


class NPURouter(BaseRouter):
    """The runner's router for a modular NPU MoE layer: the layer's NPU gating op."""

    def __init__(self, replaced: BaseRouter, routing) -> None:
        super().__init__(top_k=routing.top_k, global_num_experts=replaced.global_num_experts,
                         eplb_state=replaced.eplb_state)
        self.routing = routing
        self._method_type = replaced.routing_method_type

    @property
    def routing_method_type(self):
        return self._method_type

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        return self.routing(hidden_states, router_logits)


class NPUExperts(LoRAExpertsMixin, mk.FusedMoEExpertsModular):
    """The NPU experts (dispatch, grouped matmuls, SwiGLU, combine) in vLLM's modular form,
    with the LoRA hooks of vLLM's ``LoRAExpertsMixin``."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # built only by the NPU method

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation) -> bool:
        return activation.value == "silu"

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return not moe_parallel_config.use_all2all_kernels

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # the combine op weighs and sums

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (0,), (0,), (M, K)  # the NPU ops allocate their own outputs

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        context = self._lora_context
        hooks = None if context is None else _LoRAHooks(self, context, hidden_states, w1, w2,
                                                        topk_weights, topk_ids, expert_map)
        output.copy_(fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map,
                                   lora=hooks))


class _LoRAHooks:
    """One forward's LoRA deltas, token-major as vLLM's ``add_lora_w13``/``add_lora_w2`` take
    them (row ``t * k + j``: token t's j-th expert), moved to and from the dispatch's
    expert-sorted rows through its row index."""

    def __init__(self, experts, context, x, w1, w2, weights, ids, expert_map):
        self.experts, self.context, self.x, self.w1, self.w2 = experts, context, x, w1, w2
        self.weights, self.ids, self.expert_map = weights, ids, expert_map
        self.meta = None

    def gate_up(self, rows: torch.Tensor, sorted_rows: torch.Tensor) -> None:
        tokens, top_k = self.ids.shape
        delta = rows.new_zeros(tokens, top_k, rows.shape[-1])
        self.meta = self.experts.apply_w13_lora(
            self.context, y=delta, x=self.x, topk_ids=self.ids, topk_weights=self.weights,
            expert_map=self.expert_map, w1=self.w1, w2=self.w2, num_tokens=tokens,
            top_k_num=top_k)
        rows.index_add_(0, sorted_rows, delta.view(tokens * top_k, -1))

    def down(self, out: torch.Tensor, hidden: torch.Tensor, sorted_rows: torch.Tensor) -> None:
        tokens, top_k = self.ids.shape
        delta = out.new_zeros(tokens, top_k, out.shape[-1])
        sorted_ids, expert_ids, padded, token_slots = self.meta
        self.experts.apply_w2_lora(
            self.context, y=delta, x=hidden.index_select(0, sorted_rows),
            topk_weights=self.weights, sorted_token_ids_lora=sorted_ids,
            expert_ids_lora=expert_ids, num_tokens_post_padded_lora=padded,
            token_lora_mapping=token_slots, num_tokens=tokens, w1=self.w1, w2=self.w2,
            top_k_num=top_k)
        out.add_(delta.sum(dim=1))


def modular_for_lora(wrapped, instance, args, kwargs):
    """``FusedMoEWithLoRA.__init__``: the NPU MoE method made modular (routing on the runner's
    :class:`NPURouter`, experts on :class:`NPUExperts`) before vLLM checks and wraps it."""
    runner = args[0] if args else kwargs["base_layer"]
    layer = runner.routed_experts
    method = layer.quant_method
    if isinstance(method, AscendUnquantizedFusedMoEMethod):  # not a seam: ours
        method.moe_quant_config = method.get_fused_moe_quant_config(layer)
        method.moe_kernel = mk.FusedMoEKernel(
            maybe_make_prepare_finalize(moe=method.moe, quant_config=method.moe_quant_config,
                                        allow_new_interface=True),
            NPUExperts(method.moe, method.moe_quant_config))
        method.modular = True
        runner.router = NPURouter(runner.router, layer.ascend_routing)
    return wrapped(*args, **kwargs)
