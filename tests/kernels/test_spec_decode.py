"""The NPU implementations of vLLM's speculative-decoding kernels (ascend_patch.npu.spec_decode).

Oracles: per-request loops written from the Triton kernels' source (vLLM 0.33
``v1/sample/rejection_sampler.py``, ``v1/spec_decode/utils.py``), hand-derived vectors, and for
random rejection sampling the distribution it must keep (Leviathan et al. 2023): whatever the
draft distribution q, the emitted token is distributed as the target p.
"""

from __future__ import annotations

import types

import pytest
import torch

from ascend_patch.npu.runner.v1.spec_decode import install, kernels


def _requests(cu: list[int]):
    return [(0 if b == 0 else cu[b - 1], cu[b]) for b in range(len(cu))]


def loop_verify(output, cu, drafts, accept, replacement, bonus, rows):
    """Both rejection kernels' loop: keep drafts while accepted, write the replacement at the first
    rejection, the bonus token when none was rejected."""
    for b, (start, end) in enumerate(_requests(cu)):
        if not rows[b]:
            continue
        rejected = False
        for pos in range(end - start):
            if rejected:
                break
            t = start + pos
            if accept(t, pos):
                output[b, pos] = drafts[t]
            else:
                rejected = True
                output[b, pos] = replacement[t]
        if not rejected:
            output[b, end - start] = bonus[b]


def _batch(seed: int, batch: int = 5, width: int = 4, vocab: int = 6):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, width + 1, (batch,), generator=g)
    cu = torch.cumsum(counts, 0).to(torch.int32)
    tokens = int(cu[-1])
    return g, cu, tokens, {
        "drafts": torch.randint(0, vocab, (tokens,), generator=g, dtype=torch.int32),
        "bonus": torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int64),
        "output": torch.full((batch, width + 1), -1, dtype=torch.int32),
    }


@pytest.mark.parametrize("seed", range(4))
def test_greedy_rejection_equals_the_kernels_loop(seed):
    g, cu, tokens, data = _batch(seed)
    # argmax equal to the draft about half the time, so requests stop at different positions
    argmax = torch.where(torch.rand(tokens, generator=g) < 0.6, data["drafts"].long(),
                         torch.randint(0, 6, (tokens,), generator=g))
    is_greedy = torch.rand(cu.shape[0], generator=g) < 0.7
    expected = data["output"].clone()
    loop_verify(expected, cu.tolist(), data["drafts"].tolist(),
                lambda t, pos: int(data["drafts"][t]) == int(argmax[t]), argmax.tolist(),
                data["bonus"].tolist(), is_greedy.tolist())
    output = data["output"].clone()
    kernels.rejection_greedy_sample_kernel(output, cu, data["drafts"], argmax, data["bonus"],
                                           is_greedy, 4)
    assert torch.equal(output, expected)


