"""The NPU implementations of Model Runner V2's input kernels (ascend_patch.npu.runner.v2.input_kernels).

Oracles: per-request loops transcribed from the Triton kernels (vLLM 0.34.0
``v1/worker/gpu/{input_batch,buffer_utils,mm/rope,model_states/prompt_embeds}.py``, identical
kernels in 0.33.0), vectors derived by hand, and vLLM's own host code (``StagedWriteTensor``,
``post_update``, ...) launching the implementations through its kernel registry. Every loop runs
over Python ints, row by row, the way one Triton program does.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
import torch

from ascend_patch.npu.runner.v2 import input_kernels as kernels

MAX_REQS, MAX_LEN, MAX_TOKENS, DRAFTS = 8, 24, 40, 3


def _kernel(fn):
    module = next(m for m, functions in kernels.KERNELS.items() if fn in functions)
    return getattr(importlib.import_module(module), fn.__name__)


def _vllm_names(kernel):
    """The installed vLLM kernel's parameter names, as the registry reads them (a Triton
    ``JITFunction``'s ``arg_names``; without Triton the plain function's, or an override's)."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        names = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    return tuple(names)


ALL = [fn for functions in kernels.KERNELS.values() for fn in functions]
LAUNCH_OPTIONS = {kernels._post_update_kernel: ("num_warps",)}
"""Launch options MRV2 passes with a kernel's arguments (input_batch.py post_update: num_warps=1)."""


@pytest.mark.parametrize("fn", ALL, ids=lambda fn: fn.__name__)
def test_parameters_are_the_kernels(fn):
    ours = inspect.signature(fn).parameters
    assert tuple(ours) == _vllm_names(_kernel(fn)) + LAUNCH_OPTIONS.get(fn, ())
    for option in LAUNCH_OPTIONS.get(fn, ()):
        assert ours[option].default is None


WRONG = pytest.mark.parametrize("wrong", [False, True], ids=["exact", "off_by_one"])
"""Each comparison runs twice: on the implementation as it is, which must agree with the loop, and
as a negative control on an off-by-one slip fed through its inputs (a token read one late, a
comparison turned from < into <=, ...), which the same comparison must catch."""


def _agree(*pairs) -> bool:
    return all(torch.equal(ours, expected) for ours, expected in pairs)


def _late(tensor: torch.Tensor) -> torch.Tensor:
    return tensor + 1


# --- A batch: rows in every state a step can hold -------------------------------------------


