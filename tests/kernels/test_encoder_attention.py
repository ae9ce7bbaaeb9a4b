"""Encoder-only attention: the ``npu_fusion_attention`` reference (TND, no mask or a band) and
the encoder backend's impl, against independent math.

The oracle is tests/kernels/test_attention.py's: float32 ``scaled_dot_product_attention`` per
sequence over its own keys, the band written out position by position; bidirectional attention is
the band unbounded on both sides.
"""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from ascend_patch.npu import kernels
from ascend_patch.npu.attention.encoder import AscendEncoderMetadata, AscendEncoderOnlyImpl
from ascend_patch.npu.kernels import reference
from tests.helpers.attention import CAUSAL_MASK, oracle

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
BAND_MASK = CAUSAL_MASK.bool()  # [FA-WHEEL]: sparse_mode 4 reads the same triu(ones, 1) mask

heads = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
                  st.sampled_from([32, 64, 96, 128]))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
lengths = st.lists(st.integers(1, 130), min_size=1, max_size=6)


def _batch(q_lens, kv_heads, group, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    total = sum(q_lens)
    query = torch.randn(total, kv_heads * group, head_dim, generator=generator).to(dtype)
    key = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    return query, key, value, ends


def _expected(query, key, value, ends, scale, reach=None):
    out = torch.empty(query.shape, dtype=torch.float32)
    for start, end in zip([0, *ends[:-1]], ends):
        rows = slice(start, end)
        out[rows] = oracle(query[rows], key[rows], value[rows], scale, causal=False,
                           pre_tokens=reach, next_tokens=reach)
    return out


@settings(max_examples=25, deadline=None)
@given(q_lens=lengths, layout=heads, dtype=dtypes, seed=st.integers(0, 2**31 - 1))
def test_fusion_attention_tnd_attends_each_sequence_bidirectionally(q_lens, layout, dtype, seed):
    kv_heads, group, head_dim = layout
    query, key, value, ends = _batch(q_lens, kv_heads, group, head_dim, dtype, seed)
    scale = head_dim ** -0.5
    out = kernels.fusion_attention(query, key, value, kv_heads * group, "TND", scale=scale,
                                   actual_seq_qlen=ends, actual_seq_kvlen=ends)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), _expected(query, key, value, ends, scale),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@settings(max_examples=20, deadline=None)
@given(q_lens=lengths, layout=heads, window=st.integers(1, 40), dtype=dtypes,
       seed=st.integers(0, 2**31 - 1))
