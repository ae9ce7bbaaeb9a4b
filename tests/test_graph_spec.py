"""Speculative decoding in FULL graphs on the emulated NPU: verification rows replayed from graphs
give the tokens the same engine gives eagerly.

With speculative decoding a decode step verifies 1 + k query tokens per request. The Ascend
builder reports ``UNIFORM_BATCH`` for them, so vLLM keeps FULL_DECODE_ONLY graphs for uniform
verification batches (capture sizes rounded to multiples of 1 + k) and the attention runs the
causal TND npu_fused_infer_attention_score in its ``.out`` form, whose host query ends and KV
lengths every replay re-issues. One driver process runs every engine: the tiny Llama in bf16
with itself as its draft (every draft accepted: every decode step is a uniform verification
batch) and with n-gram drafts, each with graphs (on by default) and eagerly; and the self-drafting
engine with the host-parameter updates left out, whose replays must part from eager mode's. The
decode batches shrink from 3 requests to 1 (different max_tokens), so padded graphs replay too.
DeepSeek MTP on a tiny DeepSeek-V3 at DeepSeek's MLA dimensions whose MTP layer's drafts are
often accepted (:mod:`ascend_patch.kit.tiny_drafts`' shifted MTP): its verification rows run
FIA's MLA form (1 + k absorbed queries per request, causal, whole batches of them accepted), in
graphs against the same engine run eagerly and against the same graphs without their
host-parameter updates.
The drafter's own graphs: on the V1 runner, with a target mode that has PIECEWISE graphs
(FULL_AND_PIECEWISE under torch.compile) vLLM's runner gives the EAGLE drafter PIECEWISE graphs of
its own (the shifted EAGLE head drafting for its tiny Llama, whose drafts are often accepted),
against the same pair run eagerly and against the same graphs replaying stale drafter inputs.
Model Runner V2 (vLLM 0.34+) captures the drafter in FULL graphs of its own by default: its
prefill over the verified tokens (1 + k rows per request; 2 + k for a draft model, which adds a
correction token) and each draft step after the first (one token per request), whose attention
host parameters are renewed before each replay like the target's; against the same pair run
eagerly and against the same graphs with the drafter's updates left out.
"""

from __future__ import annotations

import pytest

from ascend_patch.kit import tiny_drafts
from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import MODELS_DIR, assert_tracks_hf_logits, run_engine
from tests.helpers.patch_sets import installed

SPEC_TOKENS = 3
ROWS = 1 + SPEC_TOKENS
LAYERS = 2  # attention layers of the tiny Llama (ascend_patch/kit/tiny_models.py)
MTP_LAYERS = 1  # the shifted MTP model's target layers (ascend_patch/kit/tiny_drafts.py)
SHIFTED_LAYERS = 1  # tiny-llama-shifted's layers; its EAGLE head has one more
MRV2 = installed().runner == "V2"
# Attention layers of each engine's drafter: the tiny Llama drafting for itself, an EAGLE head,
# DeepSeek's MTP layer.
DRAFT_LAYERS = {"self_draft": LAYERS, "mistral self_draft": LAYERS, "eagle": 1, "mtp": 1,
                "shifted eagle": 1}
# The EAGLE head's attention layer is numbered after its one-layer target's.
SHIFTED_DRAFTER_LAYER = "layers.1."
# MRV2's drafter graphs: its prefill at the target's three request counts, and one-token draft
# steps at vLLM's request-count grid up to max_num_seqs (1, 2, 3, 4), which the engine's capture
# sizes list beside the target's.
DRAFT_STEP_SIZES = {1, 2, 3, 4} if MRV2 else set()
DRAFTER_CAPTURES = 3 + len(DRAFT_STEP_SIZES)
PIECES = 2  # PIECEWISE pieces of a one-layer model (split at its attention)
ENGINE = {"dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 4,
          "gpu_memory_utilization": 0.9, "disable_log_stats": False}
GREEDY = [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in (24, 15, 9)]


def _verification_sizes(engine: dict) -> list[int]:
    """The target's capture sizes: vLLM rounds them to multiples of 1 + k (verification rows per
    request); on Model Runner V2 the drafter's one-token steps add theirs."""
    sizes = engine["capture_sizes"]
    assert {size for size in sizes if size % ROWS} <= DRAFT_STEP_SIZES
    return [size for size in sizes if size % ROWS == 0]


