"""vLLM's user-facing generation features on the emulated NPU, each against an independent oracle.

One driver process (tests/engine_driver.py) serves every check: an fp32 tiny-Llama engine
with the xgrammar structured-output backend runs all the sampling features, then a second
engine in the same process runs the structured-output cases with the guidance backend
(vLLM allows one backend per engine). The tests below only assert on that shared result.

The oracle is Hugging Face transformers on the same fp32 weights: its log-softmax for
logprobs, its own beam search, its logits processors (with the few vLLM definitions HF
lacks, presence/frequency penalties and how bad words are tokenized, re-implemented here),
and independent parsers (``re``, ``json`` + ``jsonschema``, ``lark``) for structured output.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from ascend_patch.kit.oracle import prompt_token_ids
from tests.helpers.engine import run_engine

MAX_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8,
          # two engines share the process's emulated HBM
          "gpu_memory_utilization": 0.3}
# fp32 logits through different kernels than HF's: agreement far below any rank gap that matters.
LOGPROB_ATOL = 1e-4
TOP_K = 8
BEAM_WIDTH, BEAM_TOKENS = 3, 8

REGEX = r"[a-c]{3}-(0|[1-9][0-9]?)"
CHOICES = ["alpha", "beta", "gamma", "delta"]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["x", "y"]},
        "name": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "tag", "name"],
    "additionalProperties": False,
}
# One language, written for each backend: xgrammar takes EBNF, guidance Lark; the lark
# library parses the output independently.
GRAMMAR_EBNF = ('root ::= pair | pair ";" pair | pair ";" pair ";" pair\n'
                'pair ::= key "=" [0-9]\nkey ::= "a" | "b" | "c"')
GRAMMAR_LARK = ('start: pair | pair ";" pair | pair ";" pair ";" pair\n'
                'pair: KEY "=" DIGIT\nKEY: "a" | "b" | "c"\nDIGIT: /[0-9]/')
BACKENDS = ("xgrammar", "guidance")


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["tiny-llama"]


@pytest.fixture(scope="module")
def hf(llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # per call, as each check needs
    return model, AutoTokenizer.from_pretrained(llama)


def hf_generate(hf, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    model, _ = hf
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=512)
def _log_softmax(model, sequence: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), dim=-1)


def hf_log_softmax(hf, sequence: list[int]) -> torch.Tensor:
    """fp32 log-probabilities of the next token at every position of ``sequence``."""
    return _log_softmax(hf[0], tuple(sequence))


class OutputPenalties:
    """vLLM's presence and frequency penalties (the OpenAI definition, over output tokens only):
    ``logit -= frequency * count + presence * (count > 0)``. HF has no such processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        output = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """How vLLM turns bad words into token sequences (``SamplingParams.update_from_tokenizer``):
    each word as is, and with one leading space when that tokenizes to a different first
    token but as many tokens."""
    banned = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        banned.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            banned.append(spaced)
    return banned


# --- the shared engine run ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cases(llama, hf):
    """The requests, and what they depend on from the oracle (stop strings and bad words are
    cut from HF's own greedy output, so they are known before the engine starts)."""
    _, tokenizer = hf
    prompts = prompt_token_ids(llama, [6, 23, 40, 130])
    greedy = [hf_generate(hf, p, MAX_TOKENS) for p in prompts]
    # 7-token windows on which beams end at EOS (the beam tests assert they still do)
    beam_prompts = [prompt_token_ids(llama, [7] * 53)[i] for i in (10, 43, 52)]
    return {"prompts": prompts, "greedy": greedy, "beam_prompts": beam_prompts,
            "stop": _stop_string(tokenizer, greedy[1]), "bad_words": _bad_words(tokenizer, greedy[2]),
            "tokenizer": tokenizer}


