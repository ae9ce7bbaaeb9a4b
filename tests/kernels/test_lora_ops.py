"""LoRA on the NPU path off-hardware: the BGMV reference (``npu_batch_gather_matmul_``) and the
punica wrapper vLLM's LoRA layers call, against per-row float64 math written here (each row
through its own adapter's A then B, base-model rows untouched), and the BGMV contract."""

import pytest
import torch
from vllm.lora.layers.utils import LoRAMapping

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import KernelContractError
from ascend_patch.npu.lora.punica import PunicaWrapperNPU

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}
HIDDEN, RANK, SLOTS = 256, 16, 2
# Per token the adapter id (0: the base model); slot i holds id i + 1. Three requests.
TOKEN_IDS = (1, 1, 1, 0, 0, 2, 2, 1)
REQUEST_IDS = (1, 0, 2)


def oracle(y, x, lora_a, lora_b, slots, scale=1.0, offset=0):
    """Row by row in float64: ``y[t, offset:offset + N] += scale * x[t] @ A[s]ᵀ @ B[s]ᵀ`` for
    ``s = slots[t] >= 0``; lora_a [slots, 1, R, K], lora_b [slots, 1, N, R]."""
    out = y.double().clone()
    width = lora_b.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            row = x[t].double() @ lora_a[slot, 0].double().T @ lora_b[slot, 0].double().T
            out[t, offset: offset + width] += scale * row
    return out


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def stacked(generator, *shape, dtype):
    return (torch.randn(SLOTS, 1, *shape, generator=generator) * 0.1).to(dtype)


def slots_of(ids):
    return [i - 1 for i in ids]  # id 0 (no adapter) -> -1


@pytest.fixture
def wrapper(monkeypatch):
    # This process's vLLM platform is not the NPU one: stage host data unpinned, as the emulated
    # NPU platform does (it has no pinned host memory).
    monkeypatch.setattr("vllm.utils.torch_utils.PIN_MEMORY", False)
    punica = PunicaWrapperNPU(64, 8, "cpu")
    punica.update_metadata(LoRAMapping(TOKEN_IDS, REQUEST_IDS, is_prefill=True), [1, 2], SLOTS, 512)
    return punica


@pytest.mark.parametrize("dtype, bgmv_launches", [(torch.float32, 0), (torch.float16, 3)])
def test_a_merged_layer_adds_each_tokens_adapter(wrapper, dtype, bgmv_launches):
    """QKV-like slices (256, 128, 128): fp16 takes one BGMV launch per slice, fp32 plain torch;
    both equal the per-row math, and the base model's rows stay exactly as they were."""
    generator = torch.Generator().manual_seed(0)
    slices = (256, 128, 128)
    x = torch.randn(len(TOKEN_IDS), HIDDEN, generator=generator).to(dtype)
    y = torch.randn(len(TOKEN_IDS), sum(slices), generator=generator).to(dtype)
    lora_a = [stacked(generator, RANK, HIDDEN, dtype=dtype) for _ in slices]
    lora_b = [stacked(generator, size, RANK, dtype=dtype) for size in slices]
    expected, offset = y.double(), 0
    for a, b, size in zip(lora_a, lora_b, slices):
        expected = oracle(expected, x, a, b, slots_of(TOKEN_IDS), scale=0.5, offset=offset)
        offset += size
    before = y.clone()
    with kernels.count_launches() as launches:
        wrapper.add_lora_linear(y, x, tuple(lora_a), tuple(lora_b), 0.5, slices)
    assert launches["batch_gather_matmul_"] == bgmv_launches
    assert_close(y, expected, dtype)
    base_rows = [t for t, i in enumerate(TOKEN_IDS) if i == 0]
    assert torch.equal(y[base_rows], before[base_rows])
    assert not torch.equal(y, before)