def _task_updates(run: dict, name: str, target_layers: int = LAYERS) -> int:
    """One re-issued launch per captured attention layer and replay: the target's layers per
    target replay, the drafter's per drafter replay (Model Runner V2's FULL drafter graphs)."""
    by_model = run["graph_replays_by_model"]
    drafter = by_model.get("drafter", 0)
    return target_layers * by_model.get("backbone", 0) + (drafter and DRAFT_LAYERS[name] * drafter)


def _speculative(method: str, **config) -> dict:
    return {"speculative_config": {"method": method, "num_speculative_tokens": SPEC_TOKENS,
                                   **config}}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["tiny-llama"]


@pytest.fixture(scope="module")
def prompts(llama):
    text, other, third = prompt_token_ids(llama, [14, 6, 9])
    return [text, other * 3, third * 2]  # repeats, so the n-gram drafter proposes


@pytest.fixture(scope="module")
def mistral_prompts(tiny_models):
    # Longer than its 100-token window by the end: the band cuts the verification rows.
    return prompt_token_ids(tiny_models["tiny-mistral"], [120, 95, 30])


@pytest.fixture(scope="module")
def mtp_model():
    return tiny_drafts.build(MODELS_DIR)["tiny-deepseek-v3-shifted-mtp"]


@pytest.fixture(scope="module")
def mtp_prompts(mtp_model):
    return prompt_token_ids(mtp_model, [14, 6, 9])


@pytest.fixture(scope="module")
def shifted():
    return tiny_drafts.build(MODELS_DIR)["tiny-llama-shifted"]


@pytest.fixture(scope="module")
def shifted_prompts(shifted):
    return prompt_token_ids(shifted, [14, 6, 9])