def _stop_string(tokenizer, tokens: list[int]) -> str:
    """Three printable ASCII characters from the middle of the greedy text."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for start in range(3, len(text) - 3):
        piece = text[start:start + 3]
        if piece.isascii() and piece.isprintable() and text.find(piece) == start:
            return piece
    raise AssertionError(f"no ASCII stop string in {text!r}")


def _bad_words(tokenizer, tokens: list[int]) -> list[str]:
    """A one-token and a two-token word that greedy decoding generates (after its first token)
    and that tokenize back to exactly those tokens."""
    words = []
    for width in (1, 2):
        for start in range(1, len(tokens) - width):
            piece = tokens[start:start + width]
            word = tokenizer.decode(piece)
            if word.strip() == word and tokenizer.encode(word, add_special_tokens=False) == piece:
                words.append(word)
                break
    assert len(words) == 2, f"no usable bad words in {tokens}"
    return words


def _runs(cases) -> dict[str, dict]:
    prompts, greedy = cases["prompts"], cases["greedy"]
    sample = {"temperature": 0.9, "top_k": TOP_K, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    seeded = {**sample, "n": 3, "seed": 1234}
    first, second = prompts[0], prompts[1]
    return {
        "logprobs": {"prompts": prompts, "sampling": [{**GREEDY, "logprobs": 5, "prompt_logprobs": 3}]},
        "sampled_logprobs": {"prompts": prompts[:2],
                             "sampling": [{**sample, "n": 2, "seed": 7, "logprobs": 2}]},
        **{f"beam_lp{penalty:g}": {"kind": "beam_search", "prompts": cases["beam_prompts"],
                                   "beam": {"beam_width": BEAM_WIDTH, "max_tokens": BEAM_TOKENS,
                                            "length_penalty": penalty}}
           for penalty in (1.0, -1.0)},
        "repetition": {"prompts": prompts[:2], "sampling": [{**GREEDY, "repetition_penalty": 1.4}]},
        "presence": {"prompts": prompts[:2], "sampling": [{**GREEDY, "presence_penalty": 1.5}]},
        "frequency": {"prompts": prompts[:2], "sampling": [{**GREEDY, "frequency_penalty": 0.9}]},
        "all_penalties": {"prompts": prompts[:2], "sampling": [{**GREEDY, "repetition_penalty": 1.2,
                                                                "presence_penalty": 0.5,
                                                                "frequency_penalty": 0.5}]},
        "seeded": {"prompts": [first, second], "sampling": [seeded]},
        "seeded_again": {"prompts": [first, second], "sampling": [seeded]},
        "other_seed": {"prompts": [first, second], "sampling": [{**seeded, "seed": 4321}]},
        # the seeded request again, now batched between others
        "seeded_in_batch": {"prompts": [second, first, prompts[2]],
                            "sampling": [sample, seeded, GREEDY]},
        "stop": {"prompts": [second], "sampling": [{**GREEDY, "stop": [cases["stop"]]}]},
        "stop_included": {"prompts": [second],
                          "sampling": [{**GREEDY, "stop": [cases["stop"]], "include_stop_str_in_output": True}]},
        "stop_token": {"prompts": [first], "sampling": [{**GREEDY, "stop_token_ids": [greedy[0][4]]}]},
        "bad_words": {"prompts": [prompts[2]], "sampling": [{**GREEDY, "bad_words": cases["bad_words"]}]},
        # without min_tokens this would stop at the second token
        "min_tokens": {"prompts": [first], "sampling": [{"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                                         "min_tokens": 6, "stop_token_ids": [greedy[0][1]]}]},
        "logit_bias": {"prompts": prompts[:2], "sampling": [{**GREEDY, "logit_bias": _logit_bias(greedy)}]},
        "allowed_token_ids": {"prompts": prompts[:2],
                              "sampling": [{**GREEDY, "allowed_token_ids": _allowed(greedy)}]},
        "chat": {"kind": "chat", "conversations": [[{"role": "user", "content": "What is a header?"}]],
                 "sampling": [GREEDY]},
        "prompt_too_long": {"prompts": [list(range(3, 600))], "sampling": [GREEDY]},
        "after_prompt_too_long": {"prompts": prompts[:2], "sampling": [GREEDY]},
        **_structured_runs("xgrammar", prompts),
    }


def _logit_bias(greedy) -> dict[int, float]:
    """Forbid greedy's first token of the first prompt, favour one it never chose."""
    unused = next(t for t in range(3, 512) if all(t not in g for g in greedy))
    return {greedy[0][0]: -100.0, unused: 4.0}


def _allowed(greedy) -> list[int]:
    """About twenty tokens: every third one greedy chose, and a run it mostly did not."""
    chosen = sorted({t for g in greedy[:2] for t in g[::3]})
    return sorted(set(chosen) | set(range(100, 120 - len(chosen))))


