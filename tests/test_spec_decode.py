"""Speculative decoding on the emulated NPU: ngram and draft models, lossless against HF greedy.

One driver process runs every engine (in-process, one after the other): the same model without
speculation, with n-gram drafts (mostly rejected), with itself as its draft (every draft
accepted), and with an unrelated model as its draft under requested async scheduling (almost every
draft rejected: the run that attends over rejected drafts' slots if the host KV lengths are
vLLM's optimistic ones). Then the configurations the platform refuses, each in one line.

The target as its own draft accepts every draft only with exact host KV lengths in the drafter's
passes (vLLM lengthens their queries on the device only).
"""

from __future__ import annotations

import types

import pytest

from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import run_engine

MAX_TOKENS = 20
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True,
          "disable_log_stats": False, "gpu_memory_utilization": 0.3}
SPEC_TOKENS = 3


def _speculative(method: str, **config) -> dict:
    return {**ENGINE, "speculative_config": {"method": method, "num_speculative_tokens": SPEC_TOKENS,
                                             **config}}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["tiny-llama"]


@pytest.fixture(scope="module")
def prompts(llama):
    # The second repeats its n-grams, so the n-gram drafter proposes from the first step.
    text, repeated = prompt_token_ids(llama, [14, 6])
    return [text, repeated * 3]


@pytest.fixture(scope="module")
def engines(llama, tiny_models, prompts, tmp_path_factory):
    run = [{"prompts": prompts, "sampling": [GREEDY]}]
    other = str(tiny_models["tiny-qwen2"])  # same KV shape and vocabulary, other weights
    configs = {
        "plain": ENGINE,
        "ngram": _speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
        "self_draft": _speculative("draft_model", model=str(llama)),
        "other_draft_async": {**_speculative("draft_model", model=other), "async_scheduling": True},
        "full_graphs": {**_speculative("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
                        "enforce_eager": False,
                        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    }
    result = run_engine({"engines": [{"model": str(llama), "kwargs": kwargs, "runs": run}
                                     for kwargs in configs.values()]},
                        tmp_path_factory.mktemp("spec_decode"))
    return dict(zip(configs, result["engines"]))


@pytest.fixture(scope="module")
def oracle(llama, prompts):
    return hf_greedy(llama, prompts, MAX_TOKENS)


def _counts(engine: dict) -> dict:
    assert "error" not in engine, engine["error"]
    return engine["runs"][0]["spec_decode"]


@pytest.mark.parametrize("name", ["plain", "ngram", "self_draft", "other_draft_async"])
def test_greedy_tokens_equal_hf_and_the_engine_without_speculation(engines, oracle, name):
    assert "error" not in engines[name], engines[name]["error"]
    assert engines[name]["runs"][0]["tokens"] == oracle
    assert engines[name]["runs"][0]["tokens"] == engines["plain"]["runs"][0]["tokens"]


def test_the_target_as_its_own_draft_accepts_every_draft(engines):
    counts = _counts(engines["self_draft"])
    assert counts["draft_tokens"] >= SPEC_TOKENS * (MAX_TOKENS // (SPEC_TOKENS + 1))
    assert counts["accepted_tokens"] == counts["draft_tokens"]


@pytest.mark.parametrize("name", ["ngram", "other_draft_async"])
def test_rejected_drafts_are_reported_and_leave_the_output_exact(engines, name):
    counts = _counts(engines[name])
    assert counts["drafts"] > 0
    assert counts["accepted_tokens"] < counts["draft_tokens"]


def test_async_scheduling_is_turned_off_with_speculative_decoding_in_one_line(engines):
    log = engines["other_draft_async"]["log"]
    assert sum("async scheduling is off with speculative decoding" in line for line in log) == 1


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "suffix"])
def test_other_methods_are_refused_in_one_line_naming_the_method(method):
    from ascend_patch.npu.spec_decode import config

    vllm_config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=method))
    with pytest.raises(NotImplementedError) as refused:
        config.check(vllm_config)
    assert str(refused.value) == (f"speculative decoding with method {method!r} is not supported by "
                                  "ascend-patch yet (supported: ngram, draft_model)")


def test_full_graphs_with_speculative_decoding_are_refused_in_one_line(engines):
    error = engines["full_graphs"]["error"]  # vLLM's config validation wraps the platform's
    assert ("Value error, FULL_DECODE_ONLY ACL graphs are not supported with speculative decoding "
            "yet: run with --enforce-eager or -cc.cudagraph_mode=NONE [") in error, error