def _batch(seed: int, num_reqs: int = 6):
    """``num_reqs`` rows on random request slots: first chunks, middle chunks and last chunks of
    prefills, resumed requests (prefill_len > prompt: output tokens re-prefilled), decodes with
    0..DRAFTS drafts, one row with an empty query; the token buffer is padded past the batch and
    ``query_start_loc`` padded as for FULL graphs."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    slots = torch.randperm(MAX_REQS, generator=g)[:num_reqs]
    prefill_len = torch.randint(1, 12, (MAX_REQS,), generator=g, dtype=torch.int32)
    num_computed = torch.zeros(MAX_REQS, dtype=torch.int32)
    query_lens, drafts = [], []
    for b, r in enumerate(slots.tolist()):
        pl = int(prefill_len[r])
        kind = b % 3 if b != num_reqs - 2 else "empty"
        if kind == 0:  # a prefill chunk (first, middle or last)
            nc = rnd(0, pl - 1)
            query_lens.append(rnd(1, pl - nc)), drafts.append(0)
        elif kind == "empty":
            nc = rnd(0, pl + 3)
            query_lens.append(0), drafts.append(0)
        else:  # a decode, with drafts
            nc = rnd(pl, pl + 4)
            d = rnd(0, DRAFTS)
            query_lens.append(1 + d), drafts.append(d)
        num_computed[r] = nc
    qsl = torch.full((MAX_REQS + 1,), 0, dtype=torch.int32)
    qsl[1 : num_reqs + 1] = torch.tensor(query_lens).cumsum(0)
    qsl[num_reqs + 1 :] = qsl[num_reqs]
    return {
        "g": g,
        "idx_mapping": slots.to(torch.int64),
        "query_start_loc": qsl,
        "prefill_len": prefill_len,
        "num_computed": num_computed,
        "drafts": drafts,
        "all_token_ids": torch.randint(0, 1000, (MAX_REQS, MAX_LEN), generator=g, dtype=torch.int32),
    }


def _rows(data):
    qsl = data["query_start_loc"].tolist()
    return [(b, r, qsl[b], qsl[b + 1]) for b, r in enumerate(data["idx_mapping"].tolist())]


# --- _prepare_prefill_inputs_kernel -----------------------------------------------------------


def loop_prepare_prefill(input_ids, next_prefill, idx_mapping, qsl, all_ids, prefill_lens, num_computed):
    num_lookahead = next_prefill.shape[0]
    for b, r in enumerate(idx_mapping.tolist()):
        pl, nc = int(prefill_lens[r]), int(num_computed[r])
        if nc >= pl:
            continue
        start, end = int(qsl[b]), int(qsl[b + 1])
        for i in range(end - start):
            input_ids[start + i] = all_ids[r, nc + i]
        for k in range(num_lookahead):
            pos = nc + end - start + k
            next_prefill[k, r] = all_ids[r, pos] if pos < pl else 0


def _run_prepare_prefill(fn, data, num_lookahead):
    input_ids = torch.full((MAX_TOKENS,), -5, dtype=torch.int32)
    next_prefill = torch.full((num_lookahead, MAX_REQS), -9, dtype=torch.int32)
    fn(input_ids, next_prefill, next_prefill.stride(0), num_lookahead, data["idx_mapping"],
       data["query_start_loc"], data["all_token_ids"], data["all_token_ids"].stride(0),
       data["prefill_len"], data["num_computed"], BLOCK_SIZE=1024, LOOKAHEAD_BLOCK=4)
    return input_ids, next_prefill


@WRONG
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_lookahead", [0, 2])
def test_prepare_prefill_inputs_equals_the_kernels_loop(seed, num_lookahead, wrong):
    data = _batch(seed)
    ours = dict(data, num_computed=_late(data["num_computed"])) if wrong else data
    input_ids, next_prefill = _run_prepare_prefill(kernels._prepare_prefill_inputs_kernel, ours,
                                                   num_lookahead)
    expected_ids = torch.full((MAX_TOKENS,), -5, dtype=torch.int32)
    expected_next = torch.full((num_lookahead, MAX_REQS), -9, dtype=torch.int32)
    loop_prepare_prefill(expected_ids, expected_next, data["idx_mapping"], data["query_start_loc"],
                         data["all_token_ids"], data["prefill_len"], data["num_computed"])
    assert _agree((input_ids, expected_ids), (next_prefill, expected_next)) is not wrong


def test_prepare_prefill_inputs_by_hand():
    # Row 0 -> slot 2: prompt 10 11 12 13 14, 1 computed, chunk of 2 -> 11 12; lookahead 13 14.
    # Row 1 -> slot 0: decoding (3 computed of a 3-token prefill): untouched.
    # Row 2 -> slot 1: resumed after preemption, prefill 4 (prompt + one output), 3 computed,
    # chunk of 1 -> 23; lookahead past the prefill -> 0 0. Slots past the batch stay.
    all_ids = torch.tensor([[1, 2, 3, 4, 5], [20, 21, 22, 23, 24], [10, 11, 12, 13, 14]], dtype=torch.int32)
    input_ids = torch.full((6,), -1, dtype=torch.int32)
    next_prefill = torch.full((2, 3), -1, dtype=torch.int32)
    kernels._prepare_prefill_inputs_kernel(
        input_ids, next_prefill, 3, 2, torch.tensor([2, 0, 1]), torch.tensor([0, 2, 3, 4], dtype=torch.int32),
        all_ids, 5, torch.tensor([3, 4, 5], dtype=torch.int32), torch.tensor([3, 3, 1], dtype=torch.int32))
    assert input_ids.tolist() == [11, 12, -1, 23, -1, -1]
    assert next_prefill.tolist() == [[-1, 0, 13], [-1, 0, 14]]


# --- _prepare_pos_seq_lens_kernel -------------------------------------------------------------


def loop_pos_seq_lens(pos, seq_lens, idx_mapping, qsl, num_computed, max_num_reqs):
    num_reqs = idx_mapping.shape[0]
    for i in range(num_reqs, max_num_reqs):
        seq_lens[i] = 0
    for b, r in enumerate(idx_mapping.tolist()):
        nc, start, end = int(num_computed[r]), int(qsl[b]), int(qsl[b + 1])
        seq_lens[b] = nc + end - start
        for i in range(end - start):
            pos[start + i] = nc + i


@WRONG
@pytest.mark.parametrize("seed", range(4))
def test_prepare_pos_seq_lens_equals_the_kernels_loop(seed, wrong):
    data = _batch(seed)
    pos, seq_lens = torch.full((MAX_TOKENS,), -3), torch.full((MAX_REQS,), -3, dtype=torch.int32)
    expected_pos, expected_seq_lens = pos.clone(), seq_lens.clone()
    num_computed = _late(data["num_computed"]) if wrong else data["num_computed"]
    kernels._prepare_pos_seq_lens_kernel(pos, seq_lens, data["idx_mapping"], data["query_start_loc"],
                                         num_computed, MAX_REQS, BLOCK_SIZE=1024)
    loop_pos_seq_lens(expected_pos, expected_seq_lens, data["idx_mapping"], data["query_start_loc"],
                      data["num_computed"], MAX_REQS)
    assert _agree((pos, expected_pos), (seq_lens, expected_seq_lens)) is not wrong


def test_prepare_pos_seq_lens_by_hand():
    # Row 0 -> slot 1 (5 computed, query 1): position 5, seq_len 6. Row 1 -> slot 0 (0
    # computed, query 3): 0 1 2, seq_len 3. seq_lens of the two padded rows: 0.
    pos, seq_lens = torch.full((6,), -1), torch.full((4,), -1, dtype=torch.int32)
    kernels._prepare_pos_seq_lens_kernel(pos, seq_lens, torch.tensor([1, 0]),
                                         torch.tensor([0, 1, 4, 4, 4], dtype=torch.int32),
                                         torch.tensor([0, 5], dtype=torch.int32), 4)
    assert pos.tolist() == [5, 0, 1, 2, -1, -1]
    assert seq_lens.tolist() == [6, 3, 0, 0]


# --- _combine_sampled_and_draft_tokens_kernel -------------------------------------------------


def loop_combine(input_ids, idx_mapping, last_sampled, qsl, seq_lens, prefill_len, draft_tokens,
                 cu_num_logits, logits_indices, num_new):
    for b, r in enumerate(idx_mapping.tolist()):
        start_l, end_l = int(cu_num_logits[b]), int(cu_num_logits[b + 1])
        num_logits = end_l - start_l
        num_draft = num_logits - num_new
        query_end = int(qsl[b + 1])
        logits_start = query_end - num_logits
        for i in range(num_logits):
            logits_indices[start_l + i] = logits_start + i
        seq_len, pl = int(seq_lens[b]), int(prefill_len[r])
        if seq_len <= pl:
            continue
        if num_new > 0 and seq_len - num_logits >= pl:
            input_ids[logits_start] = last_sampled.view(-1)[r]
        for i in range(max(num_draft, 0)):
            input_ids[query_end - num_draft + i] = draft_tokens[r, i]


def _combine_case(seed: int, num_new: int):
    data = _batch(seed)
    num_reqs = data["idx_mapping"].shape[0]
    qlens = (data["query_start_loc"][1 : num_reqs + 1] - data["query_start_loc"][:num_reqs]).tolist()
    # A row samples its drafts plus num_new; an empty query has no logits.
    num_logits = [0 if q == 0 else min(q, d + num_new) for q, d in zip(qlens, data["drafts"])]
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(num_logits).cumsum(0)
    seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32)
    for b, r in enumerate(data["idx_mapping"].tolist()):
        seq_lens[b] = int(data["num_computed"][r]) + qlens[b]
    g = data["g"]
    args = dict(
        idx_mapping=data["idx_mapping"],
        last_sampled=torch.randint(0, 1000, (MAX_REQS, 1), generator=g),
        qsl=data["query_start_loc"], seq_lens=seq_lens, prefill_len=data["prefill_len"],
        draft_tokens=torch.randint(0, 1000, (MAX_REQS, DRAFTS), generator=g),
        cu_num_logits=cu)
    return data, args, int(cu[-1])


def _run_combine(fn, args, total_logits, num_new):
    input_ids = torch.arange(MAX_TOKENS, dtype=torch.int32) + 5000
    logits_indices = torch.full((total_logits,), -7, dtype=torch.int64)
    fn(input_ids, args["idx_mapping"], args["last_sampled"], args["qsl"], args["seq_lens"],
       args["prefill_len"], args["draft_tokens"], args["draft_tokens"].stride(0),
       args["cu_num_logits"], logits_indices, BLOCK_SIZE=4, NUM_NEW_SAMPLED_TOKENS=num_new)
    return input_ids, logits_indices


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_new", [1, 0])
def test_combine_sampled_and_draft_tokens_equals_the_kernels_loop(seed, num_new):
    _, args, total = _combine_case(seed, num_new)
    input_ids, logits_indices = _run_combine(kernels._combine_sampled_and_draft_tokens_kernel, args,
                                             total, num_new)
    expected_ids = torch.arange(MAX_TOKENS, dtype=torch.int32) + 5000
    expected_indices = torch.full((total,), -7, dtype=torch.int64)
    loop_combine(expected_ids, args["idx_mapping"], args["last_sampled"], args["qsl"],
                 args["seq_lens"], args["prefill_len"], args["draft_tokens"], args["cu_num_logits"],
                 expected_indices, num_new)
    assert torch.equal(logits_indices, expected_indices)
    assert torch.equal(input_ids, expected_ids)


def test_combine_sampled_and_draft_tokens_by_hand():
    # Row 0 -> slot 1: decode with 2 drafts (query 3 at 0..2, seq_len 9 > prefill 5): the last
    # sampled 77 at 0, drafts 40 41 at 1 2, logits 0 1 2.
    # Row 1 -> slot 0: chunked prefill (query 2 at 3..4, seq_len 4 <= prefill 6): logit 4 only.
    # Row 2 -> slot 2: the last prefill chunk's sample slot: seq_len 7 > prefill 6, but its
    # logit's position 6 is the prompt's: the prompt token at 5 stays, logit 5.
    input_ids = torch.tensor([-1, -1, -1, 50, 51, 52, -1], dtype=torch.int32)
    logits_indices = torch.full((5,), -1)
    kernels._combine_sampled_and_draft_tokens_kernel(
        input_ids, torch.tensor([1, 0, 2]), torch.tensor([[66], [77], [88]]),
        torch.tensor([0, 3, 5, 6], dtype=torch.int32), torch.tensor([9, 4, 7], dtype=torch.int32),
        torch.tensor([6, 5, 7], dtype=torch.int32), torch.tensor([[30, 31], [40, 41], [60, 61]]), 2,
        torch.tensor([0, 3, 4, 5], dtype=torch.int32), logits_indices, 4)
    assert logits_indices.tolist() == [0, 1, 2, 4, 5]
    assert input_ids.tolist() == [77, 40, 41, 50, 51, 52, -1]


def test_a_draft_off_by_one_fails_the_comparison():
    """Negative control: the same comparison rejects an implementation that reads each draft
    from the next column (drafts[r, i + 1]), the slip the window arithmetic invites."""
    _, args, total = _combine_case(1, 1)
    assert any(n > 1 for n in (args["cu_num_logits"][1:] - args["cu_num_logits"][:-1]).tolist())
    shifted = dict(args, draft_tokens=torch.cat((args["draft_tokens"][:, 1:],
                                                 args["draft_tokens"][:, :1]), dim=1))
    wrong_ids, _ = _run_combine(kernels._combine_sampled_and_draft_tokens_kernel, shifted, total, 1)
    expected_ids = torch.arange(MAX_TOKENS, dtype=torch.int32) + 5000
    loop_combine(expected_ids, args["idx_mapping"], args["last_sampled"], args["qsl"],
                 args["seq_lens"], args["prefill_len"], args["draft_tokens"], args["cu_num_logits"],
                 torch.empty(total, dtype=torch.int64), 1)
    assert not torch.equal(wrong_ids, expected_ids)


# --- _get_num_sampled_and_rejected_kernel ------------------------------------------------------


@WRONG
def test_num_sampled_and_rejected_equals_the_kernels_loop(wrong):
    _, args, _ = _combine_case(2, 1)
    num_reqs = args["idx_mapping"].shape[0]
    num_sampled = torch.randint(1, DRAFTS + 2, (num_reqs,), generator=torch.Generator().manual_seed(3),
                                dtype=torch.int32)
    # Row 0 a chunked prefill for sure (seq_len below its prefill_len), row 1 the prefill's last
    # chunk (seq_len equal to it: it samples).
    prefill_len = args["prefill_len"][args["idx_mapping"]]
    args["seq_lens"][0], args["seq_lens"][1] = int(prefill_len[0]) - 1, int(prefill_len[1])
    expected_sampled, expected_rejected = num_sampled.clone(), torch.zeros(num_reqs, dtype=torch.int32)
    for b, r in enumerate(args["idx_mapping"].tolist()):
        chunked = int(args["seq_lens"][b]) < int(args["prefill_len"][r])
        n = 0 if chunked else int(num_sampled[b])
        expected_sampled[b] = n
        logits = int(args["cu_num_logits"][b + 1]) - int(args["cu_num_logits"][b])
        expected_rejected[b] = 0 if chunked else logits - n
    rejected = torch.full((num_reqs,), -1, dtype=torch.int32)
    kernels._get_num_sampled_and_rejected_kernel(  # wrong: chunked when seq_len <= prefill_len
        num_sampled, rejected, args["seq_lens"], args["cu_num_logits"], args["idx_mapping"],
        _late(args["prefill_len"]) if wrong else args["prefill_len"])
    assert num_sampled[0] == 0 and rejected[0] == 0
    assert _agree((num_sampled, expected_sampled), (rejected, expected_rejected)) is not wrong


# --- _post_update_kernel ----------------------------------------------------------------------


def loop_post_update(idx_mapping, num_computed, last_sampled, bin_counts, sampled, num_sampled,
                     num_rejected, qsl, all_ids, total_len, drafts, drafts_out):
    for b, r in enumerate(idx_mapping.tolist()):
        if r < 0:
            continue
        if drafts is not None:
            for i in range(drafts.shape[1]):
                drafts_out[r, i] = drafts[b, i]
        length, n = int(total_len[r]), int(num_sampled[b])
        if n > 0:
            last_sampled.view(-1)[r] = sampled[b, n - 1]
            total_len[r] = length + n
        for i in range(n):
            token = int(sampled[b, i])
            all_ids[r, length + i] = token
            if bin_counts is not None:
                bin_counts[r, token] += 1
        query_len = 0 if qsl is None else int(qsl[b + 1]) - int(qsl[b])
        num_computed[r] += query_len - int(num_rejected[b])


def _post_update_case(seed: int, with_drafts: bool, with_counts: bool, with_qsl: bool):
    data = _batch(seed)
    g = data["g"]
    num_reqs = data["idx_mapping"].shape[0]
    idx = data["idx_mapping"].clone()
    idx[1] = -1  # a filtered row (pipeline parallelism)
    sampled = torch.randint(0, 12, (num_reqs, DRAFTS + 1), generator=g)
    sampled[:, 1] = sampled[:, 0]  # a token sampled twice: counted twice
    num_sampled = torch.randint(0, DRAFTS + 2, (num_reqs,), generator=g, dtype=torch.int32)
    state = {
        "num_computed": data["num_computed"].clone(),
        "last_sampled": torch.randint(0, 12, (MAX_REQS, 1), generator=g),
        "bin_counts": torch.randint(0, 3, (MAX_REQS, 12), generator=g, dtype=torch.int32) if with_counts else None,
        "all_ids": data["all_token_ids"].clone(),
        "total_len": torch.randint(0, MAX_LEN - DRAFTS - 1, (MAX_REQS,), generator=g, dtype=torch.int32),
        "drafts_out": torch.randint(0, 1000, (MAX_REQS, DRAFTS), generator=g),
    }
    inputs = {
        "idx": idx, "sampled": sampled, "num_sampled": num_sampled,
        "num_rejected": torch.randint(0, 2, (num_reqs,), generator=g, dtype=torch.int32),
        "qsl": data["query_start_loc"] if with_qsl else None,
        "drafts": torch.randint(0, 1000, (num_reqs, DRAFTS), generator=g) if with_drafts else None,
    }
    return state, inputs


def _run_post_update(fn, state, inputs):
    s = {k: None if v is None else v.clone() for k, v in state.items()}
    counts = s["bin_counts"]
    fn(inputs["idx"], s["num_computed"], s["last_sampled"], counts,
       counts.stride(0) if counts is not None else 0, inputs["sampled"], inputs["sampled"].stride(0),
       inputs["num_sampled"], inputs["num_rejected"], inputs["qsl"], s["all_ids"],
       s["all_ids"].stride(0), s["total_len"], inputs["drafts"], s["drafts_out"],
       DRAFTS if inputs["drafts"] is not None else 0, num_warps=1)
    return s


def _loop_post_update_state(state, inputs):
    s = {k: None if v is None else v.clone() for k, v in state.items()}
    loop_post_update(inputs["idx"], s["num_computed"], s["last_sampled"], s["bin_counts"],
                     inputs["sampled"], inputs["num_sampled"], inputs["num_rejected"], inputs["qsl"],
                     s["all_ids"], s["total_len"], inputs["drafts"], s["drafts_out"])
    return s


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_drafts,with_counts,with_qsl",
                         [(False, True, True), (True, True, True), (True, False, False)])
def test_post_update_equals_the_kernels_loop(seed, with_drafts, with_counts, with_qsl):
    state, inputs = _post_update_case(seed, with_drafts, with_counts, with_qsl)
    ours = _run_post_update(kernels._post_update_kernel, state, inputs)
    expected = _loop_post_update_state(state, inputs)
    for name, value in expected.items():
        assert (value is None and ours[name] is None) or torch.equal(ours[name], value), name


def test_post_update_by_hand():
    # Row 0 -> slot 1: sampled 7 7 (2 of 3), total_len 2 -> tokens at 2 3, total 4, last 7,
    # bin 7 counted twice, query 3 less 1 rejected -> computed 5 + 2. Row 1 filtered (-1).
    # Row 2 -> slot 0: nothing sampled (chunked prefill): query 2 -> computed 0 + 2.
    computed, last = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([[1], [2]])
    counts = torch.zeros(2, 8, dtype=torch.int32)
    all_ids, total = torch.zeros(2, 5, dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    kernels._post_update_kernel(
        torch.tensor([1, -1, 0]), computed, last, counts, 8, torch.tensor([[7, 7, 3], [4, 4, 4], [5, 5, 5]]), 3,
        torch.tensor([2, 3, 0], dtype=torch.int32), torch.tensor([1, 0, 0], dtype=torch.int32),
        torch.tensor([0, 3, 4, 6], dtype=torch.int32), all_ids, 5, total, None, None, 0, num_warps=1)
    assert computed.tolist() == [2, 7]
    assert last.tolist() == [[1], [7]]
    assert counts[1].tolist() == [0] * 7 + [2] and not counts[0].any()
    assert all_ids.tolist() == [[0] * 5, [0, 0, 7, 7, 0]]
    assert total.tolist() == [1, 4]


def test_an_appending_off_by_one_fails_the_comparison():
    """Negative control: appending sampled tokens one column late (total_len + 1) is caught."""
    state, inputs = _post_update_case(0, False, True, True)
    late = dict(state, total_len=state["total_len"] + 1)
    ours = _run_post_update(kernels._post_update_kernel, late, inputs)
    expected = _loop_post_update_state(state, inputs)
    assert not torch.equal(ours["all_ids"], expected["all_ids"])


# --- _post_update_num_computed_tokens_kernel and _expand_idx_mapping_kernel --------------------


def test_post_update_num_computed_tokens_by_hand():
    computed = torch.tensor([10, 20, 30, 40], dtype=torch.int32)
    kernels._post_update_num_computed_tokens_kernel(torch.tensor([3, 0]), computed,
                                                    torch.tensor([0, 4, 5, 5], dtype=torch.int32))
    assert computed.tolist() == [11, 20, 30, 44]


@WRONG
@pytest.mark.parametrize("seed", range(3))
def test_post_update_num_computed_tokens_equals_the_kernels_loop(seed, wrong):
    data = _batch(seed)
    computed = data["num_computed"].clone()
    expected = computed.clone()
    for b, r, start, end in _rows(data):
        expected[r] += end - start
    qsl = data["query_start_loc"]
    kernels._post_update_num_computed_tokens_kernel(  # wrong: each row the next row's query
        data["idx_mapping"], computed, qsl[1:] if wrong else qsl)
    assert _agree((computed, expected)) is not wrong


# --- the hybrid model state's accepted counts (model_states/mamba_hybrid.py) -------------------


def test_num_accepted_scatter_and_fill_by_hand():
    """A row's accepted count is what it sampled, at least one (a chunked prefill samples none);
    a filtered row (-1) leaves its request alone."""
    accepted = torch.ones(4, dtype=torch.int32)
    kernels._scatter_num_accepted_kernel(_i32([2, -1, 0]), _i32([0, 3, 2]), accepted)
    assert accepted.tolist() == [2, 1, 1, 1]
    kernels._fill_num_accepted_kernel(_i32([1, -1, 3]), accepted, 4)
    assert accepted.tolist() == [2, 4, 1, 4]


@WRONG
@pytest.mark.parametrize("seed", range(3))
def test_num_accepted_scatter_equals_the_kernels_loop(seed, wrong):
    generator = torch.Generator().manual_seed(seed)
    requests = torch.randperm(8, generator=generator)[:5].to(torch.int32)
    requests[1] = -1
    sampled = torch.randint(0, 4, (5,), generator=generator, dtype=torch.int32)
    accepted = torch.randint(1, 4, (8,), generator=generator, dtype=torch.int32)
    expected = accepted.clone()
    for r, n in zip(requests.tolist(), sampled.tolist()):
        if r >= 0:
            expected[r] = max(n, 1)
    # wrong: each row's count booked for the next row's request
    kernels._scatter_num_accepted_kernel(requests.roll(1) if wrong else requests, sampled, accepted)
    assert _agree((accepted, expected)) is not wrong


def loop_expand(idx_mapping, expanded, local_pos, cu):
    for b, r in enumerate(idx_mapping.tolist()):
        for i in range(int(cu[b + 1]) - int(cu[b])):
            expanded[int(cu[b]) + i] = r
            local_pos[int(cu[b]) + i] = i


@WRONG
@pytest.mark.parametrize("seed", range(3))
def test_expand_idx_mapping_equals_the_kernels_loop(seed, wrong):
    _, args, total = _combine_case(seed, 1)
    expanded, local = torch.full((total + 2,), -1), torch.full((total + 2,), -1, dtype=torch.int32)
    expected_expanded, expected_local = expanded.clone(), local.clone()
    cu = args["cu_num_logits"]
    kernels._expand_idx_mapping_kernel(args["idx_mapping"], expanded, local, _late(cu) if wrong else cu, 4)
    loop_expand(args["idx_mapping"], expected_expanded, expected_local, cu)
    assert _agree((expanded, expected_expanded), (local, expected_local)) is not wrong


def test_expand_idx_mapping_by_hand():
    expanded, local = torch.full((5,), -1), torch.full((5,), -1, dtype=torch.int32)
    kernels._expand_idx_mapping_kernel(torch.tensor([6, 2, 4]), expanded, local,
                                       torch.tensor([0, 3, 3, 4], dtype=torch.int32), 4)
    assert expanded.tolist() == [6, 6, 6, 4, -1]
    assert local.tolist() == [0, 1, 2, 0, -1]


# --- _apply_write_kernel ------------------------------------------------------------------------


def loop_apply_write(output, stride, indices, starts, contents, cu_lens):
    flat = output.view(-1)
    for w in range(indices.shape[0]):
        begin = 0 if w == 0 else int(cu_lens[w - 1])
        for i in range(int(cu_lens[w]) - begin):
            flat[int(indices[w]) * stride + int(starts[w]) + i] = contents[begin + i]


@WRONG
@pytest.mark.parametrize("seed", range(3))
def test_apply_write_equals_the_kernels_loop(seed, wrong):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(MAX_REQS, generator=g)[:5].to(torch.int32)
    lens = torch.randint(1, 6, (5,), generator=g)
    starts = torch.stack([torch.randint(0, MAX_LEN - int(n), (1,), generator=g)[0] for n in lens]).to(torch.int32)
    cu = lens.cumsum(0).to(torch.int32)
    contents = torch.randint(0, 100, (int(cu[-1]),), generator=g, dtype=torch.int32)
    output = torch.full((MAX_REQS, MAX_LEN), -1, dtype=torch.int32)
    expected = output.clone()
    kernels._apply_write_kernel(output, MAX_LEN, rows, _late(starts) if wrong else starts, contents,
                                cu, None, BLOCK_SIZE=1024, MULTI_GROUP=False)
    loop_apply_write(expected, MAX_LEN, rows, starts, contents, cu)
    assert _agree((output, expected)) is not wrong


def test_apply_write_by_hand():
    # Row 2 from column 1: 5 6; row 0 from 0: 7; a 1-D tensor (stride 1) takes elements.
    output = torch.zeros(3, 4, dtype=torch.int64)
    kernels._apply_write_kernel(output, 4, torch.tensor([2, 0], dtype=torch.int32),
                                torch.tensor([1, 0], dtype=torch.int32), torch.tensor([5, 6, 7]),
                                torch.tensor([2, 3], dtype=torch.int32), None, MULTI_GROUP=False)
    assert output.tolist() == [[7, 0, 0, 0], [0] * 4, [0, 5, 6, 0]]
    lengths = torch.zeros(4, dtype=torch.int32)
    kernels._apply_write_kernel(lengths, 1, torch.tensor([3, 1], dtype=torch.int32),
                                torch.zeros(2, dtype=torch.int32), torch.tensor([9, 8], dtype=torch.int32),
                                torch.tensor([1, 2], dtype=torch.int32), None, MULTI_GROUP=False)
    assert lengths.tolist() == [0, 8, 0, 9]


def test_apply_write_refuses_pointer_tables():
    with pytest.raises(RuntimeError, match="MULTI_GROUP takes device pointers"):
        kernels._apply_write_kernel(torch.zeros(2, dtype=torch.uint64), torch.ones(2, dtype=torch.int64),
                                    torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int32), MULTI_GROUP=True)


# --- _prepare_rope_positions_kernel ------------------------------------------------------------


def loop_rope(positions, stride, prefill_positions, stride0, stride1, delta, idx_mapping, qsl,
              prefill_lens, num_computed, num_dims):
    flat_out, flat_in = positions.view(-1), prefill_positions.view(-1)
    for b, r in enumerate(idx_mapping.tolist()):
        nc, pl = int(num_computed[r]), int(prefill_lens[r])
        start, end = int(qsl[b]), int(qsl[b + 1])
        for i in range(end - start):
            for d in range(num_dims):
                if nc < pl:
                    value = flat_in[r * stride0 + d * stride1 + nc + i]
                else:
                    value = nc + i + int(delta[r])
                flat_out[d * stride + start + i] = value


@WRONG
@pytest.mark.parametrize("seed", range(3))
def test_rope_positions_equal_the_kernels_loop(seed, wrong):
    data = _batch(seed)
    dims, g = 3, data["g"]
    # RopeState's layout: prefill positions [max_reqs * dims, max_len], positions [dims, tokens + 1]
    prefill = torch.randint(0, 500, (MAX_REQS * dims, MAX_LEN), generator=g, dtype=torch.int32)
    delta = torch.randint(-4, 5, (MAX_REQS,), generator=g, dtype=torch.int32)
    positions = torch.full((dims, MAX_TOKENS + 1), -1, dtype=torch.int64)
    expected = positions.clone()
    args = (prefill, dims * MAX_LEN, MAX_LEN, delta, data["idx_mapping"], data["query_start_loc"],
            data["prefill_len"], data["num_computed"])
    ours = args[:-1] + (_late(data["num_computed"]) if wrong else data["num_computed"],)
    kernels._prepare_rope_positions_kernel(positions, MAX_TOKENS + 1, *ours, BLOCK_SIZE=1024, NUM_DIMS=dims)
    loop_rope(expected, MAX_TOKENS + 1, *args, dims)
    assert _agree((positions, expected)) is not wrong


def test_rope_positions_by_hand():
    # Two dims. Row 0 -> slot 1 prefilling (1 of 3 computed, query 2): its staged positions at
    # columns 1 2 of rows 2 (dim 0) and 3 (dim 1). Row 1 -> slot 0 decoding (4 computed, delta
    # -2): 4 - 2 = 2 in both dims.
    prefill = torch.tensor([[0, 0, 0], [0, 0, 0], [10, 11, 12], [20, 21, 22]], dtype=torch.int32)
    positions = torch.full((2, 4), -1)
    kernels._prepare_rope_positions_kernel(
        positions, 4, prefill, 6, 3, torch.tensor([-2, 0], dtype=torch.int32), torch.tensor([1, 0]),
        torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32),
        torch.tensor([4, 1], dtype=torch.int32), NUM_DIMS=2)
    assert positions.tolist() == [[11, 12, 2, -1], [21, 22, 2, -1]]


# --- Through vLLM's registry and vLLM's own host code ----------------------------------------


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


LAUNCHES = {  # fn -> (grid, every kernel argument in order, constexprs included): the hand cases
    kernels._prepare_prefill_inputs_kernel: lambda: ((3,), [
        torch.full((6,), -1, dtype=torch.int32), torch.full((2, 3), -1, dtype=torch.int32), 3, 2,
        torch.tensor([2, 0, 1]), _i32([0, 2, 3, 4]), torch.arange(15, dtype=torch.int32).view(3, 5), 5,
        _i32([3, 4, 5]), _i32([3, 3, 1]), 1024, 2]),
    kernels._prepare_pos_seq_lens_kernel: lambda: ((3,), [
        torch.full((6,), -1), torch.full((4,), -1, dtype=torch.int32), torch.tensor([1, 0]),
        _i32([0, 1, 4, 4, 4]), _i32([0, 5]), 4, 1024]),
    kernels._combine_sampled_and_draft_tokens_kernel: lambda: ((3,), [
        _i32([-1, -1, -1, 50, 51, 52, -1]), torch.tensor([1, 0, 2]), torch.tensor([[66], [77], [88]]),
        _i32([0, 3, 5, 6]), _i32([9, 4, 7]), _i32([6, 5, 7]), torch.tensor([[30, 31], [40, 41], [60, 61]]),
        2, _i32([0, 3, 4, 5]), torch.full((5,), -1), 4, 1]),
    kernels._get_num_sampled_and_rejected_kernel: lambda: ((2,), [
        _i32([2, 1]), _i32([-1, -1]), _i32([9, 4]), _i32([0, 3, 4]), torch.tensor([1, 0]), _i32([6, 5])]),
    kernels._post_update_kernel: lambda: ((3,), [
        torch.tensor([1, -1, 0]), _i32([0, 5]), torch.tensor([[1], [2]]), torch.zeros(2, 8, dtype=torch.int32), 8,
        torch.tensor([[7, 7, 3], [4, 4, 4], [5, 5, 5]]), 3, _i32([2, 3, 0]), _i32([1, 0, 0]),
        _i32([0, 3, 4, 6]), torch.zeros(2, 5, dtype=torch.int32), 5, _i32([1, 2]), None, None, 0]),
    kernels._post_update_num_computed_tokens_kernel: lambda: ((2,), [
        torch.tensor([3, 0]), _i32([10, 20, 30, 40]), _i32([0, 4, 5, 5])]),
    kernels._expand_idx_mapping_kernel: lambda: ((3,), [
        torch.tensor([6, 2, 4]), torch.full((5,), -1), torch.full((5,), -1, dtype=torch.int32),
        _i32([0, 3, 3, 4]), 4]),
    kernels._scatter_num_accepted_kernel: lambda: ((3,), [
        _i32([2, -1, 0]), _i32([0, 3, 2]), torch.ones(4, dtype=torch.int32)]),
    kernels._fill_num_accepted_kernel: lambda: ((2,), [_i32([1, 3]), torch.ones(4, dtype=torch.int32), 4]),
    kernels._apply_write_kernel: lambda: ((2, 1), [
        torch.zeros(3, 4, dtype=torch.int64), 4, _i32([2, 0]), _i32([1, 0]), torch.tensor([5, 6, 7]),
        _i32([2, 3]), None, 1024, False]),
    kernels._prepare_rope_positions_kernel: lambda: ((2,), [
        torch.full((2, 4), -1), 4, torch.arange(12, dtype=torch.int32).view(4, 3), 6, 3, _i32([-2, 0]),
        torch.tensor([1, 0]), _i32([0, 2, 3]), _i32([2, 3]), _i32([4, 1]), 1024, 2]),
}


def _clones(values):
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


@pytest.mark.parametrize("fn", ALL, ids=lambda fn: fn.__name__)
def test_kernel_override_launches_by_the_kernels_names(fn):
    """vLLM's ``KernelOverride`` launched as its JIT warm-up does, ``override[grid](**kwargs)``
    keyed by the kernel's own names, runs the implementation on those arguments: it leaves what
    a direct positional call leaves, and it writes something."""
    from vllm.triton_utils.dispatcher import KernelOverride

    override = KernelOverride(_kernel(fn), fn)
    grid, values = LAUNCHES[fn]()
    assert len(values) == len(override.arg_names)
    before, by_name = _clones(values), _clones(values)
    override[grid](**dict(zip(override.arg_names, by_name)))
    fn(*values)
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    assert all(torch.equal(by_name[i], values[i]) for i in tensors)
    assert any(not torch.equal(by_name[i], before[i]) for i in tensors)


@pytest.fixture
def registered(monkeypatch):
    """The implementations registered with vLLM's kernel registry, as the platform does; vLLM's
    buffers on the non-UVA path the emulated NPU takes (host tensors copied to the device, here
    the CPU)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher, triton
    from vllm.utils import torch_utils
    from vllm.v1.worker.gpu import buffer_utils

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.setattr(buffer_utils, "is_pin_memory_available", lambda: False, raising=False)  # 0.34+
    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False, raising=False)  # 0.33's host staging
    # The host wrappers size BLOCK_SIZE with triton.next_power_of_2, which vLLM's placeholder for
    # a missing Triton lacks: the NPU runner must provide it too.
    monkeypatch.setattr(triton, "next_power_of_2", lambda n: 1 << max(n - 1, 0).bit_length(),
                        raising=False)
    monkeypatch.setattr(dispatcher, "_registry", dict(dispatcher._registry))
    originals = {}
    for module, functions in kernels.KERNELS.items():
        owner = importlib.import_module(module)
        for fn in functions:
            originals[(owner, fn.__name__)] = getattr(owner, fn.__name__)
    dispatcher.register_kernels({f"{m}.{fn.__name__}": fn for m, fns in kernels.KERNELS.items() for fn in fns})
    yield
    for (owner, name), original in originals.items():  # other tests see vLLM's own kernels
        monkeypatch.setattr(owner, name, original)


