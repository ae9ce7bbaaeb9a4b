"""Mixture-of-experts models on the emulated NPU, against HF transformers.

Four MoE families with different routing: Qwen3-MoE (softmax top-2, renormalised),
Qwen2-MoE (softmax top-2, not renormalised, plus a gated shared expert that stays vLLM's),
Mixtral (softmax top-2) and GLM-4.5 (DeepSeek-V3 routing: sigmoid scores, a correction
bias that only selects, grouped top-k, routed scaling; a shared expert). Each runs fp32 (equal
to HF token for token) and bf16 (the fused attention kernels, within bf16 rounding of HF's fp32
logits), with prefix caching and chunked prefill on, in ONE driver process: every engine shares
the vLLM import. Two more GLM-4.5 configurations the NPU gating op cannot take (groups of 2
experts; sigmoid weights not renormalised) route with vLLM's own grouped top-k.
"""

from __future__ import annotations

import pytest
import torch

from ascend_patch.kit import tiny_adapters
from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import (
    MODELS_DIR,
    assert_greedy_equals_hf,
    assert_tracks_hf_logits,
    module_items,
    only_marked,
    run_engine,
)
from tests.helpers import lora

MOE_MODELS = ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-glm4-moe")
# The gating op each family's routing maps to.
# Renormalised softmax routing (Qwen3-MoE, Mixtral) is one launch of the v2 op with renorm=1.
GATING = {"tiny-qwen3-moe": "moe_gating_top_k_softmax_v2",
          "tiny-qwen2-moe": "moe_gating_top_k_softmax",
          "tiny-mixtral": "moe_gating_top_k_softmax_v2", "tiny-glm4-moe": "moe_gating_top_k"}
PROMPT_LENGTHS = [3, 17, 129, 200]
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# Chunks of 64 tokens: the 129- and 200-token prompts prefill over several steps, beside
# decodes of the shorter ones; the second run is served from the prefix cache.
ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.9,
          "enable_prefix_caching": True, "enable_chunked_prefill": True,
          "max_num_batched_tokens": 64}
MOE_OPS = ("moe_init_routing_v2", "grouped_matmul")
# The combine op per dtype: the envelopes of their docs (bf16 unpermute, fp16/fp32 finalize).
COMBINE = {"float32": "moe_finalize_routing", "bfloat16": "moe_token_unpermute"}


@pytest.fixture(scope="module")
def prompts(tiny_models):
    return prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)


# Configurations the NPU MoE path refuses, each with the message a user gets at start-up.
REFUSED = {
    "ungrouped unnormalised sigmoid routing": (
        "tiny-glm4-moe-ungrouped-unnormalised", {},
        "uses routing the NPU gating op cannot take (sigmoid scores without renormalisation: "
        "npu_moe_gating_top_k always renormalises sigmoid weights); ascend-patch cannot run it "
        "on the NPU"),
}
# Grouped routing npu_moe_gating_top_k cannot take, which vLLM's own grouped top-k (torch ops)
# routes instead, with one warning per model naming the layers and the op's limit.
NATIVE_ROUTING = {
    "tiny-glm4-moe-pairs": "npu_moe_gating_top_k: group_count must be a grouping with more than "
                           "2 experts per group, got 4 groups of 2",
    "tiny-glm4-moe-unnormalised": "sigmoid scores without renormalisation: npu_moe_gating_top_k "
                                  "always renormalises sigmoid weights",
}
MODES = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
         "bfloat16 eager": {"dtype": "bfloat16", "enforce_eager": True}}
# The eager bf16 Qwen3-MoE counts each decoder layer's launches over pure decode steps (eight
# one-token prompts), as scripts/bench_engine.py counts them; graphs would hide them.
COUNTED = ("tiny-qwen3-moe", "bfloat16 eager")
DECODE_STEPS = {"prompts": [[i + 3] for i in range(8)], "layer_launches": True,
                "sampling": [{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}]}
ENGINES = [*((name, mode) for name in MOE_MODELS for mode in ("float32", "bfloat16")),
           *((name, "float32") for name in NATIVE_ROUTING),
           ("tiny-glm4-moe-pairs", "bfloat16"), ("tiny-glm4-moe-pairs", "bfloat16 eager"), COUNTED]
# Qwen3-MoE serving two LoRA adapters (attention and every expert's gate/up/down) and the base
# model in one fp32 batch (as tests/test_distributed.py serves them at TP=2 and TP=2 x EP=2).
# The same in bf16 decodes in FULL graphs (on by default), the adapters' slots read in replays.
LORA, LORA_GRAPHS = ("tiny-qwen3-moe", "lora"), ("tiny-qwen3-moe", "lora bfloat16")
LORA_ADAPTERS = lora.MOE_ADAPTERS
LORA_ENGINE = {**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}


