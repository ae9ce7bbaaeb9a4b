"""The reference attention and cache-write kernels, and the composed attention, against
independent math.

The oracle is ``scaled_dot_product_attention`` in float32 over each sequence's ORIGINAL contiguous
K/V (GQA by repeating K/V heads, the causal or band mask written out position by position; the
soft-cap written out as a masked softmax); the kernels under test read the same K/V back out of a
paged cache that the test filled through random block tables, with stale block ids in the unused
table columns and, under a sliding window, a shared stale "null" block in place of the blocks
that lie wholly before every query's window (as vLLM's SlidingWindowManager leaves them).
"""

import re

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from ascend_patch.npu import kernels
from tests.helpers.attention import (
    CAUSAL_MASK,
    TOLERANCE,
    assert_close,
    cumulative,
    half_dtypes,
    mixed_batch,
    oracle,
    paged_cache,
    seeds,
)

# The composed path computes in the model's dtype, not in fp32 as the fused kernels do: measured
# (2026-12-05) up to 8.0e-3 beyond 2^-7 of the oracle over 705 bf16 comparisons; about twice that.
COMPOSED_BF16 = {"atol": 1.6e-2, "rtol": 2**-7}

head_layouts = st.tuples(
    st.sampled_from([1, 2, 4]),  # KV heads
    st.sampled_from([1, 2, 4, 8]),  # query heads per KV head (GQA group)
    st.sampled_from([64, 128]),  # head dim
)


def random_sequences(kv_lens, kv_heads, head_dim, dtype, generator):
    shape = (kv_heads, head_dim)
    keys = [torch.randn(n, *shape, generator=generator).to(dtype) for n in kv_lens]
    values = [torch.randn(n, *shape, generator=generator).to(dtype) for n in kv_lens]
    return keys, values


