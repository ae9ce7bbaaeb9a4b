"""Attention: the Ascend attention backend and the multi-head latent attention (MLA) one, and
the KV-cache spec promotion they rely on."""

from ascend_patch.overlay.declarations import Contract, Patch
from ascend_patch.patches._declare import cite, contract

ATTENTION = "ascend_patch.npu.attention.backend:AscendAttentionImpl"

# The attention backend interface AscendAttentionBackend implements (chosen by
# NPUPlatform.get_attn_backend_cls).
ATTENTION_CONTRACTS = [
    contract("vllm.v1.attention.backend:AttentionImpl.forward",
             "(self, layer, query, key, value, kv_cache, attn_metadata, output, "
             "output_scale=..., output_block_scale=...)", "the Ascend attention impl",
             implementation=ATTENTION,
             upstream="vllm/v1/attention/backend.py: the attention backend interface",
             pr="vllm-project/vllm#39125"),
    contract("vllm.v1.attention.backend:AttentionImpl.__init__",
             "(self, num_heads, head_size, scale, num_kv_heads=..., alibi_slopes=..., "
             "sliding_window=..., kv_cache_dtype=..., logits_soft_cap=..., attn_type=..., "
             "kv_sharing_target_layer_name=...)",
             "the impl takes the sliding window and the logits soft-cap where vLLM's Attention "
             "passes them (positionally)", implementation=ATTENTION,
             upstream="vllm/model_executor/layers/attention/attention.py builds impl_cls(num_heads, "
                      "head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, "
                      "logits_soft_cap, attn_type, kv_sharing_target_layer_name, **extra_impl_args)"),
    contract("vllm.v1.attention.backend:AttentionMetadataBuilder.build",
             "(self, common_prefix_len, common_attn_metadata, fast_build=...)",
             "the Ascend metadata builder",
             implementation="ascend_patch.npu.attention.backend:AscendMetadataBuilder",
             upstream="vllm/v1/attention/backend.py: the attention backend interface"),
    contract("vllm.model_executor.layers.attention.encoder_only_attention:"
             "create_encoder_only_attention_backend", "(underlying_attn_backend)",
             "encoder-only layers (BERT, XLM-RoBERTa) get the platform's encoder backend wrapped in "
             "a builder that clears `causal`; the encoder impl attends without a mask because of "
             "it (and refuses causal metadata)",
             implementation="ascend_patch.npu.attention.encoder:AscendEncoderOnlyImpl",
             upstream="vllm/model_executor/layers/attention/encoder_only_attention.py: "
                      "EncoderOnlyAttention subclasses the selected backend with a builder that "
                      "copies the common metadata with causal=False"),
]


def hybrid_promotion(module: str, vllm: str | None = None, pr: str | None = None) -> Contract:
    """vLLM's promotion of sliding-window KV specs to full attention when the hybrid manager is
    turned off, which the attention backend relies on (it moved to kv_cache_planning.py in 0.33)."""
    return Contract(
        f"vllm.v1.core.{module}:unify_hybrid_kv_cache_specs",
        reason="with the hybrid manager turned off (--disable-hybrid-kv-cache-manager, a KV "
               "connector without HMA), windowed layers beside full ones keep every token's "
               "blocks in one group; the attention applies the windows itself",
        vllm=vllm,
        signature=("(kv_cache_spec)",),
        upstream=cite(f"vllm/v1/core/{module}.py: SlidingWindowSpec -> FullAttentionSpec when both "
                      "kinds are present (a uniformly windowed model keeps its SlidingWindowSpec)",
                      pr),
        remove_when="vLLM no longer lets the hybrid manager be turned off",
        implementation=ATTENTION,
    )



_MLA_LAYER = "vllm.model_executor.layers.attention.mla_attention"
_MLA_IMPL = "ascend_patch.npu.attention.mla:AscendMLAImpl"
_MLA_INTERFACE = ("vllm/v1/attention/backend.py: MLAAttentionImpl, the interface vLLM's MLAAttention "
                  "layer (model_executor/layers/attention/mla_attention.py) drives")
_MLA_PREFILL = ("vllm/v1/attention/backends/mla/prefill/selector.py (0.21+): MLAAttention.__init__ "
                "builds a prefill backend whatever its impl, FLASH_ATTN when the platform has no "
                "device capability, and that constructor asserts flash_attn_varlen_func imports")