def test_a_slice_that_is_the_whole_output_runs_plain_torch(wrapper):
    """BGMV takes a slice narrower than the output only ([BGMV-WHEEL] H2 < y_column)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(len(TOKEN_IDS), HIDDEN, generator=generator).half()
    y = torch.zeros(len(TOKEN_IDS), HIDDEN, dtype=torch.float16)
    lora_a, lora_b = stacked(generator, RANK, HIDDEN, dtype=torch.float16), stacked(
        generator, HIDDEN, RANK, dtype=torch.float16)
    with kernels.count_launches() as launches:
        wrapper.add_lora_linear(y, x, (lora_a,), (lora_b,), 1.0, (HIDDEN,))
    assert launches["batch_gather_matmul_"] == 0
    assert_close(y, oracle(torch.zeros_like(y), x, lora_a, lora_b, slots_of(TOKEN_IDS)), torch.float16)


def test_shrink_then_expand_equals_the_merged_math(wrapper):
    """The fully sharded layers' separate calls: fp32 buffers per slice, then the expand."""
    generator = torch.Generator().manual_seed(2)
    slices = (128, 128)
    x = torch.randn(len(TOKEN_IDS), HIDDEN, generator=generator)
    y = torch.randn(len(TOKEN_IDS), sum(slices), generator=generator)
    lora_a = [stacked(generator, RANK, HIDDEN, dtype=torch.float32) for _ in slices]
    lora_b = [stacked(generator, size, RANK, dtype=torch.float32) for size in slices]
    expected = oracle(y, x, lora_a[0], lora_b[0], slots_of(TOKEN_IDS))
    expected = oracle(expected, x, lora_a[1], lora_b[1], slots_of(TOKEN_IDS), offset=128)
    buffer = torch.zeros(len(slices), len(TOKEN_IDS), RANK)
    wrapper.add_shrink(buffer, x, tuple(lora_a), 1.0)
    wrapper.add_expand(y, buffer, tuple(lora_b), slices, offset_start=0, add_input=True)
    assert_close(y, expected, torch.float32)


def test_embedding_and_logits_use_token_and_request_slots(wrapper):
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(len(TOKEN_IDS), RANK, generator=generator)  # the lora_a embedding rows
    embedded = torch.randn(len(TOKEN_IDS), HIDDEN, generator=generator)
    lora_b = stacked(generator, HIDDEN, RANK, dtype=torch.float32)
    identity = torch.eye(RANK).expand(SLOTS, 1, RANK, RANK)
    expected = oracle(embedded, rows, identity, lora_b, slots_of(TOKEN_IDS))
    wrapper.add_lora_embedding(embedded, rows, lora_b, add_input=True)
    assert_close(embedded, expected, torch.float32)

    hidden = torch.randn(len(REQUEST_IDS), HIDDEN, generator=generator)
    logits = torch.randn(len(REQUEST_IDS), 520, generator=generator)  # wider: vocab padding
    lora_a = stacked(generator, RANK, HIDDEN, dtype=torch.float32)
    lora_b = stacked(generator, 512, RANK, dtype=torch.float32)
    expected = oracle(logits, hidden, lora_a, lora_b, slots_of(REQUEST_IDS), scale=2.0)
    wrapper.add_lora_logits(logits, hidden, lora_a, lora_b, 2.0)
    assert_close(logits, expected, torch.float32)


