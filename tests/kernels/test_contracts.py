"""Each documented contract violation is rejected by the reference kernels, with a message that
names the op, the argument, what was found and what the documentation expects."""

import re

import pytest
import torch

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import KernelContractError
from tests.helpers.attention import CAUSAL_MASK

BF16 = torch.bfloat16


def fused_attention(*, query_shape=(5, 8, 128), block_size=128, num_blocks=8, **overrides):
    """A valid paged call (a decode of kv 200 and a 4-token chunk over kv 140), then overrides."""
    tokens, heads, head_dim = query_shape
    kv_heads = overrides.pop("kv_heads", 2)
    cache = torch.zeros(num_blocks, block_size, kv_heads * head_dim, dtype=BF16)
    args = dict(
        query=torch.zeros(query_shape, dtype=BF16), key=cache, value=cache.clone(),
        atten_mask=CAUSAL_MASK, block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        actual_seq_lengths=[1, 5], actual_seq_lengths_kv=[200, 140], num_heads=heads,
        num_key_value_heads=kv_heads, scale=head_dim**-0.5, input_layout="TND",
        block_size=block_size, sparse_mode=3,
    )
    args.update(overrides)
    return kernels.fused_infer_attention_score(args.pop("query"), args.pop("key"),
                                               args.pop("value"), **args)


def fused_decode(*, head_dim=128, **overrides):
    """A valid BSH decode of two sequences (kv 200 and 140) with a window mask, then overrides."""
    cache = torch.zeros(8, 128, 2 * head_dim, dtype=BF16)
    mask = torch.arange(256) < torch.tensor([100, 40])[:, None]
    args = dict(
        query=torch.zeros(2, 1, 8 * head_dim, dtype=BF16), key=cache, value=cache.clone(),
        atten_mask=mask, block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        actual_seq_lengths_kv=[200, 140], num_heads=8, num_key_value_heads=2,
        scale=head_dim**-0.5, input_layout="BSH", block_size=128,
    )
    args.update(overrides)
    return kernels.fused_infer_attention_score(args.pop("query"), args.pop("key"),
                                               args.pop("value"), **args)


def paged_attention(*, head_size=128, block_size=128, **overrides):
    """A valid decode of three sequences over [8, block_size, 2, head_size] caches, then edits."""
    query = torch.zeros(3, 8, head_size, dtype=BF16)
    cache = torch.zeros(8, block_size, 2, head_size, dtype=BF16)
    args = dict(query=query, key_cache=cache, value_cache=cache.clone(), num_kv_heads=2,
                num_heads=8, scale_value=0.1,
                block_table=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
                context_lens=torch.tensor([5, 17, 16], dtype=torch.int32),
                out=torch.empty_like(query))
    args.update(overrides)
    return kernels.paged_attention(**args)


def scatter(**overrides):
    """A valid write of 4 tokens into a [2, 16, 2, 64] cache, then overrides."""
    cache = torch.zeros(2, 16, 2, 64, dtype=BF16)
    args = dict(key=torch.ones(4, 2, 64, dtype=BF16), value=torch.ones(4, 2, 64, dtype=BF16),
                key_cache=cache, value_cache=cache.clone(),
                slot_mapping=torch.tensor([0, 5, 17, 31], dtype=torch.int32))
    args.update(overrides)
    return kernels.scatter_pa_kv_cache(**args)


def rotary_mul(**overrides):
    """3 tokens of 4 heads as BSND with one batch, cos/sin 1S1D (the rotary op's own layout)."""
    x = torch.zeros(1, 3, 4, 64)
    args = dict(self=x, r1=torch.rand(1, 3, 1, 64), r2=torch.rand(1, 3, 1, 64), rotary_mode="half")
    args.update(overrides)
    return kernels.rotary_mul(**args)


def mrope(**overrides):
    """3 tokens of 4 query and 2 key heads of 64, strided slices of one qkv row each, over a bf16
    [16, 64] cos|sin cache (npu_mrope's RoPE mode)."""
    qkv = torch.zeros(3, 8 * 64, dtype=BF16)
    args = dict(positions=torch.tensor([0, 5, 15]), query=qkv[:, :256], key=qkv[:, 256:384],
                cos_sin_cache=torch.rand(16, 64, dtype=BF16), head_size=64, rotary_mode="half")
    args.update(overrides)
    return kernels.mrope(**args)