def null_out_blocks_before(block_table, kv_lens, first_seen, block_size, key_cache, value_cache,
                            generator):
    """Point every block that lies wholly before ``first_seen[row]`` at one shared block of stale
    values (id 0, overwritten with noise), as vLLM's SlidingWindowManager nulls freed blocks."""
    key_cache[0] = torch.randn(key_cache.shape[1:], generator=generator).to(key_cache.dtype) * 100
    value_cache[0] = torch.randn(value_cache.shape[1:], generator=generator).to(value_cache.dtype) * 100
    for row, first in enumerate(first_seen):
        block_table[row, :max(first, 0) // block_size] = 0


def fused_paged_tnd(query, key_cache, value_cache, block_table, q_lens, kv_lens, kv_heads, scale,
                    **mask):
    """npu_fused_infer_attention_score in TND over the paged cache, with the causal mask tensor
    and ``mask`` (sparse_mode, pre/next_tokens)."""
    num_blocks, block_size = key_cache.shape[:2]
    paged = (num_blocks, block_size, -1)
    return kernels.fused_infer_attention_score(
        query, key_cache.view(paged), value_cache.view(paged),
        atten_mask=CAUSAL_MASK, block_table=block_table, actual_seq_lengths=cumulative(q_lens),
        actual_seq_lengths_kv=list(kv_lens), num_heads=query.shape[1], num_key_value_heads=kv_heads,
        scale=scale, input_layout="TND", block_size=block_size, **mask,
    )


def assert_per_sequence(out, query, q_lens, keys, values, dtype, expected):
    """Each sequence's rows of ``out`` against ``expected(query rows, key, value)``."""
    start = 0
    for q_len, key, value in zip(q_lens, keys, values):
        rows = slice(start, start + q_len)
        assert_close(out[rows], expected(query[rows], key, value), dtype)
        start += q_len


@settings(max_examples=50, deadline=None)
@given(batch=mixed_batch(), heads=head_layouts, block_size=st.sampled_from([128, 128, 256]),
       dtype=half_dtypes, seed=seeds)
def test_fused_attention_paged_mixed_batch(batch, heads, block_size, dtype, seed):
    kv_heads, group, head_dim = heads
    num_heads = kv_heads * group
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = zip(*batch)
    keys, values = random_sequences(kv_lens, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, block_size, generator)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5

    out, lse = fused_paged_tnd(query, key_cache, value_cache, block_table, q_lens, kv_lens,
                               kv_heads, scale, sparse_mode=3)

    assert out.shape == query.shape and out.dtype == dtype
    assert lse.shape == (0,) and lse.dtype == torch.float32  # as the op and its meta kernel
    assert_per_sequence(out, query, q_lens, keys, values, dtype,
                        lambda q, key, value: oracle(q, key, value, scale, causal=True))


def test_a_key_left_out_of_a_long_decode_fails_the_tolerance():
    """The negative control of the bf16 tolerance: a paged decode over 600 keys passes against
    the oracle, and fails against it with one key hidden for 9 in 10 of the keys (the rest carry
    too little weight for bf16 to tell them from rounding)."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, group, head_dim, context = 2, 4, 128, 600
    keys, values = random_sequences([context], kv_heads, head_dim, torch.bfloat16, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, 128, generator)
    query = torch.randn(1, kv_heads * group, head_dim, generator=generator).to(torch.bfloat16)
    scale = head_dim**-0.5

    out, _ = fused_paged_tnd(query, key_cache, value_cache, block_table, [1], [context], kv_heads,
                             scale, sparse_mode=3)

    assert_close(out, oracle(query, keys[0], values[0], scale, True), torch.bfloat16)
    caught = 0
    for missing in range(context):
        hidden = torch.zeros(1, context, dtype=torch.bool)
        hidden[0, missing] = True
        without = oracle(query, keys[0], values[0], scale, True, hidden=hidden)
        caught += not torch.allclose(out.float(), without, **TOLERANCE[torch.bfloat16])
    assert caught >= 0.9 * context, caught


@st.composite
def band_batch(draw):
    """A mixed batch with at least one query longer than one token (the band needs the prefill
    branch), and a band: pre_tokens ≥ 0, next_tokens small or unbounded (2147483647)."""
    batch = draw(mixed_batch())
    if max(q for q, _ in batch) == 1:
        batch.append((draw(st.integers(2, 100)), 0))
        batch[-1] = (batch[-1][0], batch[-1][0] + draw(st.integers(0, 300)))
    pre = draw(st.integers(0, 400))
    room = min(kv - q for q, kv in batch)  # next_tokens + kv - q ≥ 0 keeps every row non-empty
    after = draw(st.sampled_from([0, 0, 2147483647]) | st.integers(max(-room, -pre), 8))
    return batch, pre, after


@pytest.mark.parametrize("window", [1, 5, 17])
def test_a_sliding_window_of_w_keys_is_the_band_with_pre_tokens_w_minus_1(window):
    """The window's pre_tokens, settled from the definitions rather than this file's oracle. The
    band of sparse_mode=4 as npu_fusion_attention's doc builds it in its worked example (hidden =
    triu(ones, next + 1) + tril(ones, -pre - 1)), anchored at the bottom right, against HF's
    sliding-window mask (vLLM's window: FlashAttention's window_size=(W - 1, 0)): they agree at
    pre_tokens = W - 1, next_tokens = 0; vllm-ascend's pre_tokens = W shows one key more. The
    reference FIA computes the band: SDPA under HF's mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q_len, kv_len, heads, head_dim = 24, 40, 2, 64  # a chunk behind 16 cached tokens
    query_positions = torch.arange(kv_len - q_len, kv_len)[:, None]
    visible = sliding_window_causal_mask_function(window)(0, 0, query_positions,
                                                          torch.arange(kv_len)[None])

    def doc_band(pre, after):
        ones, shift = torch.ones(q_len, kv_len, dtype=torch.bool), kv_len - q_len
        return ~(ones.triu(shift + after + 1) | ones.tril(shift - pre - 1))

    assert torch.equal(doc_band(window - 1, 0), visible)
    # pre_tokens = W adds, for every query with W keys before it, the key W positions back.
    rows, columns = (doc_band(window, 0) & ~visible).nonzero().unbind(1)
    assert rows.numel() > 0 and bool((query_positions[rows, 0] - columns == window).all())

    generator = torch.Generator().manual_seed(window)
    query = torch.randn(q_len, heads, head_dim, generator=generator).to(torch.bfloat16)
    key, value = (torch.randn(kv_len, heads, head_dim, generator=generator).to(torch.bfloat16)
                  for _ in range(2))
    expected = F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1) for t in (query, key, value)), attn_mask=visible,
        scale=head_dim**-0.5).transpose(0, 1)

    def reference(pre_tokens):
        out, _ = kernels.fused_infer_attention_score(
            query, key, value, atten_mask=CAUSAL_MASK, actual_seq_lengths=[q_len],
            actual_seq_lengths_kv=[kv_len], num_heads=heads, num_key_value_heads=heads,
            scale=head_dim**-0.5, pre_tokens=pre_tokens, next_tokens=0, input_layout="TND",
            sparse_mode=4)
        return out.float()

    assert_close(reference(window - 1), expected, torch.bfloat16)
    assert not torch.allclose(reference(window), expected, **TOLERANCE[torch.bfloat16])


