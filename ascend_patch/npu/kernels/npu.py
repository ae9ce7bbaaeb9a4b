"""The real kernels: thin calls of the documented torch_npu ops.

This is the only module in the project that touches torch_npu.

torch_npu is imported on the first call, never at import time: importing it initialises the NPU
runtime (and without the CANN toolkit it breaks ``import torch`` itself), so merely selecting this
backend must stay free. Each kernel keeps the signature of its ``reference`` twin; arguments go to
torch_npu under the names the op schemas use (``csrc/aten/npu_native_functions_by_codegen.yaml``
and the ATB ``m.def`` strings in ``lib/libop_plugin_atb.so`` of the wheel): torch_npu sets each op
as the dispatcher's own ``torch.ops.npu.<op>`` / ``torch.ops.atb.<op>`` (``_init/core/_exports.py``,
``utils/custom_ops.py``, ``op_plugin/atb/_atb_ops.py``), which binds by those names, ``self``
included. tests/test_npu_wheels.py replays every call the emulated engine makes against each
torch-npu wheel the matrix names.

The device-runtime queries at the end (probe, names, memory, seeding) live here for the same
reason: they are torch_npu calls; :mod:`ascend_patch.npu.device` and the loader reach the NPU through
them.
"""

import functools
import importlib
import importlib.util
import sys


def _torch_npu():
    # torch.compile traces the layer ops through here: a lookup it can trace, an import it cannot.
    module = sys.modules.get("torch_npu")
    return module if module is not None else importlib.import_module("torch_npu")


def recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None,
                               actual_seq_lengths=None, ssm_state_indices=None,
                               num_accepted_tokens=None, g=None, gk=None):
    # The in-place form (state Tensor(a!)): the state cache's slots advance where vLLM keeps them.
    return _torch_npu().npu_recurrent_gated_delta_rule(
        query, key, value, state, beta=beta, scale=scale, actual_seq_lengths=actual_seq_lengths,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens, g=g, gk=gk)


def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    # npu_scatter_pa_kv_cache rather than ATB _npu_reshape_and_cache: both write vLLM's ND
    # [num_blocks, block_size, KVH, D] caches, but this one has a torch_npu API doc stating its
    # contract (equal dtypes, int32/int64 slots in range, no duplicates) and needs no NNAL. The
    # doc allows cache_mode "Norm" (ND) on A2/A3, but vllm-ascend writes with it only on its
    # A5/NZ path and uses _npu_reshape_and_cache on A2/A3, so this call has no production
    # precedent there: `ascend-patch verify` exercises it. Its default mode is "PA_NZ".
    _torch_npu().npu_scatter_pa_kv_cache(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slot_mapping, cache_mode="Norm",
    )


def fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    block_table=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads,
    num_key_value_heads,
    scale,
    pre_tokens=2147483647,
    next_tokens=2147483647,
    input_layout="TND",
    block_size=0,
    sparse_mode=0,
):
    # query, key, value positionally, as the documented prototype has them before its `*`.
    return _torch_npu().npu_fused_infer_attention_score(
        query, key, value,
        atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        pre_tokens=pre_tokens, next_tokens=next_tokens,
        input_layout=input_layout, block_size=block_size, sparse_mode=sparse_mode,
    )


def fused_infer_attention_score_decode(query, key, value, *, atten_mask, block_table,
                                       actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                       scale, block_size, attention_out, softmax_lse,
                                       workspace=None):
    # One-token BSH queries over the paged cache with the window as a mask, written into caller
    # buffers with a workspace sized beforehand: the .out form a FULL graph captures and re-issues
    # per step with new actual_seq_lengths_kv (vllm-ascend's full_graph_fia, update_graph_params).
    return _torch_npu().npu_fused_infer_attention_score.out(
        query, key, value,
        atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, input_layout="BSH",
        block_size=block_size, workspace=workspace, attention_out=attention_out,
        softmax_lse=softmax_lse,
    )


def fused_infer_attention_score_decode_workspace(query, key, value, *, atten_mask, block_table,
                                                 actual_seq_lengths_kv, num_heads,
                                                 num_key_value_heads, scale, block_size):
    return _torch_npu()._npu_fused_infer_attention_score_get_max_workspace(
        query, key, value,
        atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, input_layout="BSH",
        block_size=block_size,
    )