def test_greedy_rejection_by_hand():
    # request 0: drafts 3 7, argmax 3 7 -> both kept, bonus 9; request 1: draft 4 vs argmax 5 ->
    # 5 written, nothing after; request 2: no drafts -> only its bonus.
    output = torch.full((3, 3), -1, dtype=torch.int32)
    kernels.rejection_greedy_sample_kernel(
        output, torch.tensor([2, 3, 3], dtype=torch.int32), torch.tensor([3, 7, 4], dtype=torch.int32),
        torch.tensor([3, 7, 5]), torch.tensor([9, 8, 6]), None, 2)
    assert output.tolist() == [[3, 7, 9], [5, -1, -1], [6, -1, -1]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("no_draft_probs", [False, True])
def test_random_rejection_equals_the_kernels_loop(seed, no_draft_probs):
    g, cu, tokens, data = _batch(seed)
    target = torch.rand(tokens, 6, generator=g).softmax(-1)
    draft = torch.rand(tokens, 6, generator=g).softmax(-1)
    if tokens:
        draft[0, data["drafts"][0]] = 0.0  # a zero draft probability is rejected
    uniform = torch.rand(tokens, generator=g, dtype=torch.float64)
    recovered = torch.randint(0, 6, (tokens,), generator=g, dtype=torch.int32)
    is_greedy = torch.rand(cu.shape[0], generator=g) < 0.3
    drafts = data["drafts"]

    def accept(t, pos):
        q = 1.0 if no_draft_probs else float(draft[t, drafts[t]])
        return q > 0 and float(target[t, drafts[t]]) / q >= float(uniform[t])

    expected = data["output"].clone()
    loop_verify(expected, cu.tolist(), drafts.tolist(), accept, recovered.tolist(),
                data["bonus"].tolist(), (~is_greedy).tolist())
    output = data["output"].clone()
    kernels.rejection_random_sample_kernel(output, cu, drafts, None if no_draft_probs else draft,
                                           target, data["bonus"], recovered, uniform, is_greedy, 4, 6,
                                           NO_DRAFT_PROBS=no_draft_probs)
    assert torch.equal(output, expected)


@pytest.mark.parametrize("no_draft_probs", [False, True])
def test_recovered_tokens_equal_the_kernels_loop(no_draft_probs):
    g, cu, tokens, data = _batch(7)
    target = torch.rand(tokens, 6, generator=g).softmax(-1)
    draft = torch.rand(tokens, 6, generator=g).softmax(-1)
    inv_q = torch.empty(cu.shape[0], 6).exponential_(generator=g).reciprocal()
    expected = []
    for b, (start, end) in enumerate(_requests(cu.tolist())):
        for t in range(start, end):
            scores = []
            for v in range(6):
                if no_draft_probs:
                    prob = 0.0 if v == int(data["drafts"][t]) else float(target[t, v])
                else:
                    prob = max(float(target[t, v]) - float(draft[t, v]), 0.0)
                scores.append(prob * float(inv_q[b, v]))
            expected.append(max(range(6), key=lambda v: (scores[v], -v)))  # first maximum
    output = torch.empty(tokens, dtype=torch.int32)
    kernels.sample_recovered_tokens_kernel(output, cu, data["drafts"], None if no_draft_probs else draft,
                                           target, inv_q, 6, NO_DRAFT_PROBS=no_draft_probs)
    assert output.tolist() == expected


def test_expand_by_hand():
    # requests own 2, 0 and 3 tokens; 5 (replace_from) becomes 0; the slot past them stays.
    output = torch.full((6,), -7.0)
    kernels.expand_kernel(output, torch.tensor([1.5, 2.5, 5.0]), torch.tensor([2, 2, 5], dtype=torch.int32),
                          5.0, 0.0)
    assert output.tolist() == [1.5, 1.5, 0.0, 0.0, 0.0, -7.0]


def test_eagle_padded_preparation_by_hand():
    # drafts 3, 0, 2; valid sampled 2 (1 rejected), 1, 3 (none rejected); queries end at 4, 5, 8.
    indices, rejected = torch.full((4,), -1, dtype=torch.int32), torch.full((4,), -1, dtype=torch.int32)
    kernels.eagle_prepare_inputs_padded_kernel(
        torch.tensor([3, 3, 5], dtype=torch.int32), torch.tensor([2, 1, 3], dtype=torch.int32),
        torch.tensor([0, 4, 5, 8], dtype=torch.int32), indices, rejected, 3)
    assert rejected.tolist() == [2, 0, 0, -1]
    assert indices.tolist() == [1, 4, 7, -1]
    # the next token: the last valid sampled one, else the backup (count 0 when discarded)
    sampled = torch.tensor([[5, 6, -1], [-1, -1, -1], [7, 8, 9]], dtype=torch.int32)
    next_ids, counts = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    kernels.eagle_prepare_next_token_padded_kernel(
        sampled, torch.tensor([False, False, True]), torch.tensor([11, 12, 13], dtype=torch.int32),
        next_ids, counts, 100, 3, 3, 3)
    assert next_ids.tolist() == [6, 12, 13]
    assert counts.tolist() == [2, 0, 0]


def test_eagle_step_slot_mapping_by_hand():
    # block size 4; request 0 at position 5 -> 6 in its block 1 (id 9): slot 38; request 1 at
    # position 7 reaches max_model_len 8 -> position 0, the pad slot, length 1; padding rows: PAD.
    positions = torch.tensor([5, 7])
    seq_lens = torch.tensor([6, 8], dtype=torch.int32)
    block_table = torch.tensor([[3, 9], [4, 5]], dtype=torch.int32)
    clamped, slots = torch.empty(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    kernels.eagle_step_slot_mapping_metadata_kernel(positions, block_table, 2, seq_lens, clamped, slots,
                                                    4, 8, 2, -1, 2)
    assert clamped.tolist() == [6, 0]
    assert slots.tolist() == [38, -1, -1]
    assert seq_lens.tolist() == [7, 1]



@pytest.mark.parametrize("shift", [False, True])
def test_copy_and_expand_eagle_inputs_by_hand(shift):
    # Two requests, 3 and 4 input tokens; request 0 accepted up to its token 1 (one rejected),
    # request 1 up to its last. Two slots each: the next (bonus) token and one parallel-drafting
    # slot; -1 pads, -2 marks parallel drafting. Buffers are longer than the output: the tail stays.
    i32 = torch.int32
    ids, positions = torch.full((12,), 99, dtype=i32), torch.full((12,), 99, dtype=torch.int64)
    rejected, masked = torch.zeros(12, dtype=torch.bool), torch.zeros(12, dtype=torch.bool)
    new, mapping = torch.full((4,), 99, dtype=i32), torch.full((7,), 99, dtype=i32)
    kernels.copy_and_expand_eagle_inputs_kernel(
        torch.tensor([10, 11, 12, 20, 21, 22, 23], dtype=i32), torch.tensor([5, 6, 7, 0, 1, 2, 3]),
        torch.tensor([100, 200], dtype=i32), ids, positions, rejected, masked, new, mapping,
        torch.tensor([0, 3, 7], dtype=i32), torch.tensor([1, 6], dtype=i32), -1, -2, 7, 2, shift)
    if shift:  # each request drops its first token; hidden states map onto the shifted runs
        assert ids.tolist() == [11, 100, -2, -1, 21, 22, 23, 200, -2] + [99] * 3
        assert positions.tolist() == [5, 6, 7, 0, 0, 1, 2, 3, 4] + [99] * 3
        assert rejected.tolist() == [False, False, False, True] + [False] * 8
        assert masked.tolist() == [False, False, True, False, False, False, False, False, True] + [False] * 3
        assert new.tolist() == [1, 2, 7, 8]
        assert mapping.tolist() == [0, 1, 2, 4, 5, 6, 7]
    else:
        assert ids.tolist() == [10, 11, 100, -2, -1, 20, 21, 22, 23, 200, -2, 99]
        assert positions.tolist() == [5, 6, 7, 8, 0, 0, 1, 2, 3, 4, 5, 99]
        assert rejected.tolist() == [False] * 4 + [True] + [False] * 7
        assert masked.tolist() == [False, False, False, True] + [False] * 6 + [True, False]
        assert new.tolist() == [2, 3, 9, 10]
        assert mapping.tolist() == [99] * 7  # written only with shifted inputs

P = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],  # the target at each draft position
                  [0.10, 0.20, 0.30, 0.25, 0.15],
                  [0.05, 0.05, 0.60, 0.10, 0.20]])