@settings(max_examples=30, deadline=None)
@given(case=band_batch(), heads=head_layouts, dtype=half_dtypes, seed=seeds)
def test_fused_attention_band_paged_mixed_batch(case, heads, dtype, seed):
    """sparse_mode=4: each query row sees the keys from pre_tokens before its bottom-right
    aligned diagonal to next_tokens after it; blocks wholly before the band may be a stale
    shared block."""
    batch, pre, after = case
    kv_heads, group, head_dim = heads
    num_heads, block_size = kv_heads * group, 128
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = zip(*batch)
    keys, values = random_sequences(kv_lens, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, block_size, generator,
                                                      reserve_null=True)
    null_out_blocks_before(block_table, kv_lens, [kv - q - pre for q, kv in batch], block_size,
                           key_cache, value_cache, generator)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5

    out, _ = fused_paged_tnd(query, key_cache, value_cache, block_table, q_lens, kv_lens,
                             kv_heads, scale, pre_tokens=pre, next_tokens=after, sparse_mode=4)

    assert_per_sequence(out, query, q_lens, keys, values, dtype, lambda q, key, value: oracle(
        q, key, value, scale, causal=False, pre_tokens=pre,
        next_tokens=None if after == 2147483647 else after))


@settings(max_examples=25, deadline=None)
@given(data=st.data(), context=st.lists(st.integers(1, 700), min_size=1, max_size=6),
       heads=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 4]),
                       st.sampled_from([64, 80, 96, 128, 256])),
       dtype=half_dtypes, seed=seeds)
