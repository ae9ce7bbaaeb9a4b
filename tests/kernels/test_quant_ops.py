"""The int8 quantisation ops and the W8A8 layer math against independent plain-torch formulas,
and the op contracts they enforce."""

import pytest
import torch

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import KernelContractError
from ascend_patch.npu.quantization import checkpoint, w8a8

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _int8(*shape, seed=0):
    return torch.randint(-127, 128, shape, generator=_generator(seed), dtype=torch.int8)


# --- npu_dynamic_quant ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_dynamic_quant_is_per_token_symmetric(dtype):
    x = (torch.randn(6, 96, generator=_generator()) * 4).to(dtype)
    x[2] = 0  # an all-zero row: scale 0, zeros
    y, scale = kernels.dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == FP32 and scale.shape == (6,)
    for row in range(6):
        values = x[row].double()
        expected_scale = values.abs().max() / 127
        assert float(scale[row]) == pytest.approx(float(expected_scale), rel=1e-6)
        if expected_scale == 0:
            assert not y[row].any()
            continue
        expected = torch.round(values / expected_scale)
        assert (y[row].double() - expected).abs().max() <= 1  # fp32 division vs fp64
        assert (y[row].double() == expected).float().mean() > 0.99
        assert int(y[row].abs().max()) == 127


@pytest.mark.parametrize("call, error", [
    (lambda: kernels.dynamic_quant(torch.zeros(4, 8)), "input must be float16 or bfloat16"),
    (lambda: kernels.dynamic_quant(torch.zeros(8, dtype=BF16)), "input must be more than 1-D"),
    (lambda: kernels.dynamic_quant(torch.zeros(4, 8, dtype=BF16), smooth_scales=torch.ones(
        4, dtype=BF16)), "smooth_scales must be shape (8,)"),
])
def test_dynamic_quant_contract(call, error):
    with pytest.raises(KernelContractError, match=__import__("re").escape(error)):
        call()


# --- npu_quantize ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_quantize_multiplies_adds_rounds_and_saturates(dtype):
    x = (torch.randn(5, 40, generator=_generator()) * 3).to(dtype)
    inverse, offset = torch.tensor([40.0], dtype=dtype), torch.tensor([-3.0], dtype=dtype)
    y = kernels.quantize(x, inverse, offset, torch.qint8, axis=-1, div_mode=False)
    expected = (x.double() * 40 - 3).round().clamp(-128, 127)
    assert y.dtype == torch.int8 and torch.equal(y.double(), expected)
    assert y.min() == -128 and y.max() == 127  # |x| * 40 reaches past int8


def test_quantize_along_the_token_axis():
    x = torch.randn(4, 16, generator=_generator())
    per_row = torch.tensor([1.0, 10.0, 100.0, 0.5])
    y = kernels.quantize(x, per_row, None, torch.qint8, axis=-2, div_mode=False)
    assert torch.equal(y.double(), (x.double() * per_row[:, None].double()).round().clamp(-128, 127))


@pytest.mark.parametrize("call, error", [
    (lambda x: kernels.quantize(x, torch.ones(1), None, torch.qint8, -1, False),
     "scales must be torch.bfloat16 like input"),
    (lambda x: kernels.quantize(x, torch.ones(3, dtype=BF16), None, torch.qint8, -1, False),
     "scales must be 1 or 16 entries"),
    (lambda x: kernels.quantize(x, torch.ones(1, dtype=BF16), torch.zeros(1, dtype=torch.int8),
                                torch.qint8, -1, False), "zero_points must be torch.bfloat16"),
    (lambda x: kernels.quantize(x, torch.ones(1, dtype=BF16), None, torch.quint8, -1, False),
     "dtype must be torch.qint8"),
])
def test_quantize_contract(call, error):
    x = torch.zeros(4, 16, dtype=BF16)
    with pytest.raises(KernelContractError, match=__import__("re").escape(error)):
        call(x)
    with pytest.raises(NotImplementedError, match="div_mode=True"):
        kernels.quantize(x, torch.ones(1, dtype=BF16), None, torch.qint8, -1, True)


# --- npu_quant_matmul --------------------------------------------------------------------------


def test_quant_matmul_per_token_and_channel_scales_with_a_float_bias():
    x1, x2 = _int8(7, 300), _int8(300, 48, seed=1)
    scale = torch.rand(48, generator=_generator(2)) / 100
    token = torch.rand(7, generator=_generator(3)) / 100
    bias = torch.randn(48, generator=_generator(4)).to(BF16)
    out = kernels.quant_matmul(x1, x2, scale, pertoken_scale=token, bias=bias, output_dtype=BF16)
    exact = (x1.long() @ x2.long()).double() * scale.double() * token.double()[:, None]
    expected = exact + bias.double()
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-3)