def test_fusion_attention_band_sees_the_window_on_either_side(q_lens, layout, window, dtype, seed):
    kv_heads, group, head_dim = layout
    query, key, value, ends = _batch(q_lens, kv_heads, group, head_dim, dtype, seed)
    scale = head_dim ** -0.5
    out = kernels.fusion_attention(query, key, value, kv_heads * group, "TND", scale=scale,
                                   actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=4,
                                   atten_mask=BAND_MASK, pre_tockens=window, next_tockens=window)
    torch.testing.assert_close(out.float(), _expected(query, key, value, ends, scale, window),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_band_wider_than_every_sequence_is_bidirectional_attention():
    query, key, value, ends = _batch([5, 9], 2, 2, 64, torch.float32, 0)
    common = {"scale": 0.125, "actual_seq_qlen": ends, "actual_seq_kvlen": ends}
    full = kernels.fusion_attention(query, key, value, 4, "TND", **common)
    band = kernels.fusion_attention(query, key, value, 4, "TND", sparse_mode=4,
                                    atten_mask=BAND_MASK, pre_tockens=8, next_tockens=8, **common)
    narrow = kernels.fusion_attention(query, key, value, 4, "TND", sparse_mode=4,
                                      atten_mask=BAND_MASK, pre_tockens=2, next_tockens=2, **common)
    torch.testing.assert_close(band, full)
    assert not torch.allclose(narrow, full, atol=1e-3)


def _call(**change):
    query, key, value, ends = _batch([3, 4], 2, 2, 64, torch.float16, 1)
    arguments = {"query": query, "key": key, "value": value, "head_num": 4, "input_layout": "TND",
                 "scale": 0.125, "actual_seq_qlen": ends, "actual_seq_kvlen": ends, **change}
    return reference.fusion_attention(**arguments)


@pytest.mark.parametrize(("change", "message"), [
    ({"head_num": 2}, "head_num must be the query's 4 heads, got 2"),
    ({"actual_seq_qlen": [4, 3]}, "actual_seq_qlen must be cumulative"),
    ({"actual_seq_qlen": [3, 6]}, "actual_seq_qlen must be cumulative, ending at query.shape[0] = 7"),
    ({"actual_seq_kvlen": [7]}, "actual_seq_kvlen must be 2 entries like actual_seq_qlen, got 1"),
    ({"actual_seq_qlen": torch.tensor([3, 7])}, "actual_seq_qlen must be a host list[int]"),
    ({"key": torch.zeros(7, 3, 64, dtype=torch.float16),
      "value": torch.zeros(7, 3, 64, dtype=torch.float16)},
     "key heads (N) must be a divisor of the query's 4 heads, got 3"),
    ({"value": torch.zeros(7, 2, 64, dtype=torch.bfloat16)}, "value must be torch.float16 like query"),
    ({"value": torch.zeros(7, 2, 32, dtype=torch.float16)}, "value must be shape (7, 2, 64) like key"),
    ({"query": torch.zeros(7, 4, 64, dtype=torch.float64)}, "query must be float16 or bfloat16 or float32"),
    ({"atten_mask": BAND_MASK}, "atten_mask must be None with sparse_mode=0"),
    ({"sparse_mode": 4, "atten_mask": BAND_MASK.T.contiguous(), "pre_tockens": 1,
      "next_tockens": 1}, "atten_mask must be nonzero exactly above the diagonal"),
    ({"sparse_mode": 4, "atten_mask": BAND_MASK.to(torch.int8), "pre_tockens": 1,
      "next_tockens": 1}, "atten_mask must be bool or uint8"),
    ({"sparse_mode": 4, "atten_mask": BAND_MASK[None], "pre_tockens": 1, "next_tockens": 1},
     "atten_mask must be (2048, 2048) (varlen takes the SS form only)"),
    ({"sparse_mode": 4, "atten_mask": None, "pre_tockens": 1, "next_tockens": 1},
     "atten_mask must be the 2048×2048 causal mask with sparse_mode=4"),
])
def test_the_reference_refuses_what_the_op_documents_it_cannot_take(change, message):
    with pytest.raises(kernels.KernelContractError, match=message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        _call(**change)


def test_the_reference_refuses_head_dims_above_768_and_more_than_1024_sequences():
    wide = torch.zeros(2, 1, 800)
    with pytest.raises(kernels.KernelContractError, match=r"query head dim \(D\) must be in \[1, 768\]"):
        reference.fusion_attention(wide, wide, wide, 1, "TND", actual_seq_qlen=[2],
                                           actual_seq_kvlen=[2])
    tokens = torch.zeros(1025, 1, 64)
    ends = list(range(1, 1026))
    with pytest.raises(kernels.KernelContractError, match="actual_seq_qlen must be 1 to 1024 entries"):
        reference.fusion_attention(tokens, tokens, tokens, 1, "TND", actual_seq_qlen=ends,
                                           actual_seq_kvlen=ends)


# --- the encoder backend's impl -----------------------------------------------------------------


def _impl(**kwargs):
    return AscendEncoderOnlyImpl(4, 64, 0.125, num_kv_heads=2, attn_type="encoder_only", **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 7])
def test_the_impl_runs_one_fused_launch_per_step_and_ignores_padding(dtype, window):
    q_lens = [1, 17, 40, 3]
    query, key, value, ends = _batch(q_lens, 2, 2, 64, dtype, 3)
    padded = [torch.cat([t, torch.randn(5, *t.shape[1:]).to(dtype)]) for t in (query, key, value)]
    output = torch.full_like(padded[0], 7.0)
    meta = AscendEncoderMetadata(num_tokens=ends[-1], query_ends=ends)
    impl = _impl(sliding_window=window)
    with kernels.count_launches() as launches:
        impl.forward(None, *padded, torch.empty(0), meta, output)
    assert dict(launches) == {"fusion_attention": 1}
    reach = None if window is None else window - 1
    torch.testing.assert_close(output[:ends[-1]].float(),
                               _expected(query, key, value, ends, 0.125, reach),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.all(output[ends[-1]:] == 7.0), "padding rows are left alone"


def test_more_than_1024_sequences_take_one_launch_per_1024():
    """1024 pairs of tokens, then a sequence of 5: the second launch holds only the last."""
    q_lens = [2] * 1024 + [5]
    query, key, value, ends = _batch(q_lens, 2, 2, 64, torch.float32, 4)
    output = torch.empty_like(query)
    with kernels.count_launches() as launches:
        _impl().forward(None, query, key, value, torch.empty(0),
                        AscendEncoderMetadata(num_tokens=ends[-1], query_ends=ends), output)
    assert dict(launches) == {"fusion_attention": 2}
    # The pairs at once: [pairs, heads, 2, D], each query head over its KV head's two keys.
    pairs = [t[:2048].float().unflatten(0, (1024, 2)).transpose(1, 2) for t in (query, key, value)]
    q, k, v = pairs[0], *(t.repeat_interleave(2, dim=1) for t in pairs[1:])
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
    expected = torch.cat([expected.transpose(1, 2).flatten(0, 1),
                          _expected(query[2048:], key[2048:], value[2048:], [5], 0.125)])
    torch.testing.assert_close(output, expected)


def test_soft_capped_logits_run_composed_attention():
    query, key, value, ends = _batch([6, 11], 2, 2, 64, torch.float32, 5)
    output = torch.empty_like(query)
    impl = _impl(logits_soft_cap=5.0)
    assert impl.composed_reason() == "logits soft-cap 5: npu_fusion_attention has no soft-cap input"
    with kernels.count_launches() as launches:
        impl.forward(None, query, key, value, torch.empty(0),
                     AscendEncoderMetadata(num_tokens=ends[-1], query_ends=ends), output)
    assert not launches
    expected = torch.cat([oracle(query[s:e], key[s:e], value[s:e], 0.125, causal=False, soft_cap=5.0)
                          for s, e in zip([0, *ends[:-1]], ends)])
    torch.testing.assert_close(output, expected)


def test_alibi_and_other_attention_types_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="Ascend encoder-only attention does not support ALiBi"):
        _impl(alibi_slopes=[1.0, 0.5, 0.25, 0.125])
    with pytest.raises(NotImplementedError, match="does not support attention type decoder"):
        AscendEncoderOnlyImpl(4, 64, 0.125, attn_type="decoder")


# --- multimodal encoder attention (vLLM's MMEncoderAttention) -----------------------------------


def _mm_layers(heads, kv_heads, head_dim):
    """vLLM's MMEncoderAttention and the NPU one, built as models build them."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    from ascend_patch.npu.ops.mm_encoder_attention import AscendMMEncoderAttention

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return (MMEncoderAttention(heads, head_dim, num_kv_heads=kv_heads),
                AscendMMEncoderAttention(heads, head_dim, num_kv_heads=kv_heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_mm_encoder_attention_of_an_image_batch_is_vllms_in_one_launch(dtype, heads, kv_heads):
    """BLIP/CLIP style: [images, tokens, heads * head size], each image its own sequence."""
    native, npu = _mm_layers(heads, kv_heads, 64)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, 17, n * 64, generator=generator).to(dtype)
                         for n in (heads, kv_heads, kv_heads))
    with kernels.count_launches() as launches:
        out = npu.forward_oot(query, key, value)
    assert dict(launches) == {"fusion_attention": 1}
    expected = native.forward_native(query, key, value)
    assert out.shape == expected.shape == query.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_encoder_attention_of_packed_sequences_is_vllms_in_one_launch(dtype):
    """Qwen VL style: one batch row [1, T, heads, head size] packing the sequences of cu_seqlens
    (images, or their attention windows), each attending only to itself."""
    native, npu = _mm_layers(2, 2, 80)
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 40, 2, 80, generator=generator).to(dtype) for _ in range(3))
    cu_seqlens = torch.tensor([0, 16, 20, 40], dtype=torch.int32)
    with kernels.count_launches() as launches:
        out = npu.forward_oot(query, key, value, cu_seqlens=cu_seqlens)
    assert dict(launches) == {"fusion_attention": 1}
    expected = native.forward_native(query, key, value, cu_seqlens=cu_seqlens)
    assert out.shape == expected.shape == query.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    # The negative control: one sequence over all 40 tokens is another attention.
    whole = npu.forward_oot(query, key, value)
    assert not torch.allclose(whole.float(), expected.float(), atol=1e-2)


def test_mm_encoder_cross_attention_is_left_to_vllm():
    """No launch: vLLM's own torch runs it, and gives each image's 5 queries its 9 keys."""
    _, npu = _mm_layers(2, 2, 64)
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 5, 128, generator=generator)
    key, value = (torch.randn(2, 9, 128, generator=generator) for _ in range(2))
    with kernels.count_launches() as launches:
        out = npu.forward_oot(query, key, value)
    assert not launches
    for image in range(2):
        q, k, v = (x[image].view(x.shape[1], 2, 64) for x in (query, key, value))
        expected = oracle(q, k, v, 64**-0.5, causal=False).reshape(5, 128)
        torch.testing.assert_close(out[image], expected, atol=1e-5, rtol=1e-5)