def test_fused_attention_bsh_decode_with_a_mask(data, context, heads, dtype, seed):
    """One-token queries in BSH over a paged cache, with a (B, KV_S) mask: a sliding window's
    mask (keys before the window hidden, those blocks a stale shared block) or a random one."""
    kv_heads, group, head_dim = heads
    num_heads, block_size = kv_heads * group, 128
    generator = torch.Generator().manual_seed(seed)
    keys, values = random_sequences(context, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, block_size, generator,
                                                      reserve_null=True)
    width = block_table.shape[1] * block_size
    if data.draw(st.booleans(), label="sliding window"):
        window = data.draw(st.integers(1, 500), label="window")
        first = [n - window for n in context]
        hidden = torch.arange(width) < torch.tensor(first)[:, None]
        null_out_blocks_before(block_table, context, first, block_size, key_cache, value_cache,
                               generator)
    else:
        hidden = torch.rand(len(context), width, generator=generator) < 0.5
        for row, n in enumerate(context):  # each sequence keeps at least one of its keys
            hidden[row, int(torch.randint(n, (1,), generator=generator))] = False
    query = torch.randn(len(context), 1, num_heads * head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5

    paged = (key_cache.shape[0], block_size, -1)
    out, _ = kernels.fused_infer_attention_score(
        query, key_cache.view(paged), value_cache.view(paged), atten_mask=hidden.contiguous(),
        block_table=block_table, actual_seq_lengths_kv=context, num_heads=num_heads,
        num_key_value_heads=kv_heads, scale=scale, input_layout="BSH", block_size=block_size,
    )

    assert out.shape == query.shape
    for row, (key, value) in enumerate(zip(keys, values)):
        expected = oracle(query[row].view(1, num_heads, head_dim), key, value, scale, True,
                          hidden=hidden[row:row + 1, :len(key)])
        assert_close(out[row].view(1, num_heads, head_dim), expected, dtype)
    # The .out form FULL graphs capture writes the same into the caller's buffer.
    written = torch.full_like(query, float("nan"))
    kernels.fused_infer_attention_score_decode(
        query, key_cache.view(paged), value_cache.view(paged), atten_mask=hidden.contiguous(),
        block_table=block_table, actual_seq_lengths_kv=context, num_heads=num_heads,
        num_key_value_heads=kv_heads, scale=scale, block_size=block_size, attention_out=written,
        softmax_lse=torch.empty(0), workspace=torch.empty(0, dtype=torch.uint8))
    torch.testing.assert_close(written, out, rtol=0, atol=0)


def test_the_out_form_refuses_a_foreign_output_or_workspace():
    cache = torch.zeros(4, 128, 2 * 64, dtype=torch.bfloat16)
    query = torch.zeros(2, 1, 4 * 64, dtype=torch.bfloat16)
    call = dict(atten_mask=torch.zeros(2, 256, dtype=torch.bool),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                actual_seq_lengths_kv=[5, 140], num_heads=4, num_key_value_heads=2, scale=0.125,
                block_size=128, softmax_lse=torch.empty(0))
    op = "npu_fused_infer_attention_score.out"
    with pytest.raises(kernels.KernelContractError, match=re.escape(
            f"{op}: attention_out must be torch.bfloat16 of shape (2, 1, 256)")):
        kernels.fused_infer_attention_score_decode(query, cache, cache, **call,
                                                   attention_out=torch.zeros(2, 1, 256))
    with pytest.raises(kernels.KernelContractError, match=f"{op}: workspace must be uint8"):
        kernels.fused_infer_attention_score_decode(query, cache, cache, **call,
                                                   attention_out=torch.zeros_like(query),
                                                   workspace=torch.zeros(4))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 16), context=st.lists(st.integers(0, 600), min_size=1, max_size=5),
       window=st.none() | st.integers(1, 300), heads=head_layouts, dtype=half_dtypes, seed=seeds)
def test_verification_rows_on_the_tnd_out_form(rows, context, window, heads, dtype, seed):
    """Speculative verification rows (1 + k ≤ 16 queries per sequence, each behind its own cached
    context) on the .out form FULL graphs capture: every row sees its context and the rows up to
    its own (in a windowed layer, the last ``window`` of them: the band with pre_tokens
    window - 1), against the oracle, and the same as the plain TND call."""
    kv_heads, group, head_dim = heads
    num_heads = kv_heads * group
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [rows] * len(context), [n + rows for n in context]
    keys, values = random_sequences(kv_lens, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, 128, generator)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    paged = (key_cache.shape[0], 128, -1)
    written = torch.full_like(query, float("nan"))
    band = {"sparse_mode": 3} if window is None else {
        "sparse_mode": 4, "pre_tokens": window - 1, "next_tokens": 0}
    call = dict(atten_mask=CAUSAL_MASK, block_table=block_table,
                actual_seq_lengths=cumulative(q_lens), actual_seq_lengths_kv=kv_lens,
                num_heads=num_heads, num_key_value_heads=kv_heads, scale=scale, block_size=128,
                **band)
    workspace = kernels.fused_infer_attention_score_verify_workspace(
        query, key_cache.view(paged), value_cache.view(paged), **call)
    kernels.fused_infer_attention_score_verify(
        query, key_cache.view(paged), value_cache.view(paged), **call, attention_out=written,
        softmax_lse=torch.empty(0), workspace=workspace)

    assert_per_sequence(written, query, q_lens, keys, values, dtype, lambda q, key, value: oracle(
        q, key, value, scale, causal=True, pre_tokens=None if window is None else window - 1))
    plain, _ = fused_paged_tnd(query, key_cache, value_cache, block_table, q_lens, kv_lens,
                               kv_heads, scale, **band)
    torch.testing.assert_close(written, plain, rtol=0, atol=0)