def test_quant_matmul_int32_bias_is_added_to_the_accumulator():
    x1, x2 = _int8(5, 64), _int8(64, 24, seed=1)
    scale = torch.rand(24, generator=_generator(2)) / 50
    bias = torch.randint(-1000, 1000, (24,), generator=_generator(3), dtype=torch.int32)
    out = kernels.quant_matmul(x1, x2, scale, bias=bias, output_dtype=FP16)
    expected = ((x1.long() @ x2.long()) + bias.long()).double() * scale.double()
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -10, atol=1e-3)
    # int32 output: the accumulator (+ bias); the scale does not take part [QMM-ACLNN]
    acc = kernels.quant_matmul(x1, x2, scale, bias=bias, output_dtype=torch.int32)
    assert torch.equal(acc.long(), (x1.long() @ x2.long()) + bias.long())


def test_quant_matmul_takes_the_transposed_view_of_an_n_by_k_weight():
    x1, weight = _int8(3, 32), _int8(16, 32, seed=1)
    scale = torch.ones(16)
    direct = kernels.quant_matmul(x1, weight.t().contiguous(), scale, output_dtype=torch.int32)
    assert torch.equal(kernels.quant_matmul(x1, weight.t(), scale, output_dtype=torch.int32), direct)


@pytest.mark.parametrize("kwargs, error", [
    ({"output_dtype": FP16, "bias": torch.zeros(8, dtype=FP16)}, "bias must be int32"),
    # [QMM-WHEEL] fp16 output with pertoken_scale: no bf16 bias (the meta kernel: a bf16 bias
    # needs bf16 output).
    ({"output_dtype": FP16, "pertoken_scale": torch.ones(4), "bias": torch.zeros(8, dtype=BF16)},
     "bias must be int32 or float16 or float32"),
    ({"output_dtype": torch.int32, "pertoken_scale": torch.ones(4)}, "pertoken_scale must be None"),
    ({"output_dtype": BF16, "pertoken_scale": torch.ones(5)}, "pertoken_scale must be shape (4,)"),
    ({"output_dtype": FP32}, "output_dtype must be float16, bfloat16 or int32"),
    ({"output_dtype": BF16, "scale": torch.ones(3)}, "scale must be 1 or 8 entries"),
    ({"output_dtype": BF16, "x2": torch.zeros(12, 8, dtype=torch.int8)}, "x2 must be shape (16, n)"),
])
def test_quant_matmul_contract(kwargs, error):
    arguments = {"x1": torch.zeros(4, 16, dtype=torch.int8), "x2": torch.zeros(16, 8, dtype=torch.int8),
                 "scale": torch.ones(8), **kwargs}
    x1, x2, scale = arguments.pop("x1"), arguments.pop("x2"), arguments.pop("scale")
    with pytest.raises(KernelContractError, match=__import__("re").escape(error)):
        kernels.quant_matmul(x1, x2, scale, **arguments)


def test_quant_matmul_takes_an_fp16_bias_for_fp16_output_with_pertoken_scale():
    """[QMM-WHEEL] 表1 column 4: a float bias is added after dequantisation."""
    x1, x2 = _int8(4, 16), _int8(16, 8, seed=1)
    scale, token_scale, bias = torch.rand(8) / 50, torch.rand(4) / 50, torch.randn(8).to(FP16)
    out = kernels.quant_matmul(x1, x2, scale, pertoken_scale=token_scale, bias=bias,
                               output_dtype=FP16)
    expected = (x1.double() @ x2.double()) * scale.double() * token_scale.double()[:, None]
    assert out.dtype == FP16
    torch.testing.assert_close(out, (expected + bias.double()).to(FP16))


def test_quant_matmul_unimplemented_forms_say_so():
    x1, x2 = torch.zeros(4, 16, dtype=torch.int8), torch.zeros(16, 8, dtype=torch.int8)
    with pytest.raises(NotImplementedError, match="int8 output"):
        kernels.quant_matmul(x1, x2, torch.ones(8))
    with pytest.raises(NotImplementedError, match="int64"):
        kernels.quant_matmul(x1, x2, torch.ones(8, dtype=torch.int64), output_dtype=FP16)


# --- the W8A8 layer: NPU form built once, the seam calls per step --------------------------------


def _weights(rows=40, cols=64, seed=0):
    weight = torch.randn(rows, cols, generator=_generator(seed)) * 0.2
    scale = weight.abs().amax(dim=1) / 127
    return (weight / scale[:, None]).round().to(torch.int8), scale


