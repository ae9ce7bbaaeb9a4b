"""Mixture-of-experts layers on the kernel seam.

vLLM builds every MoE layer's expert computation through a quant method; without
quantization that is ``UnquantizedFusedMoEMethod``, a registered custom op, which an
out-of-tree platform replaces with ``CustomOp.register_oot`` (vLLM 0.20–0.33). On such a
platform vLLM selects no kernel of its own (the ``OOT`` backend), so the method must do
all the work. :class:`AscendUnquantizedFusedMoEMethod` does it *monolithically*: vLLM's
runner hands it the router logits (``apply_monolithic``, the path vLLM's own CPU backend
used up to 0.27), and it routes, dispatches, computes and combines on the NPU:

1. routing: ``npu_moe_gating_top_k_softmax`` (softmax top-k), its ``_v2`` with ``renorm=1``
   (softmax top-k renormalised, in the same launch) or ``npu_moe_gating_top_k``
   (sigmoid/softmax scores, score-correction bias, grouped top-k, routed scaling), with
   exactly the semantics of vLLM's own routers for the same layer attributes;
2. dispatch: ``npu_moe_init_routing_v2`` sorts the token copies by expert and counts
   the rows each expert gets;
3. experts: ``npu_grouped_matmul`` (gate and up projections) → ``npu_swiglu`` →
   ``npu_grouped_matmul`` (down projection), the counts as the group list;
4. combine: ``npu_moe_token_unpermute`` (bf16) or ``npu_moe_finalize_routing`` (fp16,
   fp32; the envelopes their docs give) weighs each copy by its routing weight and sums
   them back per token.

Shared experts (Qwen2-MoE's gated one, DeepSeek's) stay vLLM's: its runner runs them
beside the routed experts. Tensor parallelism splits each expert's intermediate size and
vLLM reduces the outputs; expert parallelism gives each rank a subset of the experts
(vLLM's ``expert_map``), each rank combines the copies routed to its own experts, and the
same reduction sums the ranks' partial outputs.

Grouped routing the NPU gating op cannot take (its documented limits: more than 2 experts
per group, at most 2048 experts..., as its reference checks them; or sigmoid weights without
renormalisation, which the op always renormalises) runs vLLM's own ``grouped_topk``, the
torch function vLLM's ``GroupedTopKRouter`` calls for the layer (same module and signature in
0.20–0.33), and the model runner logs one warning per model naming the layers and the limit
(:func:`report_routing`). Routing vLLM would not run through ``grouped_topk`` either (a model's
own Python routing function, other scoring functions, ungrouped routing the ops cannot take)
is refused at load time, naming the model and the layer.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from ascend_patch.npu import kernels

logger = logging.getLogger("vllm.ascend_patch")


class UnsupportedMoEError(NotImplementedError):
    """An MoE layer asks for something the NPU MoE path cannot do."""


def _layer_name(layer) -> str | None:
    return layer.layer_name or None


def _model_name() -> str:
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config().model_config  # None outside an engine's config
    return (config.model if config is not None else None) or "this model"


def _where(layer) -> str:
    """``model: MoE layer 'name'`` for error messages."""
    name = _layer_name(layer)
    return f"{_model_name()}: MoE layer {name!r}" if name else f"{_model_name()}: an MoE layer"


class Routing:
    """The routing one MoE layer asks for, resolved once at load time from the layer's
    attributes into the NPU gating op and its arguments, or into vLLM's ``grouped_topk``
    where the op cannot take it (``npu_limit`` says why)."""

    def __init__(self, layer) -> None:
        self.layer = _layer_name(layer) or "an MoE layer"
        self.top_k = layer.top_k
        self.renormalize = layer.renormalize
        self.scoring = layer.scoring_func
        self.bias = layer.e_score_correction_bias
        self.scaling = float(layer.routed_scaling_factor or 1.0)
        groups, group_top_k = layer.num_expert_group, layer.topk_group
        self.grouped = bool(layer.use_grouped_topk) and not (
            (groups or 1) <= 1 and (group_top_k or 1) <= 1
        )
        self.groups = groups if self.grouped else 1
        self.group_top_k = group_top_k if self.grouped else 1
        custom = layer.custom_routing_function
        problem = None
        if custom is not None:
            name = getattr(custom, "__qualname__", custom)  # not a seam: any callable
            problem = (f"its own routing function {name!r}, "
                       "which no NPU gating op computes")
        elif self.scoring not in ("softmax", "sigmoid"):
            problem = (f"scoring function {self.scoring!r} (the NPU gating ops do softmax and "
                       "sigmoid)")
        if problem is not None:
            raise UnsupportedMoEError(f"{_where(layer)} uses {problem}; ascend-patch cannot run "
                                      "it on the NPU")
        # vLLM applies routed_scaling_factor only for grouped or biased routing.
        self.apply_scaling = self.grouped or self.bias is not None
        self.plain_softmax = self.scoring == "softmax" and not self.grouped and self.bias is None
        experts = layer.global_num_experts
        self.npu_limit = self._npu_limit(experts)
        # vLLM's GroupedTopKRouter routes through grouped_topk only for a grouping that divides
        # the experts; anything else it sends to its CUDA top-k kernels, which Ascend lacks.
        by_grouped_topk = self.grouped and experts > self.groups and experts % self.groups == 0
        if self.npu_limit is not None and not by_grouped_topk:
            raise UnsupportedMoEError(f"{_where(layer)} uses routing the NPU gating op cannot take "
                                      f"({self.npu_limit}); ascend-patch cannot run it on the NPU")

    def _npu_limit(self, experts: int) -> str | None:
        """Why the NPU gating op cannot compute this routing, or None. Its documented limits
        are its reference's contract, checked here on host stand-ins for one token."""
        if self.scoring == "sigmoid" and not self.renormalize:
            return ("sigmoid scores without renormalisation: npu_moe_gating_top_k always "
                    "renormalises sigmoid weights")
        bias = None if self.bias is None else torch.zeros(experts)
        name, args, kwargs = self._gating(torch.zeros(1, experts), bias)
        return kernels.contract_violation(name, *args, **kwargs)

    def _gating(self, logits, bias):
        """The NPU gating op for this routing and its arguments: ``(name, args, kwargs)``."""
        if self.plain_softmax and self.renormalize:  # the softmax of the top k: renormalised
            return "moe_gating_top_k_softmax_v2", (logits,), {"k": self.top_k, "renorm": 1}
        if self.plain_softmax:
            return "moe_gating_top_k_softmax", (logits,), {"k": self.top_k}
        # The op renormalises sigmoid weights itself (and scales after that); softmax weights
        # are renormalised by the caller, so scaling waits until then.
        sigmoid = self.scoring == "sigmoid"
        return "moe_gating_top_k", (logits, self.top_k), dict(
            bias=bias, k_group=self.group_top_k, group_count=self.groups,
            group_select_mode=1 if self.bias is not None else 0, renorm=0,
            norm_type=1 if sigmoid else 0, out_flag=False,
            routed_scaling_factor=self.scaling if sigmoid and self.apply_scaling else 1.0,
            eps=1e-20)

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert ids int32 [T, k])`` for tokens x [T, H] and their router
        logits [T, E]; the weights fp32, or in the logits' dtype for plain softmax routing."""
        if self.npu_limit is not None:  # as vLLM's GroupedTopKRouter calls it
            return grouped_topk(
                hidden_states=x, gating_output=logits, topk=self.top_k,
                renormalize=self.renormalize, num_expert_group=self.groups,
                topk_group=self.group_top_k, scoring_func=self.scoring,
                routed_scaling_factor=self.scaling, e_score_correction_bias=self.bias)
        if self.plain_softmax:
            # One launch: the softmax ops take the logits in the model's dtype and return the
            # weights in it, the dtype the combine weighs the rows in (vLLM's routers return fp32
            # weights; the combine rounds them to the rows' dtype all the same).
            name, args, kwargs = self._gating(logits, None)
            weights, ids, _ = getattr(kernels, name)(*args, **kwargs)
            return weights, ids
        logits = logits.float()  # the op returns weights in the logits' dtype; vLLM's are fp32
        name, args, kwargs = self._gating(logits, None if self.bias is None else self.bias.float())
        weights, ids, _ = getattr(kernels, name)(*args, **kwargs)
        if self.scoring == "sigmoid":
            return weights.float(), ids
        weights = weights.float()
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.apply_scaling and self.scaling != 1.0:
            weights = weights * self.scaling
        return weights, ids


