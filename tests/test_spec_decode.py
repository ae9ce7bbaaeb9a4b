"""Speculative decoding on the emulated NPU: ngram, draft models, EAGLE, EAGLE-3 and DeepSeek
MTP, lossless against HF greedy.

One driver process runs every engine (in-process, one after the other): the same model without
speculation, with n-gram drafts (mostly rejected), with itself as its draft (every draft
accepted), and with an unrelated model as its draft under requested async scheduling (almost every
draft rejected: the run that attends over rejected drafts' slots if the host KV lengths are
vLLM's optimistic ones); an EAGLE-3 head (random) on the same target; an EAGLE-1 head whose drafts
are known in advance (:mod:`ascend_patch.kit.tiny_drafts`' shifted pair) on its own one-layer
target; and a tiny DeepSeek-V3 with and without its MTP layer drafting (MLA and MoE in the
drafter), the layer again one whose drafts are known in advance (mostly accepted). The engine without speculation, the n-gram one and the self-drafting one also serve
chunked prefill (a 32-token budget), prefix caching, structured outputs (xgrammar, and guidance
beside n-grams: a regex and a JSON schema) and seeded random sampling, each checked against HF
or that engine without speculation; vLLM's acceptance counters by draft position are checked on
every method. Then the configurations the platform refuses, each in one line.

The target as its own draft accepts every draft only with exact host KV lengths in the drafter's
passes (vLLM lengthens their queries on the device only). The shifted EAGLE head proposes exactly
the drafts :func:`~ascend_patch.kit.tiny_drafts.shifted_drafts` predicts only when its attention
sees exactly the accepted tokens: vLLM's padded drafting writes the rejected drafts' K/V and then
shortens the drafter's KV lengths on the device only.  So does the shifted MTP layer (its verification
batches: 1 + 2 rows per request, most of them accepted).
"""

from __future__ import annotations

import json
import re
import types

import pytest

from ascend_patch.kit import tiny_drafts
from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import MODELS_DIR, only_marked_tests, run_engine

MAX_TOKENS = 20
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True,
          "disable_log_stats": False, "gpu_memory_utilization": 0.3}
SPEC_TOKENS = 3
SHIFTED_SPEC_TOKENS = 5  # five chained drafts: four steps that would see a rejected draft's K/V


FEATURES = {"max_num_batched_tokens": 32, "enable_prefix_caching": True,
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
"""The engines that also serve chunked prefill (a 32-token step budget), prefix caching and
structured outputs, with and without speculation."""
LONG_PROMPT = 160  # five prefill chunks; its first 128-token KV block is cached for the rerun
GREEDY_PREFIX = 8  # greedy tokens the regex of a structured run lets through before its own part
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "y"]}},
          "required": ["n", "tag"], "additionalProperties": False}
STRUCTURED = {"temperature": 0.0, "max_tokens": 48}
SEEDED = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
FEATURE_RUNS = ("long", "long_cached", "regex", "json", "seeded", "seeded_again", "seeded_in_batch")
"""The runs after the greedy one (run 0) of the engines with :data:`FEATURES`, in order."""


def _feature_runs(model) -> list[dict]:
    prompts = _prompts(model)
    long = _long_prompts(model)
    seeded = _seeded_prompts(model)
    return [{"prompts": long, "sampling": [GREEDY]}, {"prompts": long, "sampling": [GREEDY]},
            {"prompts": prompts, "sampling": [{**STRUCTURED, "structured_outputs": {"regex": regex}}
                                              for regex in _regexes(model, prompts)]},
            {"prompts": prompts, "sampling": [{**STRUCTURED, "structured_outputs": {"json": SCHEMA}}]},
            {"prompts": seeded, "sampling": [{**SEEDED, "seed": 7}]},
            {"prompts": seeded, "sampling": [{**SEEDED, "seed": 7}]},
            # the first prompt with its seed again, second in a batch beside another seed
            {"prompts": seeded[::-1], "sampling": [{**SEEDED, "seed": 9}, {**SEEDED, "seed": 7}]}]


