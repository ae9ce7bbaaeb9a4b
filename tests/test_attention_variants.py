"""Attention beyond dense full causal on the emulated NPU, against HF transformers.

Sliding windows (Mistral: every layer, so vLLM's SlidingWindowManager frees the blocks that fall
out of the window; Gemma 2 and 3: alternating windowed and global layers, and Gemma 3's five
windowed layers to one global, which vLLM's hybrid KV-cache manager gives a KV-cache group and a
block table per layer of the pattern, windowed groups freeing their blocks too), soft-capped attention
logits (Gemma 2), head sizes the fused prefill kernel does not take (Gemma's 256, a Llama with
96), and what stays refused (Mamba). The windows (64, 100) are shorter than the longer prompts,
which also span more than one 128-token KV block, so the windows cut. Prefix caching and chunked
prefill are on; every engine runs in ONE driver process.

fp32 runs composed attention and must equal HF token for token, with each token's
log-probability within float rounding of HF's (greedy tokens alone can hide a wrong window). bf16
runs the fused kernels where they apply: each layer-step writes the cache once
(``scatter_pa_kv_cache``) and then runs one fused launch or the composed path, so the launch
counts show which path served every layer-step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ascend_patch.kit.oracle import hf_greedy, hf_model, prompt_token_ids
from tests.helpers.engine import assert_tracks_hf_logits, run_engine

PROMPT_LENGTHS = [3, 150, 320]
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}
ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.9,
          "enable_prefix_caching": True, "enable_chunked_prefill": True,
          "max_num_batched_tokens": 64}
# (model, dtype[, variant]) -> runs of the prompts; a second run is served from the prefix cache.
ENGINES = {
    ("tiny-gemma3-5to1", "float32"): 2,
    ("tiny-gemma3-5to1", "float32", "one KV-cache group"): 2,
    ("tiny-gemma2", "float32"): 2,
    ("tiny-mistral", "float32"): 2,
    ("tiny-gemma2", "bfloat16"): 1,
    ("tiny-mistral", "bfloat16"): 2,
    ("tiny-gemma3", "bfloat16"): 1,
    ("tiny-gemma3", "bfloat16", "FULL decode graphs asked for"): 1,
    ("tiny-llama-hd96", "bfloat16"): 1,
    ("tiny-mamba", "bfloat16"): 0,
}
# The variants' engine arguments. vLLM's hybrid KV-cache manager (on by default) gives a model
# mixing windowed and global layers one KV-cache group per layer of its pattern; turned off, the
# windowed layers' specs become full attention and every layer shares one group.
# Windowed bf16 models run FULL decode graphs by default, whose replays the launch counts below do
# not see: their kernel-path engines run eager (graphs replayed against eager:
# tests/test_graph_windowed.py, and the variant asking for them here).
EAGER = {("tiny-mistral", "bfloat16"), ("tiny-gemma3", "bfloat16")}
VARIANTS = {"one KV-cache group": {"disable_hybrid_kv_cache_manager": True},
            "FULL decode graphs asked for": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}}
# What each model's HF oracle loses when a feature is taken away: the windows and the soft-cap
# must each move the log-probabilities far beyond the agreement asked for.
FEATURES = {"tiny-gemma2": [{"sliding_window": 4096}, {"attn_logit_softcapping": None}],
            "tiny-mistral": [{"sliding_window": None}], "tiny-gemma3-5to1": [{"sliding_window": 4096}]}


@pytest.fixture(scope="module")
def prompts(tiny_models):
    return prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The driver's spec, started ahead of the module (tests/helpers/prefetch.py)."""
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    engines = [{"model": str(tiny_models[name]),
                "kwargs": {**ENGINE, "dtype": dtype, **(VARIANTS[variant[0]] if variant else {}),
                           **({"enforce_eager": True} if (name, dtype) in EAGER and not variant else {})},
                "runs": [{"prompts": prompts, "sampling": [GREEDY]}] * count}
               for (name, dtype, *variant), count in ENGINES.items()]
    return [{"engines": engines}]


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    [spec] = engine_specs(tiny_models)
    result = run_engine(spec, tmp_path_factory.mktemp("attention"), timeout=1200)
    assert result["platform"] == "EmulatedNPUPlatform"
    return dict(zip(ENGINES, result["engines"]))


