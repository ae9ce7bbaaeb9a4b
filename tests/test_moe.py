"""Mixture-of-experts models on the emulated NPU, against HF transformers.

Four MoE families with different routing: Qwen3-MoE (softmax top-2, renormalised),
Qwen2-MoE (softmax top-2, not renormalised, plus a gated shared expert that stays vLLM's),
Mixtral (softmax top-2) and GLM-4.5 (DeepSeek-V3 routing: sigmoid scores, a correction
bias that only selects, grouped top-k, routed scaling; a shared expert). Each runs fp32 (equal to HF token for token) and bf16 (the
fused attention kernels, within bf16 rounding of HF's fp32 logits), with prefix caching and
chunked prefill on, in ONE driver process: every engine shares the vLLM import.
"""

from __future__ import annotations

import pytest

from tests.conftest import assert_tracks_hf_logits, hf_greedy, prompt_token_ids, run_engine

MOE_MODELS = ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-glm4-moe")
# The gating op each family's routing maps to.
GATING = {"tiny-qwen3-moe": "moe_gating_top_k_softmax", "tiny-qwen2-moe": "moe_gating_top_k_softmax",
          "tiny-mixtral": "moe_gating_top_k_softmax", "tiny-glm4-moe": "moe_gating_top_k"}
PROMPT_LENGTHS = [3, 17, 129, 200]
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# Chunks of 64 tokens: the 129- and 200-token prompts prefill over several steps, beside
# decodes of the shorter ones; the second run is served from the prefix cache.
ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.9,
          "enable_prefix_caching": True, "enable_chunked_prefill": True,
          "max_num_batched_tokens": 64}
MOE_OPS = ("moe_init_routing_v2", "grouped_matmul", "moe_token_unpermute")


@pytest.fixture(scope="module")
def prompts(tiny_models):
    return prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def runs(tiny_models, prompts, tmp_path_factory):
    engines = [
        {"model": str(tiny_models[name]), "kwargs": {**ENGINE, "dtype": dtype},
         "runs": [{"prompts": prompts, "sampling": [GREEDY]}, {"prompts": prompts, "sampling": [GREEDY]}]}
        for name in MOE_MODELS for dtype in ("float32", "bfloat16")
    ]
    result = run_engine({"engines": engines}, tmp_path_factory.mktemp("moe"), timeout=1200)
    assert result["platform"] == "EmulatedNPUPlatform"
    return {(name, dtype): engine for (name, dtype), engine
            in zip([(n, d) for n in MOE_MODELS for d in ("float32", "bfloat16")], result["engines"])}


@pytest.mark.parametrize("name", MOE_MODELS)
def test_fp32_greedy_equals_hf_token_for_token(name, runs, tiny_models, prompts):
    engine = runs[(name, "float32")]
    assert "error" not in engine, engine.get("error")
    oracle = hf_greedy(tiny_models[name], prompts, MAX_TOKENS)
    first, cached = engine["runs"]
    assert first["tokens"] == oracle
    assert cached["tokens"] == oracle, "served from the prefix cache"
    assert sum(cached["cached"]) > 0


@pytest.mark.parametrize("name", MOE_MODELS)
def test_experts_run_on_the_npu_moe_ops(name, runs):
    launches = runs[(name, "float32")]["runs"][0]["launches"]
    for op in (GATING[name], *MOE_OPS):
        assert launches.get(op, 0) > 0, (op, launches)
    # Per MoE layer and forward pass: one routing, one dispatch, two grouped matmuls, one
    # combine; the tiny models have two MoE layers.
    assert launches["grouped_matmul"] == 2 * launches["moe_init_routing_v2"]
    assert launches["moe_token_unpermute"] == launches["moe_init_routing_v2"] == launches[GATING[name]]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_bf16_runs_the_fused_kernels_and_tracks_fp32_hf(name, runs, tiny_models, prompts):
    engine = runs[(name, "bfloat16")]
    assert "error" not in engine, engine.get("error")
    first, cached = engine["runs"]
    assert first["launches"]["fused_infer_attention_score"] > 0
    assert first["launches"]["paged_attention"] > 0
    assert first["launches"]["grouped_matmul"] > 0
    assert_tracks_hf_logits(tiny_models[name], prompts, first["tokens"])
    assert_tracks_hf_logits(tiny_models[name], prompts, cached["tokens"])