def _round_trip_dynamic(x):
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    return (x / scale).round() * scale


@pytest.mark.parametrize("dtype, tolerance", [(FP32, 1e-6), (BF16, 2 ** -7), (FP16, 2 ** -9)])
def test_dynamic_layer_equals_the_dequantised_linear(dtype, tolerance):
    weight, scale = _weights()
    bias = torch.randn(40, generator=_generator(5)) * 0.3
    layer = torch.nn.Module()
    w8a8.finish_dynamic(layer, weight, scale)
    assert layer.weight.shape == (64, 40) and layer.weight.is_contiguous()  # [K, N], once
    x = (torch.randn(2, 3, 64, generator=_generator(6)) * 2).to(dtype)
    out = w8a8.apply(layer, x, bias.to(dtype))
    assert out.shape == (2, 3, 40) and out.dtype == dtype
    expected = torch.nn.functional.linear(_round_trip_dynamic(x.double()),
                                          weight.double() * scale.double()[:, None],
                                          bias.to(dtype).double())
    error = (out.double() - expected).norm() / expected.norm()
    assert error <= tolerance * 4, error


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
def test_static_layer_with_a_zero_point_equals_the_dequantised_linear(dtype):
    weight, weight_scale = _weights()
    input_scale, zero_point = torch.tensor([0.02]), torch.tensor([7], dtype=torch.int8)
    bias = torch.randn(40, generator=_generator(5)) * 0.3
    layer = torch.nn.Module()
    w8a8.finish_static(layer, weight, input_scale * weight_scale, input_scale, zero_point,
                       w8a8.zero_point_correction(weight, zero_point), dtype)
    x = (torch.randn(9, 64, generator=_generator(6))).to(dtype)
    out = w8a8.apply(layer, x, bias.to(dtype))
    # the scale the op multiplies by is 1 / input_scale in the activation dtype
    inverse = float((1 / input_scale.double()).to(dtype))
    x_q = (x.double() * inverse + 7).round().clamp(-128, 127)
    expected = torch.nn.functional.linear((x_q - 7) * 0.02, weight.double() *
                                          weight_scale.double()[:, None], bias.to(dtype).double())
    tolerance = {FP32: 1e-6, BF16: 2 ** -7, FP16: 2 ** -9}[dtype]
    assert (out.double() - expected).norm() / expected.norm() <= tolerance * 4


def test_msmodelslim_int64_deq_scale_is_its_fp32_bits():
    scale = torch.tensor([0.0123, 3.5e-5, 1.0])
    stored = scale.view(torch.int32).to(torch.int64)  # deqscale2int64
    assert torch.equal(checkpoint.decode_fp32_bits(stored), scale)
    assert torch.equal(checkpoint.decode_fp32_bits(scale), scale)


# --- W8A8 experts ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tolerance", [(BF16, 3e-2), (FP32, 4e-3)])
def test_int8_expert_path_matches_the_quantised_moe_definition(dtype, tolerance):
    """Dense per-token MoE in fp64 with int8 weights and both activations round-tripped per
    token, against dispatch (quant_mode=1) → int8 grouped matmuls → requantised SwiGLU."""
    from ascend_patch.npu.ops.fused_moe import fused_experts

    tokens, experts, hidden, inter, top_k = 24, 4, 64, 32, 2
    g = _generator(7)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g)
    q13, s13 = zip(*(_weights_of(w) for w in w13))
    q2, s2 = zip(*(_weights_of(w) for w in w2))
    q13, s13, q2, s2 = map(torch.stack, (q13, s13, q2, s2))
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (q13[e].double() * s13[e].double()[:, None] @
                        _round_trip_dynamic(x[t].double()[None])[0]).chunk(2)
            h = torch.nn.functional.silu(gate) * up
            down = q2[e].double() * s2[e].double()[:, None] @ _round_trip_dynamic(h[None])[0]
            expected[t] += weights[t, j] * down
    scale_dtype = BF16 if dtype == BF16 else FP32
    got = fused_experts(x.to(dtype), q13.transpose(1, 2).contiguous(), q2.transpose(1, 2).contiguous(),
                        weights, ids, scales=(s13.to(scale_dtype), s2.to(scale_dtype)))
    assert got.dtype == dtype
    assert (got.double() - expected).norm() <= tolerance * expected.norm()


def _weights_of(weight):
    scale = weight.abs().amax(dim=1) / 127
    return (weight / scale[:, None]).round().to(torch.int8), scale
