"""Recurrent layers on the emulated NPU, served by stock vLLM 0.33: a Granite 4.0-H style Mamba-2
hybrid (three Mamba-2 layers, one attention layer) and a Qwen3-Next (three gated-DeltaNet layers,
one gated attention layer, MoE), built locally. Their convolutions and scans run the composed path
(ascend_patch.npu.ops.recurrent), the gated delta rule's bf16 decode npu_recurrent_gated_delta_rule
(kernel seam); their states live in the hybrid KV-cache manager's groups.

One driver process runs every engine (tests/engine_driver.py): fp32 greedy against HF
transformers' own torch paths, with a 150-token prompt spanning several scan chunks (32 tokens
for Mamba-2, 64 for the gated delta rule) and a 64-token scheduler budget that splits it over
three steps (chunked prefill resumes from the stored states); a KV pool too small for the batch,
so requests are preempted and recomputed; the negative control, decode steps that never advance
their state; and Qwen3-Next in bf16 against HF's logits. The composed functions and the seam
op's reference are checked against naive token-by-token recurrences written here, and the seam
op's contract by violating it. The driver fills every uninitialized tensor with NaN (as every
engine driver does): padded tokens' hidden states are vLLM's uninitialized buffers, and their
K/V land in the null block, which no attention of a real sequence may read.
"""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version

from ascend_patch.kit.oracle import hf_greedy
from tests.helpers.engine import assert_tracks_hf_logits, run_engine

SERVED = Version(version("vllm")).release >= (0, 33)
# Served from 0.33: on the V1 runner there (the pinned 0.33.0 run), through Model Runner V2's
# hybrid model state from 0.34 (the main line).
pytestmark = [pytest.mark.each_runner,
              pytest.mark.skipif(not SERVED, reason="recurrent layers are served on vLLM 0.33 and later")]

# 150 tokens: five SSD chunks, and three scheduler steps at 64 tokens a step.
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(150)], list(range(40, 47)),
           [(11 * i) % 480 + 10 for i in range(70)]]
MAX_TOKENS = 48
_BASE = {"dtype": "float32", "max_model_len": 512, "enable_prefix_caching": False,
         "max_num_batched_tokens": 64}
_GREEDY = [{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}]
# Four requests of a prompt and 80 generated tokens that need a second attention block (the
# Qwen3-Next's are 128 tokens, the Granite's 384) each hold 3 state blocks and 1 attention block
# at admission: of 9 usable blocks two requests take 8, and the first to cross into its second
# attention block takes the last, so the other is preempted and recomputed later.
PRESSED = {name: [[(13 * i + r) % 490 + 7 for i in range(length)] for r in range(4)]
           for name, length in (("tiny-granite4", 340), ("tiny-qwen3-next", 100))}


def _engines(name, model, bf16=False):
    """The fp32 engine, the pressed one and the negative control (and a bf16 one) of a model."""
    # The first leaves prefix caching to vLLM's default (on), which the overlay turns off.
    unset = {k: v for k, v in _BASE.items() if k != "enable_prefix_caching"}
    engines = [
        {"model": model, "kwargs": unset, "runs": [{"prompts": PROMPTS, "sampling": _GREEDY}]},
        {"model": model, "kwargs": {**_BASE, "num_gpu_blocks_override": 10,
                                    "disable_log_stats": False},
         "runs": [{"prompts": PRESSED[name], "counters": ["vllm:num_preemptions"],
                   "sampling": [{"temperature": 0, "max_tokens": 80, "ignore_eos": True}]}]},
        {"model": model, "kwargs": _BASE, "stale_recurrent_state": True,
         "runs": [{"prompts": PROMPTS, "sampling": _GREEDY}]},
    ]
    if bf16:
        engines.append({"model": model, "kwargs": {**_BASE, "dtype": "bfloat16"},
                        "runs": [{"prompts": PROMPTS, "sampling": _GREEDY}]})
    return engines


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The driver's spec, started ahead of the module (tests/helpers/prefetch.py)."""
    if not SERVED:
        return []
    granite, qwen3_next = (str(tiny_models[name]) for name in ("tiny-granite4", "tiny-qwen3-next"))
    return [{"engines": _engines("tiny-granite4", granite)
                        + _engines("tiny-qwen3-next", qwen3_next, bf16=True)}]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """Every engine of both models, in one driver process."""
    [spec] = engine_specs(tiny_models)
    engines = run_engine(spec, tmp_path_factory.mktemp("recurrent"), timeout=2400)["engines"]
    for engine in engines:
        assert "error" not in engine, engine["error"]
    return {"tiny-granite4": engines[:3], "tiny-qwen3-next": engines[3:]}