def fused_infer_attention_score_verify(query, key, value, *, atten_mask, block_table,
                                       actual_seq_lengths, actual_seq_lengths_kv, num_heads,
                                       num_key_value_heads, scale, block_size, sparse_mode,
                                       attention_out, softmax_lse, pre_tokens=2147483647,
                                       next_tokens=2147483647, workspace=None):
    # Speculative verification rows (1 + k TND queries per sequence, causal or the band) over the
    # paged cache, written into caller buffers with a workspace sized beforehand: the .out form a
    # FULL graph captures and re-issues per step with new host query and KV lengths (vllm-ascend's
    # full_graph_fia with TND, update_graph_params).
    return _torch_npu().npu_fused_infer_attention_score.out(
        query, key, value,
        atten_mask=atten_mask, block_table=block_table, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, pre_tokens=pre_tokens,
        next_tokens=next_tokens, input_layout="TND", block_size=block_size,
        sparse_mode=sparse_mode, workspace=workspace, attention_out=attention_out,
        softmax_lse=softmax_lse,
    )


def fused_infer_attention_score_verify_workspace(query, key, value, *, atten_mask, block_table,
                                                 actual_seq_lengths, actual_seq_lengths_kv,
                                                 num_heads, num_key_value_heads, scale,
                                                 block_size, sparse_mode, pre_tokens=2147483647,
                                                 next_tokens=2147483647):
    return _torch_npu()._npu_fused_infer_attention_score_get_max_workspace(
        query, key, value,
        atten_mask=atten_mask, block_table=block_table, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, pre_tokens=pre_tokens,
        next_tokens=next_tokens, input_layout="TND", block_size=block_size,
        sparse_mode=sparse_mode,
    )


def fusion_attention(query, key, value, head_num, input_layout, *, atten_mask=None, scale=1.0,
                     pre_tockens=2147483647, next_tockens=2147483647, actual_seq_qlen=None,
                     actual_seq_kvlen=None, sparse_mode=0):
    # The op returns (attention, softmax_max, softmax_sum, softmax_out, seed, offset, numels):
    # the last six feed its backward pass, which inference never runs.
    return _torch_npu().npu_fusion_attention(
        query, key, value, head_num, input_layout,
        atten_mask=atten_mask, scale=scale, pre_tockens=pre_tockens, next_tockens=next_tockens,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        sparse_mode=sparse_mode,
    )[0]

def paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                    block_table, context_lens, out, workspace=None):
    _torch_npu()._npu_paged_attention(
        query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
        num_heads=num_heads, scale_value=scale_value, block_table=block_table,
        context_lens=context_lens, out=out, workspace=workspace,
    )


def paged_attention_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                              block_table, context_lens, out):
    # The buffer a captured _npu_paged_attention is given, so the launch (and each task update of
    # it) does not allocate its own outside the graph pool.
    return _torch_npu()._npu_paged_attention_get_workspace(
        query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
        num_heads=num_heads, scale_value=scale_value, block_table=block_table,
        context_lens=context_lens, out=out,
    )


def rms_norm(self, gamma, epsilon=1e-6):
    return _torch_npu().npu_rms_norm(self, gamma=gamma, epsilon=epsilon)


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    return _torch_npu().npu_add_rms_norm(x1=x1, x2=x2, gamma=gamma, epsilon=epsilon)


def swiglu(self, dim=-1):
    return _torch_npu().npu_swiglu(self, dim=dim)


def rotary_mul(self, r1, r2, rotary_mode="half"):
    return _torch_npu().npu_rotary_mul(self, r1, r2, rotary_mode=rotary_mode)


def mrope(positions, query, key, cos_sin_cache, head_size, rotary_mode="half", mrope_section=None):
    # Over vLLM's [max_position, rotary_dim] cos|sin cache, query and key in one launch: the RoPE
    # mode (mrope_section [0, 0, 0]), as vllm-ascend's rope_forward_oot calls it without Triton,
    # or the mrope mode of vLLM's MRotaryEmbedding sections. cache_mode "default" (sections side
    # by side): "interleave" needs aclnnRopeWithSinCosCacheV2, which the binding refuses without.
    return _torch_npu().npu_mrope(
        positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache, head_size=head_size,
        mrope_section=[0, 0, 0] if mrope_section is None else list(mrope_section),
        rotary_mode=rotary_mode, cache_mode="default",
    )


def top_k_top_p(logits, p=None, k=None):
    if k is None:
        return _top_p_only()(logits, p)
    # By keyword: the positional order is (logits, p, k), easy to get backwards.
    return _torch_npu().npu_top_k_top_p(logits, p=p, k=k)