def top_k_top_p(**overrides):
    args = dict(logits=torch.zeros(2, 50), p=torch.tensor([0.5, 0.9]),
                k=torch.tensor([5, 10], dtype=torch.int32))
    args.update(overrides)
    return kernels.top_k_top_p(**args)


def swap_blocks(**overrides):
    """A valid copy of blocks 3 and 0 of an 8-block cache into host rows 1 and 4, then overrides."""
    args = dict(src=torch.zeros(8, 2, 16, 2, 64, dtype=BF16), dst=torch.zeros(5, 2, 16, 2, 64, dtype=BF16),
                block_mapping=torch.tensor([[3, 1], [0, 4]]))
    args.update(overrides)
    return kernels.swap_blocks(**args)


FIA = "npu_fused_infer_attention_score"
PA = "_npu_paged_attention"

VIOLATIONS = {
    # npu_fused_infer_attention_score
    "fia block_table int64": (
        lambda: fused_attention(block_table=torch.tensor([[0, 1], [2, 3]])),
        f"{FIA}: block_table must be int32, got torch.int64"),
    "fia block size 64 with a prefill query": (
        lambda: fused_attention(block_size=64, num_blocks=16,
                                block_table=torch.arange(16, dtype=torch.int32).view(2, 8)),
        f"{FIA}: block_size must be a multiple of 128 in [128, 512] when a query is longer "
        "than 1, got 64"),
    "fia decode block size not a multiple of 16": (
        lambda: fused_attention(query_shape=(2, 8, 128), block_size=24, num_blocks=32,
                                actual_seq_lengths=[1, 2],
                                block_table=torch.arange(32, dtype=torch.int32).view(2, 16)),
        f"{FIA}: block_size must be a multiple of 16 in [16, 512] for decode, got 24"),
    "fia block_size argument disagrees with the cache": (
        lambda: fused_attention(block_size=128, key=torch.zeros(8, 256, 256, dtype=BF16),
                                value=torch.zeros(8, 256, 256, dtype=BF16)),
        f"{FIA}: block_size must be key.shape[1] = 256, got 128"),
    "fia actual_seq_lengths decreasing": (
        lambda: fused_attention(actual_seq_lengths=[4, 1]),
        f"{FIA}: actual_seq_lengths must be cumulative (non-negative and non-decreasing), "
        "got [4, 1]"),
    "fia actual_seq_lengths per-sequence instead of cumulative": (
        lambda: fused_attention(actual_seq_lengths=[1, 4]),
        f"{FIA}: actual_seq_lengths must be cumulative, ending at query.shape[0] = 5, got [1, 4]"),
    "fia actual_seq_lengths as a device tensor": (
        lambda: fused_attention(actual_seq_lengths=torch.tensor([1, 5])),
        f"{FIA}: actual_seq_lengths must be a host list[int], got Tensor"),
    "fia head dim over the TND limit": (
        lambda: fused_attention(query_shape=(5, 8, 256)),
        f"{FIA}: query head dim (D) must be 64 or 128 for TND, got 256"),
    "fia float32 query": (
        lambda: fused_attention(query=torch.zeros(5, 8, 128)),
        f"{FIA}: query must be float16 or bfloat16, got torch.float32"),
    "fia non-contiguous query": (
        lambda: fused_attention(query=torch.zeros(8, 5, 128, dtype=BF16).transpose(0, 1)),
        f"{FIA}: query must be contiguous"),
    "fia heads not divisible": (
        lambda: fused_attention(num_key_value_heads=3),
        f"{FIA}: num_key_value_heads must be a divisor of num_heads=8 with ratio ≤ 64, got 3"),
    "fia mask of the wrong shape": (
        lambda: fused_attention(atten_mask=CAUSAL_MASK[:1024, :1024].contiguous()),
        f"{FIA}: atten_mask must be (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), "
        "got (1024, 1024)"),
    "fia mask of a float dtype": (
        lambda: fused_attention(atten_mask=CAUSAL_MASK.float()),
        f"{FIA}: atten_mask must be bool or int8 or uint8, got torch.float32"),
    "fia mask with the keep region marked": (
        lambda: fused_attention(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril()),
        f"{FIA}: atten_mask must be nonzero exactly above the diagonal"),
    "fia causal without a mask": (
        lambda: fused_attention(atten_mask=None),
        f"{FIA}: atten_mask must be the 2048×2048 causal mask with sparse_mode=3, got None"),
    "fia block id out of range": (
        lambda: fused_attention(block_table=torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)),
        f"{FIA}: block_table must be block ids in [0, 8), got 99 at [1, 1]"),
    "fia block_table rows differ from the batch": (
        lambda: fused_attention(block_table=torch.zeros(3, 2, dtype=torch.int32)),
        f"{FIA}: block_table must be 2 rows (one per sequence), got 3"),
    "fia kv length beyond the block table": (
        lambda: fused_attention(actual_seq_lengths_kv=[200, 300]),
        f"{FIA}: actual_seq_lengths_kv must be per-sequence lengths in [0, 256]"),
    "fia query longer than its kv": (
        lambda: fused_attention(actual_seq_lengths_kv=[200, 3]),
        f"{FIA}: actual_seq_lengths_kv must be ≥ the query length of each sequence under "
        "sparse_mode=3, got (4, 3)"),
    "fia band over single-token queries only": (
        lambda: fused_attention(query_shape=(2, 8, 128), actual_seq_lengths=[1, 2], sparse_mode=4,
                                pre_tokens=99, next_tokens=0),
        f"{FIA}: sparse_mode must be 3 or 0 when every query is one token long (sparse_mode and "
        "pre/next_tokens are ignored for Q_S = 1), got 4"),
    "fia band with a negative pre_tokens": (
        lambda: fused_attention(sparse_mode=4, pre_tokens=-1, next_tokens=5),
        f"{FIA}: pre_tokens must be ≥ 0 (the last query row would see no key), got -1"),
    "fia empty band": (
        lambda: fused_attention(sparse_mode=4, pre_tokens=3, next_tokens=-4),
        f"{FIA}: pre_tokens + next_tokens must be ≥ 0 (the band must not be empty), got -1"),
    "fia band leaving a row without keys": (
        lambda: fused_attention(sparse_mode=4, pre_tokens=200, next_tokens=-137),
        f"{FIA}: actual_seq_lengths_kv must be ≥ the query length - next_tokens (-137) of each "
        "sequence under sparse_mode=4, got (4, 140)"),
    "fia band without the mask": (
        lambda: fused_attention(sparse_mode=4, pre_tokens=99, next_tokens=0, atten_mask=None),
        f"{FIA}: atten_mask must be the 2048×2048 causal mask with sparse_mode=4, got None"),
    "fia single-token band": (
        lambda: fused_decode(sparse_mode=4, pre_tokens=99, next_tokens=0),
        f"{FIA}: sparse_mode/pre_tokens/next_tokens must be their defaults for a single-token "
        "query (the op ignores them; pass the mask instead), got (4, 99, 0)"),
    "fia decode mask narrower than the block table": (
        lambda: fused_decode(atten_mask=torch.zeros(2, 200, dtype=torch.bool)),
        f"{FIA}: atten_mask must be a last dim ≥ 256 (block_table columns × block_size), got 200"),
    "fia decode mask hiding a whole sequence": (
        lambda: fused_decode(atten_mask=torch.arange(256) < torch.tensor([100, 140])[:, None]),
        f"{FIA}: atten_mask must be to leave each sequence at least one of its keys, got row 1 "
        "all masked"),
    "fia decode mask of a float dtype": (
        lambda: fused_decode(atten_mask=torch.zeros(2, 256)),
        f"{FIA}: atten_mask must be bool or int8 or uint8, got torch.float32"),
    "fia decode head dim not 16-byte aligned": (
        lambda: fused_decode(head_dim=100),
        f"{FIA}: query head dim (D) must be ≤ 512 and 16-byte aligned, got 100"),
    "fia cache smaller than the sequences need": (
        lambda: fused_attention(num_blocks=3, block_table=torch.tensor([[0, 1], [2, 0]],
                                                                      dtype=torch.int32)),
        f"{FIA}: key must be ≥ 4 blocks (the sum over sequences), got 3"),
    # _npu_paged_attention
    "pa head size over 576": (
        lambda: paged_attention(head_size=640, block_size=16),
        f"{PA}: head_size must be ≤ 576, got 640"),
    "pa block size over 128 with a head size over 256": (
        lambda: paged_attention(head_size=512, block_size=256),
        f"{PA}: block_size (key_cache.shape[1]) must be ≤ 128 when head_size > 256, got 256"),
    "pa block size not a multiple of 16": (
        lambda: paged_attention(block_size=24),
        f"{PA}: block_size (key_cache.shape[1]) must be a multiple of 16, got 24"),
    "pa block_table int64": (
        lambda: paged_attention(block_table=torch.tensor([[0, 1], [2, 3], [4, 5]])),
        f"{PA}: block_table must be int32, got torch.int64"),
    "pa context_lens int64": (
        lambda: paged_attention(context_lens=torch.tensor([5, 17, 16])),
        f"{PA}: context_lens must be int32, got torch.int64"),
    "pa context_lens on the device": (
        lambda: paged_attention(context_lens=torch.empty(3, dtype=torch.int32, device="meta")),
        f"{PA}: context_lens must be a host (CPU) tensor, got meta"),
    "pa empty context": (
        lambda: paged_attention(context_lens=torch.tensor([5, 0, 16], dtype=torch.int32)),
        f"{PA}: context_lens must be in [1, 256] (block_table columns × block_size), got 0"),
    "pa non-contiguous out": (
        lambda: paged_attention(out=torch.empty(8, 3, 128, dtype=BF16).transpose(0, 1)),
        f"{PA}: out must be contiguous"),
    # npu_scatter_pa_kv_cache
    "scatter duplicate slots": (
        lambda: scatter(slot_mapping=torch.tensor([0, 5, 5, 31], dtype=torch.int32)),
        "npu_scatter_pa_kv_cache: slot_mapping must be free of duplicates, got 1 duplicate"),
    "scatter padding slot -1": (
        lambda: scatter(slot_mapping=torch.tensor([0, -1, 17, 31], dtype=torch.int32)),
        "npu_scatter_pa_kv_cache: slot_mapping must be within [0, 31], got range [-1, 31]"),
    "scatter float slots": (
        lambda: scatter(slot_mapping=torch.tensor([0.0, 5.0, 17.0, 31.0])),
        "npu_scatter_pa_kv_cache: slot_mapping must be int32 or int64, got torch.float32"),
    "scatter cache dtype differs": (
        lambda: scatter(key_cache=torch.zeros(2, 16, 2, 64, dtype=torch.float16)),
        "npu_scatter_pa_kv_cache: key_cache must be torch.bfloat16 like key, got torch.float16"),
    "scatter non-contiguous key": (
        lambda: scatter(key=torch.ones(2, 4, 64, dtype=BF16).transpose(0, 1)),
        "npu_scatter_pa_kv_cache: key must be contiguous"),
    "scatter non-contiguous slot_mapping": (
        lambda: scatter(slot_mapping=torch.tensor([[0, 1], [5, 6], [17, 18], [31, 30]],
                                                  dtype=torch.int32)[:, 0]),
        "npu_scatter_pa_kv_cache: slot_mapping must be contiguous, got strides (2,)"),
    # norms and activation
    "rms_norm 1-D input": (
        lambda: kernels.rms_norm(torch.zeros(64), torch.ones(64)),
        "npu_rms_norm: self must be 2-D to 8-D, got 1-D (64,)"),
    "rms_norm bf16 gamma for fp32 input": (
        lambda: kernels.rms_norm(torch.zeros(2, 64), torch.ones(64, dtype=BF16)),
        "npu_rms_norm: gamma must be torch.float32 like self, got torch.bfloat16"),
    # [RMS-WHEEL] gamma's dtype is self's: the fp32 gamma the .md's table lists is not allowed.
    "rms_norm fp32 gamma for bf16 input": (
        lambda: kernels.rms_norm(torch.zeros(2, 64, dtype=BF16), torch.ones(64)),
        "npu_rms_norm: gamma must be torch.bfloat16 like self, got torch.float32"),
    "rms_norm gamma not trailing": (
        lambda: kernels.rms_norm(torch.zeros(2, 64), torch.ones(32)),
        "npu_rms_norm: gamma must be trailing dims of (2, 64), got (32,)"),
    "add_rms_norm x2 shape differs": (
        lambda: kernels.add_rms_norm(torch.zeros(2, 64), torch.zeros(1, 64), torch.ones(64)),
        "npu_add_rms_norm: x2 must be torch.float32 of shape (2, 64) like x1"),
    "add_rms_norm empty input": (
        lambda: kernels.add_rms_norm(torch.zeros(0, 64), torch.zeros(0, 64), torch.ones(64)),
        "npu_add_rms_norm: x1 must be non-empty, got shape (0, 64)"),
    "swiglu odd last dim": (
        lambda: kernels.swiglu(torch.zeros(4, 7)),
        "npu_swiglu: self must be even-sized on dim -1, got (4, 7)"),
    "swiglu non-contiguous": (
        lambda: kernels.swiglu(torch.zeros(8, 4).t()),
        "npu_swiglu: self must be contiguous"),
    # rotary
    "rotary_mul unknown mode": (
        lambda: rotary_mul(rotary_mode="neox"),
        "npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got 'neox'"),
    "rotary_mul factor outside [-1, 1]": (
        lambda: rotary_mul(r1=torch.full((1, 3, 1, 64), 1.5)),
        "npu_rotary_mul: r1 must be within [-1, 1], got range [1.5, 1.5]"),
    "rotary_mul odd head dim": (
        lambda: rotary_mul(self=torch.zeros(1, 3, 4, 63), r1=torch.rand(1, 3, 1, 63),
                           r2=torch.rand(1, 3, 1, 63)),
        "npu_rotary_mul: self must be an even last dim below 896, got 63"),
    "rotary_mul TND (3-D) input": (
        lambda: rotary_mul(self=torch.zeros(3, 4, 64), r1=torch.rand(3, 1, 64),
                           r2=torch.rand(3, 1, 64)),
        "npu_rotary_mul: self must be 4-D, got 3-D (3, 4, 64)"),
    "rotary_mul sin shaped unlike cos": (
        lambda: rotary_mul(r2=torch.rand(1, 3, 4, 64)),
        "npu_rotary_mul: r2 must be shape (1, 3, 1, 64) like r1, got (1, 3, 4, 64)"),
    "rotary_mul interleave with per-head factors": (
        lambda: rotary_mul(r1=torch.rand(1, 3, 4, 64), r2=torch.rand(1, 3, 4, 64),
                           rotary_mode="interleave"),
        "npu_rotary_mul: r1 must be one of interleave mode's cos/sin layouts for the input "
        "(1, 3, 4, 64) (BNSD: 11SD; BSND: 1S1D; SBND: S11D), got (1, 3, 4, 64)"),
    "rotary_mul factors that broadcast but fit no layout": (
        lambda: rotary_mul(self=torch.zeros(2, 3, 4, 64), r1=torch.rand(1, 3, 4, 64),
                           r2=torch.rand(1, 3, 4, 64)),
        "npu_rotary_mul: r1 must be one of half mode's cos/sin layouts for the input (2, 3, 4, 64) "
        "(BNSD: 11SD, B1SD, BNSD; BSND: 1S1D, BS1D, BSND; SBND: S11D, SB1D, SBND), "
        "got (1, 3, 4, 64)"),
    "rotary_mul 1000 heads in half mode": (
        lambda: rotary_mul(self=torch.zeros(1, 2, 1000, 64), r1=torch.rand(1, 2, 1, 64),
                           r2=torch.rand(1, 2, 1, 64)),
        "npu_rotary_mul: self must be B and N below 1000 in half mode, got BSND with B=1, "
        "N=1000, SBND with B=2, N=1000"),
    "rotary_mul B * N of 1000 in interleave mode": (
        lambda: rotary_mul(self=torch.zeros(1, 2, 1000, 64), r1=torch.rand(1, 2, 1, 64),
                           r2=torch.rand(1, 2, 1, 64), rotary_mode="interleave"),
        "npu_rotary_mul: self must be B * N below 1000 in interleave mode, got BSND with B=1, "
        "N=1000"),
    # npu_mrope
    "mrope 'interleaved' (the .md's spelling, which the binding refuses)": (
        lambda: mrope(rotary_mode="interleaved"),
        "npu_mrope: rotary_mode must be 'half' or 'interleave', got 'interleaved'"),
    "mrope 2-D positions in RoPE mode (mrope_section [0, 0, 0])": (
        lambda: mrope(positions=torch.zeros(3, 3, dtype=torch.int64)),
        "npu_mrope: positions must be 1-D, got 2-D (3, 3)"),
    "mrope 1-D positions in mrope mode": (
        lambda: mrope(mrope_section=[8, 12, 12]),
        "npu_mrope: positions must be 2-D, got 1-D (3,)"),
    "mrope positions of 2 rows for 3 sections": (
        lambda: mrope(positions=torch.zeros(2, 3, dtype=torch.int64), mrope_section=[8, 12, 12]),
        "npu_mrope: positions must be 3 rows, one per mrope section, got (2, 3)"),
    "mrope section outside the kernels' list (V2's [11, 11, 10])": (
        lambda: mrope(positions=torch.zeros(3, 3, dtype=torch.int64), mrope_section=[11, 11, 10]),
        "npu_mrope: mrope_section must be one of [[16, 24, 24], [24, 20, 20], [8, 12, 12], "
        "[16, 16, 16, 16]] summing to rotary dim 64 / 2, got [11, 11, 10]"),
    "mrope sections summing past rotary dim / 2": (
        lambda: mrope(positions=torch.zeros(3, 3, dtype=torch.int64), mrope_section=[16, 24, 24]),
        "npu_mrope: mrope_section must be one of [[16, 24, 24], [24, 20, 20], [8, 12, 12], "
        "[16, 16, 16, 16]] summing to rotary dim 64 / 2, got [16, 24, 24]"),
    "mrope 3-D query": (
        lambda: mrope(query=torch.zeros(3, 4, 64, dtype=BF16)),
        "npu_mrope: query must be 2-D, got 3-D (3, 4, 64)"),
    "mrope cache dtype unlike the query": (
        lambda: mrope(cos_sin_cache=torch.rand(16, 64)),
        "npu_mrope: query must be torch.float32 like cos_sin_cache, got torch.bfloat16"),
    "mrope head size 80 in bf16": (
        lambda: mrope(query=torch.zeros(3, 320, dtype=BF16), key=torch.zeros(3, 160, dtype=BF16),
                      head_size=80),
        "npu_mrope: cos_sin_cache must be a rotary dim <= head size 80, both multiples of 32, got 64"),
    "mrope rotary dim 48 in bf16": (
        lambda: mrope(cos_sin_cache=torch.rand(16, 48, dtype=BF16)),
        "npu_mrope: cos_sin_cache must be a rotary dim <= head size 64, both multiples of 32, got 48"),
    "mrope key of fewer tokens": (
        lambda: mrope(key=torch.zeros(2, 128, dtype=BF16)),
        "npu_mrope: key must be shape (3, heads * 64), got (2, 128)"),
    "mrope position past the cache": (
        lambda: mrope(positions=torch.tensor([0, 5, 16])),
        "npu_mrope: positions must be within [0, 16), got range [0, 16]"),
    # top-k / top-p
    "top_k k = 0": (
        lambda: top_k_top_p(k=torch.tensor([0, 5], dtype=torch.int32)),
        "npu_top_k_top_p: k must be within [1, 1024], got range [0, 5]"),
    "top_k k = 1025": (
        lambda: top_k_top_p(logits=torch.zeros(2, 2000),
                            k=torch.tensor([1025, 5], dtype=torch.int32)),
        "npu_top_k_top_p: k must be within [1, 1024], got range [5, 1025]"),
    "top_k k over the vocab": (
        lambda: top_k_top_p(k=torch.tensor([60, 5], dtype=torch.int32)),
        "npu_top_k_top_p: k must be ≤ vocab size 50, got 60"),
    "top_k k int64": (
        lambda: top_k_top_p(k=torch.tensor([5, 10])),
        "npu_top_k_top_p: k must be int32, got torch.int64"),
    "top_p dtype differs from logits": (
        lambda: top_k_top_p(p=torch.tensor([0.5, 0.9], dtype=torch.float16)),
        "npu_top_k_top_p: p must be torch.float32 like logits, got torch.float16"),
    "top_p above 1": (
        lambda: top_k_top_p(p=torch.tensor([0.5, 1.5])),
        "npu_top_k_top_p: p must be within [0, 1], got range [0.5, 1.5]"),
    "top_k_top_p neither p nor k": (
        lambda: top_k_top_p(p=None, k=None),
        "npu_top_k_top_p: p/k must be at least one of p and k, got both None"),
    # swap_blocks: KV offload's block copies
    "swap_blocks int32 mapping": (
        lambda: swap_blocks(block_mapping=torch.tensor([[3, 1]], dtype=torch.int32)),
        "swap_blocks: block_mapping must be int64, got torch.int32"),
    "swap_blocks mapping not pairs": (
        lambda: swap_blocks(block_mapping=torch.tensor([3, 1])),
        "swap_blocks: block_mapping must be [n, 2] (source, destination) pairs, got (2,)"),
    "swap_blocks source out of range": (
        lambda: swap_blocks(block_mapping=torch.tensor([[8, 1]])),
        "swap_blocks: block_mapping's source blocks must be in [0, 8), got [8]"),
    "swap_blocks destination out of range": (
        lambda: swap_blocks(block_mapping=torch.tensor([[3, 5]])),
        "swap_blocks: block_mapping's destination blocks must be in [0, 5), got [5]"),
    "swap_blocks destination twice": (
        lambda: swap_blocks(block_mapping=torch.tensor([[3, 1], [0, 1]])),
        "swap_blocks: block_mapping's destination blocks must be distinct, got [1, 1]"),
    "swap_blocks dtypes differ": (
        lambda: swap_blocks(dst=torch.zeros(5, 2, 16, 2, 64)),
        "swap_blocks: dst must be of src's dtype torch.bfloat16, got torch.float32"),
    "swap_blocks block shapes differ": (
        lambda: swap_blocks(dst=torch.zeros(5, 2, 16, 64, 2, dtype=BF16)),
        "swap_blocks: dst must be blocks of src's shape (2, 16, 2, 64), got (2, 16, 64, 2)"),
    "swap_blocks block not contiguous": (
        lambda: swap_blocks(src=torch.zeros(8, 2, 64, 2, 16, dtype=BF16).transpose(2, 4)),
        "swap_blocks: src must be contiguous within each block"),
}