def _structured_runs(backend: str, prompts) -> dict[str, dict]:
    structured = {"temperature": 0.0, "max_tokens": 48}
    grammar = GRAMMAR_EBNF if backend == "xgrammar" else GRAMMAR_LARK
    specs = {"regex": {"regex": REGEX}, "choice": {"choice": CHOICES}, "json": {"json": SCHEMA},
             "grammar": {"grammar": grammar}}
    runs = {f"{backend}_{name}": {"prompts": prompts[:2], "sampling": [{**structured, "structured_outputs": spec}]}
            for name, spec in specs.items()}
    # A spec vLLM rejects, then valid requests on the same engine.
    invalid = {"regex": "[a-c"} if backend == "xgrammar" else {"grammar": "start: pair\npair: KEY"}
    runs[f"{backend}_invalid"] = {"prompts": prompts[:1], "sampling": [{**structured, "structured_outputs": invalid}]}
    runs[f"{backend}_after_invalid"] = {"prompts": prompts[2:4], "sampling": [{**structured,
                                                                               "structured_outputs": specs["regex"]}]}
    runs[f"{backend}_greedy_after_invalid"] = {"prompts": prompts[:2], "sampling": [GREEDY]}
    return runs


@pytest.fixture(scope="module")
def results(llama, cases, tmp_path_factory):
    runs = _runs(cases)
    guidance = _structured_runs("guidance", cases["prompts"])
    engines = [
        {"model": str(llama), "runs": list(runs.values()),
         "kwargs": {**ENGINE, "structured_outputs_config": {"backend": "xgrammar",
                                                            "disable_any_whitespace": True}}},
        {"model": str(llama), "runs": list(guidance.values()),
         "kwargs": {**ENGINE, "structured_outputs_config": {"backend": "guidance",
                                                            "disable_any_whitespace": True}}},
    ]
    result = run_engine({"engines": engines, "report_errors": True}, tmp_path_factory.mktemp("conformance"))
    assert result["platform"] == "EmulatedNPUPlatform"
    by_name = {}
    for names, engine in zip((runs, guidance), result["engines"], strict=True):
        assert "error" not in engine, engine["error"]
        by_name.update(zip(names, engine["runs"], strict=True))
    return by_name


def completed(results, name: str) -> dict:
    run = results[name]
    assert "error" not in run, f"{name}: {run['error']}"
    return run


# --- logprobs -------------------------------------------------------------------------------


def _check_position(entries, logprobs: torch.Tensor, must_contain: int, top: int) -> None:
    """One position's returned logprobs: the given token plus the top ``top`` tokens, each with
    HF's log-probability and its rank among all tokens."""
    tokens = [token for token, _, _ in entries]
    assert must_contain in tokens and len(set(tokens)) == len(tokens)
    assert len(tokens) in (top, top + 1)
    best = logprobs.topk(top)
    for token, value, rank in entries:
        reference = float(logprobs[token])
        assert value == pytest.approx(reference, abs=LOGPROB_ATOL), token
        # rank: 1 + how many tokens are more likely (ties within the tolerance may go either way)
        above = int((logprobs > reference + LOGPROB_ATOL).sum())
        assert above + 1 <= rank <= int((logprobs > reference - LOGPROB_ATOL).sum()) + 1, token
    top_tokens = {t for t, _, r in entries if r <= top}
    assert top_tokens == set(best.indices.tolist()) or float(best.values[-1]) - float(
        logprobs.topk(top + 1).values[-1]) < LOGPROB_ATOL


def test_logprobs_equal_hf_log_softmax_with_ranks(results, cases, hf):
    run = completed(results, "logprobs")
    assert run["tokens"] == cases["greedy"]
    for prompt, output in zip(cases["prompts"], run["outputs"], strict=True):
        completion = output["completions"][0]
        sequence = prompt + completion["tokens"]
        reference = hf_log_softmax(hf, sequence)
        for i, (token, entries) in enumerate(zip(completion["tokens"], completion["logprobs"], strict=True)):
            _check_position(entries, reference[len(prompt) - 1 + i], token, 5)