def test_vllm_post_update_runs_the_implementation(registered):
    """MRV2's ``post_update`` (with its ``num_warps=1`` launch option) through the registry."""
    from vllm.v1.worker.gpu import input_batch

    state, inputs = _post_update_case(4, True, True, True)
    s = {k: None if v is None else v.clone() for k, v in state.items()}
    input_batch.post_update(inputs["idx"], s["num_computed"], s["last_sampled"], s["bin_counts"],
                            inputs["sampled"], inputs["num_sampled"], inputs["num_rejected"], inputs["qsl"],
                            s["all_ids"], s["total_len"], inputs["drafts"], s["drafts_out"])
    expected = _loop_post_update_state(state, inputs)
    for name, value in expected.items():
        assert torch.equal(s[name], value), name


def test_vllm_hybrid_state_books_accepted_counts_through_the_implementations(registered):
    """``MambaHybridModelState.postprocess_state`` (without prefix caching or ReplaySSM: the
    served configuration) launches both accepted-count kernels through the registry."""
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    state = object.__new__(MambaHybridModelState)
    state.__dict__.update(num_accepted_tokens_gpu=torch.ones(4, dtype=torch.int32), recoverssm=None,
                          _align_mode=False, _use_flashinfer_replayssm=False)
    state.postprocess_state(_i32([3, 0]), _i32([2, 0]))
    assert state.num_accepted_tokens_gpu.tolist() == [1, 1, 1, 2]
    state.postprocess_state(_i32([2, 3]), 0)
    assert state.num_accepted_tokens_gpu.tolist() == [1, 1, 1, 1]

