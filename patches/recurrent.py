"""Recurrent layers (Mamba-2 mixers, gated DeltaNet) on the composed path: vLLM launches Triton
kernels for their convolution, selective scan and gated delta rule, which do not exist on the
NPU; the functions that launch them are replaced, by name, with the composed path's
(``ascend_patch.npu.ops.recurrent``), and the copies the layers imported are rebound with them."""

from ascend_patch.overlay.declarations import Contract, Patch

_OPS = "vllm.model_executor.layers.mamba.ops"
_COMPOSED = "ascend_patch.npu.ops.recurrent"
_NO_TRITON = ("launches Triton kernels (CPU builds swap in vllm._C kernels), neither of which "
              "exists on the NPU")
_REMOVE = "a torch_npu or triton-ascend op takes vLLM's convolution and selective scan"
_FLA = "vllm.third_party.flash_linear_attention.ops"

# Served and proven from 0.33 (the V1 runner) and 0.34 (Model Runner V2's hybrid model state): the
# mixers' calls changed across 0.20–0.32.
RELEASES = ">=0.33"

RECURRENT = [
    Patch(
        f"{_OPS}.{module}:{name}",
        reason=f"run {what} on the composed path (generic torch ops per sequence)",
        vllm=RELEASES,
        signature=(signature,),
        replacement=f"{_COMPOSED}:instead",
        implementation=f"{_COMPOSED}:{name}",
        upstream=f"vllm/model_executor/layers/mamba/ops/{module}.py: {_NO_TRITON}",
        remove_when=_REMOVE,
    )
    for module, name, what, signature in (
        ("causal_conv1d", "causal_conv1d_fn", "the prefill causal convolution",
         "(x, weight, bias, conv_states, query_start_loc, cache_indices=..., "
         "has_initial_state=..., activation=..., pad_slot_id=..., null_block_id=..., "
         "metadata=..., validate_data=...)"),
        ("causal_conv1d", "causal_conv1d_update", "the decode causal convolution",
         "(x, conv_state, weight, bias=..., activation=..., conv_state_indices=..., "
         "num_accepted_tokens=..., query_start_loc=..., max_query_len=..., null_block_id=..., "
         "validate_data=..., out=...)"),
        ("ssd_combined", "mamba_chunk_scan_combined_varlen", "Mamba-2's chunked prefill scan",
         "(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, "
         "seq_idx, out, D=..., z=..., dt_bias=..., initial_states=..., dt_softplus=..., "
         "dt_limit=..., return_intermediate_states=..., state_dtype=..., final_states_out=..., "
         "final_state_indices=...)"),
        ("ssu_dispatch", "selective_state_update", "Mamba-2's decode state update",
         "(state, x, dt, A, B, C, D, dt_bias, z=..., dt_softplus=..., state_batch_indices=..., "
         "dst_state_batch_indices=..., null_block_id=..., out=..., num_accepted_tokens=..., "
         "cu_seqlens=..., is_blackwell=...)"),
    )
] + [
    Patch(
        f"{_FLA}.{module}:{name}",
        reason=f"run {what} on the composed path (generic torch ops per sequence)",
        vllm=RELEASES,
        signature=(signature,),
        replacement=f"{_COMPOSED}:instead",
        implementation=f"{_COMPOSED}:{name}",
        upstream=f"vllm/third_party/flash_linear_attention/ops/{module}.py: FLA's Triton "
                 "kernels, which do not exist on the NPU",
        remove_when="a torch_npu or triton-ascend op takes vLLM's gated delta rule as vLLM calls it",
    )
    for module, name, what, signature in (
        ("fused_gdn_prefill_post_conv", "fused_post_conv_prep",
         "gated DeltaNet's split, L2 norm and gates after the prefill convolution",
         "(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, "
         "apply_l2norm=..., output_g_exp=...)"),
        ("chunk", "chunk_gated_delta_rule", "the gated delta rule's chunked prefill",
         "(q, k, v, g, beta, scale=..., initial_state=..., output_final_state=..., "
         "cu_seqlens=..., chunk_indices=..., chunk_offsets=..., use_qk_l2norm_in_kernel=..., "
         "core_attn_out=...)"),
        ("fused_sigmoid_gating", "fused_sigmoid_gating_delta_rule_update",
         "the gated delta rule's decode (gates and state update)",
         "(A_log, a, b, dt_bias, q, k, v, beta=..., threshold=..., scale=..., initial_state=..., "
         "inplace_final_state=..., cu_seqlens=..., ssm_state_indices=..., "
         "num_accepted_tokens=..., use_qk_l2norm_in_kernel=..., is_kda=...)"),
        ("fused_recurrent", "fused_recurrent_gated_delta_rule_packed_decode",
         "the gated delta rule's packed decode (vLLM's default when no request prefills)",
         "(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, "
         "use_qk_l2norm_in_kernel=...)"),
    )
] + [
    Contract(
        "vllm.v1.kv_cache_interface:MambaSpec",
        reason="allocate_kv_cache's wrapper keeps vLLM's [blocks, 1, 1, page] state views of "
               "the layers of a Mamba group (the layer unpacks its conv and SSM states itself)",
        vllm=RELEASES,
        upstream="vllm/v1/kv_cache_interface.py: the spec of a recurrent layer's state cache",
        remove_when="never: vLLM's spec class; the contract only guards its presence",
        implementation="ascend_patch.npu.runner.kv_allocation:allocate_kv_cache",
    ),
    Patch(
        "vllm.engine.arg_utils:EngineArgs._set_default_chunked_prefill_and_prefix_caching_args",
        reason="prefix caching left unset is turned off, in one line, for a model whose recurrent "
               "states the NPU path serves but does not cache (asked for, it is refused)",
        vllm=RELEASES,
        signature=("(self, model_config)",),
        wrapper="ascend_patch.npu.ops.recurrent_layers:recurrent_states_uncached_by_default",
        upstream="vllm/engine/arg_utils.py: prefix caching defaults to on for hybrid models whose "
                 "Mamba cache mode 'align' checkpoints states (Triton kernels)",
        remove_when="the NPU path caches recurrent states (align mode)",
    ),
]

# From 0.34 Qwen3-Next's gated DeltaNet gathers and scatters its prefill states with two Triton
# kernels of their own (v0_34 composes these beside RECURRENT).
STATE_COPIES = [
    Patch(
        f"{_OPS}.{name}:{name}",
        reason=f"run {what} on the composed path (one torch index op)",
        signature=signature,
        replacement=f"{_COMPOSED}:instead",
        implementation=f"{_COMPOSED}:{name}",
        upstream=f"vllm/model_executor/layers/mamba/ops/{name}.py (called by Qwen3-Next's gated "
                 f"DeltaNet from 0.34): a Triton kernel that asserts a CUDA or XPU tensor",
        remove_when="vLLM gives these row copies a torch fallback or a platform hook",
    )
    for name, what, signature in (
        ("gather_initial_states", "the gated delta rule's gather of prefill initial states",
         ("(state, indices, has_initial_state)",)),
        # No signature: vLLM's warm-up decorator shows its Triton kernel's parameters at runtime.
        ("scatter_states", "the gated delta rule's scatter of prefill final states", None),
    )
]
