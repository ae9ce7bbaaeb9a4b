"""Stock vLLM generating on the emulated NPU, checked against HF transformers.

The engines run in fresh interpreters with ``ASCEND_PATCH=emulate`` (see
engine_driver.py), in-process engine core, several one after another in each driver
process, so each configuration costs a few seconds of start-up and the module three
vLLM imports. The oracle is Hugging Face transformers on
the same local weights, fp32 greedy, token for token. The drivers fill every uninitialized
tensor with NaN (engine_driver.py), so a read of bytes nobody wrote (vLLM's padded rows, the
null block) cannot pass by the luck of what memory held.
"""

from __future__ import annotations

import math

import pytest
import torch

from ascend_patch.kit import oracle
from ascend_patch.kit.oracle import hf_greedy, hf_logits, prompt_token_ids
from tests.helpers.engine import MODELS_DIR, run_engine
from tests.helpers.process import clean_env

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


SEEDED_SAMPLE = {"temperature": 0.8, "max_tokens": 16, "ignore_eos": True}
SEEDED_REQUESTS = [
    {**SEEDED_SAMPLE, "seed": 7},
    {**SEEDED_SAMPLE, "seed": 7, "top_k": 5},
    {**SEEDED_SAMPLE, "seed": 11, "top_p": 0.5},
    {**SEEDED_SAMPLE, "seed": 13, "min_p": 0.3},
    {**SEEDED_SAMPLE, "seed": 17, "top_k": 20, "top_p": 0.8},
]
SEEDED_PROMPTS = (1, 2, 3, 4, 5)
# Two engines a quarter of the emulated 512 MiB apart: their KV caches must differ by that.
KV_UTILISATION = (0.25, 0.5)
REFUSED = [
    ({"block_size": 16}, "--block-size 16 is not supported on Ascend"),
]
# Two adapters and the base model mixed in one batch: per prompt, the adapter's name or None.
LORA_PROMPTS = (0, 1, 2, 3, 4, 5)
LORA_ADAPTERS = ("tiny-llama-lora-a", None, "tiny-llama-lora-b", "tiny-llama-lora-b", None,
                 "tiny-llama-lora-a")
LORA_ENGINE = {**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}


@pytest.fixture(scope="module")
def adapters():
    from ascend_patch.kit import tiny_adapters

    return tiny_adapters.build(MODELS_DIR)


def _fp32_spec(tiny_models) -> tuple[dict, list]:
    """The fp32 engines, one after another in one driver process (each shut down, its emulated
    HBM freed, before the next starts): two Llamas that differ only in their share of the
    emulated HBM; the Llama with prefix caching (vLLM's default) serving the prompts twice,
    prompts sharing a prefix, then seeded sampling; the Llama forcing chunked prefill; Qwen2;
    the Llama serving two LoRA adapters and the base model in one batch; and the configurations
    the NPU path refuses; and their names."""
    from ascend_patch.kit import tiny_adapters

    llama = tiny_models["tiny-llama"]
    prompts = prompt_token_ids(llama, PROMPT_LENGTHS)
    adapters = tiny_adapters.build(MODELS_DIR)
    chosen = [prompts[i] for i in SEEDED_PROMPTS]
    shared = _shared_prefix_prompts(prompts)
    qwen = tiny_models["tiny-qwen2"]
    engines, names = [], []
    for utilisation in KV_UTILISATION:
        engines.append({"model": str(llama), "kwargs": {**ENGINE, "gpu_memory_utilization": utilisation},
                        "runs": [{"prompts": prompts[:2], "sampling": [GREEDY]}]})
        names.append(("kv", utilisation))
    engines.append({"model": str(llama), "kwargs": {**ENGINE, "enable_prefix_caching": True}, "runs": [
        {"prompts": prompts, "sampling": [GREEDY]},
        {"prompts": prompts, "sampling": [GREEDY]},  # the same again: served from cache
        {"prompts": shared, "sampling": [GREEDY]},
        {"prompts": chosen, "sampling": SEEDED_REQUESTS},
        {"prompts": chosen, "sampling": SEEDED_REQUESTS},
        {"prompts": chosen[:1], "sampling": [{**SEEDED_SAMPLE, "seed": 8}]},
    ]})
    names.append("cached")
    engines.append({"model": str(llama), "runs": [{"prompts": prompts, "sampling": [GREEDY]}],
                    "kwargs": {**ENGINE, "enable_prefix_caching": False, "enable_chunked_prefill": True,
                               "max_num_batched_tokens": 64}})
    names.append("chunked")
    engines.append({"model": str(qwen), "kwargs": ENGINE,
                    "runs": [{"prompts": prompt_token_ids(qwen, PROMPT_LENGTHS), "sampling": [GREEDY]}]})
    names.append("qwen2")
    engines.append({"model": str(llama), "kwargs": LORA_ENGINE, "runs": [{
        "prompts": [prompts[i] for i in LORA_PROMPTS], "sampling": [GREEDY],
        "adapters": [name and str(adapters[name]) for name in LORA_ADAPTERS]}]})
    names.append("lora")
    for kwargs, message in REFUSED:
        engines.append({"model": str(llama), "kwargs": {**ENGINE, **kwargs}, "runs": []})
        names.append(("refused", message))
    return {"engines": engines}, names