@functools.cache
def _top_p_only():
    """``npu_top_k_top_p(logits, p=p)`` as an op whose fake kernel tracing can run. torch_npu's
    meta kernel is ``npu_top_k_top_p_meta(logits, p, k)`` without defaults, and the dispatcher
    leaves an argument at its default out of the call, so a traced (FakeTensor or meta) top-p-only
    call raises "missing 1 required positional argument: 'k'" (torch-npu 2.11-2.14
    ``op_plugin/meta/_meta_registrations.py``). Run eagerly, the op is the torch_npu call."""
    import torch

    @torch.library.custom_op("ascend_patch::npu_top_p", mutates_args=())
    def npu_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return _torch_npu().npu_top_k_top_p(logits, p=p)

    @npu_top_p.register_fake
    def _(logits, p):
        return torch.empty_like(logits)

    return npu_top_p



# --- mixture of experts (references and call order: kernels/moe.py) -------------------------------


def moe_gating_top_k_softmax(x, finished=None, k=1):
    return _torch_npu().npu_moe_gating_top_k_softmax(x, finished=finished, k=k)


def moe_gating_top_k_softmax_v2(x, *, k=1, finished=None, renorm=0, output_softmax=False):
    return _torch_npu().npu_moe_gating_top_k_softmax_v2(x, k=k, finished=finished, renorm=renorm,
                                                        output_softmax=output_softmax)


def moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
                     group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                     out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    op = _torch_npu().npu_moe_gating_top_k
    # The hash-routing inputs came with torch-npu 2.13: the 2.10/2.11 schema has no input_ids or
    # tid2eid and rejects a call naming them, so they go only to a torch_npu that takes them.
    hashing = {name: value for name, value in (("input_ids", input_ids), ("tid2eid", tid2eid))
               if value is not None or name in _argument_names(op)}
    missing = [name for name in hashing if name not in _argument_names(op)]
    if missing:
        raise ValueError(f"npu_moe_gating_top_k: the installed torch_npu takes no {', '.join(missing)}"
                         " (hash routing needs torch-npu 2.13 or later)")
    return op(
        x, k, bias=bias, **hashing, k_group=k_group, group_count=group_count,
        group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
        out_flag=out_flag, routed_scaling_factor=routed_scaling_factor, eps=eps,
    )


@functools.cache
def _argument_names(op) -> frozenset[str]:
    """The argument names of a torch_npu op's schema, read from the installed torch_npu."""
    return frozenset(argument.name for argument in op.default._schema.arguments)


def moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                        expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                        expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                        active_expert_range=[], row_idx_type=0):
    return _torch_npu().npu_moe_init_routing_v2(
        x, expert_idx, scale=scale, offset=offset, active_num=active_num,
        expert_capacity=expert_capacity, expert_num=expert_num, drop_pad_mode=drop_pad_mode,
        expert_tokens_num_type=expert_tokens_num_type,
        expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
        active_expert_range=active_expert_range, row_idx_type=row_idx_type,
    )


def grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                   antiquant_offset=None, per_token_scale=None, group_list=None,
                   activation_input=None, activation_quant_scale=None,
                   activation_quant_offset=None, split_item=0, group_type=None,
                   group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    return _torch_npu().npu_grouped_matmul(
        x, weight, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, group_list=group_list,
        activation_input=activation_input, activation_quant_scale=activation_quant_scale,
        activation_quant_offset=activation_quant_offset, split_item=split_item,
        group_type=group_type, group_list_type=group_list_type, act_type=act_type,
        output_dtype=output_dtype, tuning_config=tuning_config,
    )


def moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                        restore_shape=None):
    return _torch_npu().npu_moe_token_unpermute(
        permuted_tokens, sorted_indices, probs=probs, padded_mode=padded_mode,
        restore_shape=restore_shape,
    )


def moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                         expanded_src_to_dst_row, expert_for_source_row, drop_pad_mode=0):
    # Positional: the schema spells the last tensor "export_for_source_row", not the documented
    # "expert_for_source_row", so the documented keyword would be rejected.
    return _torch_npu().npu_moe_finalize_routing(
        expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
        expert_for_source_row, drop_pad_mode=drop_pad_mode,
    )


# --- int8 quantisation (references and call order: kernels/quant.py) -----------------------------


def dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None):
    return _torch_npu().npu_dynamic_quant(input, smooth_scales=smooth_scales,
                                          group_index=group_index, dst_type=dst_type)


def quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    return _torch_npu().npu_quantize(input, scales, zero_points, dtype, axis=axis,
                                     div_mode=div_mode)


def quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                 group_sizes=None):
    return _torch_npu().npu_quant_matmul(
        x1, x2, scale, offset=offset, pertoken_scale=pertoken_scale, bias=bias,
        output_dtype=output_dtype, group_sizes=group_sizes,
    )


# --- multi-head latent attention (references and call order: kernels/mla.py) ---------------------


def fused_infer_attention_score_mla(query, key, value, *, query_rope=None, key_rope=None,
                                    atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, num_heads, num_key_value_heads,
                                    scale, input_layout="TND", sparse_mode=0,
                                    softmax_lse_flag=False):
    # The same op as fused_infer_attention_score, in the form MLA prefills use (kernels/mla.py).
    return _torch_npu().npu_fused_infer_attention_score(
        query, key, value,
        query_rope=query_rope, key_rope=key_rope, atten_mask=atten_mask,
        actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        input_layout=input_layout, sparse_mode=sparse_mode, softmax_lse_flag=softmax_lse_flag,
    )


def fused_infer_attention_score_mla_decode(query, key, value, *, query_rope, key_rope,
                                           block_table, actual_seq_lengths_kv, num_heads,
                                           num_key_value_heads, scale, input_layout, block_size,
                                           attention_out, softmax_lse, atten_mask=None,
                                           sparse_mode=0, workspace=None):
    # The op's rope (MLA) branch over the paged latent cache, written into caller buffers with a
    # workspace sized beforehand: the .out form vllm-ascend captures in ACL graphs and re-issues
    # per step with new actual_seq_lengths_kv (mla_v1 / acl_graph.update_mla_attn_params). With
    # 1 + k query tokens per sequence (MTP verification rows) it takes the causal mask
    # (sparse_mode=3). The outputs by the schema's names (attention_out, softmax_lse).
    return _torch_npu().npu_fused_infer_attention_score.out(
        query, key, value,
        query_rope=query_rope, key_rope=key_rope, atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, input_layout=input_layout,
        block_size=block_size, sparse_mode=sparse_mode, workspace=workspace,
        attention_out=attention_out, softmax_lse=softmax_lse,
    )


def fused_infer_attention_score_mla_decode_workspace(query, key, value, *, query_rope, key_rope,
                                                     block_table, actual_seq_lengths_kv,
                                                     num_heads, num_key_value_heads, scale,
                                                     input_layout, block_size, atten_mask=None,
                                                     sparse_mode=0):
    # The workspace of the largest call of this shape, so a captured launch (and each task update
    # of it) uses the graph's buffer instead of allocating its own.
    return _torch_npu()._npu_fused_infer_attention_score_get_max_workspace(
        query, key, value,
        query_rope=query_rope, key_rope=key_rope, atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
        num_key_value_heads=num_key_value_heads, scale=scale, input_layout=input_layout,
        block_size=block_size, sparse_mode=sparse_mode,
    )


def multi_head_latent_attention(q_nope, q_rope, ctkv, k_rope, block_tables, context_lens,
                                q_headnum, qk_scale, kv_headnum):
    # An ATB op: torch_npu.atb.<name> is torch.ops.atb.<name>, bound by its schema's names.
    return _torch_npu().atb.npu_multi_head_latent_attention(
        q_nope=q_nope, q_rope=q_rope, ctkv=ctkv, k_rope=k_rope, block_tables=block_tables,
        context_lens=context_lens, q_headnum=q_headnum, qk_scale=qk_scale, kv_headnum=kv_headnum,
    )

# --- device runtime -------------------------------------------------------------------------------


def kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, epsilon=1e-5,
                          cache_mode="Norm", is_output_kv=False):
    # The _v2 form: its schema declares the caches mutated (Tensor(a!), Tensor(b!)), which the
    # plain one's does not, so graph capture and functionalisation see the in-place write.
    return _torch_npu().npu_kv_rmsnorm_rope_cache_v2(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, epsilon=epsilon, cache_mode=cache_mode,
        is_output_kv=is_output_kv)


def interleave_rope(x, cos, sin):
    return _torch_npu().npu_interleave_rope(x, cos, sin)


