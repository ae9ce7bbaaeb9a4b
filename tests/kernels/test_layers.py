"""Norm, activation, rotary and top-k/top-p reference kernels against vLLM's native layers."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from ascend_patch.npu import kernels

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
float_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
seeds = st.integers(0, 2**31 - 1)


def vllm_layer(cls, *args, **kwargs):
    # vLLM's CustomOp layers read the current config when built; this machine has no accelerator.
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return cls(*args, **kwargs)


def assert_close(actual, expected):
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 33), hidden=st.sampled_from([8, 64, 896]), dtype=float_dtypes,
       eps=st.sampled_from([1e-6, 1e-5]), seed=seeds)
def test_rms_norm_matches_vllm(tokens, hidden, dtype, eps, seed):
    generator = torch.Generator().manual_seed(seed)
    layer = vllm_layer(RMSNorm, hidden, eps=eps, dtype=dtype)
    layer.weight.data.copy_(torch.rand(hidden, generator=generator) + 0.5)
    x = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype)

    y, rstd = kernels.rms_norm(x, layer.weight.data, eps)

    assert_close(y, layer.forward_native(x))
    expected_rstd = (x.float().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    assert rstd.dtype == torch.float32 and rstd.shape == (tokens, 1)
    torch.testing.assert_close(rstd, expected_rstd)


def test_rms_norm_per_head():
    """A 3-D input (per-head q/k norm), gamma in the input's dtype."""
    layer = vllm_layer(RMSNorm, 64, eps=1e-6, dtype=torch.bfloat16)
    layer.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 4, 64).to(torch.bfloat16)
    y, rstd = kernels.rms_norm(x, layer.weight.data, 1e-6)
    assert y.dtype == torch.bfloat16 and rstd.shape == (5, 4, 1)
    assert_close(y, layer.forward_native(x.float()).to(torch.bfloat16))


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 33), hidden=st.sampled_from([8, 64, 896]), dtype=float_dtypes,
       seed=seeds)
def test_add_rms_norm_matches_vllm_fused_residual(tokens, hidden, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    layer = vllm_layer(RMSNorm, hidden, eps=1e-6, dtype=dtype)
    layer.weight.data.copy_(torch.rand(hidden, generator=generator) + 0.5)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    residual = torch.randn(tokens, hidden, generator=generator).to(dtype)

    y, rstd, summed = kernels.add_rms_norm(x, residual, layer.weight.data, 1e-6)

    expected_y, expected_residual = layer.forward_native(x.clone(), residual.clone())
    assert_close(y, expected_y)
    assert_close(summed, expected_residual)
    assert rstd.dtype == torch.float32 and rstd.shape == (tokens, 1)


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from([(7, 16), (3, 5, 128), (1, 2 * 4864)]), dtype=float_dtypes,
       seed=seeds)
def test_swiglu_matches_silu_and_mul(shape, dtype, seed):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
    assert_close(kernels.swiglu(x), SiluAndMul.forward_native(x))


rope_shapes = st.sampled_from([
    # (head_size, rotary_dim, query heads, kv heads)
    (64, 64, 4, 2),
    (128, 128, 8, 1),
    (128, 64, 4, 4),  # partial rotary
    (80, 32, 2, 1),  # partial rotary, head size not a power of two
])


def vllm_rope(head_size, rotary_dim, is_neox_style, dtype):
    return vllm_layer(RotaryEmbedding, head_size, rotary_dim, 4096, 10000.0, is_neox_style, dtype)


@settings(max_examples=30, deadline=None)
@given(shape=rope_shapes, tokens=st.integers(1, 40), is_neox_style=st.booleans(),
       dtype=float_dtypes, seed=seeds)
