"""The MLA reference kernels against independent math, and their documented contracts.

The oracle (``tests.kernels.test_attention.oracle``) is ``scaled_dot_product_attention`` in float32
over each sequence's ORIGINAL contiguous tensors, with a query ``q_nope ++ q_rope`` against keys
``k_nope ++ k_rope`` (the rope key repeated over heads) and the causal mask written out position by
position; the references compute the two score terms separately and, for the absorbed forms, read
the latent and rope planes back out of a paged cache (the latent as the "key", the rope key as the
"value" plane of ``test_attention.paged_cache``) filled through random block tables with stale ids
in the unused columns.
"""

import re

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import KernelContractError
from ascend_patch.npu.kernels.mla import ATB_MLA_HEADS
from tests.kernels.test_attention import (
    CAUSAL_MASK,
    assert_close,
    cumulative,
    half_dtypes,
    mixed_batch,
    oracle,
    paged_cache,
    seeds,
)

LATENT, ROPE, NOPE = 512, 64, 128


def latent_sequences(kv_lens, dtype, generator):
    """Per sequence: the latent ``[s, 1, 512]`` and the rope key ``[s, 1, 64]``."""
    latents = [torch.randn(n, 1, LATENT, generator=generator).to(dtype) for n in kv_lens]
    ropes = [torch.randn(n, 1, ROPE, generator=generator).to(dtype) for n in kv_lens]
    return latents, ropes


def latent_oracle(q_nope, q_rope, latent, rope, scale, causal):
    """Absorbed MLA as plain attention: keys latent ++ rope (576), values the latent."""
    return oracle(torch.cat((q_nope, q_rope), dim=-1), torch.cat((latent, rope), dim=-1), latent,
                  scale, causal)


@settings(max_examples=12, deadline=None)
@given(batch=mixed_batch(max_prefix=300), heads=st.sampled_from([1, 4, 8]),
       block_size=st.sampled_from([128, 256]), dtype=half_dtypes, seed=seeds)
def test_absorbed_form_over_the_paged_latent_cache(batch, heads, block_size, dtype, seed):
    """D = 512: decodes, fresh prefills and chunks behind cached context in one TND call."""
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = zip(*batch)
    latents, ropes = latent_sequences(kv_lens, dtype, generator)
    latent_cache, rope_cache, block_table = paged_cache(latents, ropes, block_size, generator)
    q_nope = torch.randn(sum(q_lens), heads, LATENT, generator=generator).to(dtype)
    q_rope = torch.randn(sum(q_lens), heads, ROPE, generator=generator).to(dtype)
    scale = (LATENT + ROPE) ** -0.5
    paged = latent_cache.view(latent_cache.shape[0], block_size, LATENT)

    out, lse = kernels.fused_infer_attention_score_mla(
        q_nope, paged, paged, query_rope=q_rope,
        key_rope=rope_cache.view(rope_cache.shape[0], block_size, ROPE), atten_mask=CAUSAL_MASK,
        block_table=block_table, actual_seq_lengths=cumulative(q_lens),
        actual_seq_lengths_kv=list(kv_lens), num_heads=heads, num_key_value_heads=1, scale=scale,
        input_layout="TND", block_size=block_size, sparse_mode=3,
    )

    assert out.shape == q_nope.shape and out.dtype == dtype and lse.shape == (0,)
    start = 0
    for q_len, latent, rope in zip(q_lens, latents, ropes):
        rows = slice(start, start + q_len)
        assert_close(out[rows], latent_oracle(q_nope[rows], q_rope[rows], latent, rope, scale,
                                              causal=True), dtype)
        start += q_len


@settings(max_examples=15, deadline=None)
@given(batch=mixed_batch(max_prefix=200), heads=st.sampled_from([1, 4, 8, 12]),
       group=st.sampled_from([1, 2]), causal=st.booleans(), dtype=half_dtypes, seed=seeds)
