"""Every seam op's documented limits, in one table that dispatch and the references both read.

Dispatch (the attention paths, the MLA backend, the sampler, the custom ops) decides from these
which kernel a layer or a batch can take; the reference kernels
(:mod:`ascend_patch.npu.kernels.reference`) refuse a call outside them by name. The tag in
brackets names the source; the references' module docstrings give each tag's full citation
(op-plugin is Ascend/op-plugin at 517f2e7d, docs under ``docs/zh/custom_APIs/torch_npu/``).
"""

# --- npu_fused_infer_attention_score (FIA) --------------------------------------------------------

# [FIA] num_heads ≤ 256; num_key_value_heads divides it with a ratio ≤ 64.
FIA_MAX_HEADS = 256
FIA_MAX_GQA_RATIO = 64
# [FIA] actual_seq_lengths: TND batch ≤ 4096 entries.
FIA_TND_MAX_BATCH = 4096
# [FIA-TILING] TND: D ∈ {64, 128, 192}; [FIA-V2] TND: "GQA和PA场景不支持V_D等于192".
FIA_TND_HEAD_SIZES = (64, 128, 192)
FIA_TND_PAGED_HEAD_SIZES = (64, 128)  # over a paged cache, or with GQA
# [FIA] cache layout BnBsH: KV_N * D > 65535 is rejected.
FIA_MAX_KV_HIDDEN = 65535
# [FIA] PageAttention约束: Q_S > 1 → block_size a multiple of 128 in [128, 512];
# Q_S = 1 → non-zero, ≤ 512; TND (D ≠ 512): a multiple of 16.
FIA_PREFILL_BLOCK_ALIGN = 128
FIA_DECODE_BLOCK_ALIGN = 16
FIA_MAX_BLOCK_SIZE = 512
# [VA-SPEC] verification rows on TND: 1 + num_speculative_tokens ≤ 16 query rows per sequence
# (vllm-ascend's attention builders assert it, its speculative-decoding guide names the limit).
FIA_VERIFY_MAX_QUERY = 16
# [FIA] 各轴取值范围 (BSH, Q_S = 1): D ≤ 512, 16-byte aligned in fp16/bf16.
FIA_DECODE_MAX_HEAD_SIZE = 512
FIA_HEAD_ALIGN_BYTES = 16
# [FIA] Q_S = 1: KV_S ≤ 262144.
FIA_DECODE_MAX_KV_LEN = 262144
# [FIA] "sparse_mode=2/3/4时: shape必须为(2048, 2048)或(1, 2048, 2048)或(1, 1, 2048, 2048)".
CAUSAL_MASK_SIZE = 2048
# [FIA] pre_tokens/next_tokens default: 2147483647 (unbounded).
FIA_UNBOUNDED_TOKENS = 2147483647

# The MLA prefill form, TND without rope inputs. [FIA-WHEEL] TND: "T小于等于65536";
# "N等于8/16/32/64/128, 且Q_N、K_N、V_N相等"; "Q_D、K_D等于192, V_D等于128/192" ([FIA] TND布局约束,
# 无rope: the same pairs, besides Q_D = K_D = V_D = 128, which [FIA-WHEEL] does not list).
FIA_TND_MAX_TOKENS = 65536
FIA_TND_MLA_HEADS = (8, 16, 32, 64, 128)
FIA_TND_MLA_HEAD_DIMS = ((192, 128), (192, 192))
# [FIA-WHEEL] query_rope约束 (sparse ≠ 4): query D 512, N 32/64/128, S 1-16, BSH/BSND/BNSD.
FIA_ROPE_HEADS = (32, 64, 128)
FIA_ROPE_MAX_QUERY = 16
FIA_ROPE_LAYOUTS = ("BSH", "BSND", "BNSD")
# [FIA-WHEEL] the same: key N 1, D 512 (key_rope D 64); "必须开启PageAttention, 此时block_size支持16、128"
# (A2/A3, ND); Q_S = 1: "支持sparse=0且不传mask".
FIA_ROPE_BLOCK_SIZES = (16, 128)

# --- npu_fusion_attention (FA): encoder-only attention, TND ---------------------------------------

# [FA-WHEEL] "varlen场景下长度最大支持1K" (actual_seq_qlen's entries), "T(B*S)取值范围1~1M".
FA_TND_MAX_SEQUENCES = 1024
FA_TND_MAX_TOKENS = 1 << 20
# [FA-WHEEL] "D: Head Dim必须满足Dq=Dk和Dk≥Dv，取值范围1~768"; "Nq取值范围1~256".
FA_MAX_HEAD_DIM = 768
FA_MAX_HEADS = 256
# [FA-WHEEL] sparse_mode 4: "atten_mask为优化后的压缩下三角矩阵(2048*2048)"; pre/next_tockens
# default 2147483647 (unbounded).
FA_MASK_SIZE = 2048
FA_UNBOUNDED_TOKENS = 2147483647

# --- _npu_paged_attention (PA) --------------------------------------------------------------------

# [PA] 规格约束: block_size % 16 == 0; on A2/A3 in the plain mode head_size ≤ 576, and
# block_size ≤ 128 once head_size > 256 (KVCacheDimCheck910B).
PA_BLOCK_ALIGN = 16
PA_MAX_HEAD_SIZE = 576
PA_LARGE_HEAD_SIZE = 256
PA_LARGE_HEAD_MAX_BLOCK_SIZE = 128