@pytest.mark.parametrize("call, message", VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_violation_is_rejected_with_a_clear_message(call, message):
    with pytest.raises(KernelContractError, match=re.escape(message)):
        call()


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _baseline_fia_paged():
    out, _ = fused_attention(value=torch.ones(8, 128, 256, dtype=BF16))
    return out, torch.ones(5, 8, 128, dtype=BF16)


def _baseline_fia_decode():
    out, _ = fused_decode(value=torch.ones(8, 128, 256, dtype=BF16))
    return out, torch.ones(2, 1, 1024, dtype=BF16)


def _baseline_paged_attention():
    out = torch.zeros(3, 8, 128, dtype=BF16)
    paged_attention(value_cache=torch.ones(8, 128, 2, 128, dtype=BF16), out=out)
    return out, torch.ones(3, 8, 128, dtype=BF16)


def _baseline_scatter():
    key_cache, value_cache = (torch.zeros(2, 16, 2, 64, dtype=BF16) for _ in range(2))
    key = torch.arange(1, 5, dtype=BF16)[:, None, None].expand(4, 2, 64).contiguous()
    scatter(key=key, value=-key, key_cache=key_cache, value_cache=value_cache)
    expected = torch.zeros(32, 2, 64, dtype=BF16)
    expected[[0, 5, 17, 31]] = key
    written = torch.cat((key_cache.view(32, 2, 64), value_cache.view(32, 2, 64)))
    return written, torch.cat((expected, -expected))


def _baseline_rotary_mul():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 4, 64, generator=generator)
    r1, r2 = (torch.rand(1, 3, 1, 64, generator=generator) for _ in range(2))
    return rotary_mul(self=x, r1=r1, r2=r2), x * r1 + _rotate_half(x) * r2  # NeoX halves


