"""MLA decode in FULL graphs on the emulated NPU: replayed graphs give the tokens eager mode gives,
on a tiny DeepSeek-V3 at its MLA dimensions (latent 512, rope 64), dense and MoE.

In an engine with FULL graphs the MLA decode runs on npu_fused_infer_attention_score's MLA form,
whose host KV lengths (actual_seq_lengths_kv) every replay re-issues per layer; the eager engines
decode on the ATB MLA op. The decode batches shrink as requests finish (sizes 5 and 3 are padded
to 8 and 4), grow again in the second run, and the third run repeats the first from the prefix
cache. The control engines (dense and MoE) replay with the host-parameter updates left out: their
decodes attend over the capture's lengths, so their tokens must part from eager mode's.
"""

from __future__ import annotations

import pytest

from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import run_engine
from tests.test_graph import ENGINE, PROMPT_LENGTHS, RUNS

EAGER = {**ENGINE, "enforce_eager": True}
COMPILED = {**ENGINE, "compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}
LAYERS = 2  # attention layers of the tiny DeepSeek-V3 checkpoints (ascend_patch/kit/tiny_models.py)
ENGINES = {
    "dense graph": ("tiny-deepseek-v3", ENGINE, RUNS, {}),
    "dense eager": ("tiny-deepseek-v3", EAGER, RUNS, {}),
    "dense stale host parameters": ("tiny-deepseek-v3", ENGINE, RUNS[:1], {"stale_host_params": True}),
    "moe graph": ("tiny-deepseek-v3-moe", ENGINE, RUNS, {}),
    "moe eager": ("tiny-deepseek-v3-moe", EAGER, RUNS, {}),
    "moe stale host parameters": ("tiny-deepseek-v3-moe", ENGINE, RUNS[:1], {"stale_host_params": True}),
    "dense full and piecewise": ("tiny-deepseek-v3", COMPILED, RUNS[:1], {}),
    "moe full and piecewise": ("tiny-deepseek-v3-moe", COMPILED, RUNS[:1], {}),
}


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory):
    prompts = prompt_token_ids(tiny_models["tiny-deepseek-v3"], PROMPT_LENGTHS)
    spec = {"engines": [
        {"model": str(tiny_models[model]), "kwargs": kwargs, **extra,
         "runs": [{"prompts": prompts[:n], "sampling": sampling} for n, sampling in runs]}
        for model, kwargs, runs, extra in ENGINES.values()
    ]}
    result = run_engine(spec, tmp_path_factory.mktemp("graph-mla"), timeout=2400)
    engines = dict(zip(ENGINES, result["engines"]))
    for name, engine in engines.items():
        assert "error" not in engine, f"{name}: {engine.get('error')}"
    return engines


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_mla_graphs_are_on_by_default_and_replay_eager_tokens(engines, model):
    graph, eager = engines[f"{model} graph"], engines[f"{model} eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert graph["graph_captures"] == 4, "one FULL decode graph per size up to max_num_seqs"
    assert [run["tokens"] for run in graph["runs"]] == [run["tokens"] for run in eager["runs"]]
    # Decode batches of 5 and 3 requests replay the graphs of 8 and 4 (padded); 4, 2, 1 hit theirs.
    assert set(graph["runs"][0]["graph_replays_by_size"]) == {"1", "2", "4", "8"}
    assert sum(graph["runs"][2]["cached"]) > 0, "the third run is served from the prefix cache"
    for run in graph["runs"]:
        assert run["graph_replays"] > 0
        # Graph engines decode on FIA's MLA form only; eager ones on the ATB op only.
        assert run["launches"].get("multi_head_latent_attention", 0) == 0
    assert all(run["launches"].get("fused_infer_attention_score_mla_decode", 0) == 0
               and run["launches"]["multi_head_latent_attention"] > 0 for run in eager["runs"])


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_each_replay_updates_every_layers_mla_decode(engines, model):
    """One task update per captured attention launch: layers × replays (a missed layer would
    replay the capture's lengths)."""
    for run in engines[f"{model} graph"]["runs"]:
        assert run["task_updates"] == LAYERS * run["graph_replays"]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_without_host_parameter_updates_mla_replays_diverge(engines, model):
    stale, eager = engines[f"{model} stale host parameters"], engines[f"{model} eager"]
    assert stale["runs"][0]["graph_replays"] > 0
    diverged = [s != e for s, e in zip(stale["runs"][0]["tokens"], eager["runs"][0]["tokens"])]
    assert all(diverged), diverged


# What the graphs of one token hold outside attention, per model (2 layers): the first input norm
# (and each layer's q_a norm: the MoE model has a q LoRA rank) (npu_rms_norm), the residual norms
# (npu_add_rms_norm); dense: one npu_swiglu per layer; MoE: the dense first layer's and the shared
# expert's npu_swiglu plus the experts' own, and the second layer's routing and experts. The kv_a
# norm and the rotary (plain or YaRN-scaled) are the MLA impl's, inside the attention op: one
# npu_kv_rmsnorm_rope_cache_v2 (norm, key rope, cache write) and one npu_interleave_rope (query
# rope) per layer, over cos/sin the metadata builder gathers once per step outside the graphs.
PIECES = {
    "dense": {"rms_norm": 1, "add_rms_norm": 4, "swiglu": 2},
    "moe": {"rms_norm": 3, "add_rms_norm": 4, "swiglu": 3, "moe_gating_top_k": 1,
            "moe_init_routing_v2": 1, "grouped_matmul": 2, "moe_token_unpermute": 1},
}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_full_and_piecewise_graphs_run_the_npu_ops_in_the_compiled_pieces(engines, model):
    """torch.compile over MLA (and MoE) layers: the pieces' graphs of one token hold the NPU layer
    ops, the FULL graph the same around the MLA decode; the tokens equal eager mode's."""
    compiled, eager = engines[f"{model} full and piecewise"], engines[f"{model} eager"]
    assert compiled["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert compiled["runs"][0]["tokens"] == eager["runs"][0]["tokens"]
    assert compiled["runs"][0]["graph_replays"] > 0
    (captured,) = compiled["captured_ops"]
    assert captured["PIECEWISE"] == PIECES[model]
    assert captured["FULL"] == {**PIECES[model], "kv_rmsnorm_rope_cache": LAYERS,
                                "interleave_rope": LAYERS,
                                "fused_infer_attention_score_mla_decode": LAYERS}