def test_up_projected_form_over_contiguous_kv(batch, heads, group, causal, dtype, seed):
    """D = 128 with rope: per-head K/V and rope keys of the whole sequence, cumulative lengths."""
    kv_heads = max(heads // group, 1)
    heads = kv_heads * group
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = zip(*batch)
    keys = [torch.randn(n, kv_heads, NOPE, generator=generator).to(dtype) for n in kv_lens]
    ropes = [torch.randn(n, kv_heads, ROPE, generator=generator).to(dtype) for n in kv_lens]
    values = [torch.randn(n, kv_heads, NOPE, generator=generator).to(dtype) for n in kv_lens]
    q_nope = torch.randn(sum(q_lens), heads, NOPE, generator=generator).to(dtype)
    q_rope = torch.randn(sum(q_lens), heads, ROPE, generator=generator).to(dtype)
    scale = (NOPE + ROPE) ** -0.5

    out, _ = kernels.fused_infer_attention_score_mla(
        q_nope, torch.cat(keys), torch.cat(values), query_rope=q_rope, key_rope=torch.cat(ropes),
        atten_mask=CAUSAL_MASK if causal else None, actual_seq_lengths=cumulative(q_lens),
        actual_seq_lengths_kv=cumulative(kv_lens), num_heads=heads, num_key_value_heads=kv_heads,
        scale=scale, input_layout="TND", sparse_mode=3 if causal else 0,
    )

    start = 0
    for q_len, key, rope, value in zip(q_lens, keys, ropes, values):
        rows = slice(start, start + q_len)
        expected = oracle(torch.cat((q_nope[rows], q_rope[rows]), dim=-1),
                          torch.cat((key, rope), dim=-1), value, scale, causal)
        assert_close(out[rows], expected, dtype)
        start += q_len


@settings(max_examples=15, deadline=None)
@given(context=st.lists(st.integers(1, 300), min_size=1, max_size=6),
       heads=st.sampled_from(ATB_MLA_HEADS[:3]), block_size=st.sampled_from([16, 64, 128]),
       dtype=half_dtypes, seed=seeds)
def test_multi_head_latent_attention_decode(context, heads, block_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    latents, ropes = latent_sequences(context, dtype, generator)
    latent_cache, rope_cache, block_table = paged_cache(latents, ropes, block_size, generator)
    q_nope = torch.randn(len(context), heads, LATENT, generator=generator).to(dtype)
    q_rope = torch.randn(len(context), heads, ROPE, generator=generator).to(dtype)
    scale = 0.7 * (LATENT + ROPE) ** -0.5

    out = kernels.multi_head_latent_attention(q_nope, q_rope, latent_cache, rope_cache,
                                              block_table, list(context), heads, scale, 1)

    assert out.shape == q_nope.shape and out.dtype == dtype
    for row, (latent, rope) in enumerate(zip(latents, ropes)):
        one = slice(row, row + 1)
        assert_close(out[one], latent_oracle(q_nope[one], q_rope[one], latent, rope, scale, True),
                     dtype)


# --- contracts ------------------------------------------------------------------------------------

BF16 = torch.bfloat16
FIA = "npu_fused_infer_attention_score"
ATB = "npu_multi_head_latent_attention"


def absorbed(*, heads=8, block_size=128, num_blocks=6, **overrides):
    """A valid D = 512 call (a decode over 200 and a 4-token chunk over 140), then overrides."""
    cache = torch.zeros(num_blocks, block_size, LATENT, dtype=BF16)
    args = dict(
        query=torch.zeros(5, heads, LATENT, dtype=BF16), key=cache, value=cache,
        query_rope=torch.zeros(5, heads, ROPE, dtype=BF16),
        key_rope=torch.zeros(num_blocks, block_size, ROPE, dtype=BF16), atten_mask=CAUSAL_MASK,
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), actual_seq_lengths=[1, 5],
        actual_seq_lengths_kv=[200, 140], num_heads=heads, num_key_value_heads=1, scale=0.04,
        input_layout="TND", block_size=block_size, sparse_mode=3,
    )
    args.update(overrides)
    return kernels.fused_infer_attention_score_mla(args.pop("query"), args.pop("key"),
                                                   args.pop("value"), **args)


def up_projected(**overrides):
    """A valid D = 128 call: two fresh prefills of 3 and 4 tokens, then overrides."""
    args = dict(
        query=torch.zeros(7, 4, NOPE, dtype=BF16), key=torch.zeros(7, 4, NOPE, dtype=BF16),
        value=torch.zeros(7, 4, NOPE, dtype=BF16),
        query_rope=torch.zeros(7, 4, ROPE, dtype=BF16),
        key_rope=torch.zeros(7, 4, ROPE, dtype=BF16), atten_mask=CAUSAL_MASK,
        actual_seq_lengths=[3, 7], actual_seq_lengths_kv=[3, 7], num_heads=4,
        num_key_value_heads=4, scale=0.07, input_layout="TND", sparse_mode=3,
    )
    args.update(overrides)
    return kernels.fused_infer_attention_score_mla(args.pop("query"), args.pop("key"),
                                                   args.pop("value"), **args)


def latent_decode(*, heads=8, block_size=128, **overrides):
    """A valid decode of three sequences over [6, block_size, 1, 512/64] planes, then overrides."""
    args = dict(
        q_nope=torch.zeros(3, heads, LATENT, dtype=BF16),
        q_rope=torch.zeros(3, heads, ROPE, dtype=BF16),
        ctkv=torch.zeros(6, block_size, 1, LATENT, dtype=BF16),
        k_rope=torch.zeros(6, block_size, 1, ROPE, dtype=BF16),
        block_tables=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
        context_lens=[5, 140, 256], q_headnum=heads, qk_scale=0.04, kv_headnum=1,
    )
    args.update(overrides)
    return kernels.multi_head_latent_attention(**args)


VIOLATIONS = {
    "fia mla rope dim 32": (
        lambda: absorbed(query_rope=torch.zeros(5, 8, 32, dtype=BF16)),
        f"{FIA}: query_rope must be shape (5, 8, 64), got (5, 8, 32)"),
    "fia mla query dim 256": (
        lambda: up_projected(query=torch.zeros(7, 4, 256, dtype=BF16)),
        f"{FIA}: query head dim (D) must be 512 or 128 in the MLA form, got 256"),
    "fia mla 12 heads on the latent cache": (
        lambda: absorbed(heads=12),
        f"{FIA}: num_heads must be 1, 2, 4, 8, 16, 32, 64 or 128 with query D = 512, got 12"),
    "fia mla two kv heads on the latent cache": (
        lambda: absorbed(num_key_value_heads=2),
        f"{FIA}: num_key_value_heads must be 1 with query D = 512, got 2"),
    "fia mla rope key of another dtype": (
        lambda: absorbed(key_rope=torch.zeros(6, 128, ROPE, dtype=torch.float16)),
        f"{FIA}: key_rope must be torch.bfloat16 like query, got torch.float16"),
    "fia mla strided rope query": (
        lambda: absorbed(query_rope=torch.zeros(5, 8, 128, dtype=BF16)[..., :ROPE]),
        f"{FIA}: query_rope must be contiguous"),
    "fia mla value other than the latent key": (
        lambda: absorbed(value=torch.zeros(6, 128, 128, dtype=BF16)),
        f"{FIA}: value must be shape (6, 128, 512) like key, got (6, 128, 128)"),
    "fia mla prefill block size 64": (
        lambda: absorbed(block_size=64, num_blocks=12,
                         block_table=torch.arange(12, dtype=torch.int32).view(2, 6)),
        f"{FIA}: block_size must be a multiple of 128 in [128, 512] when a query is longer "
        "than 1, got 64"),
    "fia mla up-projected value dim 192": (
        lambda: up_projected(key=torch.zeros(7, 4, 192, dtype=BF16),
                             value=torch.zeros(7, 4, 192, dtype=BF16)),
        f"{FIA}: key must be shape (T_kv, 4, 128), got (7, 4, 192)"),
    "fia mla up-projected rope key on one head": (
        lambda: up_projected(key_rope=torch.zeros(7, 1, ROPE, dtype=BF16)),
        f"{FIA}: key_rope must be shape (7, 4, 64), got (7, 1, 64)"),
    "fia mla kv lengths not cumulative": (
        lambda: up_projected(actual_seq_lengths_kv=[3, 4]),
        f"{FIA}: actual_seq_lengths_kv must be cumulative, ending at key.shape[0] = 7, "
        "got [3, 4]"),
    "atb mla 4 heads": (
        lambda: latent_decode(heads=4),
        f"{ATB}: q_headnum must be 8, 16, 32, 64 or 128, got 4"),
    "atb mla block size 256": (
        lambda: latent_decode(block_size=256),
        f"{ATB}: block_size (ctkv.shape[1]) must be ≤ 128, got 256"),
    "atb mla context lengths as a tensor": (
        lambda: latent_decode(context_lens=torch.tensor([5, 140, 256], dtype=torch.int32)),
        f"{ATB}: context_lens must be a host list[int], got Tensor"),
    "atb mla scale above one": (
        lambda: latent_decode(qk_scale=1.5),
        f"{ATB}: qk_scale must be a float in (0, 1], got 1.5"),
    "atb mla two kv heads": (
        lambda: latent_decode(kv_headnum=2),
        f"{ATB}: kv_headnum must be 1 (and ctkv.shape[2] = 1), got (2, 1)"),
    "atb mla context beyond the block table": (
        lambda: latent_decode(context_lens=[5, 140, 257]),
        f"{ATB}: context_lens must be in [1, 256] (block_tables columns × block_size), got 257"),
    "atb mla float32": (
        lambda: latent_decode(q_nope=torch.zeros(3, 8, LATENT)),
        f"{ATB}: q_nope must be float16 or bfloat16, got torch.float32"),
}


def test_valid_calls_pass():
    absorbed()
    up_projected()
    latent_decode()


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_contract_violation_is_rejected_by_name(case):
    call, message = VIOLATIONS[case]
    with pytest.raises(KernelContractError, match=re.escape(message)):
        call()
