"""The reference attention and cache-write kernels against independent math.

The oracle is ``scaled_dot_product_attention`` in float32 over each sequence's ORIGINAL contiguous
K/V (GQA by repeating K/V heads, the causal mask written out position by position); the kernels
under test read the same K/V back out of a paged cache that the test filled through random block
tables, with stale block ids in the unused table columns.
"""

import math

import hypothesis.strategies as st
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from ascend_patch.npu import kernels

# The optimised sparse_mode=3 mask as vllm-ascend builds it: 1 (masked) strictly above the diagonal.
CAUSAL_MASK = torch.ones(2048, 2048, dtype=torch.int8).triu(1)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}

head_layouts = st.tuples(
    st.sampled_from([1, 2, 4]),  # KV heads
    st.sampled_from([1, 2, 4, 8]),  # query heads per KV head (GQA group)
    st.sampled_from([64, 128]),  # head dim
)
half_dtypes = st.sampled_from([torch.bfloat16, torch.float16])
seeds = st.integers(0, 2**31 - 1)


@st.composite
def mixed_batch(draw, max_prefix=600):
    """(q_len, kv_len) per sequence: decodes, fresh prefills and chunks behind a cached prefix."""
    batch = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        if kind == "decode":
            q_len, prefix = 1, draw(st.integers(0, max_prefix))
        elif kind == "prefill":
            q_len, prefix = draw(st.integers(2, 160)), 0
        else:
            q_len, prefix = draw(st.integers(2, 48)), draw(st.integers(1, max_prefix))
        batch.append((q_len, prefix + q_len))
    return batch


def oracle(query, key, value, scale, causal):
    """query [q, H, D], key/value [s, KVH, D] -> [q, H, D], all in float32."""
    q_len, heads, _ = query.shape
    kv_len, kv_heads, _ = key.shape
    key = key.float().repeat_interleave(heads // kv_heads, dim=1)
    value = value.float().repeat_interleave(heads // kv_heads, dim=1)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:  # rightDownCausal: query i sees key positions up to kv_len - q_len + i
        for i in range(q_len):
            mask[i, kv_len - q_len + i + 1:] = False
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
        attn_mask=mask, scale=scale,
    )
    return out.transpose(0, 1)


def random_sequences(kv_lens, kv_heads, head_dim, dtype, generator):
    shape = (kv_heads, head_dim)
    keys = [torch.randn(n, *shape, generator=generator).to(dtype) for n in kv_lens]
    values = [torch.randn(n, *shape, generator=generator).to(dtype) for n in kv_lens]
    return keys, values


def paged_cache(keys, values, block_size, generator, spare_blocks=3):
    """Scatter each sequence into random blocks; unused block-table columns hold stale ids."""
    per_seq = [math.ceil(k.shape[0] / block_size) for k in keys]
    num_blocks = sum(per_seq) + spare_blocks
    width = max(per_seq) + 2
    key_cache = torch.randn(num_blocks, block_size, *keys[0].shape[1:],
                            generator=generator).to(keys[0].dtype)
    value_cache = torch.randn(num_blocks, block_size, *values[0].shape[1:],  # may differ (MLA)
                              generator=generator).to(values[0].dtype)
    block_table = torch.randint(0, num_blocks, (len(keys), width), generator=generator,
                                dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=generator)
    taken = 0
    for row, (key, value, count) in enumerate(zip(keys, values, per_seq)):
        block_table[row, :count] = free[taken:taken + count].to(torch.int32)
        taken += count
        positions = torch.arange(key.shape[0])
        blocks = block_table[row, positions // block_size].long()
        key_cache[blocks, positions % block_size] = key
        value_cache[blocks, positions % block_size] = value
    return key_cache, value_cache, block_table


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol)


def cumulative(lengths):
    return torch.tensor(lengths).cumsum(0).tolist()


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

    paged = (key_cache.shape[0], block_size, -1)
    out, lse = kernels.fused_infer_attention_score(
        query, key_cache.view(paged), value_cache.view(paged),
        atten_mask=CAUSAL_MASK, block_table=block_table, actual_seq_lengths=cumulative(q_lens),
        actual_seq_lengths_kv=list(kv_lens), num_heads=num_heads, num_key_value_heads=kv_heads,
        scale=scale, input_layout="TND", block_size=block_size, sparse_mode=3,
    )

    assert out.shape == query.shape and out.dtype == dtype
    assert lse.shape == (1,)
    start = 0
    for q_len, key, value in zip(q_lens, keys, values):
        rows = slice(start, start + q_len)
        assert_close(out[rows], oracle(query[rows], key, value, scale, causal=True), dtype)
        start += q_len


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