def hf_logprobs(model_dir, prompts, generated, **config):
    """HF fp32 log-probability of each generated token, on the engine's own sequences."""
    model = hf_model(model_dir, **config)
    result = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated):
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
            rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)
            result.append(rows[torch.arange(len(tokens)), tokens].tolist())
    return result


def largest_gap(a, b):
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


GRAPHS_OFF = "ascend-patch: ACL graph mode is off by default: "
NOT_HELD = ("decode on composed attention (standard torch ops, host lengths made into tensors "
            "every step), which FULL ACL graphs cannot hold")


def paths_log(engine) -> list[str]:
    """What the engine logged besides the one line on graph mode (tested below)."""
    return [line for line in engine["log"] if not line.startswith(GRAPHS_OFF)]


@pytest.mark.parametrize(("name", "dtype", "why"), [
    ("tiny-gemma2", "bfloat16", "logits soft-cap 50: the fused attention kernels have no soft-cap "
                                f"input: its global and windowed layers {NOT_HELD}"),
    ("tiny-gemma2", "float32", "float32: the fused attention kernels take fp16/bf16 only: its "
                               f"global and windowed layers {NOT_HELD}"),
    ("tiny-llama-hd96", "bfloat16", "head size 96: the end-to-end suite proves graphs at head sizes "
                                    "64, 128, 256; ask for it with -cc.cudagraph_mode=FULL_DECODE_ONLY"),
])
def test_graph_mode_off_by_default_says_why_in_one_line(runs, name, dtype, why):
    """Instead of only vLLM's capture warning, which asks whether cudagraph_mode was set to NONE."""
    engine = runs[(name, dtype)]
    assert engine["cudagraph_mode"] == "NONE"
    assert [line for line in engine["log"] if line.startswith(GRAPHS_OFF)] == [GRAPHS_OFF + why]


@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-mistral"])
def test_fp32_equals_hf_token_for_token_and_in_log_probabilities(name, runs, tiny_models, prompts):
    engine = runs[(name, "float32")]
    assert "error" not in engine, engine.get("error")
    (line,) = paths_log(engine)  # logged as info: fp32 has no fused kernel to miss
    assert "all 2 attention layers run composed attention" in line
    assert line.endswith("for every step: float32: the fused attention kernels take fp16/bf16 only")
    first, cached = engine["runs"]
    oracle = hf_greedy(tiny_models[name], prompts, MAX_TOKENS)
    assert first["tokens"] == oracle
    assert cached["tokens"] == oracle, "served from the prefix cache"
    assert sum(cached["cached"]) > 0
    expected = hf_logprobs(tiny_models[name], prompts, first["tokens"])
    for run in (first, cached):
        assert largest_gap(run["logprobs"], expected) < 1e-3
    for missing in FEATURES[name]:
        without = hf_logprobs(tiny_models[name], prompts, first["tokens"], **missing)
        assert largest_gap(first["logprobs"], without) > 0.1, f"the test cannot see {missing}"


def hybrid_and_one_group(runs):
    """The 5:1 Gemma 3's fp32 engines: vLLM's hybrid KV-cache manager on, and off."""
    engines = runs[("tiny-gemma3-5to1", "float32")], runs[("tiny-gemma3-5to1", "float32", "one KV-cache group")]
    for engine in engines:
        assert "error" not in engine, engine.get("error")
    return engines


def test_hybrid_kv_cache_manager_gives_each_windowed_layer_its_group_and_equals_hf(runs, tiny_models, prompts):
    """Five windowed KV-cache groups and a global one, each with its own block table, freeing the
    blocks before their windows (the 320-token prompt leaves its first block behind every window
    of 100) or, on a prefix-cache hit, nulling them: token for token and in log-probabilities
    what HF and the same model in one KV-cache group give."""
    hybrid, one_group = hybrid_and_one_group(runs)
    windows = [group["sliding_window"] for group in hybrid["kv_cache"]["groups"]]
    assert sorted(windows, key=str) == [100] * 5 + [None]
    assert [group["spec"] for group in one_group["kv_cache"]["groups"]] == ["FullAttentionSpec"]
    oracle = hf_greedy(tiny_models["tiny-gemma3-5to1"], prompts, MAX_TOKENS)
    expected = hf_logprobs(tiny_models["tiny-gemma3-5to1"], prompts, oracle)
    for engine in (hybrid, one_group):
        first, cached = engine["runs"]
        assert first["tokens"] == cached["tokens"] == oracle
        assert sum(cached["cached"]) > 0, "served from the prefix cache"
        for run in (first, cached):
            assert largest_gap(run["logprobs"], expected) < 1e-3
    without = hf_logprobs(tiny_models["tiny-gemma3-5to1"], prompts, oracle, sliding_window=4096)
    assert largest_gap(hybrid["runs"][0]["logprobs"], without) > 0.1, "the test cannot see the window"


