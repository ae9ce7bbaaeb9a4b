"""Speculative decoding on the emulated NPU: ngram, draft models, EAGLE, EAGLE-3 and DeepSeek
MTP, lossless against HF greedy.

One driver process runs every engine (in-process, one after the other): the same model without
speculation, with n-gram drafts (mostly rejected), with itself as its draft (every draft
accepted), and with an unrelated model as its draft under requested async scheduling (almost every
draft rejected: the run that attends over rejected drafts' slots if the host KV lengths are
vLLM's optimistic ones); an EAGLE-3 head (random) on the same target; an EAGLE-1 head whose drafts
are known in advance (:mod:`ascend_patch.kit.tiny_drafts`' shifted pair) on its own one-layer
target; and a tiny DeepSeek-V3 with and without its MTP layer drafting (MLA and MoE in the
drafter). Then the configurations the platform refuses, each in one line.

The target as its own draft accepts every draft only with exact host KV lengths in the drafter's
passes (vLLM lengthens their queries on the device only). The shifted EAGLE head proposes exactly
the drafts :func:`~ascend_patch.kit.tiny_drafts.shifted_drafts` predicts only when its attention
sees exactly the accepted tokens: vLLM's padded drafting writes the rejected drafts' K/V and then
shortens the drafter's KV lengths on the device only.
"""

from __future__ import annotations

import types

import pytest

from ascend_patch.kit import tiny_drafts
from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import MODELS_DIR, run_engine

MAX_TOKENS = 20
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True,
          "disable_log_stats": False, "gpu_memory_utilization": 0.3}
SPEC_TOKENS = 3
SHIFTED_SPEC_TOKENS = 5  # five chained drafts: four steps that would see a rejected draft's K/V


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


TARGETS = {"shifted_eagle_async": "tiny-llama-shifted", "deepseek_plain": "tiny-deepseek-v3-mtp",
           "mtp": "tiny-deepseek-v3-mtp"}
"""The engines on another target than the tiny Llama (the MTP layer is in its target's
checkpoint)."""