def _names(marked_only: bool) -> list:
    """The driver's engines by name; a v0_20-set release (tests marked v0_20_features only)
    runs the fp32 MoE LoRA engine alone."""
    if marked_only:
        return [LORA]
    return [*ENGINES, *REFUSED, LORA, LORA_GRAPHS]


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The driver's spec, started ahead of the module (tests/helpers/prefetch.py)."""
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    adapters = [path and str(path) for _, path in lora.adapters(LORA_ADAPTERS)]

    def engine(name):
        if name in (LORA, LORA_GRAPHS):
            return {"model": str(tiny_models[LORA[0]]),
                    "kwargs": {**LORA_ENGINE, "dtype": "float32" if name == LORA else "bfloat16"},
                    "runs": [{"prompts": prompts, "sampling": [GREEDY], "adapters": adapters}]}
        if name in REFUSED:
            model, kwargs, _ = REFUSED[name]
            return {"model": str(tiny_models[model]), "kwargs": {**ENGINE, **kwargs}, "runs": []}
        model, mode = name
        return {"model": str(tiny_models[model]), "kwargs": {**ENGINE, **MODES[mode]},
                "runs": [DECODE_STEPS] if name == COUNTED else
                        [{"prompts": prompts, "sampling": [GREEDY]}] * 2}

    return [{"engines": [engine(name) for name in _names(only_marked(items or []))]}]


@pytest.fixture(scope="module")
def runs(request, tiny_models, tmp_path_factory):
    items = module_items(request)
    [spec] = engine_specs(tiny_models, items)
    result = run_engine(spec, tmp_path_factory.mktemp("moe"), timeout=1200)
    assert result["platform"] == "EmulatedNPUPlatform"
    return dict(zip(_names(only_marked(items)), result["engines"]))


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_npu_path_cannot_run_is_refused_clearly(case, runs):
    name, _, message = REFUSED[case]
    error = runs[case].get("error", "")
    assert message in error, error
    assert name in error and "MoE layer 'model.layers.0.mlp.experts'" in error, error


@pytest.mark.parametrize("name", list(NATIVE_ROUTING))
def test_routing_the_npu_gating_op_cannot_take_runs_vllms_grouped_top_k(name, runs, tiny_models,
                                                                        prompts):
    """fp32 equals HF token for token; the experts still run on the NPU MoE ops, the routing
    on no NPU gating op; one warning names the model, the layers and the op's limit."""
    engine = runs[(name, "float32")]
    assert_greedy_equals_hf(engine, tiny_models[name], prompts, MAX_TOKENS)
    launches = engine["runs"][0]["launches"]
    gating = {"moe_gating_top_k", "moe_gating_top_k_softmax", "moe_gating_top_k_softmax_v2"}
    assert not gating & set(launches), launches
    assert launches["grouped_matmul"] == 2 * launches["moe_finalize_routing"] > 0
    (warning,) = [line for line in engine["log"] if "MoE" in line]
    assert warning == (f"ascend-patch: {tiny_models[name]}: MoE layer(s) "
                       "'model.layers.0.mlp.experts', 'model.layers.1.mlp.experts' (2 of 2) route "
                       "with vLLM's grouped top-k in torch ops instead of the NPU gating op: "
                       f"{NATIVE_ROUTING[name]}")


def test_vllms_grouped_top_k_replays_in_bf16_graphs_as_it_runs_eagerly(runs):
    """Decode in FULL graphs (on by default in bf16) holds vLLM's grouped top-k too: the
    replayed graphs give the eager engine's tokens, from the prefix cache as well."""
    graph, eager = (runs[("tiny-glm4-moe-pairs", mode)] for mode in ("bfloat16", "bfloat16 eager"))
    for engine in (graph, eager):
        assert "error" not in engine, engine.get("error")
    assert all(run["graph_replays"] > 0 for run in graph["runs"])
    assert "moe_gating_top_k" not in graph["runs"][0]["launches"]
    assert [run["tokens"] for run in graph["runs"]] == [run["tokens"] for run in eager["runs"]]