def test_vllm_staged_writes_run_the_implementation(registered):
    """``StagedWriteTensor.apply_write`` launches the single-tensor kernel and leaves what the
    kernel's loop leaves (the multi-group fused writer's pointer table is avoided by
    ``NPUBlockTables.apply_staged_writes``: tests/kernels/test_mrv2_block_tables.py)."""
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

    cpu = torch.device("cpu")
    table = StagedWriteTensor((4, 6), torch.int32, cpu)
    lengths = StagedWriteTensor(4, torch.int32, cpu)
    table.stage_write(2, 1, [5, 6, 7])
    table.stage_write(0, 0, [1, 2])
    lengths.stage_write_elem(1, 11)
    lengths.stage_write_elem(3, 13)
    lengths.apply_write()
    table.apply_write()
    assert lengths.gpu.tolist() == [0, 11, 0, 13]
    assert table.gpu.tolist() == [[1, 2, 0, 0, 0, 0], [0] * 6, [0, 5, 6, 7, 0, 0], [0] * 6]
    assert not table._staged_write_indices  # cleared


def test_prompt_embeds_overlay_equals_the_kernels_loop(registered):
    """:func:`apply_prompt_embeds` on vLLM's ``PromptEmbedsState`` against the kernel's loop: a
    request prefilling with embeds and an is-token-ids mask, one with embeds and no mask whose
    chunk runs past them, one without embeds, one whose embeds are consumed."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.model_states.prompt_embeds import PromptEmbedsState

    g = torch.Generator().manual_seed(0)
    hidden = 4
    embeds = {name: torch.randn(n, hidden, generator=g) for name, n in (("a", 5), ("b", 3), ("d", 2))}
    masks = {"a": torch.tensor([0, 1, 0, 0, 1], dtype=torch.uint8), "b": None, "d": None}
    state = PromptEmbedsState(MAX_REQS, hidden, torch.float32, torch.device("cpu"))
    for index, req in enumerate(("a", "b", "c", "d")):  # the fields add_request reads
        state.add_request(index, SimpleNamespace(
            req_id=req, prompt_embeds=embeds.get(req),
            prompt_is_token_ids=None if masks.get(req) is None else masks[req].bool().tolist()))
    # rows: a -> 1 computed, query 3 (rows 1..3, row 1 a token id); b -> 1 computed, query 4
    # (rows 1..2 only); c -> no embeds; d -> 2 computed of 2 (consumed), query 1.
    req_ids, computed, query = ["a", "b", "c", "d"], [1, 1, 0, 2], [3, 4, 2, 1]
    starts = np.concatenate(([0], np.cumsum(query)))
    batch = SimpleNamespace(num_reqs=4, req_ids=req_ids, query_start_loc_np=starts.astype(np.int32),
                            num_scheduled_tokens=np.array(query, dtype=np.int32),
                            num_computed_tokens_np=np.array(computed, dtype=np.int32))
    inputs = torch.randn(12, hidden, generator=g)
    expected = inputs.clone()
    for b, req in enumerate(req_ids):  # the kernel's loop: embeds_len 0 without embeds
        if req not in embeds:
            continue
        length = embeds[req].shape[0]
        for t in range(min(query[b], length - computed[b])):
            row = computed[b] + t
            if masks[req] is None or masks[req][row] == 0:
                expected[starts[b] + t] = embeds[req][row]
    original = inputs.clone()
    kernels.apply_prompt_embeds(state, batch, None, inputs)
    assert torch.equal(inputs, expected)
    # by hand: a's row 1 is a token id (slot 0 stays), rows 2 3 -> slots 1 2; b's rows 1 2 ->
    # slots 3 4; everything else stays.
    assert torch.equal(inputs[1:3], embeds["a"][2:4]) and torch.equal(inputs[3:5], embeds["b"][1:3])
    assert torch.equal(inputs[0], original[0]) and torch.equal(inputs[5:], original[5:])


def test_vllm_input_preparation_runs_the_implementations(registered):
    """MRV2's host wrappers (``prepare_inputs``'s calls and the step's bookkeeping) launch the
    implementations through the registry, positionally with their constexprs by keyword, and
    leave what the kernels' loops leave."""
    from vllm.v1.worker.gpu import input_batch

    data, args, total = _combine_case(6, 1)
    idx, qsl = data["idx_mapping"], data["query_start_loc"]
    input_ids = torch.full((MAX_TOKENS,), -5, dtype=torch.int32)
    next_prefill = torch.full((2, MAX_REQS), -9, dtype=torch.int32)
    expected_ids, expected_next = input_ids.clone(), next_prefill.clone()
    input_batch.prepare_prefill_inputs(input_ids, next_prefill, idx, qsl, data["all_token_ids"],
                                       data["prefill_len"], data["num_computed"])
    loop_prepare_prefill(expected_ids, expected_next, idx, qsl, data["all_token_ids"],
                         data["prefill_len"], data["num_computed"])
    assert torch.equal(input_ids, expected_ids) and torch.equal(next_prefill, expected_next)

    pos, seq_lens = torch.full((MAX_TOKENS,), -3), torch.full((MAX_REQS,), -3, dtype=torch.int32)
    expected_pos, expected_seq_lens = pos.clone(), seq_lens.clone()
    input_batch.prepare_pos_seq_lens(idx, qsl, data["num_computed"], pos, seq_lens)
    loop_pos_seq_lens(expected_pos, expected_seq_lens, idx, qsl, data["num_computed"], MAX_REQS)
    assert torch.equal(pos, expected_pos) and torch.equal(seq_lens, expected_seq_lens)

    logits_indices = input_batch.combine_sampled_and_draft_tokens(
        input_ids, idx, args["last_sampled"], qsl, args["seq_lens"], args["prefill_len"],
        args["draft_tokens"], args["cu_num_logits"], total, 1)
    expected_indices = torch.empty(total, dtype=torch.int64)
    loop_combine(expected_ids, idx, args["last_sampled"], qsl, args["seq_lens"], args["prefill_len"],
                 args["draft_tokens"], args["cu_num_logits"], expected_indices, 1)
    assert torch.equal(logits_indices, expected_indices) and torch.equal(input_ids, expected_ids)

    expanded, local = input_batch.expand_idx_mapping(idx, total, args["cu_num_logits"], DRAFTS + 1)
    expected_expanded, expected_local = torch.empty_like(expanded), torch.empty_like(local)
    loop_expand(idx, expected_expanded, expected_local, args["cu_num_logits"])
    assert torch.equal(expanded, expected_expanded) and torch.equal(local, expected_local)

    num_sampled = torch.ones(idx.shape[0], dtype=torch.int32)
    sampled, rejected = input_batch.get_num_sampled_and_rejected(
        num_sampled, args["seq_lens"], args["cu_num_logits"], idx, args["prefill_len"])
    chunked = args["seq_lens"][: idx.shape[0]] < args["prefill_len"][idx]
    logits = args["cu_num_logits"][1:] - args["cu_num_logits"][:-1]
    assert sampled.tolist() == [0 if c else 1 for c in chunked.tolist()]
    assert rejected.tolist() == [0 if c else n - 1 for c, n in zip(chunked.tolist(), logits.tolist())]

    computed = data["num_computed"].clone()
    expected_computed = computed.clone()
    for b, r, start, end in _rows(data):
        expected_computed[r] += end - start
    input_batch.post_update_num_computed_tokens(idx, computed, qsl)
    assert torch.equal(computed, expected_computed)