def test_the_verification_form_refuses_rows_beyond_16_and_an_unmasked_mode():
    cache = torch.zeros(4, 128, 2 * 64, dtype=torch.bfloat16)
    call = dict(atten_mask=CAUSAL_MASK, block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                num_heads=4, num_key_value_heads=2, scale=0.125, block_size=128,
                softmax_lse=torch.empty(0))
    op = "npu_fused_infer_attention_score.out"
    query = torch.zeros(34, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(kernels.KernelContractError, match=re.escape(
            f"{op}: actual_seq_lengths must be 1 to 16 query rows per sequence (verification "
            "rows), got [17, 17]")):
        kernels.fused_infer_attention_score_verify(
            query, cache, cache, **call, actual_seq_lengths=[17, 34],
            actual_seq_lengths_kv=[40, 200], sparse_mode=3, attention_out=torch.zeros_like(query))
    query = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(kernels.KernelContractError, match=re.escape(
            f"{op}: sparse_mode must be 3 (rightDownCausal) or 4 (band) for verification rows, "
            "got 0")):
        kernels.fused_infer_attention_score_verify(
            query, cache, cache, **call, actual_seq_lengths=[4, 8], actual_seq_lengths_kv=[40, 200],
            sparse_mode=0, attention_out=torch.zeros_like(query))


@settings(max_examples=30, deadline=None)
@given(batch=mixed_batch(max_prefix=300), heads=head_layouts,
       window=st.none() | st.integers(1, 400), soft_cap=st.none() | st.floats(0.5, 60),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=seeds)
def test_composed_attention_windows_and_soft_cap(batch, heads, window, soft_cap, dtype, seed):
    """The composed path (fp32 models, soft-capped layers, head sizes no fused kernel takes):
    decode rows batched, longer queries one by one, over the paged cache."""
    from ascend_patch.npu.kernels import composed

    kv_heads, group, head_dim = heads
    num_heads, block_size = kv_heads * group, 128
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = zip(*batch)
    keys, values = random_sequences(kv_lens, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, block_size, generator)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    pre = None if window is None else window - 1

    start = 0
    for row, (q_len, kv_len, key, value) in enumerate(zip(q_lens, kv_lens, keys, values)):
        rows = slice(start, start + q_len)
        if q_len == 1:
            got = composed.decode_batch(query[rows], key_cache, value_cache, block_table[row:row + 1],
                                     [kv_len], scale, pre_tokens=pre, soft_cap=soft_cap)
        else:
            seq_key, seq_value = composed.gather_sequence(key_cache, value_cache, block_table[row],
                                                       kv_len)
            got = composed.attend(query[rows], seq_key, seq_value, scale, pre_tokens=pre,
                               next_tokens=0, soft_cap=soft_cap)
        expected = oracle(query[rows], key, value, scale, True, pre_tokens=pre, soft_cap=soft_cap)
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else COMPOSED_BF16
        torch.testing.assert_close(got.float(), expected, **tolerance)
        start += q_len


@pytest.mark.parametrize("soft_cap", [None, 30.0])
def test_composed_decode_reads_only_each_rows_own_tokens(soft_cap):
    """NaN in the cache outside each row's tokens (the rest of its last block, the null block
    its table row pads with, where padded tokens' K/V land) leaves batched decode, and MLA's
    latent decode, as they are over clean bytes: the NPU kernels read a sequence's own tokens
    only. A masked-out NaN multiplied by its zero weight would be NaN."""
    from ascend_patch.npu.kernels import composed

    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, head_dim, lengths = 16, 2, 4, 32, [5, 20]
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)  # row 0 pads with the null block
    clean = [torch.zeros(4, block_size, kv_heads, head_dim) for _ in range(2)]
    for cache in clean:
        for row, length in enumerate(lengths):
            slots = torch.arange(length)
            cache[table[row, slots // block_size].long(), slots % block_size] = torch.randn(
                length, kv_heads, head_dim, generator=generator)
    dirty = [cache.clone() for cache in clean]
    for cache in dirty:
        cache[0] = float("nan")  # the null block
        cache[1, 5:] = float("nan")  # past row 0's tokens in its block
        cache[3, 4:] = float("nan")  # past row 1's tokens in its last block
    query = torch.randn(2, heads, head_dim, generator=generator)
    want = composed.decode_batch(query, *clean, table, lengths, 0.2, soft_cap=soft_cap)
    got = composed.decode_batch(query, *dirty, table, lengths, 0.2, soft_cap=soft_cap)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    latent = [cache[..., :1, :].clone() for cache in (clean[0], dirty[0])]  # [blocks, bs, 1, L]
    rope = [cache[..., :1, :8].clone() for cache in (clean[1], dirty[1])]
    q_nope, q_rope = torch.randn(2, heads, head_dim), torch.randn(2, heads, 8)
    want, got = (composed.latent_decode(q_nope, q_rope, kv, pe, table, lengths, 0.2)
                 for kv, pe in zip(latent, rope))
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)