def test_a_full_linear_head_replaces_the_rows_of_enabled_adapters(wrapper):
    """vLLM 0.31+'s classifier heads: a request's rows become its adapter head's output plus
    bias where that adapter enables the head; the others keep the base output."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(len(REQUEST_IDS), HIDDEN, generator=generator)
    y = torch.randn(len(REQUEST_IDS), 4, generator=generator)
    weight = torch.randn(SLOTS, 1, 4, HIDDEN, generator=generator)
    bias = torch.randn(SLOTS, 4, generator=generator)
    enabled = torch.tensor([False, True])
    expected = y.double().clone()
    expected[2] = x[2].double() @ weight[1, 0].double().T + bias[1].double()  # slot 1 enabled
    wrapper.apply_lora_full_linear(y, x, weight, bias, enabled)
    assert_close(y, expected, torch.float32)


def bgmv_inputs(rows=6, columns=384, size=128, rank=16, layers=2, dtype=torch.float16):
    generator = torch.Generator().manual_seed(5)
    return {
        "self": torch.randn(rows, columns, generator=generator).to(dtype),
        "x": torch.randn(rows, HIDDEN, generator=generator).to(dtype),
        "weight_b": (torch.randn(SLOTS, layers, size, rank, generator=generator) * 0.1).to(dtype),
        "indices": torch.tensor([0, -1, 1, 1, -1, 0][:rows], dtype=torch.int32),
        "weight_a": (torch.randn(SLOTS, layers, rank, HIDDEN, generator=generator) * 0.1).to(dtype),
    }


def test_bgmv_reference_follows_its_documented_formula():
    """y[:, offset : offset + H2] += scale · x @ A[i, L]ᵀ @ B[i, L]ᵀ per row, -1 rows unchanged;
    without weight_a one matmul through weight_b [W, L, H2, H1]."""
    args = bgmv_inputs()
    y, slots = args["self"].clone(), args["indices"].tolist()
    expected = oracle(y, args["x"], args["weight_a"][:, 1:], args["weight_b"][:, 1:], slots,
                      scale=0.25, offset=64)
    out = kernels.batch_gather_matmul_(y, args["x"], args["weight_b"], args["indices"],
                                       args["weight_a"], layer_idx=1, scale=0.25, y_offset=64,
                                       y_slice_size=128)
    assert out is y
    assert_close(y, expected, torch.float16)

    through = (torch.randn(SLOTS, 1, 128, HIDDEN) * 0.1).half()
    y = args["self"].clone()
    identity = torch.eye(HIDDEN).expand(SLOTS, 1, HIDDEN, HIDDEN)
    expected = oracle(y, args["x"], identity, through, slots)
    kernels.batch_gather_matmul_(y, args["x"], through, args["indices"], scale=1.0,
                                 y_slice_size=128)
    assert_close(y, expected, torch.float16)


VIOLATIONS = {
    "bf16": (bgmv_inputs(dtype=torch.bfloat16), {}, r"self must be float16"),
    "int64 indices": ({**bgmv_inputs(), "indices": torch.zeros(6, dtype=torch.long)}, {},
                      r"indices must be int32"),
    "rank 8": (bgmv_inputs(rank=8), {}, r"weight_a must be R a multiple of 16 in \[16, 128\]"),
    "rank 144": (bgmv_inputs(rank=144), {}, r"weight_a must be R a multiple of 16 in \[16, 128\]"),
    "slice the whole of y": (bgmv_inputs(columns=128), {}, r"weight_b must be H2 .* below y's 128"),
    "slice size not H2": (bgmv_inputs(), {"y_slice_size": -1}, r"y_slice_size must be weight_b's H2"),
    "range past y": (bgmv_inputs(), {"y_offset": 300}, r"y_offset must be a column range"),
    "layer out of range": (bgmv_inputs(), {"layer_idx": 2}, r"layer_idx must be in \[0, 2\)"),
    "slot out of range": ({**bgmv_inputs(), "indices": torch.tensor([0, 2, 1, 1, -1, 0],
                                                                    dtype=torch.int32)}, {},
                          r"indices must be in \[-1, 2\)"),
}


@pytest.mark.parametrize("case", VIOLATIONS)
def test_bgmv_refuses_what_its_doc_rules_out(case):
    args, extra, message = VIOLATIONS[case]
    args = dict(args)
    y = args.pop("self")
    with pytest.raises(KernelContractError, match="npu_batch_gather_matmul_: " + message):
        kernels.batch_gather_matmul_(y, **args, **{"y_slice_size": args["weight_b"].shape[2], **extra})


def test_bgmv_limits_agree_with_the_reference():
    """What the wrapper's dispatch (limits.bgmv_takes) sends to the op, the contract accepts."""
    from ascend_patch.npu.kernels import limits

    for rank, size, columns in ((16, 128, 384), (8, 128, 384), (16, 128, 128), (144, 128, 384)):
        args = bgmv_inputs(rank=rank, size=size, columns=columns)
        y = args.pop("self")
        refused = kernels.contract_violation("batch_gather_matmul_", y, **args, y_slice_size=size)
        assert limits.bgmv_takes(torch.float16, HIDDEN, rank, size, columns) == (refused is None)
    assert "self must be float16" in kernels.contract_violation(
        "batch_gather_matmul_", **bgmv_inputs(dtype=torch.float32), y_slice_size=128)
    assert not limits.bgmv_takes(torch.float32, HIDDEN, 16, 128, 384)


# -- LoRA on MoE layers: the NPU experts' hooks and the wrapper's add_lora_w13/add_lora_w2 ----

EXPERTS, MOE_HIDDEN, INTER, TOP_K = 4, 32, 16, 2