def test_a_moe_decode_layer_launches_at_the_floor(runs):
    """Issue 20's MoE floor, per decoder layer of a bf16 decode step of Qwen3-MoE, counted as
    scripts/bench_engine.py counts (margin zero). Its MoE block is 7 launches (the issue's target
    8): the router gate (a linear), the renormalised softmax top-k in one gating launch, dispatch,
    two grouped matmuls around SwiGLU, the combine; no casts, sums or divides. The rest is the
    attention half: norms (input, q and k per head, the first layer's first without a residual),
    qkv and o linears, one rotary launch, V made contiguous for the cache write (the dense
    layer's copy, tests/test_engine.py), the cache write and paged attention."""
    engine = runs[COUNTED]
    assert "error" not in engine, engine.get("error")
    launches = engine["runs"][0]["layer_launches"]
    assert launches == {"rms_norm": 2.5, "add_rms_norm": 1.5, "linear.default": 3, "mrope": 1,
                        "contiguous.default": 1, "scatter_pa_kv_cache": 1, "paged_attention": 1,
                        "moe_gating_top_k_softmax_v2": 1, "moe_init_routing_v2": 1,
                        "grouped_matmul": 2, "swiglu": 1, "moe_token_unpermute": 1}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Per adapter, the checkpoint with its deltas merged by hand, and the control with only its
    attention deltas merged (the experts' left out)."""
    adapters = tiny_adapters.build(MODELS_DIR, [name for name in LORA_ADAPTERS if name])
    root = tmp_path_factory.mktemp("merged")
    return {name: (tiny_adapters.merged(adapters[name], root / name),
                   tiny_adapters.merged(adapters[name], root / f"{name}-attention",
                                        skip=".experts."))
            for name in filter(None, dict.fromkeys(LORA_ADAPTERS))}


def _rows(adapter):
    return lora.rows(LORA_ADAPTERS, adapter)


@pytest.mark.v0_20_features
def test_two_lora_adapters_on_attention_and_experts_and_the_base_model_equal_hf_merged(
        runs, tiny_models, prompts, merged):
    """vLLM's FusedMoEWithLoRA (0.28+) on the NPU experts: each prompt's greedy tokens equal HF
    transformers with its adapter merged into the weights by hand (attention and every expert's
    gate/up/down), the base model's prompts the plain checkpoint's. The control merges the
    attention deltas only: its tokens differ, so a dropped expert LoRA delta fails here. Routing
    stays on the NPU gating op and the experts on the NPU MoE ops."""
    engine = runs[LORA]
    assert "error" not in engine, engine.get("error")
    (run,) = engine["runs"]
    tokens = run["tokens"]
    for name, (model, attention_only) in merged.items():
        chosen = [prompts[row] for row in _rows(name)]
        expected = hf_greedy(model, chosen, MAX_TOKENS)
        assert [tokens[row] for row in _rows(name)] == expected, name
        assert hf_greedy(attention_only, chosen, MAX_TOKENS) != expected, f"{name}: experts"
    assert [tokens[row] for row in _rows(None)] == hf_greedy(
        tiny_models[LORA[0]], [prompts[row] for row in _rows(None)], MAX_TOKENS)
    launches = run["launches"]
    assert launches["grouped_matmul"] == 2 * launches["moe_gating_top_k_softmax_v2"] > 0


@pytest.mark.parametrize("version, served", [("0.27.0", False), ("0.28.0", True), ("0.33.0", True)])
def test_lora_on_moe_models_is_served_where_the_patch_set_installs_its_patch(version, served):
    """The gate is the declaration (patches/lora.py, MOE_LORA): the release's patch set as the
    loader selects and records it. Where it does not wrap FusedMoEWithLoRA, the platform refuses
    LoRA on a MoE model at start-up in one line (a unit test: no engine)."""
    from types import SimpleNamespace

    from ascend_patch.npu.lora import moe_lora_release
    from ascend_patch.npu.platform import NPUPlatform
    from tests.helpers.patch_sets import patched_as_on

    config = SimpleNamespace(
        speculative_config=None, lora_config=SimpleNamespace(fully_sharded_loras=False),
        model_config=SimpleNamespace(is_moe=True, quantization=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_eplb=False))
    with patched_as_on(version):
        assert moe_lora_release() is served
        if not served:
            with pytest.raises(NotImplementedError) as refused:
                NPUPlatform.check_and_update_config(config)
            assert str(refused.value) == ("LoRA on a mixture-of-experts model (vLLM 0.20-0.27, or "
                                          "quantized) is not supported by ascend-patch yet")

def test_moe_lora_decodes_in_bf16_graphs_and_tracks_hf_merged(runs, tiny_models, prompts, merged):
    """bf16: decode replays FULL graphs with the adapters' slots rewritten in place each step;
    each prompt tracks HF's logits with its adapter merged (the base model's, the plain one's)."""
    engine = runs[LORA_GRAPHS]
    assert "error" not in engine, engine.get("error")
    (run,) = engine["runs"]
    assert run["graph_replays"] > 0
    for name in dict.fromkeys(LORA_ADAPTERS):
        model = tiny_models[LORA[0]] if name is None else merged[name][0]
        rows = _rows(name)
        assert_tracks_hf_logits(model, [prompts[row] for row in rows],
                                [run["tokens"][row] for row in rows], routed=True)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_fp32_greedy_equals_hf_token_for_token(name, runs, tiny_models, prompts):
    engine = runs[(name, "float32")]
    assert_greedy_equals_hf(engine, tiny_models[name], prompts, MAX_TOKENS)


@pytest.mark.parametrize("dtype", list(COMBINE))
@pytest.mark.parametrize("name", MOE_MODELS)
def test_experts_run_on_the_npu_moe_ops(name, dtype, runs):
    launches = runs[(name, dtype)]["runs"][0]["launches"]
    combine = COMBINE[dtype]
    (other,) = set(COMBINE.values()) - {combine}
    for op in (GATING[name], *MOE_OPS, combine):
        assert launches.get(op, 0) > 0, (op, launches)
    assert other not in launches
    # Per MoE layer and forward pass: one routing, one dispatch, two grouped matmuls, one
    # combine; the tiny models have two MoE layers.
    assert launches["grouped_matmul"] == 2 * launches["moe_init_routing_v2"]
    assert launches[combine] == launches["moe_init_routing_v2"] == launches[GATING[name]]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_bf16_runs_the_fused_kernels_and_tracks_fp32_hf(name, runs, tiny_models, prompts):
    engine = runs[(name, "bfloat16")]
    assert "error" not in engine, engine.get("error")
    first, cached = engine["runs"]
    assert first["launches"]["fused_infer_attention_score"] > 0
    # Decode runs paged attention inside replayed FULL graphs (on by default for bf16), each
    # replay re-issuing it with the step's context lengths; the experts run in them too.
    assert first["graph_replays"] > 0 and first["launches"]["paged_attention_workspace"] > 0
    assert first["launches"]["grouped_matmul"] > 0
    assert_tracks_hf_logits(tiny_models[name], prompts, first["tokens"], routed=True)
    assert_tracks_hf_logits(tiny_models[name], prompts, cached["tokens"], routed=True)


# -- the expert path on its own: routing held fixed -------------------------------------------


def _dense_moe(x, w13, w2, weights, ids):
    """The MoE definition, token by token in fp64: sum_j w_j * down_e(silu(gate_e x) * up_e x)
    with vLLM's layouts w13 [E, 2I, H] (gate rows first) and w2 [E, H, I]."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _expert_case(tokens=48, experts=8, hidden=64, inter=32, top_k=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    return x, w13, w2, weights, ids.to(torch.int32)


@pytest.mark.usefixtures("reference_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_expert_path_matches_the_moe_definition(dtype):
    """fp16 and fp32 combine on npu_moe_finalize_routing, bf16 on npu_moe_token_unpermute:
    each inside its documented dtypes (the references refuse the rest)."""
    from ascend_patch.npu import kernels
    from ascend_patch.npu.ops.fused_moe import fused_experts

    x, w13, w2, weights, ids = _expert_case()
    expected = _dense_moe(x, w13, w2, weights, ids)
    with kernels.count_launches() as launches:
        got = fused_experts(x.to(dtype), w13.transpose(1, 2).contiguous().to(dtype),
                            w2.transpose(1, 2).contiguous().to(dtype), weights, ids).double()
    combine = "moe_token_unpermute" if dtype == torch.bfloat16 else "moe_finalize_routing"
    assert launches[combine] == 1 and sum(launches.values()) == 5, launches
    # fp32: summation order only; half precision: the inputs' own rounding (8 or 11 bits).
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert (got - expected).norm() <= tolerance * expected.norm()


@pytest.mark.usefixtures("reference_kernels")
def test_expert_parallel_ranks_sum_to_the_whole():
    """Two ranks, each holding half the experts (vLLM's expert_map: global id -> local id, -1
    elsewhere), each combining only its experts' copies: their outputs add up to the MoE."""
    from ascend_patch.npu.ops.fused_moe import fused_experts

    x, w13, w2, weights, ids = _expert_case()
    expected = _dense_moe(x, w13, w2, weights, ids)
    total = torch.zeros_like(expected)
    for rank_experts in ([0, 2, 4, 6], [1, 3, 5, 7]):  # round-robin placement
        expert_map = torch.full((8,), -1, dtype=torch.int32)
        expert_map[rank_experts] = torch.arange(4, dtype=torch.int32)
        local13 = w13[rank_experts].transpose(1, 2).contiguous()
        local2 = w2[rank_experts].transpose(1, 2).contiguous()
        total += fused_experts(x, local13, local2, weights, ids, expert_map).double()
    assert (total - expected).norm() <= 1e-5 * expected.norm()