def prepare_layer(layer, has_bias: bool) -> None:
    """Refuse what the NPU expert path cannot run, and resolve the layer's routing once."""
    activation = layer.activation.value
    problems = {
        f"activation {activation!r} (the NPU path is SwiGLU: npu_swiglu)": activation != "silu",
        "expert biases": bool(has_bias),
        "router weights applied to the input": bool(layer.apply_router_weight_on_input),
    }
    unsupported = [name for name, used in problems.items() if used]
    if unsupported:
        raise UnsupportedMoEError(f"{_where(layer)} uses {', '.join(unsupported)}; not "
                                  "supported on the NPU yet")
    layer.ascend_routing = Routing(layer)


class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``UnquantizedFusedMoEMethod`` on the NPU: routing and experts through the kernel seam."""

    modular = False  # set for LoRA (ascend_patch.npu.lora.moe): routing by the runner's router

    @property
    def is_monolithic(self) -> bool:
        # the router logits come here: routing runs on the NPU gating ops
        return not self.modular

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)  # vLLM does nothing more for OOT
        prepare_layer(layer, self.moe.has_bias)
        # npu_grouped_matmul takes the weight as [experts, in, out]: transpose once, here,
        # never per step. vLLM keeps [experts, out, in].
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data = param.data.transpose(1, 2).contiguous()

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        weights, ids = layer.ascend_routing(x, router_logits)
        return fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.expert_map)


def report_routing(model: torch.nn.Module, model_name: str) -> None:
    """Log once per model which MoE layers run vLLM's grouped top-k instead of the NPU gating
    op, and why: one warning per reason."""
    layers = [module.ascend_routing for module in model.modules()
              if isinstance(getattr(module, "ascend_routing", None), Routing)]  # not a seam: ours
    by_limit: dict[str, list[str]] = {}
    for routing in layers:
        if routing.npu_limit is not None:
            by_limit.setdefault(routing.npu_limit, []).append(repr(routing.layer))
    for limit, names in by_limit.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning("ascend-patch: %s: MoE layer(s) %s (%d of %d) route with vLLM's grouped "
                       "top-k in torch ops instead of the NPU gating op: %s", model_name, shown,
                       len(names), len(layers), limit)


def fused_experts(x, w13, w2, weights, ids, expert_map=None, scales=None, lora=None):
    """Routed experts for tokens ``x`` [T, H]: dispatch, SwiGLU MLP per expert, combine.

    ``w13`` is [E_local, H, 2I] and ``w2`` [E_local, I, H]. Under expert parallelism
    ``expert_map`` maps global expert ids to this rank's (-1 elsewhere): a copy routed to
    another rank's expert gets weight 0 and is parked on local expert 0. That keeps every
    documented contract (the counts sum to the dispatched rows, the combine index is a
    permutation) with no host sync, at the price of computing those copies; in decode the
    grouped matmul is bound by reading the weights, which parking adds none of.

    ``scales`` = ``(w13_scale [E, 2I], w2_scale [E, H])`` makes it dynamic W8A8: int8 weights,
    the dispatch quantises each row per token (init_routing quant_mode=1), npu_dynamic_quant
    requantises the SwiGLU output, and both grouped matmuls dequantise with the per-channel and
    per-token scales into bf16 (bf16 scales) or fp16 (fp32 scales; the op has no fp32 output,
    so an fp32 model's experts compute in fp16).

    ``lora`` (:class:`ascend_patch.npu.lora.moe.NPUExperts`'s hooks) adds the adapters' deltas
    to the gate/up rows before SwiGLU and to the combined output.
    """
    tokens, top_k = ids.shape
    if expert_map is not None:
        # index_select, not expert_map[ids]: advanced indexing may take a boolean mask, so it
        # counts as a host sync, which an ACL graph (on by default, EP included) cannot hold.
        local = expert_map.index_select(0, ids.flatten().long()).view(ids.shape)
        weights = torch.where(local >= 0, weights, 0.0)
        ids = local.clamp_(min=0).to(torch.int32)
    experts = w13.shape[0]
    expanded, expanded_row_idx, counts, row_scale = kernels.moe_init_routing_v2(
        x, ids, active_num=tokens * top_k, expert_num=experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, experts], quant_mode=-1 if scales is None else 1,
    )
    groups = {"group_list": counts, "split_item": 2, "group_type": 0, "group_list_type": 1}
    if scales is None:
        gate_up = kernels.grouped_matmul([expanded], [w13], **groups)[0]
        if lora is not None:
            sorted_rows = expanded_row_idx.long()
            lora.gate_up(gate_up, sorted_rows)
        hidden = kernels.swiglu(gate_up, dim=-1)
        down = kernels.grouped_matmul([hidden], [w2], **groups)[0]
    else:
        w13_scale, w2_scale = scales
        out_dtype = torch.bfloat16 if w13_scale.dtype == torch.bfloat16 else torch.float16
        gate_up = kernels.grouped_matmul([expanded], [w13], scale=[w13_scale],
                                         per_token_scale=[row_scale], output_dtype=out_dtype,
                                         **groups)[0]
        hidden, hidden_scale = kernels.dynamic_quant(kernels.swiglu(gate_up, dim=-1))
        down = kernels.grouped_matmul([hidden], [w2], scale=[w2_scale],
                                      per_token_scale=[hidden_scale], output_dtype=out_dtype,
                                      **groups)[0]
    out = combine(down, expanded_row_idx, weights.to(down.dtype))
    if lora is not None:
        lora.down(out, hidden, sorted_rows)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def combine(rows, expanded_row_idx, weights):
    """``out[t] = sum_j weights[t, j] * rows[expanded_row_idx[t * k + j]]``, on the op whose
    documented envelope holds the rows' dtype (kernels/moe.py): ``npu_moe_token_unpermute``
    for bf16, ``npu_moe_finalize_routing`` for fp16 and fp32, whose only documented mode
    (``drop_pad_mode=0``) reads the index by column."""
    if rows.dtype == torch.bfloat16:
        return kernels.moe_token_unpermute(rows, expanded_row_idx, probs=weights)
    tokens, top_k = weights.shape
    by_column = expanded_row_idx.view(tokens, top_k).t().contiguous().view(-1)
    return kernels.moe_finalize_routing(rows, None, None, None, weights, by_column, None,
                                        drop_pad_mode=0)