def test_hybrid_kv_cache_manager_fits_more_blocks_and_sequences_in_the_same_hbm(runs):
    """The same emulated HBM, charged once for the KV tensors the groups share (a block id belongs
    to one group at a time): a block id costs one page per layer of a group instead of one per
    layer of the model, so the pool grows by the
    pages the windowed layers no longer hold for every token, and vLLM's maximum concurrency
    at max_model_len (from each config's groups) grows with it."""
    hybrid, one_group = (engine["kv_cache"] for engine in hybrid_and_one_group(runs))
    for plan in (hybrid, one_group):
        (page,) = {group["page_bytes"] for group in plan["groups"]}
        (layers_per_block,) = {group["layers"] for group in plan["groups"]}
        assert plan["charged_bytes"] == plan["num_blocks"] * page * layers_per_block > 0
    # Both pools are cut from the same free HBM: the hybrid one in pages, the other in pages x layers.
    model_layers = sum(group["layers"] for group in one_group["groups"])
    assert hybrid["num_blocks"] // model_layers == one_group["num_blocks"] > 0
    assert hybrid["max_concurrency"] > one_group["max_concurrency"]


def _composed_layer_steps(launches):
    """Layer-steps the composed path served: each layer-step writes the cache once and runs
    at most one fused attention launch."""
    fused = launches.get("fused_infer_attention_score", 0) + launches.get("paged_attention", 0)
    return launches["scatter_pa_kv_cache"] - fused


def single_bf16_run(runs, name):
    """The bf16 engine's one run, its launch counts and the one line it logged."""
    engine = runs[(name, "bfloat16")]
    assert "error" not in engine, engine.get("error")
    (run,) = engine["runs"]
    (warning,) = paths_log(engine)
    return run, run["launches"], warning


def test_bf16_mistral_runs_every_windowed_layer_step_fused(runs, tiny_models, prompts):
    """Every layer windowed, head size 128: the band (sparse_mode=4) for prefill and mixed
    batches, the masked one-token FIA for decode, also over prefix-cached and freed blocks."""
    engine = runs[("tiny-mistral", "bfloat16")]
    assert "error" not in engine, engine.get("error")
    assert not paths_log(engine), "nothing runs composed"
    for run in engine["runs"]:
        launches = run["launches"]
        assert launches["fused_infer_attention_score"] == launches["scatter_pa_kv_cache"] > 0
        assert "paged_attention" not in launches  # no mask input: never for a windowed layer
        assert_tracks_hf_logits(tiny_models["tiny-mistral"], prompts, run["tokens"])
    assert sum(engine["runs"][1]["cached"]) > 0


def test_bf16_gemma3_decodes_fused_and_prefills_composed_with_one_warning(runs, tiny_models, prompts):
    """Head size 256, a KV-cache group per layer: decode runs fused in both layers (the windowed one through the masked
    one-token FIA, the global one through _npu_paged_attention); the TND prefill kernel takes
    64 and 128 only, so prefill runs composed, as the one warning says."""
    run, launches, warning = single_bf16_run(runs, "tiny-gemma3")
    groups = runs[("tiny-gemma3", "bfloat16")]["kv_cache"]["groups"]
    assert [group["sliding_window"] for group in groups] == [100, None], "the hybrid manager's two groups"
    assert launches["fused_infer_attention_score"] == launches["paged_attention"] >= MAX_TOKENS - 1
    assert _composed_layer_steps(launches) > 0
    assert "all 2 attention layers" in warning and "head size 256" in warning
    assert "prefill and mixed batches (decode-only batches stay fused)" in warning
    assert_tracks_hf_logits(tiny_models["tiny-gemma3"], prompts, run["tokens"])


def test_full_decode_graphs_asked_for_beside_windowed_groups_replay_the_eager_tokens(runs):
    """Both KV-cache groups' decodes are held in FULL graphs (the windowed one's masked FIA and the
    global one's paged attention, each group with its own block table): the replays give the
    eager engine's tokens, the prompts longer than the window."""
    asked = runs[("tiny-gemma3", "bfloat16", "FULL decode graphs asked for")]
    assert "error" not in asked, asked.get("error")
    assert (asked["cudagraph_mode"], asked["graph_captures"]) == ("FULL_DECODE_ONLY", 4)
    (run,) = asked["runs"]
    assert run["graph_replays"] > 0
    assert run["tokens"] == runs[("tiny-gemma3", "bfloat16")]["runs"][0]["tokens"]