def test_prompt_logprobs_equal_hf_log_softmax_with_ranks(results, cases, hf):
    run = completed(results, "logprobs")
    for prompt, output in zip(cases["prompts"], run["outputs"], strict=True):
        assert output["prompt_token_ids"] == prompt
        positions = output["prompt_logprobs"]
        assert len(positions) == len(prompt) and positions[0] is None
        reference = hf_log_softmax(hf, prompt)
        for i in range(1, len(prompt)):
            _check_position(positions[i], reference[i - 1], prompt[i], 3)


def test_sampled_logprobs_are_raw_and_include_the_sampled_token(results, cases, hf):
    """logprobs_mode raw_logprobs (vLLM's default): the model's log-softmax before temperature
    and top-k, for the top 2 and for the sampled token, which top-k sampling keeps in HF's top 8."""
    run = completed(results, "sampled_logprobs")
    for prompt, output in zip(cases["prompts"][:2], run["outputs"], strict=True):
        assert len(output["completions"]) == 2
        for completion in output["completions"]:
            assert len(completion["tokens"]) == MAX_TOKENS  # ignore_eos
            reference = hf_log_softmax(hf, prompt + completion["tokens"])
            for i, (token, entries) in enumerate(zip(completion["tokens"], completion["logprobs"], strict=True)):
                row = reference[len(prompt) - 1 + i]
                _check_position(entries, row, token, 2)
                assert token in row.topk(TOP_K).indices.tolist()


# --- beam search ----------------------------------------------------------------------------


def hf_beam_search(hf, prompt: list[int], length_penalty: float) -> list[list[int]]:
    """HF beam search with early_stopping="never" (the exact search, which vLLM's is: it runs
    every step to max_tokens); each sequence up to and including its EOS."""
    model, tokenizer = hf
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=BEAM_WIDTH,
                             num_return_sequences=BEAM_WIDTH, max_new_tokens=BEAM_TOKENS,
                             length_penalty=length_penalty, early_stopping="never",
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = out[:, len(prompt):].tolist()
    return [row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
            for row in rows]


def beam_search_by_definition(hf, prompt: list[int], length_penalty: float, finish_any_eos: bool):
    """Beam search written out on HF log-probabilities. Each step extends every beam by its
    2·width most likely tokens and keeps the best width candidates that do not end in EOS;
    the result is the best width of the finished and running beams, by cumulative logprob /
    generated length ** length_penalty. A candidate ending in EOS is finished: every one
    (``finish_any_eos``, vLLM's rule) or only one ranking among the step's best width (HF's)."""
    eos = hf[1].eos_token_id

    def score(beam):
        return beam[1] / len(beam[0]) ** length_penalty

    running, finished = [([], 0.0)], []
    for _ in range(BEAM_TOKENS):
        candidates = []
        for tokens, cumulative in running:
            top = hf_log_softmax(hf, prompt + tokens)[-1].topk(2 * BEAM_WIDTH)
            candidates += [(tokens + [int(t)], cumulative + float(v)) for v, t in zip(top.values, top.indices)]
        candidates.sort(key=score, reverse=True)
        ranked = candidates if finish_any_eos else candidates[:BEAM_WIDTH]
        finished += [c for c in ranked if c[0][-1] == eos]
        running = [c for c in candidates if c[0][-1] != eos][:BEAM_WIDTH]
    return [tokens for tokens, _ in sorted(finished + running, key=score, reverse=True)[:BEAM_WIDTH]]


def _beams(results, length_penalty: float, cases) -> list[list[list[int]]]:
    run = completed(results, f"beam_lp{length_penalty:g}")
    return [[b["tokens"][len(p):] for b in beams]
            for p, beams in zip(cases["beam_prompts"], run["beams"], strict=True)]


def test_beam_search_equals_hf_beam_search(results, cases, hf):
    beams = _beams(results, 1.0, cases)
    expected = [hf_beam_search(hf, p, 1.0) for p in cases["beam_prompts"]]
    assert beams == expected
    assert any(len(b) < BEAM_TOKENS for e in expected for b in e), \
        "some beams must end at EOS, or the length penalty is idle"
    run = completed(results, "beam_lp1")
    for prompt, sequences in zip(cases["beam_prompts"], run["beams"], strict=True):
        for beam in sequences:
            generated = beam["tokens"][len(prompt):]
            reference = hf_log_softmax(hf, beam["tokens"])
            cumulative = sum(float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(generated))
            assert beam["cum_logprob"] == pytest.approx(cumulative, abs=LOGPROB_ATOL * len(generated))