def _regexes(model, prompts) -> list[str]:
    """Per prompt: its first greedy tokens' text, then ``-`` and three of a, b, c. Drafts
    that break the grammar are dropped before verification (vLLM's scheduler), so the greedy
    prefix is what gives the drafters grammar-valid drafts to verify."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.decode(tokens) for tokens in hf_greedy(model, prompts, GREEDY_PREFIX)]
    return [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n") + "-[a-c]{3}"
            for text in texts]


def _seeded_prompts(model) -> list[list[int]]:
    """Prompts prefilled in one step (20 tokens within the 32-token budget): a seeded request in
    a chunked prefill does not run in emulation (vLLM rewinds its generator's offset after the
    partial step, which the CPU generator standing in for the NPU's has not)."""
    return prompt_token_ids(model, [14, 6])


def _long_prompts(model) -> list[list[int]]:
    return [prompt_token_ids(model, [20, LONG_PROMPT])[1], _prompts(model)[1]]


def _speculative(method: str, **config) -> dict:
    return {**ENGINE, "speculative_config": {"method": method, "num_speculative_tokens": SPEC_TOKENS,
                                             **config}}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["tiny-llama"]


@pytest.fixture(scope="module")
def prompts(llama):
    return _prompts(llama)


@pytest.fixture(scope="module")
def drafts(tiny_models):
    return tiny_drafts.build(MODELS_DIR)


MTP_MODEL = "tiny-deepseek-v3-shifted-mtp"
MTP_SPEC_TOKENS = 2
TARGETS = {"shifted_eagle_async": "tiny-llama-shifted", "deepseek_plain": MTP_MODEL,
           "mtp": MTP_MODEL}
"""The engines on another target than the tiny Llama (the MTP layer is in its target's
checkpoint)."""


FEATURED = ("plain", "ngram", "self_draft", "ngram_guidance")
V0_20 = ("plain", "ngram", "self_draft", "eagle3", "shifted_eagle_async", "deepseek_plain", "mtp")
"""The engines the tests marked v0_20_features read (a v0_20-set release in CI): one lossless
greedy run per method family (n-grams, a draft model, EAGLE, EAGLE-3, MTP), without the feature
runs."""
V0_20_FEATURES = pytest.mark.v0_20_features


def _v0_20(*names):
    return [pytest.param(name, marks=V0_20_FEATURES) for name in names]


@pytest.fixture(scope="module")
def engines(llama, tiny_models, drafts, tmp_path_factory, request):
    other = str(tiny_models["tiny-qwen2"])  # same KV shape and vocabulary, other weights
    configs = {
        "plain": {**ENGINE, **FEATURES},
        "ngram": {**_speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3), **FEATURES},
        "self_draft": {**_speculative("draft_model", model=str(llama)), **FEATURES,
                       "async_scheduling": False},
        "other_draft_async": {**_speculative("draft_model", model=other), "async_scheduling": True},
        "eagle3": _speculative("eagle3", model=str(drafts["tiny-llama-eagle3"])),
        "shifted_eagle_async": {**_speculative("eagle", model=str(drafts["tiny-llama-shifted-eagle"]),
                                               num_speculative_tokens=SHIFTED_SPEC_TOKENS),
                                "async_scheduling": True},
        "deepseek_plain": ENGINE,
        "mtp": _speculative("mtp", num_speculative_tokens=MTP_SPEC_TOKENS),
        "ngram_guidance": {**_speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
                           **FEATURES, "structured_outputs_config": {
                               "backend": "guidance", "disable_any_whitespace": True}},
        "full_graphs": {**_speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
                        "enforce_eager": False,
                        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    }
    subset = only_marked_tests(request)
    if subset:
        configs = {name: configs[name] for name in V0_20}
    featured = () if subset else FEATURED
    models = {name: str(drafts[TARGETS[name]] if name in TARGETS else llama) for name in configs}
    result = run_engine({"engines": [{"model": models[name], "kwargs": kwargs,
                                      "runs": [{"prompts": _prompts(models[name], name),
                                                "sampling": [GREEDY]},
                                               *(_feature_runs(llama) if name in featured else [])]}
                                     for name, kwargs in configs.items()],
                         "report_errors": True},
                        tmp_path_factory.mktemp("spec_decode"), timeout=1500)
    return dict(zip(configs, result["engines"]))


def _prompts(model, engine: str | None = None) -> list[list[int]]:
    text, other = prompt_token_ids(model, [14, 6])
    if engine == "shifted_eagle_async":  # no repeats: the head's drafts get rejected and accepted
        return [text, other]
    # The second repeats its n-grams, so the n-gram drafter proposes from the first step.
    return [text, other * 3]


@pytest.fixture(scope="module")
def oracle(llama, prompts):
    return hf_greedy(llama, prompts, MAX_TOKENS)


def _counts(engine: dict) -> dict:
    assert "error" not in engine, engine["error"]
    return engine["runs"][0]["spec_decode"]


@pytest.mark.parametrize("name", [*_v0_20("plain", "ngram", "self_draft"), "other_draft_async",
                                  *_v0_20("eagle3")])
def test_greedy_tokens_equal_hf_and_the_engine_without_speculation(engines, oracle, name):
    assert "error" not in engines[name], engines[name]["error"]
    assert engines[name]["runs"][0]["tokens"] == oracle
    assert engines[name]["runs"][0]["tokens"] == engines["plain"]["runs"][0]["tokens"]


@pytest.mark.v0_20_features
@pytest.mark.parametrize("name, plain", [("shifted_eagle_async", None), ("mtp", "deepseek_plain")])
def test_eagle_and_mtp_tokens_equal_hf_and_the_engine_without_speculation(engines, drafts, name,
                                                                        plain):
    model = drafts[TARGETS[name]]
    assert "error" not in engines[name], engines[name]["error"]
    tokens = engines[name]["runs"][0]["tokens"]
    assert tokens == hf_greedy(model, _prompts(model, name), MAX_TOKENS)
    if plain:
        assert tokens == engines[plain]["runs"][0]["tokens"]


@pytest.mark.parametrize("name", _v0_20("eagle3", "mtp"))
def test_eagle3_and_mtp_drafts_are_proposed_and_verified(engines, name):
    counts = _counts(engines[name])
    assert counts["drafts"] > 0
    assert counts["draft_tokens"] >= counts["drafts"] * (MTP_SPEC_TOKENS if name == "mtp"
                                                         else SPEC_TOKENS)


@pytest.mark.v0_20_features
def test_eagle_drafts_are_the_ones_its_attention_over_the_accepted_tokens_gives(engines, drafts):
    """The shifted head's counters equal the prediction to the token: one draft attending over a
    rejected draft's K/V, or missing an accepted token's, changes what it proposes."""
    model = drafts["tiny-llama-shifted"]
    expected = tiny_drafts.shifted_drafts(model, _prompts(model, "shifted_eagle_async"), MAX_TOKENS,
                                          SHIFTED_SPEC_TOKENS)
    assert 0 < expected["accepted_tokens"] < expected["draft_tokens"]  # rejections to get wrong
    assert _counts(engines["shifted_eagle_async"]) == expected


@pytest.mark.v0_20_features
def test_mtp_drafts_are_the_ones_its_attention_over_the_accepted_tokens_gives(engines, drafts):
    """The shifted MTP layer (MLA, MoE) accepts most drafts, each step verifying 1 + 2 rows per
    request, and its counters equal the prediction to the token."""
    model = drafts[MTP_MODEL]
    expected = tiny_drafts.shifted_drafts(model, _prompts(model, "mtp"), MAX_TOKENS,
                                          MTP_SPEC_TOKENS, mtp=True)
    assert expected["draft_tokens"] / 2 < expected["accepted_tokens"] < expected["draft_tokens"]
    assert expected["accepted_per_position"][-1] > 0  # whole verification batches accepted
    assert _counts(engines["mtp"]) == expected


@pytest.mark.v0_20_features
def test_the_target_as_its_own_draft_accepts_every_draft(engines):
    counts = _counts(engines["self_draft"])
    assert counts["draft_tokens"] >= SPEC_TOKENS * (MAX_TOKENS // (SPEC_TOKENS + 1))
    assert counts["accepted_tokens"] == counts["draft_tokens"]


@pytest.mark.parametrize("name", [*_v0_20("ngram"), "other_draft_async"])
def test_rejected_drafts_are_reported_and_leave_the_output_exact(engines, name):
    counts = _counts(engines[name])
    assert counts["drafts"] > 0
    assert counts["accepted_tokens"] < counts["draft_tokens"]
    if name == "ngram":  # the repeated prompt's n-grams: some drafts are the model's own tokens
        assert counts["accepted_tokens"] > 0, counts


@pytest.mark.parametrize("name", ["other_draft_async", *_v0_20("shifted_eagle_async")])
def test_async_scheduling_is_turned_off_with_speculative_decoding_in_one_line(engines, name):
    log = engines[name]["log"]
    assert sum("async scheduling is off with speculative decoding" in line for line in log) == 1


@pytest.mark.v0_20_features
@pytest.mark.parametrize("method", ["suffix", "dflash", "ngram_gpu"])
def test_other_methods_are_refused_in_one_line_naming_the_method(method):
    from ascend_patch.npu.spec_decode import config

    vllm_config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=method))
    with pytest.raises(NotImplementedError) as refused:
        config.check(vllm_config)
    assert str(refused.value) == (f"speculative decoding with method {method!r} is not supported by "
                                  "ascend-patch yet (supported: ngram, draft_model, eagle, eagle3, "
                                  "mtp)")


