"""LoRA adapters with FULL decode graphs on the emulated NPU: replays give eager mode's tokens.

One driver process, fp16 (the merged QKV and gate/up slices on npu_batch_gather_matmul_, o_proj and
down_proj on the plain path, both reading the wrapper's per-token slot buffers). Two adapters and
the base model are mixed in each batch and requests finish at different steps, so consecutive
decode steps replay the same captured graph with another adapter in each row. The emulated graph
replays exactly the work it captured on the tensors it captured: a replay only sees a new step's
adapters if they were written into the buffers the capture read. The control engine proves the
test can see it: its wrapper puts each step's slots into new tensors (eager steps read them), and
its tokens part from eager mode's.
"""

from __future__ import annotations

import pytest

from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import MODELS_DIR, run_engine

PROMPT_LENGTHS = [3, 17, 129, 40, 7, 200]
ENGINE = {"dtype": "float16", "max_model_len": 512, "max_num_seqs": 8,
          "gpu_memory_utilization": 0.9, "enable_prefix_caching": True,
          "enable_chunked_prefill": True, "max_num_batched_tokens": 64,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
A, B = "tiny-llama-lora-a", "tiny-llama-lora-b"


def _greedy(max_tokens: list[int]) -> list[dict]:
    return [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in max_tokens]


# (adapter per prompt, max_tokens per prompt): decode batches shrink 6 -> 1 (6, 5, 3 padded),
# each row's adapter changing as the rows before it finish; then the adapters swapped around.
RUNS = [((A, None, B, A, B, None), [5, 9, 12, 3, 14, 7]),
        ((B, A, None, None, A, B), [11, 4, 8, 13, 6, 2])]
ENGINES = {
    "graph": (ENGINE, {}),  # graph mode left to the default
    "eager": ({**ENGINE, "enforce_eager": True}, {}),
    "stale slots": (ENGINE, {"stale_lora_slots": True}),
}


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The driver's spec, started ahead of the module (tests/helpers/prefetch.py)."""
    from ascend_patch.kit import tiny_adapters

    adapters = tiny_adapters.build(MODELS_DIR, [A, B])
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    runs = [{"prompts": prompts, "sampling": _greedy(max_tokens),
             "adapters": [name and str(adapters[name]) for name in names]}
            for names, max_tokens in RUNS]
    return [{"engines": [{"model": str(tiny_models["tiny-llama"]), "kwargs": kwargs, **extra,
                          "runs": runs} for kwargs, extra in ENGINES.values()]}]


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory):
    [spec] = engine_specs(tiny_models)
    result = run_engine(spec, tmp_path_factory.mktemp("graph-lora"), timeout=1500)
    engines = dict(zip(ENGINES, result["engines"]))
    for name, engine in engines.items():
        assert "error" not in engine, f"{name}: {engine.get('error')}"
    return engines


def _tokens(engine: dict) -> list[list[list[int]]]:
    return [run["tokens"] for run in engine["runs"]]


def test_graph_mode_is_on_by_default_with_lora_and_says_so(engines):
    graph = engines["graph"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert graph["graph_captures"] > 0
    assert any("LoRA adapters with ACL graph mode FULL_DECODE_ONLY" in line for line in graph["log"])
    assert any("LoRA adapters with ACL graph mode NONE" in line for line in engines["eager"]["log"])


def test_replayed_decode_with_lora_gives_eager_tokens(engines):
    graph, eager = engines["graph"], engines["eager"]
    assert _tokens(graph) == _tokens(eager)
    assert all(run["graph_replays"] > 0 for run in graph["runs"])
    assert all(run["graph_replays"] == 0 for run in eager["runs"])
    # The adapters matter: rows sharing a prompt but not an adapter decode differently.
    first, second = _tokens(eager)
    assert all(first[row] != second[row] for row in range(len(PROMPT_LENGTHS)))


def test_a_replay_reading_the_captured_slots_diverges(engines):
    """Negative control: each step's slots in new tensors rather than the captured buffers."""
    stale, eager = engines["stale slots"], engines["eager"]
    assert all(run["graph_replays"] > 0 for run in stale["runs"])
    assert _tokens(stale) != _tokens(eager)