def test_beam_search_finishes_every_eos_candidate_unlike_hf(results, cases, hf):
    """Upstream vLLM (entrypoints/generate/beam_search/offline.py) finishes a beam at every
    EOS among a beam's 2·width candidates; HF only at one ranking among the step's best
    width. With length_penalty -1 (short beams favoured) that changes the result for two of
    these prompts: the engine must give vLLM's answer, HF's differs only by that rule."""
    beams = _beams(results, -1.0, cases)
    vllm_rule = [beam_search_by_definition(hf, p, -1.0, finish_any_eos=True) for p in cases["beam_prompts"]]
    hf_rule = [beam_search_by_definition(hf, p, -1.0, finish_any_eos=False) for p in cases["beam_prompts"]]
    assert beams == vllm_rule
    assert [hf_beam_search(hf, p, -1.0) for p in cases["beam_prompts"]] == hf_rule
    assert vllm_rule != hf_rule, "the prompts must tell the two rules apart"


# --- penalties ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "repetition", "presence", "frequency"), [
    ("repetition", 1.4, 0.0, 0.0),
    ("presence", 1.0, 1.5, 0.0),
    ("frequency", 1.0, 0.0, 0.9),
    ("all_penalties", 1.2, 0.5, 0.5),
])
def test_penalties_equal_hf_logits_processors(results, cases, hf, name, repetition, presence, frequency):
    """Repetition: HF's own processor (prompt and output tokens, as vLLM); presence and
    frequency: vLLM's definition over output tokens, applied after repetition as vLLM does."""
    run = completed(results, name)
    expected = []
    for prompt in cases["prompts"][:2]:
        extra = [OutputPenalties(len(prompt), presence, frequency)] if presence or frequency else []
        expected.append(hf_generate(hf, prompt, MAX_TOKENS, repetition_penalty=repetition,
                                    logits_processor=extra))
    assert run["tokens"] == expected
    assert expected != cases["greedy"][:2], "the penalty must change the greedy output"


# --- seeded sampling ------------------------------------------------------------------------


def _completions(run) -> list[list[list[int]]]:
    return [[c["tokens"] for c in output["completions"]] for output in run["outputs"]]


def test_seeded_n_completions_repeat_and_differ_per_seed(results):
    seeded = _completions(completed(results, "seeded"))
    assert [len(c) for c in seeded] == [3, 3]
    assert seeded == _completions(completed(results, "seeded_again"))
    assert _completions(completed(results, "other_seed")) != seeded
    for completions in seeded:
        assert len({tuple(c) for c in completions}) == 3, "n samples of one request differ"
    # the same seeded request inside another batch samples the same tokens
    assert _completions(completed(results, "seeded_in_batch"))[1] == seeded[0]


def test_seeded_samples_stay_in_hf_top_k(results, cases, hf):
    run = completed(results, "seeded")
    for prompt, completions in zip(cases["prompts"][:2], _completions(run), strict=True):
        for tokens in completions:
            assert len(tokens) == MAX_TOKENS  # ignore_eos
            reference = hf_log_softmax(hf, prompt + tokens)
            for i, token in enumerate(tokens):
                assert token in reference[len(prompt) - 1 + i].topk(TOP_K).indices.tolist(), i


# --- stop conditions and token constraints --------------------------------------------------


def test_stop_string_ends_the_text_before_it(results, cases):
    tokenizer, stop = cases["tokenizer"], cases["stop"]
    full = tokenizer.decode(cases["greedy"][1], skip_special_tokens=True)
    completion = completed(results, "stop")["outputs"][0]["completions"][0]
    assert completion["finish_reason"] == "stop"
    assert completion["text"] == full[: full.index(stop)]
    included = completed(results, "stop_included")["outputs"][0]["completions"][0]
    assert included["text"] == full[: full.index(stop) + len(stop)]


def test_stop_token_ends_generation_at_it(results, cases):
    completion = completed(results, "stop_token")["outputs"][0]["completions"][0]
    assert completion["finish_reason"] == "stop"
    assert completion["tokens"] == cases["greedy"][0][:5]