@pytest.mark.v0_20_features
def test_mtp_of_other_models_is_refused_in_one_line_naming_the_model_type():
    from ascend_patch.npu.spec_decode import config

    draft = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="qwen3_next_mtp"))
    vllm_config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        method="mtp", draft_model_config=draft))
    with pytest.raises(NotImplementedError) as refused:
        config.check(vllm_config)
    assert str(refused.value) == ("speculative decoding with method 'mtp' on a qwen3_next_mtp draft "
                                  "is not supported by ascend-patch yet (supported: deepseek_mtp)")


def test_full_graphs_that_cannot_hold_verification_rows_are_refused_in_one_line(engines):
    """fp32 verification rows run composed attention (bf16 ones replay, dense and MTP's on MLA:
    tests/test_graph_spec.py)."""
    error = engines["full_graphs"]["error"]  # vLLM's config validation wraps the platform's
    assert ("Value error, FULL_DECODE_ONLY ACL graphs cannot hold speculative decoding here "
            "(float32: the fused attention kernels take fp16/bf16 only: "
            "verification rows run composed attention): run with --enforce-eager or "
            "-cc.cudagraph_mode=NONE [") in error, error


# --- features with speculative decoding (the engines with FEATURES) ---------------------------


def _run(engines, name: str, run: str) -> dict:
    assert "error" not in engines[name], engines[name]["error"]
    report = engines[name]["runs"][1 + FEATURE_RUNS.index(run)]
    assert "error" not in report, report["error"]
    return report


