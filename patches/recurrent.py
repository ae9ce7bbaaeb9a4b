"""Recurrent layers (Mamba-2 mixers) on the composed path: vLLM launches Triton kernels for
their convolution and selective scan, which do not exist on the NPU; the functions that launch
them are replaced, by name, with the composed path's (``ascend_patch.npu.ops.recurrent``), and
the copies ``mamba_mixer2`` imported are rebound with them."""

from ascend_patch.overlay.declarations import Contract, Patch

_OPS = "vllm.model_executor.layers.mamba.ops"
_COMPOSED = "ascend_patch.npu.ops.recurrent"
_NO_TRITON = ("launches Triton kernels (CPU builds swap in vllm._C kernels), neither of which "
              "exists on the NPU")
_REMOVE = "a torch_npu or triton-ascend op takes vLLM's convolution and selective scan"

# Served and proven on 0.33 only: the mixers' calls changed across 0.20–0.32.
RELEASES = "==0.33.*"

MAMBA2 = [
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
    Contract(
        "vllm.v1.kv_cache_interface:MambaSpec",
        reason="allocate_kv_cache's wrapper keeps vLLM's [blocks, 1, 1, page] state views of "
               "the layers of a Mamba group (the layer unpacks its conv and SSM states itself)",
        vllm=RELEASES,
        upstream="vllm/v1/kv_cache_interface.py: the spec of a recurrent layer's state cache",
        remove_when="never: vLLM's spec class; the contract only guards its presence",
        implementation="ascend_patch.npu.kv_cache:allocate_kv_cache",
    ),
]
