"""Windowed models in FULL graphs on the emulated NPU: replayed graphs give the tokens eager mode
gives on Mistral (every layer windowed, head size 128) and Gemma 3 (windowed and global layers
in two KV-cache groups, head size 256), and soft-capped Gemma 2 says in one line why it decodes
eagerly.

A windowed layer decodes on the one-token BSH npu_fused_infer_attention_score with the window as
a (batch, KV) mask (the op ignores sparse_mode and pre/next_tokens for one-token queries): in an
engine with FULL graphs its .out form, whose host KV lengths every replay re-issues and whose mask
is computed on the device from vLLM's sequence lengths inside the graph. The prompts are longer
than the windows (100 tokens), so the windows cut. The control engine replays with the
host-parameter updates left out, and its replays break the kernel's contract; Gemma 3's controls
leave out one kernel's updates each: its windowed layer's break the same contract, its global
layer's (paged attention) give tokens that part from eager mode's.
"""

from __future__ import annotations

import pytest

from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import run_engine
from tests.test_graph import ENGINE, PROMPT_LENGTHS, RUNS

EAGER = {**ENGINE, "enforce_eager": True}
LAYERS = 2  # attention layers of the tiny checkpoints (ascend_patch/kit/tiny_models.py)
ENGINES = {
    "mistral graph": ("tiny-mistral", ENGINE, RUNS),
    "mistral eager": ("tiny-mistral", EAGER, RUNS),
    "mistral stale host parameters": ("tiny-mistral", {**ENGINE, "stale": True}, RUNS[:1]),
    "gemma3 graph": ("tiny-gemma3", ENGINE, RUNS),
    "gemma3 eager": ("tiny-gemma3", EAGER, RUNS),
    # Gemma 3's controls, one per kernel: its windowed layer 0 (FIA), its global layer 1 (paged
    # attention) left with the capture's host parameters, the other layer's updates kept.
    "gemma3 stale windowed layer": ("tiny-gemma3", {**ENGINE, "stale": "layers.0."}, RUNS[:1]),
    "gemma3 stale global layer": ("tiny-gemma3", {**ENGINE, "stale": "layers.1."}, RUNS[:1]),
    "gemma2 default": ("tiny-gemma2", ENGINE, []),
    "gemma3 full and piecewise": ("tiny-gemma3", {**ENGINE, "compilation_config": {
        "mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}, RUNS[:1]),
}


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The driver's spec, started ahead of the module (tests/helpers/prefetch.py)."""
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    specs = []
    for model, kwargs, runs in ENGINES.values():
        kwargs = dict(kwargs)
        stale = kwargs.pop("stale", False)
        specs.append({"model": str(tiny_models[model]), "kwargs": kwargs,
                      **({"stale_host_params": stale} if stale else {}),
                      "runs": [{"prompts": prompts[:n], "sampling": s} for n, s in runs]})
    return [{"engines": specs, "report_errors": True}]


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory):
    [spec] = engine_specs(tiny_models)
    result = run_engine(spec, tmp_path_factory.mktemp("graph-windowed"), timeout=2400)
    engines = dict(zip(ENGINES, result["engines"]))
    for name, engine in engines.items():
        assert "error" not in engine, f"{name}: {engine.get('error')}"
        if "stale" not in name:
            assert not [run["error"] for run in engine["runs"] if "error" in run], name
    return engines


@pytest.mark.parametrize("model", ["mistral", "gemma3"])
def test_windowed_graphs_are_on_by_default_and_replay_eager_tokens(engines, model):
    graph, eager = engines[f"{model} graph"], engines[f"{model} eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert [run["tokens"] for run in graph["runs"]] == [run["tokens"] for run in eager["runs"]]
    # Decode batches of 5 and 3 requests replay the graphs of 8 and 4 (padded); 4, 2, 1 hit theirs.
    assert set(graph["runs"][0]["graph_replays_by_size"]) == {"1", "2", "4", "8"}
    assert sum(graph["runs"][2]["cached"]) > 0, "the third run is served from the prefix cache"
    assert all(run["graph_replays"] > 0 for run in graph["runs"])
    # The eager engine decodes its windowed layers on the plain call, the graph engine's eager
    # steps (mixed batches aside) never on it once decode-only batches replay.
    assert all(run["launches"].get("fused_infer_attention_score_decode", 0) == 0
               for run in eager["runs"])


@pytest.mark.parametrize("model", ["mistral", "gemma3"])
def test_each_replay_updates_every_layers_decode(engines, model):
    """One task update per captured attention launch (windowed FIA and global paged attention
    alike): layers × replays."""
    for run in engines[f"{model} graph"]["runs"]:
        assert run["task_updates"] == LAYERS * run["graph_replays"]


def test_without_host_parameter_updates_windowed_replays_break(engines):
    """The control: replays keep the capture's KV lengths while the window mask, computed in the
    graph from vLLM's device lengths, moves on with the sequences: a sequence whose window has
    moved past the capture's length gets a row whose every key within that length is masked
    (undefined output on the NPU), which the reference kernel refuses by name, ending the run."""
    stale = engines["mistral stale host parameters"]
    assert stale["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert stale["runs"][0]["error"].startswith(
        "KernelContractError: npu_fused_infer_attention_score: atten_mask must be to leave each "
        "sequence at least one of its keys, got row")


def test_gemma3_without_its_windowed_layers_updates_replays_break(engines):
    """Gemma 3's windowed layer alone left with the capture's KV lengths (its global layer's
    updates kept): the same broken contract as Mistral's."""
    stale = engines["gemma3 stale windowed layer"]
    assert stale["runs"][0]["error"].startswith(
        "KernelContractError: npu_fused_infer_attention_score: atten_mask must be to leave each "
        "sequence at least one of its keys, got row")


def test_gemma3_without_its_global_layers_updates_replays_diverge(engines):
    """Gemma 3's global layer alone (paged attention) left with the capture's context lengths (its
    windowed layer's updates kept): it attends to the wrong context, so every request's tokens
    part from eager mode's."""
    stale, eager = engines["gemma3 stale global layer"], engines["gemma3 eager"]
    run = stale["runs"][0]
    assert "error" not in run and run["graph_replays"] > 0
    assert run["task_updates"] == LAYERS * run["graph_replays"]  # issued, each but layer 1's
    diverged = [s != e for s, e in zip(run["tokens"], eager["runs"][0]["tokens"])]
    assert all(diverged), diverged


def test_gemma3_full_and_piecewise_graphs_give_eager_tokens(engines):
    """torch.compile with windowed and global layers: the pieces hold the NPU rotary (npu_mrope,
    query and key in one launch, per layer; Gemma's (1 + w) RMSNorm and GELU stay vLLM's), the
    FULL decode graph the windowed FIA and paged attention. Tokens equal eager."""
    compiled, eager = engines["gemma3 full and piecewise"], engines["gemma3 eager"]
    assert compiled["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert compiled["runs"][0]["tokens"] == eager["runs"][0]["tokens"]
    assert compiled["runs"][0]["graph_replays"] > 0
    (captured,) = compiled["captured_ops"]
    assert captured["PIECEWISE"] == {"mrope": LAYERS}
    assert captured["FULL"] == {"mrope": LAYERS, "scatter_pa_kv_cache": LAYERS,
                                "fused_infer_attention_score_decode": 1, "paged_attention": 1}


def test_soft_capped_logits_keep_graph_mode_off_and_say_why_in_one_line(engines):
    gemma2 = engines["gemma2 default"]
    assert gemma2["cudagraph_mode"] == "NONE"
    lines = [line for line in gemma2["log"] if "ACL graph mode is off by default" in line]
    assert lines == [
        "ascend-patch: ACL graph mode is off by default: logits soft-cap 50: the fused attention "
        "kernels have no soft-cap input: its global and windowed layers decode on composed "
        "attention (standard torch ops, host lengths made into tensors every step), which FULL "
        "ACL graphs cannot hold"]