@pytest.mark.parametrize("name", ["ngram", "self_draft"])
def test_chunked_prefill_and_prefix_caching_with_speculation_equal_hf(engines, llama, name):
    long = _long_prompts(llama)
    assert len(long[0]) > FEATURES["max_num_batched_tokens"]  # prefilled in chunks
    oracle = hf_greedy(llama, long, MAX_TOKENS)
    first, cached = _run(engines, name, "long"), _run(engines, name, "long_cached")
    assert first["tokens"] == oracle
    assert cached["tokens"] == oracle
    assert cached["cached"][0] >= 128, "the rerun is served from the prefix cache"
    assert first["spec_decode"]["drafts"] > 0 and cached["spec_decode"]["drafts"] > 0


@pytest.mark.parametrize("name", ["ngram", "self_draft", "ngram_guidance"])
def test_structured_outputs_with_speculation_equal_the_engine_without(engines, llama, name):
    """The grammar holds (vLLM checks each draft against it before verification) and the
    constrained greedy tokens are the engine without speculation's (xgrammar; guidance's
    regex too). The regex lets each prompt's greedy tokens through first, so the self-drafting
    engine has drafts to accept."""
    import jsonschema

    regexes = _regexes(llama, _prompts(llama))
    for run, valid in (("regex", lambda text, i: re.fullmatch(regexes[i], text, re.DOTALL)),
                       ("json", lambda text, i: jsonschema.validate(json.loads(text), SCHEMA) is None)):
        report = _run(engines, name, run)
        if name != "ngram_guidance" or run == "regex":  # guidance's JSON: validity only
            assert report["tokens"] == _run(engines, "plain", run)["tokens"], run
        for i, output in enumerate(report["outputs"]):
            completion = output["completions"][0]
            assert completion["finish_reason"] == "stop", completion  # the grammar ended it
            assert valid(completion["text"], i), (regexes[i], completion["text"])
    counts = _run(engines, name, "regex")["spec_decode"]
    if name == "self_draft":  # its drafts are the greedy tokens the regex lets through first
        assert counts["accepted_tokens"] >= GREEDY_PREFIX - 1 - SPEC_TOKENS