@pytest.fixture(scope="module")
def engines(llama, prompts, tiny_models, mistral_prompts, mtp_model, mtp_prompts, shifted,
            shifted_prompts, tmp_path_factory):
    self_draft = _speculative("draft_model", model=str(llama))
    ngram = _speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    eagle = _speculative("eagle", model=str(tiny_drafts.build(MODELS_DIR)["tiny-llama-eagle"]))
    mistral = str(tiny_models["tiny-mistral"])
    windowed = _speculative("draft_model", model=mistral)
    mtp, deepseek = _speculative("mtp"), {"model": str(mtp_model)}
    shifted_eagle = _speculative("eagle", model=str(
        tiny_drafts.build(MODELS_DIR)["tiny-llama-shifted-eagle"]))
    piecewise = {"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}
    shifted_target = {"model": str(shifted)}
    configs = {
        "self_draft graph": ({**ENGINE, **self_draft}, {}),
        "self_draft eager": ({**ENGINE, **self_draft, "enforce_eager": True}, {}),
        "ngram graph": ({**ENGINE, **ngram}, {}),
        "ngram eager": ({**ENGINE, **ngram, "enforce_eager": True}, {}),
        "eagle graph": ({**ENGINE, **eagle}, {}),
        "eagle eager": ({**ENGINE, **eagle, "enforce_eager": True}, {}),
        "self_draft stale host parameters": ({**ENGINE, **self_draft}, {"stale_host_params": True}),
        "mistral self_draft graph": ({**ENGINE, **windowed}, {"model": mistral}),
        "mistral self_draft eager": ({**ENGINE, **windowed, "enforce_eager": True},
                                     {"model": mistral}),
        "mtp graph": ({**ENGINE, **mtp}, deepseek),
        "mtp eager": ({**ENGINE, **mtp, "enforce_eager": True}, deepseek),
        "mtp stale host parameters": ({**ENGINE, **mtp}, {**deepseek, "stale_host_params": True}),
        "shifted eagle eager": ({**ENGINE, **shifted_eagle, "enforce_eager": True}, shifted_target),
    }
    if MRV2:  # the drafter's FULL graphs (by default), and the same without their updates
        configs["shifted eagle graph"] = ({**ENGINE, **shifted_eagle}, shifted_target)
        configs["shifted eagle stale drafter host parameters"] = (
            {**ENGINE, **shifted_eagle}, {**shifted_target, "stale_host_params": SHIFTED_DRAFTER_LAYER})
    else:  # then the control, in the same engine: its drafter's graphs replaying stale inputs
        configs["shifted eagle full and piecewise"] = (
            {**ENGINE, **shifted_eagle, **piecewise},
            {**shifted_target, "then": [{"kind": "stale_drafter_inputs"}, None]})
    prompts_of = {mistral: mistral_prompts, str(mtp_model): mtp_prompts,
                  str(shifted): shifted_prompts}

    def runs(extra: dict) -> list[dict]:
        greedy = {"prompts": prompts_of.get(extra.get("model"), prompts), "sampling": GREEDY}
        return [greedy] + [run or greedy for run in extra.pop("then", [])]

    result = run_engine({"engines": [{"model": str(llama), "kwargs": kwargs, "runs": runs(extra),
                                      **extra}
                                     for kwargs, extra in configs.values()]},
                        tmp_path_factory.mktemp("graph-spec"), timeout=2400)
    engines = dict(zip(configs, result["engines"]))
    for name, engine in engines.items():
        assert "error" not in engine, f"{name}: {engine.get('error')}"
    return engines


@pytest.mark.parametrize("method", ["self_draft", "ngram", "eagle"])
def test_verification_graphs_are_on_by_default_and_replay_eager_tokens(engines, llama, prompts,
                                                                      method):
    graph, eager = engines[f"{method} graph"], engines[f"{method} eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert _verification_sizes(graph)
    run, eager_run = graph["runs"][0], eager["runs"][0]
    assert run["tokens"] == eager_run["tokens"]
    assert_tracks_hf_logits(llama, prompts, run["tokens"])
    assert run["graph_replays"] > 0 and eager_run["graph_replays"] == 0
    assert run["spec_decode"]["drafts"] > 0
    assert run["spec_decode"] == eager_run["spec_decode"]  # the same drafts, accepted alike
    # Replayed verification batches: 1 + k tokens per request, padded to a capture size.
    assert {int(size) % ROWS for size in run["graph_replays_by_model_size"]["backbone"]} == {0}
    if MRV2 and method != "ngram":  # the drafter's own FULL graphs, with the same drafts
        assert run["graph_replays_by_model"]["drafter"] > 0


def test_a_padded_verification_batch_replays_the_next_graph(engines):
    """Three requests (12 tokens; 12 is no capture size) replay the 16-token graph, whose fourth
    request is padding over vLLM's null block; two and one hit their sizes."""
    graph = engines["self_draft graph"]
    assert 12 not in graph["capture_sizes"]
    assert set(graph["runs"][0]["graph_replays_by_model_size"]["backbone"]) == {"4", "8", "16"}


@pytest.mark.parametrize("name", ["self_draft", "mistral self_draft"])
def test_the_target_as_its_own_draft_accepts_every_draft_in_graphs(engines, name):
    counts = engines[f"{name} graph"]["runs"][0]["spec_decode"]
    assert counts["drafts"] > 0 and counts["accepted_tokens"] == counts["draft_tokens"]


def test_windowed_verification_rows_replay_eager_tokens(engines):
    """Mistral (every layer windowed, head size 128): verification rows on the band
    (sparse_mode 4, pre_tokens = window - 1) in graphs, past the window."""
    graph, eager = engines["mistral self_draft graph"], engines["mistral self_draft eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY"
    run = graph["runs"][0]
    assert run["tokens"] == eager["runs"][0]["tokens"]
    assert run["graph_replays"] > 0 and run["task_updates"] == _task_updates(run, "mistral self_draft")


def test_each_replay_updates_every_layers_verification(engines):
    """One task update per captured attention launch: layers × replays, the target's and on
    Model Runner V2 the drafter's (a missed layer fails)."""
    for method in ("self_draft", "ngram", "eagle"):
        engine = engines[f"{method} graph"]
        run = engine["runs"][0]
        assert run["task_updates"] == _task_updates(run, method) > 0, method
        # One FULL graph per capture size up to max_num_seqs requests of verification rows.
        sizes = [size for size in _verification_sizes(engine) if size <= ENGINE["max_num_seqs"] * ROWS]
        drafter = DRAFTER_CAPTURES if MRV2 and method != "ngram" else 0
        assert engine["graph_captures"] - drafter == len(sizes) == 3, method


def test_lengths_are_exact_with_async_scheduling_off(engines):
    """The verification rows' KV lengths are vLLM's device lengths (one copy per step), never the
    optimistic host bound async scheduling would give: the platform keeps async scheduling off
    with speculative decoding, graphs or not."""
    for name in ("self_draft graph", "ngram graph", "eagle graph"):
        assert engines[name]["async_scheduling"] is False, name


def test_without_host_parameter_updates_verification_replays_diverge(engines):
    """The control: replays keep the capture's query ends and KV lengths (a dummy batch's), so
    verification attends to the wrong context and every request's tokens part from eager mode's."""
    stale, eager = engines["self_draft stale host parameters"], engines["self_draft eager"]
    assert stale["runs"][0]["graph_replays"] > 0
    diverged = [s != e for s, e in zip(stale["runs"][0]["tokens"], eager["runs"][0]["tokens"])]
    assert all(diverged), diverged


def test_mtp_verification_rows_replay_eager_tokens(engines, mtp_model, mtp_prompts):
    """DeepSeek MTP (MLA at DeepSeek's dimensions, MoE): its verification rows on FIA's MLA form,
    causal over 1 + k absorbed queries per request, in FULL graphs, replay the tokens of the same
    engine run eagerly (the same form, launched directly). Not compared token for token with the
    model without speculation: there the MLA layers fuse their kv norm and rope
    (npu_kv_rmsnorm_rope_cache_v2), which rounds differently in bf16 (test_spec_decode checks MTP
    against the engine without speculation)."""
    graph, eager = engines["mtp graph"], engines["mtp eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert _verification_sizes(graph)
    run = graph["runs"][0]
    assert run["tokens"] == eager["runs"][0]["tokens"]
    assert_tracks_hf_logits(mtp_model, mtp_prompts, run["tokens"], routed=True)
    assert run["spec_decode"] == eager["runs"][0]["spec_decode"]  # the same drafts, accepted alike
    # Drafts accepted and rejected, some whole verification batches: rows 2..1 + k of accepted
    # drafts (bf16 rounding moves some drafts from the fp32 prediction test_spec_decode checks).
    counts = run["spec_decode"]
    assert 0 < counts["accepted_tokens"] < counts["draft_tokens"]
    assert counts["accepted_per_position"][-1] > 0 and run["graph_replays"] > 0
    # Three requests, then two, then one: padded to 16 and replayed at 8 and 4 (1 + k each).
    assert set(run["graph_replays_by_model_size"]["backbone"]) == {"4", "8", "16"}
    # Verification rows decode on FIA's MLA form, in graphs and eagerly alike; only the eager
    # engine's one-token decodes (the MTP layer's drafts) take the ATB op.
    assert run["launches"].get("multi_head_latent_attention", 0) == 0
    assert eager["runs"][0]["launches"]["multi_head_latent_attention"] > 0
    assert eager["runs"][0]["launches"]["fused_infer_attention_score_mla_decode"] > 0
    (captured,) = graph["captured_ops"]
    assert captured["FULL"]["fused_infer_attention_score_mla_decode"] > 0
    # The graph engine's MTP layer drafts eagerly on the V1 runner, on FIA's MLA form too; Model
    # Runner V2 replays those one-token drafts from the drafter's graphs.
    assert (run["launches"].get("fused_infer_attention_score_mla_decode", 0) > 0) != MRV2


def test_each_replay_updates_every_mla_layers_verification(engines):
    """One task update per captured MLA attention launch: the target's layers × its replays, and
    on Model Runner V2 the MTP layer's × the drafter's (on the V1 runner the MTP layer drafts
    eagerly under FULL_DECODE_ONLY); a missed layer fails."""
    run = engines["mtp graph"]["runs"][0]
    assert run["task_updates"] == _task_updates(run, "mtp", MTP_LAYERS) > 0
    assert ("drafter" in run["graph_replays_by_model"]) == MRV2


def test_without_host_parameter_updates_mtp_replays_diverge(engines):
    stale, eager = engines["mtp stale host parameters"], engines["mtp eager"]
    assert stale["runs"][0]["graph_replays"] > 0
    diverged = [s != e for s, e in zip(stale["runs"][0]["tokens"], eager["runs"][0]["tokens"])]
    assert all(diverged), diverged


@pytest.mark.v1_runner
def test_the_drafter_replays_its_own_piecewise_graphs(engines, shifted, shifted_prompts):
    """FULL_AND_PIECEWISE: the target verifies in FULL graphs and prefills in PIECEWISE ones,
    and vLLM gives the EAGLE drafter PIECEWISE graphs (``initialize_cudagraph_keys``: only
    PIECEWISE, only when the target's mixed mode has graphs). Each target step here fits a
    capture size, so vLLM dispatches every drafter pass, the first over the target's tokens and
    k - 1 over one token per request (padded to the smallest size, 1 + k), to its graphs:
    pieces × k replays per target step. The drafter's attention runs between its pieces, eagerly
    on this step's metadata: its pieces hold no host parameters to update (layer norms, rotary,
    MLP), only the input buffers vLLM refreshes. Tokens and the drafts accepted, position by
    position, equal the eager pair's; the tokens track HF's logits."""
    graph, eager = engines["shifted eagle full and piecewise"], engines["shifted eagle eager"]
    assert graph["cudagraph_mode"] == "FULL_AND_PIECEWISE" and eager["cudagraph_mode"] == "NONE"
    # Per capture size one PIECEWISE graph per piece of the target and the drafter; FULL
    # graphs of verification batches up to max_num_seqs requests (4, 8, 16 tokens).
    sizes = len(graph["capture_sizes"])
    assert graph["graph_captures"] == 2 * PIECES * sizes + 3
    (captured,) = graph["captured_ops"]
    assert captured["FULL"]["fused_infer_attention_score_verify"] == SHIFTED_LAYERS
    run, eager_run = _drafts_as_eager(graph, eager, shifted, shifted_prompts)
    by_model = run["graph_replays_by_model"]
    assert set(by_model) == {"backbone", "eagle_head"}
    full = run["task_updates"] // SHIFTED_LAYERS  # one per FULL replay
    target_steps = full + (by_model["backbone"] - full) // PIECES
    assert target_steps > full > 0  # verification in FULL graphs, the prefill in pieces
    assert by_model["eagle_head"] == PIECES * SPEC_TOKENS * target_steps
    assert eager_run["graph_replays"] == 0


@pytest.mark.v1_runner
def test_drafter_graphs_replaying_stale_inputs_lose_the_drafts(engines):
    """The control: the same engine's prompts again once the drafter's input buffers are
    swapped for copies (vLLM refreshes the copies, the replays read the captured buffers). Its
    replays draft from stale tokens: almost no draft is accepted (a few by chance; over half
    above), while the output stays exact (rejection keeps the target's tokens), which is why
    the acceptance counters, not the tokens, are what proves the drafter's replays above."""
    engine, eager = engines["shifted eagle full and piecewise"], engines["shifted eagle eager"]
    _drafts_lost(engine["runs"][2], eager, "eagle_head")


@pytest.mark.mrv2_only
def test_the_drafter_replays_its_own_full_graphs(engines, shifted, shifted_prompts):
    """Model Runner V2 captures the EAGLE drafter in FULL graphs of its own, by default: its
    prefill over each step's verified tokens (1 + k per request, at the target's request counts)
    and each draft step after the first (one token per request). Their attention launches are
    renewed with the draft step's metadata before each replay. Tokens and the drafts accepted,
    position by position, equal the eager pair's; the tokens track HF's logits."""
    graph, eager = engines["shifted eagle graph"], engines["shifted eagle eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert graph["graph_captures"] == 3 + DRAFTER_CAPTURES
    run, eager_run = _drafts_as_eager(graph, eager, shifted, shifted_prompts)
    # After each target replay a drafter prefill replay at its size and k - 1 one-token draft
    # steps (which also follow the target's eager prompt steps).
    by_model = run["graph_replays_by_model"]
    assert by_model["drafter"] >= SPEC_TOKENS * by_model["backbone"] > 0
    assert run["task_updates"] == _task_updates(run, "shifted eagle", SHIFTED_LAYERS)
    assert eager_run["graph_replays"] == 0


@pytest.mark.mrv2_only
def test_drafter_graphs_without_host_parameter_updates_lose_the_drafts(engines):
    """The control: the same engine with the drafter layer's updates left out (the target's are
    renewed). Its replays draft from the capture's lengths: almost no draft is accepted (a few by
    chance; over half above), while the output stays exact (rejection keeps the target's
    tokens), which is why the acceptance counters, not the tokens, prove the drafter's replays."""
    stale, eager = engines["shifted eagle stale drafter host parameters"], engines["shifted eagle eager"]
    _drafts_lost(stale["runs"][0], eager, "drafter")


def _drafts_as_eager(graph: dict, eager: dict, model, prompts) -> tuple[dict, dict]:
    """The drafter-graph engine's run and the eager one's: the same tokens (tracking HF's logits)
    and the same drafts accepted, position by position, over half of them."""
    run, eager_run = graph["runs"][0], eager["runs"][0]
    assert run["tokens"] == eager_run["tokens"]
    assert_tracks_hf_logits(model, prompts, run["tokens"])
    counts = run["spec_decode"]
    assert counts == eager_run["spec_decode"]
    assert counts["draft_tokens"] < 2 * counts["accepted_tokens"] < 2 * counts["draft_tokens"]
    return run, eager_run


def _drafts_lost(run: dict, eager: dict, drafter: str) -> None:
    """A control run whose drafter graphs replayed wrong inputs: exact tokens (rejection keeps
    the target's), almost no draft accepted."""
    assert run["graph_replays_by_model"][drafter] > 0
    assert run["tokens"] == eager["runs"][0]["tokens"]
    counts = run["spec_decode"]
    assert counts["draft_tokens"] > 0 and counts["accepted_tokens"] * 10 < counts["draft_tokens"]


def _config(dtype="bfloat16", mla=False, window=None, spec_tokens=SPEC_TOKENS, soft_cap=None,
            method="eagle"):
    import types

    import torch

    model = types.SimpleNamespace(
        use_mla=mla, dtype=getattr(torch, dtype), disable_sliding_window=False,
        get_sliding_window=lambda: window,
        hf_text_config=types.SimpleNamespace(num_key_value_heads=2, attn_logit_softcapping=soft_cap,
                                             kv_lora_rank=512, qk_rope_head_dim=64,
                                             num_attention_heads=16))
    spec = types.SimpleNamespace(method=method, num_speculative_tokens=spec_tokens)
    return types.SimpleNamespace(model_config=model, speculative_config=spec)


@pytest.mark.parametrize("config, head_size, reason", [
    ({}, 64, None),
    ({}, 128, None),
    ({"mla": True}, 576, None),
    ({"mla": True, "spec_tokens": 16}, 576, "17 verification rows per request: "
                                            "npu_fused_infer_attention_score's MLA form takes at "
                                            "most 16 query tokens per sequence "
                                            "(1 + num_speculative_tokens, one more for a "
                                            "draft model)"),
    ({"mla": True, "dtype": "float32"}, 576, "float32 MLA decodes on composed attention"),
    ({"window": 32}, 128, None),
    ({"spec_tokens": 16}, 64, "17 verification rows per request: the TND "
                              "npu_fused_infer_attention_score takes at most 16 "
                              "(1 + num_speculative_tokens, one more for a draft model)"),
    # A draft model's prefill adds a correction token per request: 2 + k rows.
    ({"spec_tokens": 15, "method": "draft_model"}, 64, "17 verification rows per request: the TND "
                                                       "npu_fused_infer_attention_score takes at "
                                                       "most 16 (1 + num_speculative_tokens, one "
                                                       "more for a draft model)"),
    ({"spec_tokens": 14, "method": "draft_model"}, 64, None),
    ({}, 256, "head size 256: npu_fused_infer_attention_score over a paged cache (TND) takes 64 "
              "and 128: verification rows run composed attention"),
    ({"soft_cap": 50.0}, 64, "logits soft-cap 50: the fused attention kernels have no soft-cap "
                             "input: verification rows run composed attention"),
])
def test_where_verification_rows_are_not_captured_says_why(config, head_size, reason):
    """What the platform's refusal (FULL graphs asked for) and its graph default log name."""
    from ascend_patch.npu.attention.paths import verify_graph_refusal

    assert verify_graph_refusal(_config(**config), head_size) == reason