def test_rotary_mul_matches_vllm(shape, tokens, is_neox_style, dtype, seed):
    """npu_rotary_mul on the rotary lanes of BSND [1, T, N, D], cos/sin 1S1D [1, T, 1, D] laid
    out per mode."""
    head_size, rotary_dim, heads, _ = shape
    generator = torch.Generator().manual_seed(seed)
    rope = vllm_rope(head_size, rotary_dim, is_neox_style, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    query = torch.randn(tokens, heads * head_size, generator=generator).to(dtype)
    expected, _ = rope.forward_native(positions, query.clone(), None)

    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    if is_neox_style:  # "half": cos/sin repeated across the two halves
        cos, sin = cos.repeat(1, 2), sin.repeat(1, 2)
    else:  # "interleave": each cos/sin value serves one adjacent pair
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    heads_view = query.view(1, tokens, heads, head_size)
    rotated = kernels.rotary_mul(heads_view[..., :rotary_dim].contiguous(), cos[None, :, None],
                                 sin[None, :, None], "half" if is_neox_style else "interleave")
    result = torch.cat((rotated, heads_view[..., rotary_dim:]), dim=-1).view(tokens, -1)

    assert_close(result, expected)


@settings(max_examples=20, deadline=None)
@given(shape=rope_shapes, tokens=st.integers(1, 40), is_neox_style=st.booleans(),
       dtype=float_dtypes, seed=seeds)
def test_rotary_custom_op_matches_vllm_in_one_launch_where_npu_mrope_serves(shape, tokens,
                                                                            is_neox_style, dtype, seed):
    """The registered rotary op on q and k split out of one qkv buffer, as models call it, against
    vLLM's own rotary: one npu_mrope launch handed the query and key views themselves (no copy)
    where its head-size rule allows, else npu_rotary_mul per tensor on a 4-D view of it."""
    from ascend_patch.npu.kernels import limits
    from ascend_patch.npu.ops.rotary_embedding import AscendRotaryEmbedding

    head_size, rotary_dim, heads, kv_heads = shape
    generator = torch.Generator().manual_seed(seed)
    args = (head_size, rotary_dim, 4096, 10000.0, is_neox_style, dtype)
    rope = vllm_rope(head_size, rotary_dim, is_neox_style, dtype)
    ours = vllm_layer(AscendRotaryEmbedding, *args)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=generator).to(dtype)
    query, key, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    expected = rope.forward_native(positions, query.clone(), key.clone())

    with kernels.record_calls() as records:
        got = ours.forward_oot(positions, query, key)
    for result, want in zip(got, expected):
        assert_close(result, want)
    calls = [(call["op"], call["args"]["tuple"]) for call in records.values()]
    if limits.mrope_takes(dtype, head_size, rotary_dim):
        ((op, args),) = calls
        assert op == "mrope" and args[5] == ("half" if is_neox_style else "interleave")
        assert [args[i]["tensor"]["offset"] for i in (1, 2)] == [0, heads * head_size]  # qkv's own
    else:
        assert {op for op, _ in calls} == {"rotary_mul"}
        assert all(len(args[0]["tensor"]["shape"]) == 4 for _, args in calls)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.sampled_from([50, 1024, 4000]),
       mode=st.sampled_from(["k", "p", "both"]), data=st.data(), seed=seeds)
def test_top_k_top_p_keeps_the_same_tokens_as_vllm(rows, vocab, mode, data, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    k = p = None
    if mode in ("k", "both"):
        k = torch.tensor(data.draw(st.lists(st.integers(1, min(vocab, 1024)), min_size=rows,
                                            max_size=rows)), dtype=torch.int32)
    if mode in ("p", "both"):
        p = torch.tensor(data.draw(st.lists(st.floats(0.0, 1.0), min_size=rows, max_size=rows)),
                         dtype=torch.float32)

    kept = torch.isfinite(kernels.top_k_top_p(logits, p=p, k=k))

    expected = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))
    assert torch.equal(kept, expected)
    assert kept.any(dim=-1).all()  # every row keeps at least its largest logit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_k_in_half_precision_keeps_the_k_largest(dtype):
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)).to(dtype)
    k = torch.tensor([1, 7, 1024, 300], dtype=torch.int32)
    kept = torch.isfinite(kernels.top_k_top_p(logits, k=k))
    assert torch.equal(kept, torch.isfinite(apply_top_k_top_p(logits.clone(), k, None)))
