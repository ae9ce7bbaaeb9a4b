"""Stock vLLM generating on the emulated NPU, checked against HF transformers.

Every engine runs in a fresh interpreter with ``ASCEND_PATCH=emulate`` (see
engine_driver.py), in-process engine core, so each configuration costs one vLLM
import and a few seconds of start-up. The oracle is Hugging Face transformers on
the same local weights, fp32 greedy, token for token.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import assert_tracks_hf_logits, hf_greedy, hf_logits, prompt_token_ids, run_engine

# Lengths chosen to cover one token short of / across / several 128-token KV blocks.
PROMPT_LENGTHS = [3, 9, 17, 64, 127, 129, 200, 300]
MAX_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.9}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["tiny-llama"]


@pytest.fixture(scope="module")
def prompts(llama):
    return prompt_token_ids(llama, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def llama_oracle(llama, prompts):
    return hf_greedy(llama, prompts, MAX_TOKENS)


def _shared_prefix_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Two full blocks of one prompt as a common prefix, each followed by its own suffix."""
    prefix = prompts[-1][:256]
    return [prefix + p[:8] for p in prompts[:4]]


@pytest.fixture(scope="module")
def llama_fp32_runs(llama, prompts, tmp_path_factory):
    """One engine with prefix caching (vLLM's default), then one forcing chunked prefill
    (each in its own process: some vLLM releases keep a deleted engine's memory)."""
    shared = _shared_prefix_prompts(prompts)
    runs = [
        {"prompts": prompts, "sampling": [GREEDY]},
        {"prompts": prompts, "sampling": [GREEDY]},  # the same again: served from cache
        {"prompts": shared, "sampling": [GREEDY]},
    ]
    cached = {"model": str(llama), "kwargs": {**ENGINE, "enable_prefix_caching": True}, "runs": runs}
    chunked = {
        "model": str(llama),
        "kwargs": {**ENGINE, "enable_prefix_caching": False, "enable_chunked_prefill": True,
                   "max_num_batched_tokens": 64},
        "runs": [{"prompts": prompts, "sampling": [GREEDY]}],
    }
    tmp = tmp_path_factory.mktemp("llama-fp32")
    result = run_engine({"engines": [cached]}, tmp)
    result["engines"] += run_engine({"engines": [chunked]}, tmp)["engines"]
    return result, shared


def test_greedy_equals_hf_token_for_token(llama_fp32_runs, llama_oracle):
    result, _ = llama_fp32_runs
    assert result["platform"] == "EmulatedNPUPlatform"
    first = result["engines"][0]
    assert first["block_size"] == 128
    assert first["runs"][0]["tokens"] == llama_oracle