@settings(max_examples=30, deadline=None)
@given(batch=st.lists(st.integers(1, 700), min_size=1, max_size=8), heads=head_layouts,
       block_size=st.sampled_from([16, 64, 128, 512]), dtype=half_dtypes, seed=seeds)
def test_fused_attention_paged_decode_only_block_sizes(batch, heads, block_size, dtype, seed):
    """Decode-only batches may use any block size that is a multiple of 16 up to 512."""
    kv_heads, group, head_dim = heads
    num_heads = kv_heads * group
    generator = torch.Generator().manual_seed(seed)
    keys, values = random_sequences(batch, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, block_size, generator)
    query = torch.randn(len(batch), num_heads, head_dim, generator=generator).to(dtype)
    scale = 0.7 * head_dim**-0.5

    paged = (key_cache.shape[0], block_size, -1)
    out, _ = kernels.fused_infer_attention_score(
        query, key_cache.view(paged), value_cache.view(paged), atten_mask=CAUSAL_MASK,
        block_table=block_table, actual_seq_lengths=cumulative([1] * len(batch)),
        actual_seq_lengths_kv=batch, num_heads=num_heads, num_key_value_heads=kv_heads, scale=scale,
        block_size=block_size, sparse_mode=3,
    )

    for row, (key, value) in enumerate(zip(keys, values)):
        assert_close(out[row:row + 1], oracle(query[row:row + 1], key, value, scale, True), dtype)


@settings(max_examples=30, deadline=None)
@given(batch=mixed_batch(max_prefix=200), heads=head_layouts, causal=st.booleans(),
       dtype=half_dtypes, seed=seeds)