def batch_gather_matmul_(self, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3,
                         y_offset=0, y_slice_size=-1):
    # LoRA's BGMV: each row of x through its own adapter's A then B, added in place into
    # self[:, y_offset : y_offset + y_slice_size]. vLLM's stacked [slots, 1, R, H] / [slots, 1, N, R]
    # LoRA weights are the op's [W, L, R, H1] / [W, L, H2, R] as they stand.
    return _torch_npu().npu_batch_gather_matmul_(
        self, x, weight_b, indices, weight_a, layer_idx=layer_idx, scale=scale,
        y_offset=y_offset, y_slice_size=y_slice_size,
    )


def swap_blocks(src, dst, block_mapping):
    # torch_npu ships no batched block copy (vllm-ascend compiles its own _C_ascend.swap_blocks),
    # so this is aten's: a gather on the source's device, one copy across, a scatter on the
    # destination's (torch_npu's IndexSelect, memcpy and InplaceIndexCopy), on the current
    # stream: not measured on an NPU.
    sources = block_mapping[:, 0].to(src.device, non_blocking=True)
    destinations = block_mapping[:, 1].to(dst.device, non_blocking=True)
    dst.index_copy_(0, destinations, src.index_select(0, sources).to(dst.device))


def installed() -> bool:
    """Whether torch_npu is installed at all (found, not imported)."""
    return importlib.util.find_spec("torch_npu") is not None


def probe() -> tuple[bool, str]:
    """``(usable, detail)``: whether torch_npu imports and sees at least one NPU."""
    if not installed():
        return False, "torch_npu is not installed"
    try:
        torch_npu = _torch_npu()
    except Exception as exc:  # a torch_npu without a matching CANN fails in many ways
        return False, f"import torch_npu failed: {exc!r}"
    count = torch_npu.npu.device_count() if torch_npu.npu.is_available() else 0
    if count == 0:
        return False, f"torch_npu {torch_npu.__version__} sees no NPU"
    return True, f"torch_npu {torch_npu.__version__} sees {count} NPU(s)"


def device_name(index: int) -> str:
    return _torch_npu().npu.get_device_name(index)


def device_count() -> int:
    return _torch_npu().npu.device_count()


def stack() -> dict:
    """What torch_npu reports of the device and the stack under it: the first NPU's SoC name
    and numeric SoC version, and the CANN and driver versions (``npu.utils.get_cann_version``)."""
    utils = _torch_npu().npu.utils
    found = {"soc": device_name(0), "soc_version": utils.get_soc_version()}
    for key, module in (("cann", "CANN"), ("driver", "DRIVER")):
        try:
            found[key] = utils.get_cann_version(module) or None
        except Exception:  # an older torch_npu without this module name: the files answer instead
            found[key] = None
    return found


def device_uuid(index: int) -> str:
    return _torch_npu().npu.get_device_properties(index).uuid


def mem_get_info(index: int | None = None) -> tuple[int, int]:
    return _torch_npu().npu.mem_get_info(index)


def current_memory_usage(device=None) -> int:
    """Peak allocation since now, which is what is in use (vLLM's CUDA platform reads it so)."""
    npu = _torch_npu().npu
    npu.reset_peak_memory_stats(device)
    return npu.max_memory_allocated(device)


def set_device(device) -> None:
    _torch_npu().npu.set_device(device)


def manual_seed_all(seed: int) -> None:
    _torch_npu().npu.manual_seed_all(seed)


def num_compute_units(index: int) -> int:
    # The NPU's counterpart of CUDA's SM count is its cube-core count.
    return _torch_npu().npu.get_device_properties(index).cube_core_num


def cuda_api() -> dict:
    """The torch.cuda stream/event entry points vLLM's GPU runner calls, as torch.npu's."""
    npu = _torch_npu().npu
    return {
        "Stream": npu.Stream,
        "Event": npu.Event,
        "current_stream": npu.current_stream,
        "default_stream": npu.default_stream,
        "stream": npu.stream,
        "set_stream": npu.set_stream,
        "synchronize": npu.synchronize,
    }


def graph_api():
    """torch_npu.npu, whose ACL graph API (NPUGraph, graph, graph_pool_handle, ExternalEvent,
    graph_task_group_begin/end, graph_task_update_begin/end, Stream, stream, current_stream) the
    graph path calls by those names (docs/zh/custom_APIs/torch_npu-npu/)."""
    return _torch_npu().npu