def test_bad_words_equal_hf_no_bad_words(results, cases, hf):
    banned = bad_word_token_ids(cases["tokenizer"], cases["bad_words"])
    prompt = cases["prompts"][2]
    expected = hf_generate(hf, prompt, MAX_TOKENS, bad_words_ids=banned)
    assert expected != cases["greedy"][2], "the bad words must change the greedy output"
    assert completed(results, "bad_words")["tokens"] == [expected]


def test_min_tokens_equals_hf_min_new_tokens(results, cases, hf):
    _, tokenizer = hf
    stop = cases["greedy"][0][1]
    expected = hf_generate(hf, cases["prompts"][0], MAX_TOKENS, min_new_tokens=6,
                           eos_token_id=[tokenizer.eos_token_id, stop])
    assert len(expected) >= 6
    assert completed(results, "min_tokens")["tokens"] == [expected]


def test_logit_bias_equals_hf_sequence_bias(results, cases, hf):
    bias = _logit_bias(cases["greedy"])
    expected = [hf_generate(hf, p, MAX_TOKENS, sequence_bias={(t,): b for t, b in bias.items()})
                for p in cases["prompts"][:2]]
    assert expected != cases["greedy"][:2]
    assert completed(results, "logit_bias")["tokens"] == expected


def test_allowed_token_ids_equal_hf_prefix_constraint(results, cases, hf):
    allowed = _allowed(cases["greedy"])
    expected = [hf_generate(hf, p, MAX_TOKENS, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
                for p in cases["prompts"][:2]]
    tokens = completed(results, "allowed_token_ids")["tokens"]
    assert all(t in allowed for row in tokens for t in row)
    assert tokens == expected


def test_chat_renders_the_template_and_equals_hf(results, hf):
    _, tokenizer = hf
    messages = [{"role": "user", "content": "What is a header?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    output = completed(results, "chat")["outputs"][0]
    assert output["prompt_token_ids"] == ids
    assert output["completions"][0]["tokens"] == hf_generate(hf, ids, MAX_TOKENS)


# --- structured outputs ---------------------------------------------------------------------


def _texts(run) -> list[str]:
    """The texts of a structured run's completions (every such run sends two prompts)."""
    assert len(run["outputs"]) == 2, run["outputs"]
    texts = []
    for output in run["outputs"]:
        completion = output["completions"][0]
        assert completion["finish_reason"] == "stop", completion  # the grammar ended it, not max_tokens
        texts.append(completion["text"])
    return texts


def _unconstrained_texts(cases) -> list[str]:
    return [cases["tokenizer"].decode(g, skip_special_tokens=True) for g in cases["greedy"][:2]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_regex(results, cases, backend):
    assert not any(re.fullmatch(REGEX, t) for t in _unconstrained_texts(cases))
    for text in _texts(completed(results, f"{backend}_regex")):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_choice(results, backend):
    for text in _texts(completed(results, f"{backend}_choice")):
        assert text in CHOICES


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_json_schema(results, backend):
    import jsonschema

    for text in _texts(completed(results, f"{backend}_json")):
        jsonschema.validate(json.loads(text), SCHEMA)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", outside_strings), f"engine-level disable_any_whitespace: {text!r}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_grammar(results, cases, backend):
    import lark

    parser = lark.Lark(GRAMMAR_LARK)
    for text in _unconstrained_texts(cases):
        with pytest.raises(lark.exceptions.LarkError):
            parser.parse(text)
    for text in _texts(completed(results, f"{backend}_grammar")):
        parser.parse(text)


# --- a rejected request leaves the engine working ------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_invalid_structured_spec_is_rejected_and_the_engine_goes_on(results, cases, backend):
    assert "ValidationError" in results[f"{backend}_invalid"]["error"]
    for text in _texts(completed(results, f"{backend}_after_invalid")):
        assert re.fullmatch(REGEX, text), text
    assert completed(results, f"{backend}_greedy_after_invalid")["tokens"] == cases["greedy"][:2]


def test_a_too_long_prompt_is_rejected_and_the_engine_goes_on(results, cases):
    assert "maximum context length is 512" in results["prompt_too_long"]["error"]
    assert completed(results, "after_prompt_too_long")["tokens"] == cases["greedy"][:2]