@pytest.fixture(scope="module")
def fp32_runs(tiny_models, tmp_path_factory):
    spec, names = _fp32_spec(tiny_models)
    result = run_engine(spec, tmp_path_factory.mktemp("fp32"))
    assert result["platform"] == "EmulatedNPUPlatform"
    assert result["vllm_C_imported"] is False, "no CUDA/CPU _C kernels on the NPU path"
    return dict(zip(names, result["engines"]))


def test_greedy_equals_hf_token_for_token(fp32_runs, llama_oracle):
    first = fp32_runs["cached"]
    assert first["block_size"] == 128
    assert first["runs"][0]["tokens"] == llama_oracle


def test_prefix_caching_serves_shared_prefixes_and_changes_nothing(llama, prompts, fp32_runs, llama_oracle):
    runs = fp32_runs["cached"]["runs"]
    shared = _shared_prefix_prompts(prompts)
    assert runs[1]["tokens"] == llama_oracle
    # A repeated prompt is served from its whole cached blocks; its last token is always
    # recomputed, so a prompt of exactly one block gets none.
    assert runs[1]["cached"] == [128 * ((n - 1) // 128) for n in PROMPT_LENGTHS]
    assert runs[2]["cached"][1:] == [256] * (len(shared) - 1), "the two shared blocks came from the cache"
    assert runs[2]["tokens"] == hf_greedy(llama, shared, MAX_TOKENS)


def test_chunked_prefill_changes_nothing(fp32_runs, llama_oracle):
    assert fp32_runs["chunked"]["runs"][0]["tokens"] == llama_oracle


def test_two_lora_adapters_and_the_base_model_in_one_batch_equal_hf_with_merged_weights(
        fp32_runs, prompts, adapters, llama_oracle, tmp_path_factory):
    """Each prompt's greedy tokens equal HF transformers on the base checkpoint with its adapter
    merged into the weights by hand (``W + alpha/r · B @ A``), the base model's prompts the plain
    checkpoint's; each adapter changes the output, so a dropped LoRA delta fails here. fp32: the
    wrapper's plain-torch path (npu_batch_gather_matmul_ takes fp16 only)."""
    from ascend_patch.kit import tiny_adapters

    run = fp32_runs["lora"]
    assert "error" not in run, run.get("error")
    (tokens,) = [r["tokens"] for r in run["runs"]]
    root = tmp_path_factory.mktemp("merged")
    for name in filter(None, dict.fromkeys(LORA_ADAPTERS)):
        rows = [row for row, adapter in enumerate(LORA_ADAPTERS) if adapter == name]
        merged = tiny_adapters.merged(adapters[name], root / name)
        expected = hf_greedy(merged, [prompts[LORA_PROMPTS[row]] for row in rows], MAX_TOKENS)
        assert [tokens[row] for row in rows] == expected, name
        assert expected != [llama_oracle[LORA_PROMPTS[row]] for row in rows], f"{name} changes nothing"
    base_rows = [row for row, adapter in enumerate(LORA_ADAPTERS) if adapter is None]
    assert [tokens[row] for row in base_rows] == [llama_oracle[LORA_PROMPTS[row]] for row in base_rows]


def test_fp32_runs_composed_attention_and_the_npu_custom_ops(fp32_runs):
    engine = fp32_runs["cached"]
    # Composed attention turns host lengths into new tensors every step: no graphs.
    assert engine["cudagraph_mode"] == "NONE"
    launches = engine["runs"][0]["launches"]
    assert launches["scatter_pa_kv_cache"] > 0
    assert "fused_infer_attention_score" not in launches and "paged_attention" not in launches
    for op in ("rms_norm", "add_rms_norm", "swiglu", "mrope"):
        assert launches[op] > 0, op


def test_qwen2_greedy_equals_hf(fp32_runs, tiny_models):
    qwen = tiny_models["tiny-qwen2"]
    tokens = fp32_runs["qwen2"]["runs"][0]["tokens"]
    assert tokens == hf_greedy(qwen, prompt_token_ids(qwen, PROMPT_LENGTHS), MAX_TOKENS)


# --- bf16 and fp16: the fused NPU kernels -----------------------------------------------------

HALF_DTYPES = ("bfloat16", "float16")
# Qwen2 and the head_dim-128 Llama: short, one block and a bit, several blocks.
HALF_LENGTHS = [3, 17, 129, 300]
HALF_SAMPLE = {"temperature": 0.8, "top_k": 5, "max_tokens": 16, "ignore_eos": True}
# Eight one-token prompts: every step decodes a batch of 8, whose V rows are strided in vLLM's qkv.
# The graph engine's KV-cache blocks: longer than the kernels' 128-token blocks, as a hybrid model's
# attention blocks are (raised to its recurrent state's page).
GRAPH_BLOCK_SIZE = 256
DECODE_STEPS = {"prompts": [[i + 3] for i in range(8)], "layer_launches": True,
                "sampling": [{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}]}


def _half_precision_spec(tiny_models) -> tuple[dict, list]:
    """One driver process, several engines: per dtype the Llama with prefix caching and a
    64-token step budget (chunked prefill, mixed prefill + decode steps, prefix-cache hits,
    seeded sampling, and in bf16 decode steps whose layers' launches are counted) and Qwen2; the
    head_dim-128 Llama in bf16; all eager, so every step
    launches its kernels (graph mode has its own tests, tests/test_graph.py). And the bf16
    Llama with FULL_DECODE_ONLY graphs asked for explicitly (by default graph mode is on
    only for releases this suite has passed on), in KV-cache blocks of two kernel blocks. And
    their names."""
    llama = tiny_models["tiny-llama"]
    prompts = prompt_token_ids(llama, PROMPT_LENGTHS)
    small = {**ENGINE, "gpu_memory_utilization": 0.15, "enforce_eager": True}
    sampling = [{**HALF_SAMPLE, "seed": seed} for seed in (3, 4)]
    qwen = tiny_models["tiny-qwen2"]
    engines, names = [], []
    for dtype in HALF_DTYPES:
        engines.append({"model": str(llama), "runs": [
            {"prompts": prompts, "sampling": [GREEDY]},
            {"prompts": _shared_prefix_prompts(prompts), "sampling": [GREEDY]},
            {"prompts": prompts[1:3], "sampling": sampling},
            {"prompts": prompts[1:3], "sampling": sampling},
            *([DECODE_STEPS] if dtype == "bfloat16" else []),
        ], "kwargs": {**small, "dtype": dtype, "enable_prefix_caching": True, "enable_chunked_prefill": True,
                      "max_num_batched_tokens": 64}})
        engines.append({"model": str(qwen), "kwargs": {**small, "dtype": dtype},
                        "runs": [{"prompts": prompt_token_ids(qwen, HALF_LENGTHS), "sampling": [GREEDY]}]})
        names += [("llama", dtype), ("qwen2", dtype)]
    hd128 = tiny_models["tiny-llama-hd128"]
    engines.append({"model": str(hd128), "kwargs": {**small, "dtype": "bfloat16"},
                    "runs": [{"prompts": prompt_token_ids(hd128, HALF_LENGTHS), "sampling": [GREEDY]}]})
    names.append(("llama-hd128", "bfloat16"))
    engines.append({"model": str(llama), "runs": [{"prompts": prompts, "sampling": [GREEDY]}],
                    "kwargs": {**ENGINE, "dtype": "bfloat16", "block_size": GRAPH_BLOCK_SIZE,
                               "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}})
    names.append(("llama-graphs", "bfloat16"))
    return {"engines": engines}, names


def engine_specs(tiny_models, items=None) -> list[dict]:
    """The drivers' specs, started ahead of the module (tests/helpers/prefetch.py)."""
    return [_fp32_spec(tiny_models)[0], _half_precision_spec(tiny_models)[0]]


@pytest.fixture(scope="module")
def half_precision_runs(tiny_models, tmp_path_factory):
    spec, names = _half_precision_spec(tiny_models)
    result = run_engine(spec, tmp_path_factory.mktemp("half"))
    for engine in result["engines"]:
        assert "error" not in engine, engine["error"]
    return dict(zip(names, result["engines"]))


def _assert_fused_attention_only(run) -> None:
    """Every layer's attention in every step went to a fused kernel: each writes the KV cache
    once (scatter_pa_kv_cache), then launches FIA (any batch with a longer query) or paged
    attention (pure decode), never the composed fp32 path."""
    launches = run["launches"]
    assert launches["fused_infer_attention_score"] > 0 and launches["paged_attention"] > 0
    assert launches["fused_infer_attention_score"] + launches["paged_attention"] == launches["scatter_pa_kv_cache"]


def _assert_tracks_fp32_hf(model_dir, prompts, tokens, dtype) -> None:
    """Half precision makes exact equality with an fp32 oracle meaningless, so the engine is
    held to what HF's own forward in ``dtype`` does on the engine's sequences
    (:func:`ascend_patch.kit.oracle.precision_tracking`)."""
    assert all(len(generated) == MAX_TOKENS for generated in tokens)
    tracking = oracle.precision_tracking(model_dir, prompts, tokens, dtype)
    assert tracking.ok, tracking.message


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_chunked_prefill_and_mixed_batches_run_the_fused_kernels(
        half_precision_runs, llama, prompts, dtype):
    run = half_precision_runs[("llama", dtype)]["runs"][0]
    _assert_fused_attention_only(run)
    assert run["fused_batches"]["with_context"] > 0, "prompt chunks behind their computed part"
    assert run["fused_batches"]["mixed"] > 0, "decode rows and prefill chunks in one FIA launch"
    _assert_tracks_fp32_hf(llama, prompts, run["tokens"], dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_prefix_cache_hits_run_the_fused_kernels(half_precision_runs, llama, prompts, dtype):
    run = half_precision_runs[("llama", dtype)]["runs"][1]
    # the two blocks of the longest prompt, computed by the previous run
    assert run["cached"] == [256] * 4
    _assert_fused_attention_only(run)
    assert run["fused_batches"]["with_context"] > 0, "suffixes behind a cached prefix"
    _assert_tracks_fp32_hf(llama, _shared_prefix_prompts(prompts), run["tokens"], dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_seeded_sampling_repeats_within_hf_top_k(half_precision_runs, llama, prompts, dtype):
    first, again = half_precision_runs[("llama", dtype)]["runs"][2:4]
    assert first["tokens"] == again["tokens"]
    assert first["tokens"][0] != first["tokens"][1][: len(first["tokens"][0])]
    assert first["launches"]["top_k_top_p"] > 0
    _assert_fused_attention_only(first)
    tracking = oracle.precision_tracking(llama, prompts[1:3], first["tokens"], dtype,
                                         top_k=HALF_SAMPLE["top_k"])
    assert tracking.ok, tracking.message


def test_a_dense_bf16_decode_layer_launches_at_the_floor(half_precision_runs):
    """Issue 20's floor, counted as scripts/bench_engine.py counts, per decoder layer of a decode
    step: two norms (the first layer's first without a residual), four linears, one rotary launch
    for q and k, the cache write, paged attention, SwiGLU; and the one copy left, of V, a strided
    slice of vLLM's qkv that the cache write takes contiguous only (npu_scatter_pa_kv_cache's
    doc, torch-npu 2.11-2.14: "输入参数不支持非连续"), so 11 against the issue's 10. The step's KV
    slots and kernel block table are built once per step by the metadata builder, outside the
    layers."""
    launches = half_precision_runs[("llama", "bfloat16")]["runs"][4]["layer_launches"]
    assert launches == {"rms_norm": 0.5, "add_rms_norm": 1.5, "linear.default": 4, "mrope": 1,
                        "contiguous.default": 1, "scatter_pa_kv_cache": 1, "paged_attention": 1,
                        "swiglu": 1}


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_qwen2_runs_the_fused_kernels(half_precision_runs, tiny_models, dtype):
    qwen = tiny_models["tiny-qwen2"]
    run = half_precision_runs[("qwen2", dtype)]["runs"][0]
    _assert_fused_attention_only(run)
    _assert_tracks_fp32_hf(qwen, prompt_token_ids(qwen, HALF_LENGTHS), run["tokens"], dtype)


def test_head_dim_128_runs_the_fused_kernels(half_precision_runs, tiny_models):
    model = tiny_models["tiny-llama-hd128"]
    run = half_precision_runs[("llama-hd128", "bfloat16")]["runs"][0]
    _assert_fused_attention_only(run)
    _assert_tracks_fp32_hf(model, prompt_token_ids(model, HALF_LENGTHS), run["tokens"], "bfloat16")


def test_bf16_decodes_in_graphs_and_tracks_fp32_hf(half_precision_runs, llama, prompts):
    """Decode in FULL ACL graphs (emulated), prefill eager on FIA, over 256-token KV-cache blocks
    that the kernels address as two 128-token kernel blocks each."""
    engine = half_precision_runs[("llama-graphs", "bfloat16")]
    run = engine["runs"][0]
    assert engine["cudagraph_mode"] == "FULL_DECODE_ONLY" and engine["graph_captures"] > 0
    assert engine["block_size"] == GRAPH_BLOCK_SIZE
    assert run["launches"]["fused_infer_attention_score"] > 0
    # Every replay re-issues each layer's paged attention with the step's context lengths.
    assert run["graph_replays"] > 0
    assert run["launches"]["paged_attention_workspace"] == 2 * run["graph_replays"]
    _assert_tracks_fp32_hf(llama, prompts, run["tokens"], "bfloat16")


def test_seeded_sampling_repeats_and_respects_top_k_top_p_min_p(llama, prompts, fp32_runs):
    runs = fp32_runs["cached"]["runs"][3:6]
    chosen = [prompts[i] for i in SEEDED_PROMPTS]
    assert runs[0]["tokens"] == runs[1]["tokens"], "a seeded request repeats exactly"
    assert runs[2]["tokens"][0] != runs[0]["tokens"][0], "another seed samples differently"
    assert runs[0]["launches"]["top_k_top_p"] > 0

    logits = hf_logits(llama, [p + t for p, t in zip(chosen, runs[0]["tokens"])])
    for prompt, tokens, request, seq_logits in zip(chosen, runs[0]["tokens"], SEEDED_REQUESTS, logits):
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


def test_kv_blocks_follow_the_emulated_hbm(fp32_runs):
    blocks = {u: fp32_runs[("kv", u)]["num_gpu_blocks"] for u in KV_UTILISATION}
    # One block holds K and V for 2 layers x 128 tokens x 2 KV heads x 64 dims in fp32.
    block_bytes = 2 * 2 * 128 * 2 * 64 * 4
    low, high = KV_UTILISATION
    expected = 512 * 2**20 * (high - low) / block_bytes
    assert math.isclose(blocks[high] - blocks[low], expected, abs_tol=1)
    assert blocks[low] > 0


def test_an_hbm_smaller_than_the_weights_fails_clearly(llama, tmp_path):
    engine = {"model": str(llama), "kwargs": ENGINE, "runs": []}
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="2MiB")
    result = run_engine({"engines": [engine]}, tmp_path, env=env)
    error = result["engines"][0]["error"]
    assert "emulated NPU out of memory: weights" in error and "ASCEND_PATCH_EMULATED_HBM" in error


@pytest.mark.parametrize("message", [message for _, message in REFUSED])
def test_unsupported_configurations_are_refused_clearly(fp32_runs, message):
    assert message in fp32_runs[("refused", message)]["error"]
