"""The attention kernels' oracle and the batches, caches and checks their tests share
(tests/kernels/test_attention.py, test_mla_ops.py).

The oracle is ``scaled_dot_product_attention`` in float32 over each sequence's contiguous K/V
(GQA by repeating K/V heads, the causal or band mask written out position by position; the
soft-cap written out as a masked softmax).
"""

import math

import hypothesis.strategies as st
import torch
import torch.nn.functional as F

# The optimised sparse_mode=3 mask as vllm-ascend builds it: 1 (masked) strictly above the diagonal.
CAUSAL_MASK = torch.ones(2048, 2048, dtype=torch.int8).triu(1)
# Kernel against the float32 oracle. Measured (2026-12-05) over the Hypothesis draws of
# tests/kernels/test_attention.py and test_mla_ops.py (about 400 bf16 and 200 fp16 comparisons):
# beyond 2^-7 of the oracle, at most 2.8e-3 in bf16 (a paged decode); beyond 2^-8, 2.3e-4 in fp16.
# Each bound is about twice that. A key left out of a 600-key bf16 decode moves the output by
# 2.4e-3 to 0.15 (median 1.1e-2): the bf16 bound catches 9 in 10 such keys, the 3e-2 it replaces
# caught 1 in 17 (test_attention.py's test_a_key_left_out_of_a_long_decode_fails_the_tolerance).
TOLERANCE = {torch.bfloat16: {"atol": 5e-3, "rtol": 2**-7}, torch.float16: {"atol": 5e-4, "rtol": 2**-8}}

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


def oracle(query, key, value, scale, causal, pre_tokens=None, next_tokens=None, soft_cap=None,
           hidden=None):
    """query [q, H, D], key/value [s, KVH, D] -> [q, H, D], all in float32. Query row i sits at
    key position d = s - q + i (bottom-right aligned); causal hides keys after d, next_tokens
    those after d + next_tokens, pre_tokens those before d - pre_tokens; ``hidden`` ([q, s] bool)
    hides more; soft_cap caps the scaled logits at ±soft_cap through tanh."""
    q_len, heads, _ = query.shape
    kv_len, kv_heads, _ = key.shape
    key = key.float().repeat_interleave(heads // kv_heads, dim=1)
    value = value.float().repeat_interleave(heads // kv_heads, dim=1)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    after = 0 if causal else next_tokens
    for i in range(q_len):
        diagonal = kv_len - q_len + i
        if after is not None:
            mask[i, max(diagonal + after + 1, 0):] = False
        if pre_tokens is not None:
            mask[i, :max(diagonal - pre_tokens, 0)] = False
    if hidden is not None:
        mask &= ~hidden
    q, k, v = query.float().transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        logits = soft_cap * torch.tanh(q @ k.transpose(1, 2) * scale / soft_cap)
        out = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1)


def paged_cache(keys, values, block_size, generator, spare_blocks=3, reserve_null=False):
    """Scatter each sequence into random blocks; unused block-table columns hold stale ids.
    ``reserve_null`` keeps block 0 out of every sequence (vLLM's null block)."""
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
    if reserve_null:
        free = free[free != 0]
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
    torch.testing.assert_close(actual.float(), expected, **TOLERANCE[dtype])


def cumulative(lengths):
    return torch.tensor(lengths).cumsum(0).tolist()