def _baseline_mrope():
    """Position 0's cos|sin row is (1, ..., 1 | 0, ..., 0): each rotated head is itself."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 8 * 64, generator=generator).to(BF16)
    cache = torch.cat((torch.ones(1, 32), torch.zeros(1, 32)), dim=-1).to(BF16)
    query, key = mrope(positions=torch.zeros(3, dtype=torch.int64), query=qkv[:, :256],
                       key=qkv[:, 256:384], cos_sin_cache=cache, rotary_mode="interleave")
    return torch.cat((query, key), dim=-1), qkv[:, :384]


def _baseline_mrope_sections():
    """mrope mode, sections [8, 12, 12]: a cache whose row p is all p rotates each section of the
    lanes by its own positions row (rows 0, 1, 2 at positions 0, 1, 2: cos|sin values 0, 1, 2);
    with x = 1 in every lane, "half" gives x1*cos - x2*sin and x2*cos + x1*sin per lane pair."""
    qkv = torch.ones(3, 8 * 64, dtype=BF16)
    cache = torch.arange(3, dtype=BF16)[:, None].expand(3, 64).contiguous()
    positions = torch.tensor([0, 1, 2])[:, None].expand(3, 3)
    query, _ = mrope(positions=positions, query=qkv[:, :256], key=qkv[:, 256:384],
                     cos_sin_cache=cache, mrope_section=[8, 12, 12])
    value = torch.cat((torch.zeros(8), torch.ones(12), torch.full((12,), 2.0)))  # per frequency
    head = torch.cat((value - value, value + value, torch.ones(0)))  # o1 = c - s, o2 = c + s
    return query, head.to(BF16).repeat(3, 4)


def _baseline_top_k_top_p():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 3
    p, k = torch.tensor([0.5, 0.9]), torch.tensor([5, 10], dtype=torch.int32)
    kept = torch.isfinite(top_k_top_p(logits=logits, p=p, k=k))
    return kept, torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))


def _baseline_swap_blocks():
    """Exactly the mapped blocks move, whole (both planes); the rest of the host rows stay."""
    src = torch.arange(8 * 2 * 16 * 2 * 64, dtype=torch.float32).view(8, 2, 16, 2, 64).to(BF16)
    dst = torch.full((5, 2, 16, 2, 64), -1.0, dtype=BF16)
    swap_blocks(src=src, dst=dst)
    expected = torch.full_like(dst, -1.0)
    expected[1], expected[4] = src[3], src[0]
    return dst, expected


BASELINES = {
    # attention over equal value rows is that row, whatever the weights
    "fia paged TND": _baseline_fia_paged,
    "fia BSH decode": _baseline_fia_decode,
    "paged attention": _baseline_paged_attention,
    "scatter": _baseline_scatter,  # exactly the mapped slots
    "rotary_mul": _baseline_rotary_mul,
    "mrope": _baseline_mrope,
    "mrope sections": _baseline_mrope_sections,
    "top_k_top_p": _baseline_top_k_top_p,  # vLLM's own top-k/top-p keeps the same logits
    "swap_blocks": _baseline_swap_blocks,
}


@pytest.mark.parametrize("baseline", BASELINES.values(), ids=BASELINES.keys())
def test_the_baselines_are_valid_and_compute_their_op(baseline):
    """Each violation above is one change away from a call that passes and computes its op."""
    actual, expected = baseline()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected)


def test_contract_error_is_a_value_error():
    assert issubclass(KernelContractError, ValueError)


def test_unsupported_layout_and_sparse_mode_are_not_contract_errors():
    """The op documents these; the seam does not implement them, and says so."""
    with pytest.raises(NotImplementedError, match="input_layout 'TND' and 'BSH'"):
        fused_attention(input_layout="BNSD")
    with pytest.raises(NotImplementedError, match="BSH for single-token queries over a paged"):
        fused_decode(query=torch.zeros(2, 3, 1024, dtype=BF16))
    with pytest.raises(NotImplementedError, match=r"sparse_mode 0 .*, 3 .* and 4 \(band\) only"):
        fused_attention(sparse_mode=2)
