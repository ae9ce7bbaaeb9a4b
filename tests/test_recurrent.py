"""Recurrent layers on the emulated NPU: a Granite 4.0-H style Mamba-2 hybrid (three Mamba-2
layers, one attention layer) built locally, served by stock vLLM 0.33 through the composed path
(ascend_patch.npu.ops.recurrent) with its conv and SSM states in the hybrid KV-cache manager's
Mamba groups.

One driver process runs every engine (tests/engine_driver.py): fp32 greedy against HF
transformers' own (torch) Mamba-2 path, with prompts spanning several SSD chunks (32 tokens)
and a scheduler budget that splits the longest prompt over several steps (chunked prefill
resumes from the stored states); a KV pool too small for the batch, so requests are preempted
and recomputed; and the negative control, decode steps that never advance their SSM state.
The composed functions are checked against a naive token-by-token recurrence written here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascend_patch.kit.oracle import hf_greedy
from tests.helpers.engine import run_engine

pytestmark = pytest.mark.skipif(
    not __import__("vllm").__version__.startswith("0.33."),
    reason="recurrent layers are served on vLLM 0.33 only")

# 150 tokens: five SSD chunks, and three scheduler steps at 64 tokens a step.
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(150)], list(range(40, 47)),
           [(11 * i) % 480 + 10 for i in range(70)]]
MAX_TOKENS = 48
_BASE = {"dtype": "float32", "max_model_len": 512, "enable_prefix_caching": False,
         "max_num_batched_tokens": 64}
_GREEDY = [{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}]
# Four requests of 100 prompt + 80 generated tokens each hold 3 state blocks and 2 attention
# blocks of 128 tokens: of 9 usable blocks two requests take 8 at admission, and the first to
# pass 128 tokens finds none free, so the other is preempted and recomputed later.
PRESSED = [[(13 * i + r) % 490 + 7 for i in range(100)] for r in range(4)]


@pytest.fixture(scope="module")
def granite(tiny_models, tmp_path_factory):
    model = str(tiny_models["tiny-granite4"])
    spec = {"engines": [
        {"model": model, "kwargs": _BASE, "runs": [{"prompts": PROMPTS, "sampling": _GREEDY}]},
        {"model": model, "kwargs": {**_BASE, "num_gpu_blocks_override": 10,
                                    "disable_log_stats": False},
         "runs": [{"prompts": PRESSED, "sampling": [{"temperature": 0, "max_tokens": 80,
                                                     "ignore_eos": True}]}]},
        {"model": model, "kwargs": _BASE, "stale_recurrent_state": True,
         "runs": [{"prompts": PROMPTS, "sampling": _GREEDY}]},
    ]}
    engines = run_engine(spec, tmp_path_factory.mktemp("recurrent"), timeout=1500)["engines"]
    for engine in engines:
        assert "error" not in engine, engine["error"]
    return engines


def test_mamba2_hybrid_fp32_greedy_equals_hf(granite, tiny_models):
    engine = granite[0]
    assert engine["runs"][0]["tokens"] == hf_greedy(tiny_models["tiny-granite4"], PROMPTS, MAX_TOKENS)
    kinds = [group["spec"] for group in engine["kv_cache"]["groups"]]
    assert kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    # the state pages are blocks of the one KV tensor, charged to the emulated HBM
    assert engine["kv_cache"]["charged_bytes"] >= engine["kv_cache"]["num_blocks"] * \
        engine["kv_cache"]["groups"][0]["page_bytes"]
    assert any("3 Mamba-2 (MambaMixer2) layers (0, 1, 3) run composed (generic torch ops" in line
               for line in engine["log"])


def test_mamba2_state_survives_preemption(granite, tiny_models):
    run = granite[1]["runs"][0]
    assert run["preemptions"] > 0
    assert run["tokens"] == hf_greedy(tiny_models["tiny-granite4"], PRESSED, 80)


def test_decode_without_state_updates_diverges(granite):
    """The negative control: the same engine with each decode step's SSM state left as it was."""
    good, stale = granite[0]["runs"][0]["tokens"], granite[2]["runs"][0]["tokens"]
    assert all(g[0] == s[0] for g, s in zip(good, stale))  # prefill is untouched
    assert all(g != s for g, s in zip(good, stale))


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
    from ascend_patch.npu.platform import recurrent_refusal

    assert recurrent_refusal(_config(architecture, prefix_caching, speculative),
                             "linear layers") == refusal