def test_fused_attention_contiguous_kv(batch, heads, causal, dtype, seed):
    """Without a block table, K/V are [T_kv, KVH, D] and both length lists are cumulative."""
    kv_heads, group, head_dim = heads
    num_heads = kv_heads * group
    generator = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = zip(*batch)
    keys, values = random_sequences(kv_lens, kv_heads, head_dim, dtype, generator)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5

    out, _ = kernels.fused_infer_attention_score(
        query, torch.cat(keys), torch.cat(values),
        atten_mask=CAUSAL_MASK if causal else None, actual_seq_lengths=cumulative(q_lens),
        actual_seq_lengths_kv=cumulative(kv_lens), num_heads=num_heads,
        num_key_value_heads=kv_heads, scale=scale, block_size=128, sparse_mode=3 if causal else 0,
    )

    start = 0
    for q_len, key, value in zip(q_lens, keys, values):
        rows = slice(start, start + q_len)
        assert_close(out[rows], oracle(query[rows], key, value, scale, causal), dtype)
        start += q_len


def test_fused_attention_head_dim_192_without_cache():
    """MHA prefill without a cache also takes D = 192 ([FIA-TILING])."""
    generator = torch.Generator().manual_seed(0)
    keys, values = random_sequences([7, 30], 4, 192, torch.bfloat16, generator)
    query = torch.randn(37, 4, 192, generator=generator).to(torch.bfloat16)
    out, _ = kernels.fused_infer_attention_score(
        query, torch.cat(keys), torch.cat(values), atten_mask=CAUSAL_MASK,
        actual_seq_lengths=[7, 37], actual_seq_lengths_kv=[7, 37], num_heads=4,
        num_key_value_heads=4, scale=192**-0.5, sparse_mode=3,
    )
    assert_close(out[:7], oracle(query[:7], keys[0], values[0], 192**-0.5, True), torch.bfloat16)
    assert_close(out[7:], oracle(query[7:], keys[1], values[1], 192**-0.5, True), torch.bfloat16)


@settings(max_examples=40, deadline=None)
@given(context=st.lists(st.integers(1, 700), min_size=1, max_size=8),
       kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([64, 128, 256]), block_size=st.sampled_from([16, 32, 64, 128]),
       dtype=half_dtypes, seed=seeds)
def test_paged_attention_decode(context, kv_heads, group, head_dim, block_size, dtype, seed):
    num_heads = kv_heads * group
    generator = torch.Generator().manual_seed(seed)
    keys, values = random_sequences(context, kv_heads, head_dim, dtype, generator)
    key_cache, value_cache, block_table = paged_cache(keys, values, block_size, generator)
    query = torch.randn(len(context), num_heads, head_dim, generator=generator).to(dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5

    kernels.paged_attention(query, key_cache, value_cache, kv_heads, num_heads, scale, block_table,
                            torch.tensor(context, dtype=torch.int32), out)

    for row, (key, value) in enumerate(zip(keys, values)):
        assert_close(out[row:row + 1], oracle(query[row:row + 1], key, value, scale, True), dtype)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), num_blocks=st.integers(1, 6), block_size=st.sampled_from([16, 128]),
       kv_heads=st.integers(1, 4), head_dims=st.sampled_from([(64, 64), (128, 128), (128, 64)]),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]), dtype=half_dtypes, seed=seeds)
def test_scatter_pa_kv_cache_writes_exactly_the_mapped_slots(
    data, num_blocks, block_size, kv_heads, head_dims, slot_dtype, dtype, seed
):
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), max_size=min(num_slots, 64),
                               unique=True))
    generator = torch.Generator().manual_seed(seed)
    key_dim, value_dim = head_dims
    key = torch.randn(len(slots), kv_heads, key_dim, generator=generator).to(dtype)
    value = torch.randn(len(slots), kv_heads, value_dim, generator=generator).to(dtype)
    slots_shape = (num_blocks, block_size, kv_heads)
    key_cache = torch.randn(*slots_shape, key_dim, generator=generator).to(dtype)
    value_cache = torch.randn(*slots_shape, value_dim, generator=generator).to(dtype)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots):
        expected_key[slot // block_size, slot % block_size] = key[token]
        expected_value[slot // block_size, slot % block_size] = value[token]

    kernels.scatter_pa_kv_cache(key, value, key_cache, value_cache,
                                torch.tensor(slots, dtype=slot_dtype))

    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)