# Multi-head latent attention (DeepSeek): vLLM's MLAAttention layer keeps projections, rotary,
# the decode-first split and the W_UK/W_UV absorption; AscendMLABackend (chosen by
# NPUPlatform.get_attn_backend_cls for use_mla) supplies the cache and the attention.
MLA_CONTRACTS = [
    contract("vllm.v1.attention.backend:MLAAttentionImpl.__init__",
             "(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, "
             "kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, "
             "q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, "
             "v_head_dim, kv_b_proj, indexer=..., q_pad_num_heads=...)",
             "MLAAttention builds the Ascend MLA impl with these keywords", implementation=_MLA_IMPL,
             upstream=_MLA_INTERFACE),
    contract("vllm.v1.attention.backend:MLAAttentionImpl.do_kv_cache_update",
             ("(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)",
              "(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, "
              "skip_scale=...)"),  # skip_scale: 0.33
             "the MLA cache write: npu_scatter_pa_kv_cache into the latent and rope planes "
             "(vLLM's default calls CUDA concat_and_cache_mla)", implementation=_MLA_IMPL,
             upstream=_MLA_INTERFACE),
    contract("vllm.v1.attention.backend:MLAAttentionImpl.forward_mqa",
             "(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)",
             "decodes (queries absorbed by the layer): npu_multi_head_latent_attention",
             implementation=_MLA_IMPL, upstream=_MLA_INTERFACE, pr="vllm-project/vllm#33284"),
    contract("vllm.v1.attention.backend:MLAAttentionImpl.forward_mha",
             ("(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output)",
              "(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, "
              "output_scale=...)"),  # output_scale: 0.24+
             "prefills, fresh or behind cached context: their latent rows read out of the cache, "
             "up-projected with kv_b_proj and attended by npu_fused_infer_attention_score in "
             "TND without rope inputs (Q/K 192, V 128)", implementation=_MLA_IMPL,
             upstream=_MLA_INTERFACE, pr="vllm-project/vllm#33284"),
    contract(f"{_MLA_LAYER}:MLAAttention.forward_impl", None,
             "splits the decode-first batch by the counts AscendMLAMetadata carries "
             "(num_actual_tokens, num_decodes, num_decode_tokens, num_prefills, decode)",
             implementation="ascend_patch.npu.attention.mla:AscendMLAMetadata",
             upstream=f"{_MLA_LAYER.replace('.', '/')}.py"),
    contract("vllm.v1.attention.backend:AttentionMetadataBuilder.reorder_batch_threshold", None,
             "AscendMLAMetadataBuilder sets 1: the runner orders each batch decode-first",
             implementation="ascend_patch.npu.attention.mla:AscendMLAMetadataBuilder",
             upstream="vllm/v1/worker/gpu_model_runner.py reorders by the builders' threshold"),
    contract("vllm.forward_context:get_forward_context", "()",
             "the MLA impl finds its layer (no_compile_layers) and the step's metadata "
             "(attn_metadata) there: forward_mha and do_kv_cache_update are not given them",
             implementation=_MLA_IMPL, upstream="vllm/forward_context.py"),
    Patch(
        "vllm.model_executor.layers.mla:MultiHeadLatentAttentionWrapper.__init__",
        reason="bf16/fp16 MLA layers hand kv_a_layernorm and the rotary to the Ascend MLA impl, "
               "which norms, rotates and caches kv in one npu_kv_rmsnorm_rope_cache_v2 launch "
               "and rotates q_pe in one npu_interleave_rope launch (3 launches fewer per layer "
               "and decode step)",
        signature=(
            "(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, "
            "q_lora_rank, kv_lora_rank, mla_modules, cache_config=..., quant_config=..., prefix=...)",
            "(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, "
            "q_lora_rank, kv_lora_rank, mla_modules, cache_config=..., quant_config=..., prefix=..., "
            "skip_topk=...)",  # 0.21
            "(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, "
            "q_lora_rank, kv_lora_rank, mla_modules, cache_config=..., quant_config=..., prefix=..., "
            "skip_topk=..., non_causal_multi_token_decode=..., "
            "allow_short_prefill_indexer_scoring_skip=...)",  # 0.27
            "(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, "
            "q_lora_rank, kv_lora_rank, mla_modules, cache_config=..., quant_config=..., prefix=..., "
            "skip_topk=..., non_causal_multi_token_decode=..., "
            "allow_short_prefill_indexer_scoring_skip=..., fuse_qkv_rmsnorm=...)",  # 0.30
            "(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, "
            "q_lora_rank, kv_lora_rank, mla_modules, cache_config=..., quant_config=..., prefix=..., "
            "skip_topk=..., non_causal_multi_token_decode=..., "
            "allow_short_prefill_indexer_scoring_skip=..., fuse_qkv_rmsnorm=..., "
            "shardq_eligible=...)",  # 0.34
        ),
        wrapper="ascend_patch.npu.attention.mla:fuse_kv_rope",
        upstream="vllm/model_executor/layers/mla.py: forward always calls "
                 "self.kv_a_layernorm(kv_c) and rotates q_pe and k_pe (writing q_pe back into q) "
                 "only under `if self.rotary_emb is not None`, so a backend cannot fuse them with "
                 "the cache write; vllm-project/vllm#23332 made the layer replaceable for this very "
                 "fusion, which would take a copy of its forward",
        remove_when="vLLM's MLA layer lets the attention backend take the kv norm and the rope "
                    "(or the overlay replaces the layer through PluggableLayer)",
    ),
    Patch(
        "vllm.v1.attention.backends.mla.prefill.selector:get_mla_prefill_backend",
        reason="MLAAttention gets a prefill backend that constructs on Ascend (and is never run: "
               "AscendMLAImpl runs prefills)",
        vllm=">=0.21,<0.32",
        signature=("(vllm_config)",),
        replacement="ascend_patch.npu.attention.mla_prefill:select_prefill_backend",
        upstream=_MLA_PREFILL + "; vllm-project/vllm#32623",
        remove_when="every supported release has Platform.get_mla_prefill_backend_cls (0.32+)",
    ),
    contract("vllm.v1.attention.backends.mla.prefill.base:MLAPrefillBackend.__init__",
             "(self, num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
             "v_head_dim, vllm_config)", "AscendMLAPrefillBackend constructs like vLLM's",
             implementation="ascend_patch.npu.attention.mla_prefill:AscendMLAPrefillBackend",
             upstream=_MLA_PREFILL, vllm=">=0.21", pr="vllm-project/vllm#32623"),
]