ARCHITECTURES = {"tiny-granite4": "GraniteMoeHybridForCausalLM",
                 "tiny-qwen3-next": "Qwen3NextForCausalLM"}
MODELS = {"tiny-granite4": ("MambaSpec", "3 Mamba-2 (MambaMixer2) layers (0, 1, 3) run composed"),
          "tiny-qwen3-next": ("MambaSpec", "3 gated DeltaNet (QwenGatedDeltaNetAttention) layers "
                                           "(0, 1, 2) run their convolution and chunked prefill "
                                           "composed")}
# The attention layer's KV-cache block: the Granite's state page raises it to three kernel blocks
# (ascend_patch.kit.tiny_models); the Qwen3-Next's state pages are padded to a 128-token page.
ATTENTION_BLOCK = {"tiny-granite4": 384, "tiny-qwen3-next": 128}


@pytest.mark.parametrize("model", MODELS)
def test_fp32_greedy_equals_hf(served, tiny_models, model):
    engine = served[model][0]
    assert engine["runs"][0]["tokens"] == hf_greedy(tiny_models[model], PROMPTS, MAX_TOKENS)
    spec, line = MODELS[model]
    assert engine["block_size"] == ATTENTION_BLOCK[model]
    groups = engine["kv_cache"]["groups"]
    assert [group["spec"] for group in groups] == [spec] * 3 + ["FullAttentionSpec"]
    # the state pages are blocks of the one KV tensor, charged to the emulated HBM
    assert engine["kv_cache"]["charged_bytes"] >= engine["kv_cache"]["num_blocks"] * groups[0]["page_bytes"]
    assert any(line in message for message in engine["log"])
    assert any(f"prefix caching is off by default for {ARCHITECTURES[model]}" in message
               for message in engine["log"])


@pytest.mark.parametrize("model", MODELS)
def test_state_survives_preemption(served, tiny_models, model):
    run = served[model][1]["runs"][0]
    assert run["counters"]["vllm:num_preemptions"] > 0
    assert run["tokens"] == hf_greedy(tiny_models[model], PRESSED[model], 80)


@pytest.mark.parametrize("model", MODELS)
def test_decode_without_state_updates_diverges(served, model):
    """The negative control: the same engine with each decode step's state left as it was."""
    good, stale = served[model][0]["runs"][0]["tokens"], served[model][2]["runs"][0]["tokens"]
    assert all(g[0] == s[0] for g, s in zip(good, stale))  # prefill is untouched
    assert all(g != s for g, s in zip(good, stale))


def test_qwen3_next_bf16_decodes_on_the_npu_op_within_bf16_tolerance(served, tiny_models):
    run = served["tiny-qwen3-next"][3]["runs"][0]
    # one launch per gated-DeltaNet layer and step with decodes: at least the 47 decode steps of
    # each request
    assert run["launches"]["recurrent_gated_delta_rule"] >= 47 * 3
    assert_tracks_hf_logits(tiny_models["tiny-qwen3-next"], PROMPTS, run["tokens"], routed=True)


# --- the composed functions against a naive token-by-token recurrence -------------------------