# --- multi-head latent attention (DeepSeek MLA) ---------------------------------------------------

# [ATB-MLA] the latent (ctkv) and rope widths; MultiLatentAttentionParam.headNum;
# "block_size <= 128"; "batch <= 8192".
LATENT_DIM, ROPE_DIM = 512, 64
ATB_MLA_HEADS = (8, 16, 32, 64, 128)
ATB_MLA_MAX_BLOCK_SIZE = 128
ATB_MLA_MAX_BATCH = 8192

# --- npu_rotary_mul -------------------------------------------------------------------------------

# [ROTARY-MUL] jit_compile=False: D < 896 and even; half: B, N < 1000; interleave: B * N < 1000.
ROTARY_HEAD_DIM_BELOW = 896
ROTARY_BATCH_HEADS_BELOW = 1000

# --- npu_mrope (RoPE mode: one-dimensional positions; mrope mode: a row per section) ----------------

# [MROPE] 约束说明: head_size and rotary_dim (cos_sin_cache's last dim, ≤ head_size) are multiples
# of 32 in float16/bfloat16, of 16 in float32.
MROPE_DIM_MULTIPLE = {"float16": 32, "bfloat16": 32, "float32": 16}


def mrope_takes(dtype, head_size: int, rotary_dim: int) -> bool:
    """Whether npu_mrope takes query/key heads of ``head_size`` in ``dtype`` rotating their first
    ``rotary_dim`` lanes."""
    multiple = MROPE_DIM_MULTIPLE.get(str(dtype).removeprefix("torch."))
    return (multiple is not None and rotary_dim <= head_size
            and head_size % multiple == 0 and rotary_dim % multiple == 0)


# [MROPE-SECTIONS] mrope mode: the sections both aclnnRopeWithSinCosCache and its V2 take (V2 alone
# adds [11, 11, 10]; the binding falls back to V1 where V2 is missing), each summing to
# rotary_dim / 2, one positions row per section.
MROPE_SECTIONS = ((16, 24, 24), (24, 20, 20), (8, 12, 12), (16, 16, 16, 16))


def mrope_section_takes(mrope_section, rotary_dim: int) -> bool:
    """Whether npu_mrope's mrope mode takes ``mrope_section`` over a ``rotary_dim`` cache."""
    section = tuple(mrope_section or ())
    return section in MROPE_SECTIONS and 2 * sum(section) == rotary_dim


# --- npu_top_k_top_p ------------------------------------------------------------------------------

# [TOPKP] k: int32 in [1, 1024].
TOP_K_MAX = 1024

# --- Mixture of Experts ---------------------------------------------------------------------------

# [SOFTMAX-TOPK] k ≤ 1024 (and ≤ the expert count).
SOFTMAX_TOP_K_MAX = 1024
# [GATING] at most 2048 experts, and a grouping whose 32-aligned size is ≤ 2048.
GATING_MAX_EXPERTS = 2048
# [INIT-V2-WHEEL] expert_num in (0, 10240].
INIT_ROUTING_MAX_EXPERTS = 10240
# [GMM] 内轴限制 InnerLimit; 1 to 128 tensors per list; ≤ 1024 groups.
GMM_INNER_LIMIT = 65536
GMM_MAX_TENSORS = 128
GMM_MAX_GROUPS = 1024
# [UNPERMUTE] "topK_num要求小于等于512" on A2/A3.
UNPERMUTE_MAX_TOP_K = 512

# --- int8 quantisation ----------------------------------------------------------------------------

# [QMM] "x1与x2最后一维的shape大小不能超过65535".
QMM_INNER_LIMIT = 65535

# --- npu_batch_gather_matmul_ (BGMV): LoRA shrink and expand in one op ----------------------------

# [BGMV-WHEEL] "数据类型Float16" for every tensor, indices Int32; x's H1 and weight_b's H2 multiples
# of 16; weight_a's R "需要是16的整数倍且取值范围为[16, 128]"; H2 "需要小于y的第二维" (strictly less:
# a slice that is the whole of y is outside the documented range); Atlas A2 only, inference only.
BGMV_ALIGN = 16
BGMV_MIN_RANK, BGMV_MAX_RANK = 16, 128


def bgmv_takes(dtype, hidden: int, rank: int, slice_size: int, y_columns: int) -> bool:
    """Whether npu_batch_gather_matmul_ takes a LoRA slice: ``dtype`` activations of width
    ``hidden`` through rank ``rank`` into ``slice_size`` of ``y_columns`` output columns."""
    return (str(dtype) == "torch.float16" and hidden % BGMV_ALIGN == 0 and rank % BGMV_ALIGN == 0
            and BGMV_MIN_RANK <= rank <= BGMV_MAX_RANK and slice_size % BGMV_ALIGN == 0
            and slice_size < y_columns)

# --- npu_recurrent_gated_delta_rule (RGDR) --------------------------------------------------------

# [RGDR] "输入shape大小需满足约束：L_i ≤ 8，N_k ≤ 256，N_v ≤ 256，D_k ≤ 256，D_v ≤ 256".
RGDR_MAX_SEQ_LEN = 8
RGDR_MAX_HEADS = 256
RGDR_MAX_HEAD_DIM = 256