@pytest.mark.parametrize("name", ["plain", "ngram", "self_draft"])
def test_seeded_sampling_with_speculation_repeats_in_any_batch(engines, name):
    """What vLLM guarantees for a seeded request: the same tokens every time, whatever else is
    in the batch (its random numbers come from its own generator). With speculation, that
    generator also feeds the rejection sampler's uniforms and recovered-token noise, so the
    tokens are another sample of the same distribution than without speculation (the
    distribution is checked in tests/kernels/test_spec_decode.py); only the prefill's token,
    sampled before any draft exists, is the same."""
    seeded = _run(engines, name, "seeded")["tokens"]
    assert _run(engines, name, "seeded_again")["tokens"] == seeded
    assert _run(engines, name, "seeded_in_batch")["tokens"][1] == seeded[0]
    assert [tokens[0] for tokens in seeded] == [
        tokens[0] for tokens in _run(engines, "plain", "seeded")["tokens"]]
    if name != "plain":
        counts = _run(engines, name, "seeded")["spec_decode"]
        assert counts["drafts"] > 0  # random rows went through rejection sampling


def test_async_scheduling_on_and_off_give_the_same_greedy_tokens(engines):
    """Without speculation async scheduling runs (vLLM's default); with it the platform turns it
    off whether asked for or not, and the tokens are the same either way."""
    settled = {name: engines[name]["async_scheduling"]
               for name in ("plain", "other_draft_async", "self_draft")}
    assert settled == {"plain": True, "other_draft_async": False, "self_draft": False}
    tokens = {name: engines[name]["runs"][0]["tokens"] for name in settled}
    assert tokens["other_draft_async"] == tokens["self_draft"] == tokens["plain"]


# --- vLLM's speculative-decoding metrics on the NPU path --------------------------------------


@pytest.mark.parametrize("name", [*_v0_20("ngram", "self_draft"), "other_draft_async",
                                  *_v0_20("eagle3", "mtp")])
def test_acceptance_by_position_adds_up_to_the_accepted_drafts(engines, name):
    """vLLM counts a draft position as accepted only when every earlier one was: the counts by
    position never grow, add up to the accepted drafts, and a position accepts at most once per
    draft step."""
    counts = _counts(engines[name])
    per_position = counts["accepted_per_position"]
    assert len(per_position) == (MTP_SPEC_TOKENS if name == "mtp" else SPEC_TOKENS)
    assert sum(per_position) == counts["accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)
    assert per_position[0] <= counts["drafts"]


@pytest.mark.v0_20_features
def test_the_target_as_its_own_draft_accepts_at_every_position(engines):
    counts = _counts(engines["self_draft"])
    assert counts["accepted_per_position"] == [counts["drafts"]] * SPEC_TOKENS
    # vLLM's mean acceptance length: 1 + accepted drafts per draft step
    assert 1 + counts["accepted_tokens"] / counts["drafts"] == 1 + SPEC_TOKENS
