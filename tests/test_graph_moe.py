"""MoE decode in FULL graphs with tensor and expert parallelism on the emulated NPU: a tiny GLM-4.5
(grouped sigmoid routing on npu_moe_gating_top_k, a shared expert) at TP=2 with EP=2, each rank
holding half the experts, replays the tokens its eager twin gives.

Both engines spawn two workers each (gloo stands in for HCCL) and run the same runs: the shared
ones of tests/test_graph.py (decode batches shrinking 5 → 1 with padded sizes, growing to 8, the
first run again from the prefix cache), then seeded random ones (random prompts out of the eight,
so prefixes repeat, with random lengths to generate). Each rank's graphs are captured at start-up
on the emulated graph, which raises at any host sync inside a capture (``.item()``, a
value-dependent shape), so a capture that holds the routing, the expert map's gather, the NPU MoE
ops and the all-reduces is the proof that the routing does not sync. The counters come from the
workers themselves (tests/engine_driver.py: "ranks", "captured_ops").
"""

from __future__ import annotations

import random

import pytest

from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import assert_tracks_hf_logits, run_engine
from tests.test_graph import ENGINE, PROMPT_LENGTHS, RUNS, TP2, _greedy

pytestmark = pytest.mark.slow

MODEL = "tiny-glm4-moe"
LAYERS = 2  # decoder layers of the tiny checkpoint, each with attention and an MoE block


def _random_runs(seed: int, count: int) -> list[tuple[list[int], list[dict]]]:
    """``count`` runs of 1 to 8 prompts drawn from the eight (repeats hit the prefix cache), each
    generating 1 to 12 tokens: decode batches of every size shrink and pad at random."""
    rng = random.Random(seed)
    return [(rng.sample(range(len(PROMPT_LENGTHS)), rng.randint(1, len(PROMPT_LENGTHS))),
             _greedy([rng.randint(1, 12) for _ in range(len(PROMPT_LENGTHS))]))
            for _ in range(count)]


SHAPES = [(list(range(n)), sampling) for n, sampling in RUNS] + _random_runs(seed=20, count=3)
TP2_EP2 = {**TP2, "enable_expert_parallel": True}
ENGINES = {"graph": {**ENGINE, **TP2_EP2}, "eager": {**ENGINE, **TP2_EP2, "enforce_eager": True}}


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The driver's spec, started ahead of the module (tests/helpers/prefetch.py)."""
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    runs = [{"prompts": [prompts[i] for i in chosen], "sampling": sampling[: len(chosen)]}
            for chosen, sampling in SHAPES]
    return [{"engines": [{"model": str(tiny_models[MODEL]), "kwargs": kwargs, "runs": runs}
                         for kwargs in ENGINES.values()]}]


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory):
    [spec] = engine_specs(tiny_models)
    result = run_engine(spec, tmp_path_factory.mktemp("graph-moe"), timeout=2400)
    engines = dict(zip(ENGINES, result["engines"]))
    for name, engine in engines.items():
        assert "error" not in engine, f"{name}: {engine.get('error')}"
    return {**engines, "prompts": [run["prompts"] for run in spec["engines"][0]["runs"]]}


def test_tp2_ep2_moe_graphs_are_on_by_default_and_replay_eager_tokens(engines):
    graph, eager = engines["graph"], engines["eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert [run["tokens"] for run in graph["runs"]] == [run["tokens"] for run in eager["runs"]]
    assert sum(graph["runs"][2]["cached"]) > 0, "the third run is served from the prefix cache"
    for run in graph["runs"]:
        first, second = run["ranks"]
        # Both ranks replay the same graphs (the all-reduces pair them), in every run.
        assert first == second and first["graph_replays"] > 0, run["ranks"]
        # One paged-attention update per layer and replay on each rank.
        assert first["task_updates"] == LAYERS * first["graph_replays"]
    # Decode batches of 5 and 3 requests replay the graphs of 8 and 4 (padded); 4, 2, 1 hit theirs.
    assert set(graph["runs"][0]["ranks"][0]["graph_replays_by_size"]) == {"1", "2", "4", "8"}
    assert all(run["ranks"] == [{"graph_replays": 0, "task_updates": 0, "graph_replays_by_size": {}}] * 2
               for run in eager["runs"])


def test_each_ranks_decode_graph_holds_the_routing_and_its_experts(engines):
    """What each rank's FULL graph of one decode token captured, per MoE layer: the NPU gating op,
    dispatch, two grouped matmuls over the rank's 4 experts and the bf16 combine. The expert map
    (global id → local id) is gathered on the device, so the routing is inside the graph."""
    for ranks in engines["graph"]["captured_ops"]:
        captured = ranks["FULL"]
        for op in ("moe_gating_top_k", "moe_init_routing_v2", "moe_token_unpermute"):
            assert captured.get(op) == LAYERS, (op, captured)
        assert captured["grouped_matmul"] == 2 * LAYERS
        assert captured["paged_attention"] == LAYERS


def test_tp2_ep2_tokens_track_hf(engines, tiny_models):
    """The replayed tokens themselves: bf16 on each rank's heads and experts, within bf16 rounding
    of HF's fp32 logits (routing near-ties may flip)."""
    graph = engines["graph"]
    for prompts, run in zip(engines["prompts"], graph["runs"]):
        assert_tracks_hf_logits(tiny_models[MODEL], prompts, run["tokens"], routed=True)