def test_vllm_rope_state_runs_the_implementations(registered):
    """M-RoPE's ``RopeState``: staged prefill positions land through ``_apply_write_kernel``,
    ``prepare_positions`` through ``_prepare_rope_positions_kernel``, as the kernels' loops."""
    from vllm.v1.worker.gpu.mm.rope import RopeState

    data = _batch(7)
    dims, g = 3, data["g"]
    rope = RopeState(dims, MAX_REQS, MAX_TOKENS, MAX_LEN, torch.device("cpu"))
    staged = torch.randint(0, 500, (MAX_REQS * dims, MAX_LEN), generator=g, dtype=torch.int32)
    for row in range(MAX_REQS * dims):
        rope.prefill_positions.stage_write(row, 0, staged[row].tolist())
    rope.prefill_delta.np[:] = torch.randint(-4, 5, (MAX_REQS,), generator=g).numpy()
    rope.apply_staged_writes()
    assert torch.equal(rope.prefill_positions.gpu, staged)
    rope.prepare_positions(data["idx_mapping"], data["query_start_loc"], data["prefill_len"],
                           data["num_computed"])
    expected = torch.zeros(dims, MAX_TOKENS + 1, dtype=torch.int64)
    loop_rope(expected, MAX_TOKENS + 1, staged, dims * MAX_LEN, MAX_LEN,
              torch.from_numpy(rope.prefill_delta.np.copy()), data["idx_mapping"],
              data["query_start_loc"], data["prefill_len"], data["num_computed"], dims)
    assert torch.equal(rope.positions, expected)