def _naive_conv(x, weight, bias, state):
    """x [dim, L] after state [dim, K-1]: y_t = silu(b + sum_k w_k x_{t-K+1+k})."""
    seq = torch.cat([state, x], dim=1)
    width = weight.shape[1]
    out = torch.stack([F.silu(bias + (weight * seq[:, t:t + width]).sum(1))
                       for t in range(x.shape[1])], dim=1)
    return out, seq[:, -(width - 1):]


def _naive_ssm(x, dt, A, B, C, D, state):
    """Token by token: h = exp(dt A) h + dt x B^T, y = h C + D x; x [L, H, P], B/C [L, G, N]."""
    heads, groups = x.shape[1], B.shape[1]
    ys = []
    for t in range(x.shape[0]):
        y = torch.empty_like(x[t])
        for h in range(heads):
            g = h // (heads // groups)
            state[h] = torch.exp(dt[t, h] * A[h]) * state[h] + dt[t, h] * torch.outer(x[t, h], B[t, g])
            y[h] = state[h] @ C[t, g] + D[h] * x[t, h]
        ys.append(y)
    return torch.stack(ys), state


def test_composed_conv1d_prefill_and_decode_follow_the_naive_recurrence():
    from ascend_patch.npu.ops import recurrent

    torch.manual_seed(0)
    dim, width = 24, 4
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    lengths, slots = [9, 1, 30], [3, 1, 5]
    x = torch.randn(dim, sum(lengths))
    states = torch.randn(7, dim, width - 1)
    initial = torch.tensor([True, False, True])
    expected_states = states.clone()
    starts = torch.tensor([0, 9, 10, 40])
    out = recurrent.causal_conv1d_fn(x, weight, bias, states, starts, torch.tensor(slots), initial,
                                     "silu")
    for seq, (begin, end) in enumerate(zip(starts, starts[1:])):
        before = expected_states[slots[seq]] if initial[seq] else torch.zeros(dim, width - 1)
        want, after = _naive_conv(x[:, begin:end], weight, bias, before)
        torch.testing.assert_close(out[:, begin:end], want)
        torch.testing.assert_close(states[slots[seq]], after)
    token = torch.randn(2, dim)
    kept = states.clone()
    stepped = recurrent.causal_conv1d_update(token, states, weight, bias, "silu",
                                             torch.tensor([5, 0]))  # 0: the null block, skipped
    want, after = _naive_conv(token[0, :, None], weight, bias, kept[5])
    torch.testing.assert_close(stepped[0], want[:, 0])
    torch.testing.assert_close(states[5], after)
    torch.testing.assert_close(states[0], kept[0])