def test_bf16_head_size_96_decodes_through_paged_attention_with_one_warning(runs, tiny_models, prompts):
    run, launches, warning = single_bf16_run(runs, "tiny-llama-hd96")
    assert launches["paged_attention"] >= 2 * (MAX_TOKENS - 1)
    assert "fused_infer_attention_score" not in launches
    assert _composed_layer_steps(launches) > 0
    assert "head size 96" in warning and "decode-only batches stay fused" in warning
    assert_tracks_hf_logits(tiny_models["tiny-llama-hd96"], prompts, run["tokens"])


def test_bf16_gemma2_soft_capped_layers_run_composed_as_logged(runs, tiny_models, prompts):
    run, launches, warning = single_bf16_run(runs, "tiny-gemma2")
    assert "fused_infer_attention_score" not in launches and "paged_attention" not in launches
    assert _composed_layer_steps(launches) == launches["scatter_pa_kv_cache"] > 0
    assert "all 2 attention layers run composed attention" in warning
    assert "for every step: logits soft-cap 50: the fused attention kernels have no soft-cap input" in warning
    assert_tracks_hf_logits(tiny_models["tiny-gemma2"], prompts, run["tokens"])


# -- what stays refused ------------------------------------------------------------------------


def test_a_mamba_model_is_refused_at_start_up_in_one_line_naming_it_and_its_layers(runs, tiny_models):
    error = runs[("tiny-mamba", "bfloat16")]["error"]
    assert error == (f"NotImplementedError: {tiny_models['tiny-mamba']}: MambaForCausalLM has Mamba "
                     "(state-space) layers and no attention: ascend-patch serves recurrent layers of "
                     "GraniteMoeHybridForCausalLM (Mamba-2 (MambaMixer2)), Qwen3NextForCausalLM (gated "
                     "DeltaNet (QwenGatedDeltaNetAttention)) only")


@pytest.mark.parametrize(("free", "hybrid", "layer_types", "named"), [
    (False, True, ["linear_attention", "linear_attention", "full_attention"],
     "Mamba or linear-attention layers ('linear_attention' in its layer_types) beside its attention layers"),
    (False, True, ["mamba", "attention"],
     "Mamba or linear-attention layers ('mamba' in its layer_types) beside its attention layers"),
    (False, True, None, "Mamba or linear-attention layers beside its attention layers"),
    (False, False, ["sliding_attention", "full_attention"], None),
])
def test_a_hybrid_models_recurrent_layers_are_named_as_its_config_names_them(free, hybrid, layer_types, named):
    from ascend_patch.npu.ops.recurrent_layers import recurrent_layers

    model = SimpleNamespace(is_attention_free=free, is_hybrid=hybrid,
                            hf_config=SimpleNamespace(layer_types=layer_types))
    assert recurrent_layers(model) == named


@pytest.mark.parametrize(("kwargs", "feature"), [
    ({"attn_type": "encoder"}, "attention type encoder"),
    ({"attn_type": "encoder_only"}, "attention type encoder_only"),
    ({"attn_type": "encoder_decoder"}, "attention type encoder_decoder"),
    ({"alibi_slopes": [0.5, 0.25]}, "ALiBi"),
    ({"sinks": torch.zeros(2)}, "sinks"),
])
def test_attention_the_backend_cannot_run_is_refused(kwargs, feature):
    from ascend_patch.npu.attention.backend import AscendAttentionImpl

    with pytest.raises(NotImplementedError, match=f"^Ascend attention backend does not support {feature}$"):
        AscendAttentionImpl(2, 64, 0.125, 2, **kwargs)


@pytest.mark.parametrize("feature", ["has_sink", "use_sparse"])
def test_backend_selection_refuses_sinks_and_sparse_attention(feature):
    from ascend_patch.npu.platform import NPUPlatform

    config = SimpleNamespace(**{"use_mla": False, "use_sparse": False, "has_sink": False, feature: True})
    with pytest.raises(NotImplementedError, match="does not support models that need"):
        NPUPlatform.get_attn_backend_cls(None, config)
