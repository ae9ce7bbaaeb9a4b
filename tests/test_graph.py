"""Graph mode end to end on the emulated NPU: replayed graphs give the tokens eager mode gives.

Every engine runs in ONE driver process (tests/engine_driver.py), bf16 so decode runs the fused
paged-attention kernel that FULL graphs hold. The decode batches shrink as requests finish
(different max_tokens), so they hit capture sizes (1, 2, 4, 8) and fall between them (3, 5, 6,
7: padded to the next size), with prefix caching and chunked prefill on. The emulated graph
replays exactly the work it captured, so a buffer the runner did not refresh, or a host
argument the replay was not handed, changes tokens; the control engine proves it: with the
host-parameter updates left out, its tokens part from eager mode's.
"""

from __future__ import annotations

import pytest

from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import (assert_tracks_hf_logits, installed_vllm_is_mrv2_only, module_items,
                                  only_marked, run_engine)

# 8 requests: the 129- and 200-token prompts prefill in 64-token chunks beside decodes.
PROMPT_LENGTHS = [3, 17, 129, 40, 7, 200, 11, 64]
ENGINE = {"dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 8,
          "gpu_memory_utilization": 0.9, "enable_prefix_caching": True,
          "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
EAGER = {**ENGINE, "enforce_eager": True}
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def _greedy(max_tokens: list[int]) -> list[dict]:
    return [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in max_tokens]


# Decode batches 5 → 1 (sizes 5 and 3 padded), then 8 → 1 (8 hits, 7 and 6 padded), then the
# first run again, served from the prefix cache.
RUNS = [(5, _greedy([6, 9, 12, 3, 14])), (8, _greedy([4, 5, 6, 7, 8, 9, 10, 11])),
        (5, _greedy([6, 9, 12, 3, 14]))]
# Sleep mode between repeats of the first run: level 1 and a full wake, then level 2 and a wake
# of the weights, then of the KV cache.
SLEEP_CYCLES = [{"kind": "sleep", "level": 1}, {"kind": "wake_up"}, RUNS[0],
                {"kind": "sleep", "level": 2}, {"kind": "wake_up", "tags": ["weights"]},
                {"kind": "wake_up", "tags": ["kv_cache"]}, RUNS[0]]
ENGINES = {
    "llama graph": ("tiny-llama", ENGINE, RUNS, {}),
    "llama eager": ("tiny-llama", EAGER, RUNS, {}),
    "qwen2 graph": ("tiny-qwen2", {**ENGINE, "enable_sleep_mode": True}, RUNS[:1] + SLEEP_CYCLES, {}),
    "qwen2 eager": ("tiny-qwen2", EAGER, RUNS[:1], {}),
    "llama stale host parameters": ("tiny-llama", ENGINE, RUNS[:1], {"stale_host_params": True}),
    # torch.compile: PIECEWISE graphs for mixed batches, FULL graphs for decode, the NPU layer
    # ops inside both.
    "llama full and piecewise": ("tiny-llama", {**ENGINE, "compilation_config": {
        "mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}, RUNS[:1], {}),
    "llama tp2 graph": ("tiny-llama", {**ENGINE, **TP2}, RUNS[:1], {}),
    "llama tp2 eager": ("tiny-llama", {**EAGER, **TP2}, RUNS[:1], {}),
}
V0_20 = ("qwen2 graph",)
"""The engine the tests marked v0_20_features read (a v0_20-set release in CI): sleep mode."""


def _names(marked_only: bool) -> list[str]:
    return list(V0_20) if marked_only else list(ENGINES)


def engine_specs(tiny_models, items) -> list[dict]:
    """The driver's spec, for the session's tests ``items`` of this module (tests/helpers/prefetch.py)."""
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    return [{"engines": [
        {"model": str(tiny_models[model]), "kwargs": kwargs, **extra,
         "runs": [run if isinstance(run, dict) else {"prompts": prompts[:run[0]], "sampling": run[1]}
                  for run in runs]}
        for model, kwargs, runs, extra in map(ENGINES.get, _names(only_marked(items)))
    ]}]


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory, request):
    items = module_items(request)
    names = _names(only_marked(items))
    [spec] = engine_specs(tiny_models, items)
    result = run_engine(spec, tmp_path_factory.mktemp("graph"), timeout=1500)
    assert result["platform"] == "EmulatedNPUPlatform"
    engines = dict(zip(names, result["engines"]))
    for name, engine in engines.items():
        assert "error" not in engine, f"{name}: {engine.get('error')}"
    return engines


def _generated(engine: dict) -> list[dict]:
    return [run for run in engine["runs"] if "tokens" in run]


def _tokens(engine: dict) -> list[list[list[int]]]:
    return [run["tokens"] for run in _generated(engine)]


def test_graph_mode_is_on_by_default_and_enforce_eager_turns_it_off(engines):
    graph, eager = engines["llama graph"], engines["llama eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY"
    # vLLM's sizes: on the V1 runner its defaults up to 2 x max_num_seqs; Model Runner V2 records
    # the token counts of the graphs it captures, its decode graphs' up to max_num_seqs requests.
    assert graph["capture_sizes"] == ([1, 2, 4, 8] if installed_vllm_is_mrv2_only() else [1, 2, 4, 8, 16])
    assert graph["graph_captures"] == 4, "one FULL decode graph per size up to max_num_seqs"
    assert eager["cudagraph_mode"] == "NONE" and eager["graph_captures"] == 0
    assert all(run["graph_replays"] == 0 for run in eager["runs"])


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_replayed_graphs_give_eager_tokens(engines, model):
    graph, eager = engines[f"{model} graph"], engines[f"{model} eager"]
    assert _tokens(graph)[: len(eager["runs"])] == _tokens(eager)
    # The first run's decode batches of 5 and 3 requests replay the graphs of 8 and 4 (padded);
    # those of 4, 2 and 1 hit their sizes.
    assert set(graph["runs"][0]["graph_replays_by_size"]) == {"1", "2", "4", "8"}
    assert all(run["graph_replays"] > 0 for run in _generated(graph))


@pytest.mark.v0_20_features
def test_sleep_frees_weights_and_kv_cache_and_wake_up_gives_the_same_tokens(engines):
    """Sleep mode (offload-and-free, ascend_patch/npu/sleep_mode.py) against the emulated HBM's
    books: both levels free exactly the weights and the KV cache; a wake of the weights alone
    brings back only them (level 2: reloaded from the checkpoint); after each full wake the graphs
    are captured again and replayed, and the tokens are those before sleep."""
    engine = engines["qwen2 graph"]
    first, sleep1, wake1, after1, sleep2, weights2, wake2, after2 = engine["runs"]
    for sleep in (sleep1, sleep2):
        before, asleep = sleep["books_before"], sleep["books"]
        assert before["weights"] > 0 and before["KV cache"] > 0
        assert asleep == {**before, "weights": 0, "KV cache": 0}
    assert weights2["books"] == {**sleep2["books_before"], "KV cache": 0}
    assert wake1["books"] == sleep1["books_before"] and wake2["books"] == sleep2["books_before"]
    assert weights2["graph_captures"] == 0
    assert wake1["graph_captures"] == wake2["graph_captures"] == engine["graph_captures"] == 4
    for woken in (after1, after2):
        assert woken["tokens"] == first["tokens"]
        assert woken["graph_replays"] == first["graph_replays"] > 0


def test_prefix_cache_hits_replay_the_same_graphs(engines):
    graph = engines["llama graph"]
    first, cached = graph["runs"][0], graph["runs"][2]
    assert sum(cached["cached"]) > 0 and cached["tokens"] == first["tokens"]
    assert cached["graph_replays"] > 0


def test_without_host_parameter_updates_replays_diverge(engines):
    """The control: the same engine with the replays' context lengths left at the capture's
    values. Decode attends to the wrong context, so its tokens must part from eager mode's."""
    stale, eager = engines["llama stale host parameters"], engines["llama eager"]
    assert stale["runs"][0]["graph_replays"] > 0
    diverged = [s != e for s, e in zip(stale["runs"][0]["tokens"], eager["runs"][0]["tokens"])]
    assert all(diverged), diverged


def test_full_and_piecewise_graphs_under_torch_compile_give_eager_tokens(engines):
    compiled, eager = engines["llama full and piecewise"], engines["llama eager"]
    assert compiled["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    # Per size one PIECEWISE graph per piece (2 layers: 3 pieces), plus FULL decode graphs.
    assert compiled["graph_captures"] == 5 * 3 + 4
    assert compiled["runs"][0]["tokens"] == eager["runs"][0]["tokens"]
    assert compiled["runs"][0]["graph_replays"] > 0


def test_compiled_pieces_run_the_npu_layer_ops(engines):
    """torch.compile traces the NPU RMSNorm/SiluAndMul/rotary as the seam's torch ops, not
    vLLM's native torch: the pieces' graphs of one token hold, for 2 layers, the first norm
    (npu_rms_norm), four residual norms (npu_add_rms_norm: 2 per layer, the last the final norm),
    one npu_mrope (query and key) and one npu_swiglu per layer, and the FULL graph the same
    around the attention kernels. The steps outside graphs (the 64-token prefill chunks, above
    the largest capture size) launch them from the compiled pieces: one npu_rms_norm each."""
    compiled = engines["llama full and piecewise"]
    layer_ops = {"rms_norm": 1, "add_rms_norm": 4, "mrope": 2, "swiglu": 2}
    (captured,) = compiled["captured_ops"]
    assert captured["PIECEWISE"] == layer_ops
    assert captured["FULL"] == {**layer_ops, "scatter_pa_kv_cache": 2, "paged_attention": 2}
    launches = compiled["runs"][0]["launches"]
    steps = launches["rms_norm"]
    assert steps > 0
    assert {op: launches[op] for op in layer_ops} == {op: n * steps for op, n in layer_ops.items()}


def test_tensor_parallel_graphs_give_eager_tokens(engines, tiny_models):
    """TP=2 over two spawned workers: the all-reduces are captured in each rank's graph. The
    bf16 TP=2 tokens themselves (fused kernels on each rank's heads) track HF's fp32 logits."""
    graph, eager = engines["llama tp2 graph"], engines["llama tp2 eager"]
    assert graph["cudagraph_mode"] == "FULL_DECODE_ONLY" and eager["cudagraph_mode"] == "NONE"
    assert _tokens(graph) == _tokens(eager)
    llama = tiny_models["tiny-llama"]
    prompts = prompt_token_ids(llama, PROMPT_LENGTHS)[: RUNS[0][0]]
    assert_tracks_hf_logits(llama, prompts, eager["runs"][0]["tokens"])


def _defaults(caplog, proven: bool, optimization_level: int = 2):
    """A bf16 Llama-like config through the platform's defaults: its graph mode and the lines of
    ours logged (a unit test: no engine)."""
    from types import SimpleNamespace

    import torch
    from vllm.config import CompilationMode

    from ascend_patch import release
    from ascend_patch.kit.engine import ascend_patch_log
    from ascend_patch.npu.platform import NPUPlatform

    model = SimpleNamespace(use_mla=False, dtype=torch.bfloat16, disable_sliding_window=False,
                            get_sliding_window=lambda: None, get_head_size=lambda: 64,
                            hf_text_config=SimpleNamespace(), pooler_config=None,
                            is_attention_free=False, is_hybrid=False)
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            mode=CompilationMode.NONE, custom_ops=[], cudagraph_mode=None,
            pass_config=SimpleNamespace(fuse_norm_quant=None, fuse_act_quant=None, fuse_attn_quant=None)),
        optimization_level=optimization_level, model_config=model, speculative_config=None,
        lora_config=None)
    caplog.set_level("INFO", logger="vllm.ascend_patch")  # as vLLM's logging config sets it
    saved, release.proven_end_to_end = release.proven_end_to_end, proven
    try:
        with ascend_patch_log() as log:
            NPUPlatform.apply_config_platform_defaults(config)
    finally:
        release.proven_end_to_end = saved
    return config.compilation_config.cudagraph_mode.name, log


def test_graph_mode_off_by_default_on_an_unproven_release_says_why_and_how_to_ask(caplog):
    import vllm

    assert _defaults(caplog, proven=False) == ("NONE", [
        f"ascend-patch: ACL graph mode is off by default: vLLM {vllm.__version__} has not passed "
        "ascend-patch's end-to-end suite with graphs (compat_matrix.yaml); ask for it with "
        "-cc.cudagraph_mode=FULL_DECODE_ONLY"])
    assert _defaults(caplog, proven=True) == ("FULL_DECODE_ONLY", [])
    assert _defaults(caplog, proven=True, optimization_level=0) == ("NONE", []), "-O0 asked for none"