def test_composed_ssd_chunks_and_state_update_follow_the_naive_recurrence():
    from ascend_patch.npu.ops import recurrent

    torch.manual_seed(1)
    heads, head_dim, groups, d_state = 4, 8, 2, 6
    lengths = [45, 20]  # chunks of 16: 16+16+13 and 3 (the second starts mid-chunk) + 16 + 1
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim)
    dt = torch.randn(total, heads)
    A, D, dt_bias = -torch.rand(heads) - 0.1, torch.randn(heads), torch.randn(heads)
    B, C = torch.randn(total, groups, d_state), torch.randn(total, groups, d_state)
    initial = torch.randn(2, heads, head_dim, d_state)
    cache = torch.zeros(4, heads, head_dim, d_state)
    out = torch.empty_like(x)
    chunks = torch.tensor([0, 16, 32, 45, 48, 64, 65])
    recurrent.mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, 16, torch.tensor([0, 45, 65]), chunks, torch.tensor([2, 5]),
        torch.tensor([0, 0, 0, 1, 1, 1]), out, D=D, dt_bias=dt_bias, initial_states=initial,
        dt_softplus=True, final_states_out=cache, final_state_indices=torch.tensor([2, 1]))
    dt_real = F.softplus(dt + dt_bias)
    for seq, (begin, end, slot) in enumerate([(0, 45, 2), (45, 65, 1)]):
        want, state = _naive_ssm(x[begin:end], dt_real[begin:end], A, B[begin:end], C[begin:end],
                                 D, initial[seq].clone())
        torch.testing.assert_close(out[begin:end], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache[slot], state, rtol=1e-4, atol=1e-4)
    # one decode token per row, the arguments broadcast along the head dim as vLLM passes them
    token, dt_token = torch.randn(2, heads, head_dim), torch.randn(2, heads)
    B1, C1 = torch.randn(2, groups, d_state), torch.randn(2, groups, d_state)
    kept = cache.clone()
    stepped = torch.empty_like(token)
    recurrent.selective_state_update(
        cache, token, dt_token[:, :, None].expand(-1, -1, head_dim),
        A[:, None, None].expand(-1, head_dim, d_state), B1, C1, D[:, None].expand(-1, head_dim),
        dt_bias[:, None].expand(-1, head_dim), dt_softplus=True,
        state_batch_indices=torch.tensor([1, -1]), out=stepped)  # -1: a padded row
    want, state = _naive_ssm(token[:1], F.softplus(dt_token + dt_bias)[:1], A, B1[:1], C1[:1], D,
                             kept[1].clone())
    torch.testing.assert_close(stepped[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache[1], state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache[[0, 2, 3]], kept[[0, 2, 3]])


def _naive_gated_delta(q, k, v, g, beta, state, scale):
    """Token by token, head by head: S = exp(g) S; S += beta (v - S k) k^T; o = S q scale, with
    value head h reading key head h // (HV / H); q, k [L, H, K], v [L, HV, V], state [HV, V, K]."""
    heads, k_heads = v.shape[1], q.shape[1]
    out = torch.empty(v.shape)
    state = state.float().clone()
    for t in range(v.shape[0]):
        for h in range(heads):
            kh = h // (heads // k_heads)
            key, query = k[t, kh].float(), q[t, kh].float()
            state[h] = state[h] * torch.exp(g[t, h].float())
            state[h] += beta[t, h].float() * torch.outer(v[t, h].float() - state[h] @ key, key)
            out[t, h] = state[h] @ query * scale
    return out, state


def _gdn_inputs(lengths, seed, dtype=torch.float32, heads=(2, 4), dims=(16, 8)):
    torch.manual_seed(seed)
    (k_heads, v_heads), (k_dim, v_dim), total = heads, dims, sum(lengths)
    q = F.normalize(torch.randn(total, k_heads, k_dim), dim=-1).to(dtype)
    k = F.normalize(torch.randn(total, k_heads, k_dim), dim=-1).to(dtype)
    v = torch.randn(total, v_heads, v_dim).to(dtype)
    g = -torch.rand(total, v_heads) * 0.5
    beta = torch.rand(total, v_heads).to(dtype)
    return q, k, v, g, beta


def test_composed_gated_delta_chunks_follow_the_naive_recurrence():
    from ascend_patch.npu.ops import recurrent

    lengths = [150, 9]  # three 64-token chunks (the last one short) and one partial chunk
    q, k, v, g, beta = _gdn_inputs(lengths, seed=2)
    initial = torch.randn(2, 4, 8, 16)
    out, finals = recurrent.chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=0.25, initial_state=initial,
        output_final_state=True, cu_seqlens=torch.tensor([0, 150, 159]))
    for seq, (begin, end) in enumerate([(0, 150), (150, 159)]):
        want, state = _naive_gated_delta(q[begin:end], k[begin:end], v[begin:end], g[begin:end],
                                         beta[begin:end], initial[seq], 0.25)
        torch.testing.assert_close(out[0, begin:end], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(finals[seq], state, rtol=1e-4, atol=1e-4)



def test_prefill_states_are_gathered_from_their_slots_and_scattered_back():
    """vLLM 0.34's gated DeltaNet prefill reads each sequence's initial state from its slot
    (zeros for a new sequence, whatever its slot holds) and writes the final states back."""
    from ascend_patch.npu.ops import recurrent

    cache = torch.randn(6, 4, 8, 16)
    cache[3] = float("nan")  # a new sequence's slot may hold anything, even NaN
    slots, started = torch.tensor([4, 3, 1], dtype=torch.int32), torch.tensor([True, False, True])
    initial = recurrent.gather_initial_states(cache, slots, started)
    torch.testing.assert_close(initial, torch.stack([cache[4], torch.zeros(4, 8, 16), cache[1]]),
                               rtol=0, atol=0)
    before, finals = cache.clone(), torch.randn(3, 4, 8, 16)
    recurrent.scatter_states(cache, finals, slots)
    torch.testing.assert_close(cache[[4, 3, 1]], finals, rtol=0, atol=0)
    torch.testing.assert_close(cache[[0, 2, 5]], before[[0, 2, 5]], rtol=0, atol=0)

def test_composed_gated_delta_decode_computes_the_gates_and_skips_padded_rows():
    from ascend_patch.npu.ops import recurrent

    q, k, v, _, _ = _gdn_inputs([1, 1, 1], seed=3)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    states = torch.randn(5, 4, 8, 16)
    kept = states.clone()
    out, _ = recurrent.fused_sigmoid_gating_delta_rule_update(
        A_log, a, b, dt_bias, q[None] * 3, k[None] * 2, v[None], scale=0.25, initial_state=states,
        cu_seqlens=torch.tensor([0, 1, 2, 3]), ssm_state_indices=torch.tensor([4, -1, 2]),
        use_qk_l2norm_in_kernel=True)  # q, k scaled: the L2 norm undoes it
    g = -A_log.exp() * F.softplus(a + dt_bias)
    for row, slot in ((0, 4), (2, 2)):
        want, state = _naive_gated_delta(q[row:row + 1], k[row:row + 1], v[row:row + 1],
                                         g[row:row + 1], torch.sigmoid(b[row:row + 1]), kept[slot],
                                         0.25)
        torch.testing.assert_close(out[0, row], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[slot], state, rtol=1e-4, atol=1e-4)
    assert out[0, 1].abs().sum() == 0
    torch.testing.assert_close(states[[0, 1, 3]], kept[[0, 1, 3]])


# --- npu_recurrent_gated_delta_rule: its reference and its contract -------------------------------


def _rgdr_call(lengths=(1, 3), accepted=None, **changes):
    """A valid call of the op: sequences of ``lengths`` tokens, each token its own state slot."""
    q, k, v, g, beta = _gdn_inputs(lengths, seed=4, dtype=torch.bfloat16)
    total = sum(lengths)
    args = {"query": q, "key": k, "value": v,
            "state": torch.randn(total + 2, 4, 8, 16).to(torch.bfloat16),
            "beta": beta, "scale": 0.25, "g": g,
            "actual_seq_lengths": torch.tensor(lengths, dtype=torch.int32),
            "ssm_state_indices": torch.arange(2, total + 2, dtype=torch.int32),
            "num_accepted_tokens": None if accepted is None else torch.tensor(accepted,
                                                                             dtype=torch.int32)}
    args.update(changes)
    return args


def test_the_gated_delta_decode_reference_follows_the_naive_recurrence(reference_kernels):
    from ascend_patch.npu import kernels

    call = _rgdr_call(lengths=(1, 3), accepted=[1, 2])
    state = call["state"]
    before = state.clone()
    out = kernels.recurrent_gated_delta_rule(call.pop("query"), call.pop("key"), call.pop("value"),
                                             call.pop("state"), **call)
    call = _rgdr_call(lengths=(1, 3), accepted=[1, 2])
    q, k, v, g, beta = call["query"], call["key"], call["value"], call["g"], call["beta"]
    # sequence 0: slot 2 -> slot 2; sequence 1 starts from its 2nd token's slot (4), writes 3, 4, 5
    for begin, end, start_slot in ((0, 1, 2), (1, 4, 4)):
        want, _ = _naive_gated_delta(q[begin:end], k[begin:end], v[begin:end], g[begin:end],
                                     beta[begin:end], before[start_slot], 0.25)
        torch.testing.assert_close(out[begin:end].float(), want, rtol=2e-2, atol=2e-2)
        # Each token's slot holds the state after it, read back from the op's own tensor: the
        # naive state rounded once to bf16 (measured 3.8e-3 at most, on values up to 1.8).
        for t in range(begin, end):
            _, after = _naive_gated_delta(q[begin:t + 1], k[begin:t + 1], v[begin:t + 1],
                                          g[begin:t + 1], beta[begin:t + 1], before[start_slot], 0.25)
            torch.testing.assert_close(state[t + 2].float(), after, rtol=2**-8, atol=1e-4)
    torch.testing.assert_close(state[:2], before[:2], rtol=0, atol=0)  # no token's slot
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(("change", "message"), [
    ({"query": torch.zeros(4, 2, 16)}, "query must be bfloat16"),
    ({"lengths": (1, 9)}, "actual_seq_lengths must be each in [1, 8]"),
    ({"state": torch.zeros(6, 4, 16, 8, dtype=torch.bfloat16)}, "state must be [BlockNum, 4, 8, 16]"),
    ({"gk": torch.zeros(4, 4)}, "gk must be None"),
    ({"ssm_state_indices": torch.arange(2, 6)}, "ssm_state_indices must be int32"),
    ({"ssm_state_indices": torch.tensor([2, 3, 4, 9], dtype=torch.int32)},
     "ssm_state_indices must be 4 slots in [0, 6)"),
    ({"g": torch.zeros(4, 4, dtype=torch.bfloat16)}, "g must be float32"),
])
def test_the_gated_delta_decode_contract_is_enforced(reference_kernels, change, message):
    from ascend_patch.npu import kernels

    lengths = change.pop("lengths", (1, 3))
    call = _rgdr_call(lengths=lengths, **change)
    with pytest.raises(kernels.KernelContractError, match=re.escape(message)):
        kernels.recurrent_gated_delta_rule(call.pop("query"), call.pop("key"), call.pop("value"),
                                           call.pop("state"), **call)


# --- what stays refused -----------------------------------------------------------------------


def _config(architecture, prefix_caching=False, speculative=None):
    from types import SimpleNamespace

    return SimpleNamespace(model_config=SimpleNamespace(architecture=architecture),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
                           speculative_config=speculative)


@pytest.mark.parametrize(("architecture", "prefix_caching", "speculative", "refusal"), [
    ("GraniteMoeHybridForCausalLM", False, None, None),
    ("GraniteMoeHybridForCausalLM", True, None,
     "prefix caching of GraniteMoeHybridForCausalLM's Mamba-2 (MambaMixer2) states is not supported "
     "by ascend-patch yet: run with --no-enable-prefix-caching"),
    ("GraniteMoeHybridForCausalLM", False, object(),
     "speculative decoding with GraniteMoeHybridForCausalLM's Mamba-2 (MambaMixer2) layers is not "
     "supported by ascend-patch yet"),
    ("NemotronHForCausalLM", False, None,
     "NemotronHForCausalLM has linear layers: ascend-patch serves recurrent layers of "
     "GraniteMoeHybridForCausalLM (Mamba-2 (MambaMixer2)), Qwen3NextForCausalLM (gated DeltaNet "
     "(QwenGatedDeltaNetAttention)) only"),
])
def test_recurrent_models_are_refused_in_one_line_where_unsupported(architecture, prefix_caching,
                                                                   speculative, refusal):
    from ascend_patch.npu.ops.recurrent_layers import recurrent_refusal
    from tests.helpers.patch_sets import patched_as_on

    with patched_as_on(version("vllm")):  # the gate is the declaration: the loader's record of it
        assert recurrent_refusal(_config(architecture, prefix_caching, speculative),
                                 "linear layers") == refusal