@pytest.fixture(scope="module")
def engines(llama, tiny_models, drafts, tmp_path_factory):
    other = str(tiny_models["tiny-qwen2"])  # same KV shape and vocabulary, other weights
    configs = {
        "plain": ENGINE,
        "ngram": _speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
        "self_draft": _speculative("draft_model", model=str(llama)),
        "other_draft_async": {**_speculative("draft_model", model=other), "async_scheduling": True},
        "eagle3": _speculative("eagle3", model=str(drafts["tiny-llama-eagle3"])),
        "shifted_eagle_async": {**_speculative("eagle", model=str(drafts["tiny-llama-shifted-eagle"]),
                                               num_speculative_tokens=SHIFTED_SPEC_TOKENS),
                                "async_scheduling": True},
        "deepseek_plain": ENGINE,
        "mtp": _speculative("mtp", num_speculative_tokens=2),
        "full_graphs": {**_speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
                        "enforce_eager": False,
                        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    }
    models = {name: str(drafts[TARGETS[name]] if name in TARGETS else llama) for name in configs}
    result = run_engine({"engines": [{"model": models[name], "kwargs": kwargs,
                                      "runs": [{"prompts": _prompts(models[name], name),
                                                "sampling": [GREEDY]}]}
                                     for name, kwargs in configs.items()]},
                        tmp_path_factory.mktemp("spec_decode"))
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


@pytest.mark.parametrize("name", ["plain", "ngram", "self_draft", "other_draft_async", "eagle3"])
def test_greedy_tokens_equal_hf_and_the_engine_without_speculation(engines, oracle, name):
    assert "error" not in engines[name], engines[name]["error"]
    assert engines[name]["runs"][0]["tokens"] == oracle
    assert engines[name]["runs"][0]["tokens"] == engines["plain"]["runs"][0]["tokens"]


@pytest.mark.parametrize("name, plain", [("shifted_eagle_async", None), ("mtp", "deepseek_plain")])
def test_eagle_and_mtp_tokens_equal_hf_and_the_engine_without_speculation(engines, drafts, name,
                                                                        plain):
    model = drafts[TARGETS[name]]
    assert "error" not in engines[name], engines[name]["error"]
    tokens = engines[name]["runs"][0]["tokens"]
    assert tokens == hf_greedy(model, _prompts(model, name), MAX_TOKENS)
    if plain:
        assert tokens == engines[plain]["runs"][0]["tokens"]


@pytest.mark.parametrize("name", ["eagle3", "mtp"])
def test_eagle3_and_mtp_drafts_are_proposed_and_verified(engines, name):
    counts = _counts(engines[name])
    assert counts["drafts"] > 0
    assert counts["draft_tokens"] >= counts["drafts"] * (2 if name == "mtp" else SPEC_TOKENS)


def test_eagle_drafts_are_the_ones_its_attention_over_the_accepted_tokens_gives(engines, drafts):
    """The shifted head's counters equal the prediction to the token: one draft attending over a
    rejected draft's K/V, or missing an accepted token's, changes what it proposes."""
    model = drafts["tiny-llama-shifted"]
    expected = tiny_drafts.shifted_drafts(model, _prompts(model, "shifted_eagle_async"), MAX_TOKENS,
                                          SHIFTED_SPEC_TOKENS)
    assert 0 < expected["accepted_tokens"] < expected["draft_tokens"]  # rejections to get wrong
    assert _counts(engines["shifted_eagle_async"]) == expected


def test_the_target_as_its_own_draft_accepts_every_draft(engines):
    counts = _counts(engines["self_draft"])
    assert counts["draft_tokens"] >= SPEC_TOKENS * (MAX_TOKENS // (SPEC_TOKENS + 1))
    assert counts["accepted_tokens"] == counts["draft_tokens"]


@pytest.mark.parametrize("name", ["ngram", "other_draft_async"])
def test_rejected_drafts_are_reported_and_leave_the_output_exact(engines, name):
    counts = _counts(engines[name])
    assert counts["drafts"] > 0
    assert counts["accepted_tokens"] < counts["draft_tokens"]


@pytest.mark.parametrize("name", ["other_draft_async", "shifted_eagle_async"])
def test_async_scheduling_is_turned_off_with_speculative_decoding_in_one_line(engines, name):
    log = engines[name]["log"]
    assert sum("async scheduling is off with speculative decoding" in line for line in log) == 1


@pytest.mark.parametrize("method", ["suffix", "dflash", "ngram_gpu"])
def test_other_methods_are_refused_in_one_line_naming_the_method(method):
    from ascend_patch.npu.spec_decode import config

    vllm_config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=method))
    with pytest.raises(NotImplementedError) as refused:
        config.check(vllm_config)
    assert str(refused.value) == (f"speculative decoding with method {method!r} is not supported by "
                                  "ascend-patch yet (supported: ngram, draft_model, eagle, eagle3, "
                                  "mtp)")


def test_mtp_of_other_models_is_refused_in_one_line_naming_the_model_type():
    from ascend_patch.npu.spec_decode import config

    draft = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="qwen3_next_mtp"))
    vllm_config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        method="mtp", draft_model_config=draft))
    with pytest.raises(NotImplementedError) as refused:
        config.check(vllm_config)
    assert str(refused.value) == ("speculative decoding with method 'mtp' on a qwen3_next_mtp draft "
                                  "is not supported by ascend-patch yet (supported: deepseek_mtp)")


def test_full_graphs_with_speculative_decoding_are_refused_in_one_line(engines):
    error = engines["full_graphs"]["error"]  # vLLM's config validation wraps the platform's
    assert ("Value error, FULL_DECODE_ONLY ACL graphs are not supported with speculative decoding "
            "yet: run with --enforce-eager or -cc.cudagraph_mode=NONE [") in error, error