Q = torch.tensor([[0.05, 0.15, 0.40, 0.10, 0.30],  # the draft: far from the target everywhere
                  [0.50, 0.05, 0.05, 0.10, 0.30],
                  [0.30, 0.30, 0.05, 0.30, 0.05]])
ROWS = 20_000
SIGNIFICANCE = 1e-3
"""Each position's chi-square test rejects at this level (three positions: at most 0.3 % of
correct samplers fail the test)."""


def _spec_decode_rows(p: torch.Tensor, q: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` seeded requests of ``k = len(p)`` drafts each through vLLM's own random rejection
    sampling (``apply_sampling_constraints`` and ``rejection_sample``, as ``RejectionSampler``
    calls them in the engine), its kernels being what vLLM 0.31+ launches once the platform has
    registered its overrides: position ``j`` drafts ``x ~ q[j]`` against target ``p[j]``."""
    pytest.importorskip("vllm.triton_utils.dispatcher", reason="vLLM 0.31+'s kernel registry")
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    install.register()
    k, vocab = p.shape
    drafts = torch.multinomial(q, rows, replacement=True,
                               generator=torch.Generator().manual_seed(1)).T.contiguous()
    metadata = SamplingMetadata(
        temperature=torch.ones(rows), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={row: torch.Generator().manual_seed(row) for row in range(rows)},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    cu = torch.arange(k, k * (rows + 1), k, dtype=torch.int32)
    logits = rejection_sampler.apply_sampling_constraints(p.log().repeat(rows, 1), cu, metadata)
    output = rejection_sampler.rejection_sample(
        drafts.flatten().to(torch.int32), [k] * rows, k, cu, q.repeat(rows, 1), logits,
        torch.zeros(rows, 1, dtype=torch.int64), metadata)
    return output[:, :k]


def _chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of ``tokens`` against ``p`` and its p-value (``vocab - 1`` degrees of
    freedom: the chi-square survival function is the regularised upper incomplete gamma)."""
    observed = torch.bincount(tokens.long(), minlength=p.shape[0]).double()
    expected = p.double() * tokens.shape[0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((p.shape[0] - 1) / 2, dtype=torch.float64)
    return float(statistic), float(torch.special.gammaincc(dof, statistic / 2))


def _per_position(output: torch.Tensor) -> list[tuple[int, float, float]]:
    """Per draft position: the requests that emitted a token there and the chi-square of those
    tokens against the target (a request reaches position j when its drafts before j were kept;
    whatever happened before, the token it emits at j must be distributed as p[j])."""
    results = []
    for j in range(output.shape[1]):
        emitted = output[:, j][output[:, j] >= 0]
        results.append((emitted.shape[0], *_chi_square(emitted, P[j])))
    return results


@pytest.mark.v1_runner
def test_random_rejection_keeps_the_target_distribution():
    from vllm.v1.sample import rejection_sampler

    output = _spec_decode_rows(P, Q, ROWS)
    for owner, ours in ((rejection_sampler._expand, kernels.expand_kernel),
                        (rejection_sampler._sample_recovered_tokens,
                         kernels.sample_recovered_tokens_kernel),
                        (rejection_sampler._rejection_random_sample,
                         kernels.rejection_random_sample_kernel)):
        assert owner.kernel.func is ours  # the rows ran on the NPU implementations
    results = _per_position(output)
    print("rejection sampling vs target, per position (rows, chi2, p-value):", results)
    for rows, statistic, p_value in results:
        assert rows > 1000  # enough rows reach every position for the test to have power
        assert p_value > SIGNIFICANCE, results
    # Acceptance: position j is reached with probability prod_{i<j} sum_x min(p_i, q_i).
    accept = torch.minimum(P, Q).sum(dim=1).double()
    for j, (rows, _, _) in enumerate(results[1:], 1):
        expected = ROWS * float(accept[:j].prod())
        assert abs(rows - expected) < 5 * expected ** 0.5, (j, rows, expected)


@pytest.mark.v1_runner
def test_a_broken_recovered_token_step_fails_the_chi_square_test(monkeypatch):
    """Negative control: the same rows with recovered tokens drawn from p instead of the residual
    max(p - q, 0), the classic bug, substituted for the kernel vLLM's dispatcher launches (the
    product's kernel is untouched). The emitted tokens then follow min(p, q) + (1 - a) p."""
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher",
                                     reason="vLLM 0.31+'s kernel registry")
    from vllm.v1.sample import rejection_sampler

    install.register()
    calls = []

    def from_target(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                    draft_probs_ptr, target_probs_ptr, inv_q_ptr, vocab_size, BLOCK_SIZE=None,
                    NO_DRAFT_PROBS=False, USE_FP64_GUMBEL=False):
        calls.append(output_token_ids_ptr.shape[0])
        kernels.sample_recovered_tokens_kernel(
            output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
            torch.zeros_like(draft_probs_ptr), target_probs_ptr, inv_q_ptr, vocab_size)

    owner = rejection_sampler._sample_recovered_tokens
    monkeypatch.setattr(owner, "kernel", dispatcher.KernelOverride(owner.kernel, from_target))
    results = _per_position(_spec_decode_rows(P, Q, ROWS))
    print("broken recovered step, per position (rows, chi2, p-value):", results)
    assert calls == [3 * ROWS]
    for rows, statistic, p_value in results:
        assert p_value < SIGNIFICANCE, results


class _Kernel:
    """A stand-in for a Triton JITFunction of vLLM's: the function it compiles (by its name) and
    its parameter names."""

    def __init__(self, impl, arg_names):
        module = next(m for m, functions in kernels.KERNELS.items() if impl in functions)
        self.fn = types.SimpleNamespace(__module__=module, __name__=impl.__name__)
        self.arg_names = arg_names


def test_installer_accepts_a_kernel_without_flags_added_later():
    # 0.20-0.22's sample_recovered_tokens_kernel has no USE_FP64_GUMBEL (added 0.23, default False).
    impl = kernels.sample_recovered_tokens_kernel
    names = install.kernel_arg_names(impl)
    older = _Kernel(impl, names[:-1])
    assert install.npu_kernel(older)[(1, 1)] is impl


def test_installer_refuses_a_kernel_whose_parameters_moved():
    impl = kernels.expand_kernel
    names = list(install.kernel_arg_names(impl))
    names[1], names[2] = names[2], names[1]
    with pytest.raises(RuntimeError, match="ascend-patch: vLLM's .*expand_kernel takes"):
        install.npu_kernel(_Kernel(impl, tuple(names)))