def _moe_with_lora(x, w13, w2, weights, ids, slots, w13_a, w13_b, w2_a, w2_b):
    """The MoE definition with each token's adapter, copy by copy in float64: gate and up of
    expert e take ``x @ A[s, e]ᵀ @ B[s, e]ᵀ`` before SwiGLU, the down projection likewise before
    the routing weight (vLLM's layouts: w13 [E, 2I, H] gate first, w2 [E, H, I])."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = slots[t]
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            if s >= 0:
                gate = gate + w13_b[0][s, e].double() @ (w13_a[0][s, e].double() @ x[t])
                up = up + w13_b[1][s, e].double() @ (w13_a[1][s, e].double() @ x[t])
            hidden = torch.nn.functional.silu(gate) * up
            down = w2[e] @ hidden
            if s >= 0:
                down = down + w2_b[0][s, e].double() @ (w2_a[0][s, e].double() @ hidden)
            out[t] += weights[t, j] * down
    return out


@pytest.mark.usefixtures("reference_kernels")
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_experts_add_each_tokens_adapter_per_expert(wrapper, expert_parallel):
    """The NPU experts (dispatch, grouped matmuls, SwiGLU, combine on the reference kernels) with
    vLLM's own LoRAExpertsMixin hooks calling the wrapper's add_lora_w13/add_lora_w2: equal to
    the MoE definition with each token's adapter per expert; under expert parallelism (vLLM's
    expert_map) the two ranks' outputs add up to it. A control that drops the down projection's
    delta misses it."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin

    from ascend_patch.npu.lora.moe import _LoRAHooks
    from ascend_patch.npu.ops.fused_moe import fused_experts

    generator = torch.Generator().manual_seed(3)
    tokens = len(TOKEN_IDS)
    x = torch.randn(tokens, MOE_HIDDEN, generator=generator)
    w13 = torch.randn(EXPERTS, 2 * INTER, MOE_HIDDEN, generator=generator) / MOE_HIDDEN**0.5
    w2 = torch.randn(EXPERTS, MOE_HIDDEN, INTER, generator=generator) / INTER**0.5
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=generator)

    def factor(*shape):
        return torch.randn(SLOTS, EXPERTS, *shape, generator=generator) * 0.3

    w13_a = (factor(RANK, MOE_HIDDEN), factor(RANK, MOE_HIDDEN))
    w13_b = (factor(INTER, RANK), factor(INTER, RANK))
    w2_a, w2_b = (factor(RANK, INTER),), (factor(MOE_HIDDEN, RANK),)
    expected = _moe_with_lora(x, w13, w2, weights, ids, slots_of(TOKEN_IDS), w13_a, w13_b,
                              w2_a, w2_b)

    class Experts(LoRAExpertsMixin):  # vLLM's hooks, on the NPU experts' activation
        moe_config = SimpleNamespace(activation=MoEActivation.SILU)

    class WithoutDown(_LoRAHooks):
        def down(self, out, hidden, sorted_rows):
            pass

    ranks = ([0, 2], [1, 3]) if expert_parallel else (list(range(EXPERTS)),)
    total, control = torch.zeros_like(expected), torch.zeros_like(expected)
    for local in ranks:
        expert_map = None
        if expert_parallel:
            expert_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
            expert_map[local] = torch.arange(len(local), dtype=torch.int32)
        context = MoELoRAContext(
            w13_lora_a_stacked=tuple(a[:, local] for a in w13_a),
            w13_lora_b_stacked=tuple(b[:, local] for b in w13_b),
            w2_lora_a_stacked=(w2_a[0][:, local],), w2_lora_b_stacked=(w2_b[0][:, local],),
            adapter_enabled=torch.ones(SLOTS + 1, dtype=torch.int32), max_loras=SLOTS,
            top_k=TOP_K, w13_num_slices=2, fully_sharded=False, tp_rank=0, tp_size=1,
            local_num_experts=len(local), punica_wrapper=wrapper, use_tuned_config=False)
        local13 = w13[local].transpose(1, 2).contiguous()
        local2 = w2[local].transpose(1, 2).contiguous()
        for out, hooks in ((total, _LoRAHooks), (control, WithoutDown)):
            lora = hooks(Experts(), context, x, local13, local2, weights, ids, expert_map)
            out += fused_experts(x, local13, local2, weights, ids, expert_map, lora=lora).double()
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
    assert (control - expected).norm() > 0.05 * expected.norm()