def test_prefix_caching_serves_shared_prefixes_and_changes_nothing(llama, llama_fp32_runs, llama_oracle):
    result, shared = llama_fp32_runs
    runs = result["engines"][0]["runs"]
    assert runs[1]["tokens"] == llama_oracle
    # A repeated prompt is served from its whole cached blocks; its last token is always
    # recomputed, so a prompt of exactly one block gets none.
    assert runs[1]["cached"] == [128 * ((n - 1) // 128) for n in PROMPT_LENGTHS]
    assert runs[2]["cached"][1:] == [256] * (len(shared) - 1), "the two shared blocks came from the cache"
    assert runs[2]["tokens"] == hf_greedy(llama, shared, MAX_TOKENS)


def test_chunked_prefill_changes_nothing(llama_fp32_runs, llama_oracle):
    result, _ = llama_fp32_runs
    assert result["engines"][1]["runs"][0]["tokens"] == llama_oracle


def test_fp32_runs_composed_attention_and_the_npu_custom_ops(llama_fp32_runs):
    result, _ = llama_fp32_runs
    # Composed attention turns host lengths into new tensors every step: no graphs.
    assert result["engines"][0]["cudagraph_mode"] == "NONE"
    launches = result["engines"][0]["runs"][0]["launches"]
    assert launches["scatter_pa_kv_cache"] > 0
    assert "fused_infer_attention_score" not in launches and "paged_attention" not in launches
    for op in ("rms_norm", "add_rms_norm", "swiglu", "rotary_mul"):
        assert launches[op] > 0, op
    assert result["vllm_C_imported"] is False, "no CUDA/CPU _C kernels on the NPU path"


def test_qwen2_greedy_equals_hf(tiny_models, tmp_path):
    qwen = tiny_models["tiny-qwen2"]
    prompts = prompt_token_ids(qwen, PROMPT_LENGTHS)
    spec = {"engines": [{"model": str(qwen), "kwargs": ENGINE,
                         "runs": [{"prompts": prompts, "sampling": [GREEDY]}]}]}
    result = run_engine(spec, tmp_path)
    assert result["engines"][0]["runs"][0]["tokens"] == hf_greedy(qwen, prompts, MAX_TOKENS)


def test_bf16_runs_the_fused_kernels_in_graphs_and_tracks_fp32_hf(llama, prompts, tmp_path):
    """bf16 exercises the fused NPU kernels (FIA for prefill, paged attention for decode), decode
    in FULL ACL graphs (asked for explicitly: by default graph mode is on only for releases this
    suite has passed on). bf16 rounding makes exact equality with an fp32 oracle meaningless,
    so every token the engine chose is checked against HF fp32 logits of the engine's own
    sequence: it must be HF's argmax, or within bf16 rounding of it."""
    kwargs = {**ENGINE, "dtype": "bfloat16", "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
    spec = {"engines": [{"model": str(llama), "kwargs": kwargs,
                         "runs": [{"prompts": prompts, "sampling": [GREEDY]}]}]}
    engine = run_engine(spec, tmp_path)["engines"][0]
    run = engine["runs"][0]
    assert engine["cudagraph_mode"] == "FULL_DECODE_ONLY" and engine["graph_captures"] > 0
    assert run["launches"]["fused_infer_attention_score"] > 0
    # Every replay re-issues each layer's paged attention with the step's context lengths.
    assert run["graph_replays"] > 0
    assert run["launches"]["paged_attention_workspace"] == 2 * run["graph_replays"]
    assert_tracks_hf_logits(llama, prompts, run["tokens"])


def test_seeded_sampling_repeats_and_respects_top_k_top_p_min_p(llama, prompts, tmp_path):
    sample = {"temperature": 0.8, "max_tokens": 16, "ignore_eos": True}
    requests = [
        {**sample, "seed": 7},
        {**sample, "seed": 7, "top_k": 5},
        {**sample, "seed": 11, "top_p": 0.5},
        {**sample, "seed": 13, "min_p": 0.3},
        {**sample, "seed": 17, "top_k": 20, "top_p": 0.8},
    ]
    chosen = [prompts[i] for i in (1, 2, 3, 4, 5)]
    spec = {"engines": [{"model": str(llama), "kwargs": ENGINE, "runs": [
        {"prompts": chosen, "sampling": requests},
        {"prompts": chosen, "sampling": requests},
        {"prompts": chosen[:1], "sampling": [{**sample, "seed": 8}]},
    ]}]}
    runs = run_engine(spec, tmp_path)["engines"][0]["runs"]
    assert runs[0]["tokens"] == runs[1]["tokens"], "a seeded request repeats exactly"
    assert runs[2]["tokens"][0] != runs[0]["tokens"][0], "another seed samples differently"
    assert runs[0]["launches"]["top_k_top_p"] > 0

    logits = hf_logits(llama, [p + t for p, t in zip(chosen, runs[0]["tokens"])])
    for prompt, tokens, request, seq_logits in zip(chosen, runs[0]["tokens"], requests, logits):
        for i, token in enumerate(tokens):
            probs = torch.softmax(seq_logits[len(prompt) - 1 + i] / request["temperature"], dim=-1)
            assert token in _allowed(probs, request), (request, i)


def _allowed(probs: torch.Tensor, request: dict) -> set[int]:
    """The tokens vLLM's top-k, then top-p, then min-p semantics may sample (a hair of slack
    at the nucleus boundary for float rounding)."""
    order = torch.argsort(probs, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if "top_k" in request:
        keep[order[request["top_k"]:]] = False
    if "top_p" in request:
        kept = probs * keep
        kept = kept / kept.sum()
        sorted_probs = kept[order]
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass strictly above each token
        keep[order[before > request["top_p"] + 1e-4]] = False
    if "min_p" in request:
        keep &= probs >= request["min_p"] * probs.max() * (1 - 1e-4)
    return set(torch.nonzero(keep).flatten().tolist())


def test_kv_blocks_follow_the_emulated_hbm(llama, prompts, tmp_path):
    engine = {"model": str(llama), "kwargs": {**ENGINE, "gpu_memory_utilization": 0.5},
              "runs": [{"prompts": prompts[:2], "sampling": [GREEDY]}]}
    blocks = {}
    for hbm in ("256MiB", "512MiB"):
        env = {"ASCEND_PATCH": "emulate", "ASCEND_PATCH_EMULATED_HBM": hbm}
        from tests.conftest import clean_env

        result = run_engine({"engines": [engine]}, tmp_path, env=clean_env(**env))
        blocks[hbm] = result["engines"][0]["num_gpu_blocks"]
    # One block holds K and V for 2 layers x 128 tokens x 2 KV heads x 64 dims in fp32.
    block_bytes = 2 * 2 * 128 * 2 * 64 * 4
    expected = 256 * 2**20 * 0.5 / block_bytes
    assert math.isclose(blocks["512MiB"] - blocks["256MiB"], expected, abs_tol=1)
    assert blocks["256MiB"] > 0


def test_an_hbm_smaller_than_the_weights_fails_clearly(llama, tmp_path):
    engine = {"model": str(llama), "kwargs": ENGINE, "runs": []}
    from tests.conftest import clean_env

    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="2MiB")
    result = run_engine({"engines": [engine]}, tmp_path, env=env)
    error = result["engines"][0]["error"]
    assert "emulated NPU out of memory: weights" in error and "ASCEND_PATCH_EMULATED_HBM" in error


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 16}, "--block-size 16 is not supported on Ascend"),
        ({"enable_lora": True}, "LoRA is not supported by ascend-patch yet"),
    ],
)
def test_unsupported_configurations_are_refused_clearly(llama, tmp_path, kwargs, message):
    engine = {"model": str(llama), "kwargs": {**ENGINE, **kwargs}, "runs": []}
    error = run_engine({"engines": [engine]}, tmp_path)["engines"][0]["error"]
    assert message in error
