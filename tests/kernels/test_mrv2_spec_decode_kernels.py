"""The NPU implementations of Model Runner V2's speculative-decoding kernels
(ascend_patch.npu.runner.v2.spec_decode_kernels).

Oracles: per-request loops transcribed from the Triton kernels' source (vLLM 0.34
``v1/worker/gpu/spec_decode/``) in Python/numpy, with Triton's Philox in Python integers and
gumbel.py's murmur3 noise from the sampling kernels' transcription; Random123's known-answer
vectors for Philox4x64-10; values derived by hand; and for the rejection sampler the
distribution it must preserve (the target's), by a chi-square test with a negative control.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import numpy as np
import pytest
import torch

from ascend_patch.npu.runner.v2 import spec_decode_kernels as kernels
from ascend_patch.npu.runner.triton_kernels import kernel_arg_names
from tests.kernels.test_mrv2_sample_kernels import SIGNIFICANCE, _chi_square, py_gumbel_noise

F32 = np.float32
INF = float("inf")

# Parameters 0.34 added to kernels 0.33 also has (0.33's list is the rest, in the same order).
ADDED_IN_0_34 = {
    name: ("draft_logits_row_mapping_ptr",)
    for name in ("_compute_local_logits_stats_kernel", "_compute_cumulative_log_p_kernel",
                 "_compute_local_residual_mass_kernel", "_rejection_kernel")
}
ADDED_IN_0_34["_resample_kernel"] = ("draft_logits_row_mapping_ptr", "SKIP_MASKED_BLOCKS")
NEW_IN_0_34 = {"_assign_rows_kernel", "_stale_drafts_kernel"}
# 0.33 passes the model length as a host int; 0.34 as a device scalar (max_model_len_ptr).
RENAMED_IN_0_34 = {"_update_draft_inputs_kernel": {"max_model_len_ptr": "max_model_len"}}

IMPLEMENTATIONS = [(module, fn) for module, fns in kernels.KERNELS.items() for fn in fns]
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _vllm_release() -> tuple[int, int]:
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def _parameters(impl) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(impl).parameters if p not in LAUNCH_OPTIONS)


@pytest.mark.parametrize("module,impl", IMPLEMENTATIONS,
                         ids=[f"{m.rpartition('.')[2]}.{fn.__name__}" for m, fn in IMPLEMENTATIONS])
def test_parameters_are_the_installed_kernels(module, impl):
    names = _parameters(impl)
    if _vllm_release() >= (0, 34):
        owner = importlib.import_module(module)
        assert kernel_arg_names(getattr(owner, impl.__name__)) == names
        return
    if impl.__name__ in NEW_IN_0_34:  # 0.33 has no draft_logits module
        assert importlib.util.find_spec(module) is None
        return
    owner = importlib.import_module(module)
    added = ADDED_IN_0_34.get(impl.__name__, ())
    renamed = RENAMED_IN_0_34.get(impl.__name__, {})
    expected = tuple(renamed.get(name, name) for name in names if name not in added)
    assert kernel_arg_names(getattr(owner, impl.__name__)) == expected


# --- Philox (tl.rand) ---------------------------------------------------------------------------

M64 = (1 << 64) - 1


def py_philox4x64(key0: int, key1: int, counter: list[int]) -> list[int]:
    """Philox4x64-10 with Python integers (triton/language/random.py's philox_impl)."""
    c, k = [x & M64 for x in counter], [key0 & M64, key1 & M64]
    for _ in range(10):
        pb, pa = 0xCA5A826395121157 * c[2], 0xD2E7470EE14C6C93 * c[0]
        c = [(pb >> 64) ^ c[1] ^ k[0], pb & M64, (pa >> 64) ^ c[3] ^ k[1], pa & M64]
        k = [(k[0] + 0x9E3779B97F4A7C15) & M64, (k[1] + 0xBB67AE8584CAA73B) & M64]
    return c


def py_tl_rand(seed: int, offset: int) -> F32:
    """tl.rand for an int64 offset: the first word as int64, negatives complemented, times
    1.0842020432385337e-19 in fp32; tl_rand32 then keeps it above 4.6566127342e-10."""
    x = py_philox4x64(seed, 0, [offset, 0, 0, 0])[0]
    if x >= 1 << 63:
        x -= 1 << 64
    if x < 0:
        x = -x - 1
    return max(F32(F32(x) * F32(1.0842020432385337e-19)), F32(4.6566127342e-10))


def test_philox_is_random123s_known_answers():
    # Random123 kat_vectors, philox4x64-10: (key, counter) -> output.
    cases = [
        ((0, 0), [0, 0, 0, 0],
         [0x16554d9eca36314c, 0xdb20fe9d672d0fdc, 0xd7e772cee186176b, 0x7e68b68aec7ba23b]),
        ((M64, M64), [M64] * 4,
         [0x87b092c3013fe90b, 0x438c3c67be8d0224, 0x9cc7d7c69cd777b6, 0xa09caebf594f0ba0]),
        ((0x452821e638d01377, 0xbe5466cf34e90c6c),
         [0x243f6a8885a308d3, 0x13198a2e03707344, 0xa4093822299f31d0, 0x082efa98ec4e6c89],
         [0xa528f45403e61d95, 0x38c72dbd566e9788, 0xa5a1610e72fd18b5, 0x57bd43b5e52b7fe6]),
    ]
    for key, counter, expected in cases:
        assert py_philox4x64(*key, counter) == expected
    # The torch version keys (seed, 0) on the counter (offset, 0, 0, 0), as tl.rand does.
    seeds = torch.tensor([0, 42, -1, 1234567890123])
    offsets = torch.tensor([0, 7, 1 << 40, 3])
    words = kernels.philox4x64(seeds, offsets)
    for i, (seed, offset) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        expected = py_philox4x64(seed, 0, [offset, 0, 0, 0])
        got = [(int(h[i]) << 32) | int(low[i]) for h, low in words]
        assert got == expected


def test_philox_uniform_equals_the_transcription_and_is_uniform():
    seeds = torch.full((4000,), 2024)
    offsets = torch.arange(4000)
    u = torch.clamp(kernels.philox_uniform(seeds, offsets), min=4.6566127342e-10)
    assert u[:50].tolist() == [float(py_tl_rand(2024, i)) for i in range(50)]
    bins = (u * 10).long().clamp(max=9)
    assert _chi_square(bins, torch.full((10,), 0.1))[1] > SIGNIFICANCE


# --- the rejection sampler: vLLM 0.34's host code over the kernels -----------------------------

def rejection_sample(target_logits, draft_logits, row_mapping, draft_sampled, cu_num_logits,
                     pos, idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature,
                     seed, num_speculative_steps, rates=None, use_fp64=False, block=False,
                     vocab_block=8192, resample_block=1024, skip_masked=False):
    """rejection_sampler_utils.py's rejection_sample() (0.34) with the NPU implementations: the
    same launches, arguments and buffer allocation (new_empty), block sizes as parameters."""
    num_reqs = cu_num_logits.shape[0] - 1
    num_logits, vocab_size = target_logits.shape
    has_draft = draft_logits is not None
    s0 = draft_logits.stride(0) if has_draft else 0
    s1 = draft_logits.stride(1) if has_draft else 0
    blocks = -(-vocab_size // vocab_block)
    padded = 1 << (blocks - 1).bit_length()
    new = target_logits.new_empty
    t_argmax = new(num_logits, blocks, dtype=torch.int64)
    t_max, t_sumexp, d_max, d_sumexp = (new(num_logits, blocks, dtype=torch.float32)
                                        for _ in range(4))
    kernels._compute_local_logits_stats_kernel(
        t_argmax, blocks, t_max, blocks, t_sumexp, blocks, d_max, blocks, d_sumexp, blocks,
        target_logits, target_logits.stride(0), draft_logits, s0, s1, row_mapping,
        expanded_idx_mapping, expanded_local_pos, temperature, vocab_size, num_logits,
        BLOCK_SIZE=vocab_block, HAS_DRAFT_LOGITS=has_draft)
    cumulative = residual_mass = None
    if block:
        cumulative = new(num_logits, dtype=torch.float32)
        kernels._compute_cumulative_log_p_kernel(
            cumulative, target_logits, target_logits.stride(0), t_max, blocks, t_sumexp, blocks,
            draft_sampled, draft_logits, s0, s1, row_mapping, d_max, blocks, d_sumexp, blocks,
            cu_num_logits, idx_mapping, temperature, blocks, PADDED_VOCAB_NUM_BLOCKS=padded,
            HAS_DRAFT_LOGITS=has_draft, num_warps=1)
        if has_draft:
            residual_mass = new(num_logits, blocks, dtype=torch.float32)
            kernels._compute_local_residual_mass_kernel(
                residual_mass, blocks, cumulative, target_logits, target_logits.stride(0), t_max,
                blocks, t_sumexp, blocks, draft_logits, s0, s1, row_mapping, d_max, blocks,
                d_sumexp, blocks, draft_sampled, expanded_idx_mapping, expanded_local_pos,
                temperature, vocab_size, num_logits, blocks, BLOCK_SIZE=vocab_block,
                PADDED_VOCAB_NUM_BLOCKS=padded)
    sampled = draft_sampled.new_empty(num_reqs, num_speculative_steps + 1, dtype=torch.int64)
    num_sampled = sampled.new_empty(num_reqs, dtype=torch.int32)
    target_lse = new(num_reqs, dtype=torch.float32)
    draft_lse = new(num_reqs, dtype=torch.float32)
    kernels._rejection_kernel(
        sampled, sampled.stride(0), num_sampled, target_lse, draft_lse, target_logits,
        target_logits.stride(0), t_argmax, blocks, t_max, blocks, t_sumexp, blocks, draft_sampled,
        draft_logits, s0, s1, row_mapping, d_max, blocks, d_sumexp, blocks, cu_num_logits,
        idx_mapping, temperature, seed, pos, rates, cumulative, residual_mass,
        blocks if residual_mass is not None else 0, None, 0.3, blocks,
        PADDED_VOCAB_NUM_BLOCKS=padded, HAS_DRAFT_LOGITS=has_draft,
        SYNTHETIC_MODE=rates is not None, USE_BLOCK_VERIFICATION=block, FLY_WINDOW_SIZE=0,
        num_warps=1)
    rejected = num_sampled.clone()
    resample_blocks = -(-vocab_size // resample_block)
    r_argmax = new(num_reqs, resample_blocks, dtype=torch.int64)
    r_max = new(num_reqs, resample_blocks, dtype=torch.float64 if use_fp64 else torch.float32)
    kernels._resample_kernel(
        r_argmax, resample_blocks, r_max, resample_blocks, target_logits, target_logits.stride(0),
        target_lse, draft_logits, s0, s1, row_mapping, draft_lse, num_sampled, cu_num_logits,
        expanded_idx_mapping, draft_sampled, temperature, seed, pos, cumulative, None, 0, None,
        None, 0, 0, vocab_size, BLOCK_SIZE=resample_block, HAS_DRAFT_LOGITS=has_draft,
        USE_FP64=use_fp64, USE_BLOCK_VERIFICATION=block, CONTEXT_WIDTH=1, WATERMARK=False,
        DEDUPLICATE_CONTEXTS=False, SKIP_MASKED_BLOCKS=skip_masked)
    kernels._insert_resampled_kernel(
        sampled, sampled.stride(0), num_sampled, r_argmax, resample_blocks, r_max,
        resample_blocks, resample_blocks, cu_num_logits, expanded_idx_mapping, temperature,
        PADDED_RESAMPLE_NUM_BLOCKS=1 << (resample_blocks - 1).bit_length(), num_warps=1)
    return sampled, num_sampled, rejected, target_lse, draft_lse


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def loop_rejection_sample(target, draft, row_mapping, draft_sampled, cu, pos, idx_mapping,
                          expanded_idx, temperature, seeds, steps, rates=None, block=False):
    """_rejection_kernel, _resample_kernel and _insert_resampled_kernel per request, in fp64
    with whole-vocab reductions (the block partials combine to the same values)."""
    num_reqs = len(cu) - 1
    sampled = np.full((num_reqs, steps + 1), -99, dtype=np.int64)
    num_sampled = np.zeros(num_reqs, dtype=np.int64)
    for r in range(num_reqs):
        req = int(idx_mapping[r])
        start, end = int(cu[r]), int(cu[r + 1])
        n = end - start - 1
        temp = float(F32(temperature[req]))
        greedy = temp == 0.0
        seed = int(seeds[req])
        draft_row = req if row_mapping is None else max(int(row_mapping[req]), 0)

        def p_log(logit):
            return _log_softmax(target[logit])

        def q_log(logit, step):
            return _log_softmax(draft[draft_row, step].astype(np.float64) / temp)

        accepted = 0
        cumulative = []
        if block and not greedy:
            log_p = 0.0
            for i in range(n):
                x = int(draft_sampled[start + i + 1])
                if x >= 0:
                    q = q_log(start + i, i)[x] if draft is not None else 0.0
                    log_p = min(log_p + p_log(start + i)[x] - q, 0.0)
                cumulative.append(log_p)
            for i in range(n):
                x = int(draft_sampled[start + i + 1])
                if x < 0:
                    break
                u = float(py_tl_rand(seed ^ (i << 32), int(pos[start + i])))
                ratio = float(np.exp(F32(cumulative[i])))
                following = int(draft_sampled[start + i + 2]) if i < n - 1 else -1
                if following >= 0:
                    if draft is not None:
                        residual = np.sum(np.maximum(ratio * np.exp(p_log(start + i + 1))
                                                     - np.exp(q_log(start + i + 1, i + 1)), 0))
                    else:
                        residual = ratio * (1 - np.exp(p_log(start + i + 1)[following]))
                    denominator = residual + 1 - ratio
                    h = residual / denominator if denominator > 0 else 1.0
                else:
                    h = ratio
                if u <= h:
                    accepted = i + 1
                sampled[r, i] = x
        else:
            for i in range(n):
                x = int(draft_sampled[start + i + 1])
                if not greedy and x < 0:
                    break
                step_seed = seed ^ (i << 32) if block else seed
                u = float(py_tl_rand(step_seed, int(pos[start + i])))
                argmax = int(np.argmax(target[start + i]))
                if rates is not None:
                    ok = u < float(F32(rates[i]))
                elif greedy:
                    ok = argmax == max(x, 0)
                else:
                    q = q_log(start + i, i)[x] if draft is not None else 0.0
                    ok = p_log(start + i)[x] > np.log(u) + q
                ok = ok and (x >= 0 or not greedy)
                sampled[r, i] = argmax if greedy and not ok else max(x, 0)
                if not ok:
                    break
                accepted += 1
        t = start + accepted
        bonus = t == end - 1
        num_sampled[r] = accepted + 1
        if greedy and not bonus:
            continue
        x = 0 if bonus else int(draft_sampled[t + 1])
        logits = target[t].astype(np.float64)
        if bonus or x < 0:
            residual = logits
        elif draft is not None:
            tl = p_log(t) + (cumulative[accepted - 1] if block and accepted > 0 else 0.0)
            ratio = np.exp(q_log(t, accepted) - tl)
            with np.errstate(divide="ignore", invalid="ignore"):
                residual = np.where(ratio < 1, tl + np.log1p(-ratio), -INF)
        else:
            residual = np.where(np.arange(len(logits)) == x, -INF, logits)
        if temp != 0.0:
            noise = np.array([py_gumbel_noise(seed, int(pos[t]), v) for v in range(len(logits))])
            residual = residual + noise
        sampled[r, accepted] = int(np.argmax(residual))
    return sampled, num_sampled


def _batch(seed=0, vocab=10, temperatures=(0.0, 0.8, 1.0, 1.3), steps=3,
           drafts=(3, 0, 2, 3, 1), draft_logits=True, shuffle=True):
    """A verification batch: per request ``r`` ``drafts[r]`` draft tokens (0: a prefill's single
    logit), draft tokens mostly the draft distribution's argmax so that some get accepted."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(drafts)
    max_reqs = num_reqs + 2
    idx_mapping = torch.randperm(max_reqs, generator=g)[:num_reqs] if shuffle else torch.arange(
        num_reqs)
    temperature = torch.zeros(max_reqs)
    for r, req in enumerate(idx_mapping.tolist()):
        temperature[req] = temperatures[r % len(temperatures)]
    seeds = torch.randint(-2**40, 2**40, (max_reqs,), generator=g)
    cu = torch.tensor([0] + list(np.cumsum([d + 1 for d in drafts])), dtype=torch.int32)
    num_logits = int(cu[-1])
    target = torch.randn(num_logits, vocab, generator=g) * 2
    draft = torch.randn(max_reqs, steps, vocab, generator=g) * 2 if draft_logits else None
    if draft is not None:  # a draft model close to the target: long accepted runs occur
        for r, req in enumerate(idx_mapping.tolist()):
            start = int(cu[r])
            target[start : start + drafts[r]] = (draft[req, : drafts[r]]
                                                 + 0.3 * target[start : start + drafts[r]])
    draft_sampled = torch.zeros(num_logits, dtype=torch.int64)
    expanded_idx = torch.zeros(num_logits, dtype=torch.int64)
    local_pos = torch.zeros(num_logits, dtype=torch.int64)
    pos = torch.zeros(num_logits, dtype=torch.int64)
    for r, req in enumerate(idx_mapping.tolist()):
        start = int(cu[r])
        base = int(torch.randint(5, 50, (1,), generator=g))
        for i in range(drafts[r] + 1):
            expanded_idx[start + i] = req
            local_pos[start + i] = i
            pos[start + i] = base + i
            if i > 0:
                source = target[start + i - 1] if draft is None else draft[req, i - 1]
                pick = int(source.argmax()) if torch.rand(1, generator=g) < 0.7 else int(
                    torch.randint(vocab, (1,), generator=g))
                draft_sampled[start + i] = pick
    return dict(target_logits=target, draft_logits=draft, row_mapping=None,
                draft_sampled=draft_sampled, cu_num_logits=cu, pos=pos, idx_mapping=idx_mapping,
                expanded_idx_mapping=expanded_idx, expanded_local_pos=local_pos,
                temperature=temperature, seed=seeds, num_speculative_steps=steps)


def _loop(batch, rates=None, block=False):
    d = batch["draft_logits"]
    mapping = batch["row_mapping"]
    return loop_rejection_sample(
        batch["target_logits"].numpy(), None if d is None else d.numpy(),
        None if mapping is None else mapping.numpy(), batch["draft_sampled"].numpy(),
        batch["cu_num_logits"].numpy(), batch["pos"].numpy(), batch["idx_mapping"].numpy(),
        batch["expanded_idx_mapping"].numpy(), batch["temperature"].numpy(),
        batch["seed"].numpy(), batch["num_speculative_steps"], rates, block)


def _check_against_loop(batch, rates=None, block=False, **options):
    sampled, num_sampled, *_ = rejection_sample(**batch, rates=rates, block=block, **options)
    expected, expected_num = _loop(batch, None if rates is None else rates.numpy(), block)
    assert num_sampled.tolist() == expected_num.tolist()
    for r, n in enumerate(expected_num.tolist()):
        assert sampled[r, :n].tolist() == expected[r, :n].tolist(), r
    return num_sampled


@pytest.mark.parametrize("draft_logits", [True, False], ids=["draft_logits", "one_hot"])
@pytest.mark.parametrize("vocab_block,resample_block", [(8192, 1024), (4, 4), (3, 8)])
@pytest.mark.parametrize("seed", range(4))
def test_rejection_sampling_equals_the_kernels_loop(seed, vocab_block, resample_block,
                                                     draft_logits):
    batch = _batch(seed, draft_logits=draft_logits)
    _check_against_loop(batch, vocab_block=vocab_block, resample_block=resample_block)


@pytest.mark.parametrize("draft_logits", [True, False], ids=["draft_logits", "one_hot"])
@pytest.mark.parametrize("seed", range(4))
def test_block_verification_equals_the_kernels_loop(seed, draft_logits):
    batch = _batch(seed + 10, draft_logits=draft_logits)
    _check_against_loop(batch, block=True, vocab_block=4, resample_block=4)


def test_the_loop_comparison_sees_every_request_and_a_wrong_seed():
    # Coverage: the batches hold fully accepted, partially accepted and rejected requests of
    # every kind; negative control: the loop with other seeds disagrees with the kernels.
    outcomes, agreements = set(), []
    for seed in range(4):
        batch = _batch(seed)
        sampled, num_sampled, rejected, *_ = rejection_sample(**batch, vocab_block=4)
        drafts = (batch["cu_num_logits"][1:] - batch["cu_num_logits"][:-1] - 1).tolist()
        temps = batch["temperature"][batch["idx_mapping"]].tolist()
        for n, accepted, temp in zip(drafts, rejected.tolist(), temps):
            if n:
                outcomes.add((temp == 0.0, "all" if accepted == n else "some" if accepted
                              else "none"))
        batch["seed"] = batch["seed"] + 1
        expected, expected_num = _loop(batch)
        agreements.append(num_sampled.tolist() == expected_num.tolist() and all(
            sampled[r, :n].tolist() == expected[r, :n].tolist()
            for r, n in enumerate(expected_num.tolist())))
    assert not all(agreements)
    assert outcomes == {(g, k) for g in (True, False) for k in ("all", "some", "none")}


def test_synthetic_acceptance_equals_the_kernels_loop():
    batch = _batch(3)
    _check_against_loop(batch, rates=torch.tensor([0.9, 0.5, 0.2]), vocab_block=4)


def test_a_row_mapped_draft_cache_equals_the_loop_and_fp64_draws_keep_the_verdicts():
    batch = _batch(5)
    num_reqs = batch["idx_mapping"].shape[0]
    mapping = torch.full((num_reqs + 2,), -1, dtype=torch.int32)
    order = torch.randperm(num_reqs + 2, generator=torch.Generator().manual_seed(1))
    mapping[batch["idx_mapping"]] = order[:num_reqs].int()
    cache = torch.zeros_like(batch["draft_logits"])
    cache[order[:num_reqs]] = batch["draft_logits"][batch["idx_mapping"]]
    batch["draft_logits"], batch["row_mapping"] = cache, mapping
    sampled, num_sampled, *_ = rejection_sample(**batch, vocab_block=4)
    expected, expected_num = loop_rejection_sample(
        batch["target_logits"].numpy(), cache.numpy(), mapping.numpy(),
        batch["draft_sampled"].numpy(), batch["cu_num_logits"].numpy(), batch["pos"].numpy(),
        batch["idx_mapping"].numpy(), batch["expanded_idx_mapping"].numpy(),
        batch["temperature"].numpy(), batch["seed"].numpy(), 3)
    assert num_sampled.tolist() == expected_num.tolist()
    fp64, fp64_num, *_ = rejection_sample(**batch, vocab_block=4, use_fp64=True)
    assert fp64_num.tolist() == num_sampled.tolist()  # acceptance does not depend on the draw


def _greedy_case(drafts, targets_argmax, vocab=6):
    """One greedy request whose step i's target argmax is targets_argmax[i] (the last: bonus)."""
    n = len(drafts)
    target = torch.full((n + 1, vocab), -1.0)
    for i, token in enumerate(targets_argmax):
        target[i, token] = 5.0
    return dict(
        target_logits=target, draft_logits=None, row_mapping=None,
        draft_sampled=torch.tensor([0] + list(drafts)),
        cu_num_logits=torch.tensor([0, n + 1], dtype=torch.int32),
        pos=torch.arange(n + 1) + 10, idx_mapping=torch.tensor([1]),
        expanded_idx_mapping=torch.ones(n + 1, dtype=torch.int64),
        expanded_local_pos=torch.arange(n + 1), temperature=torch.tensor([0.7, 0.0]),
        seed=torch.tensor([1, 2]), num_speculative_steps=3)


GREEDY_CASES = [
    ((2, 4, 1), (2, 4, 1, 5), [2, 4, 1, 5], 3),  # all accepted: the bonus argmax follows
    ((3, 4, 1), (2, 4, 1, 5), [2], 0),  # first rejected: the target argmax replaces it
    ((2, 4, 0), (2, 4, 1, 5), [2, 4, 1], 2),  # partial
    ((2, -1, 1), (2, 4, 1, 5), [2, 4], 1),  # a placeholder is rejected, the argmax stored
]


@pytest.mark.parametrize("drafts,argmaxes,tokens,accepted", GREEDY_CASES)
def test_greedy_verification_by_hand(drafts, argmaxes, tokens, accepted):
    sampled, num_sampled, rejected, target_lse, _ = rejection_sample(
        **_greedy_case(drafts, argmaxes), vocab_block=4, resample_block=4)
    assert rejected.tolist() == [accepted]
    assert num_sampled.tolist() == [len(tokens)]
    assert sampled[0, : len(tokens)].tolist() == tokens
    assert target_lse.tolist() == [0.0]  # greedy requests keep 0


def test_zero_draft_rows_sample_their_bonus_and_padded_steps_stay_unwritten():
    # Request 0 is a prefill (one logit, no drafts), request 1 has 1 of 3 possible drafts.
    case = _greedy_case((2,), (2, 4))
    case["target_logits"] = torch.cat((torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 0.0]]),
                                       case["target_logits"]))
    case["draft_sampled"] = torch.tensor([0, 0, 2])
    case["cu_num_logits"] = torch.tensor([0, 1, 3], dtype=torch.int32)
    case["pos"] = torch.tensor([4, 10, 11])
    case["idx_mapping"] = torch.tensor([0, 1])
    case["expanded_idx_mapping"] = torch.tensor([0, 1, 1])
    case["expanded_local_pos"] = torch.tensor([0, 0, 1])
    case["temperature"] = torch.tensor([0.0, 0.0])
    sampled, num_sampled, rejected, *_ = rejection_sample(**case, vocab_block=4, resample_block=4)
    assert rejected.tolist() == [0, 1] and num_sampled.tolist() == [1, 2]
    assert sampled[0, 0] == 3 and sampled[1, :2].tolist() == [2, 4]


def test_rejection_kernel_writes_only_verified_steps():
    batch = _greedy_case((3, 4, 1), (2, 4, 1, 5))
    blocks = 2
    t_argmax = torch.tensor([[0, 4], [4, 0], [4, 4], [4, 4]])
    t_max = torch.tensor([[5.0, -1.0], [-1.0, 5.0], [-1.0, 5.0], [5.0, 5.0]])
    sampled = torch.full((1, 4), -7, dtype=torch.int64)
    steps, lse, dlse = (torch.full((1,), -7, dtype=torch.int32), torch.full((1,), -7.0),
                        torch.full((1,), -7.0))
    unread = torch.full((4, blocks), float("nan"))  # greedy requests read no summed exponentials
    kernels._rejection_kernel(
        sampled, 4, steps, lse, dlse, batch["target_logits"], 6, t_argmax, blocks, t_max, blocks,
        unread, blocks, batch["draft_sampled"], None, 0, 0, None, unread, blocks, unread, blocks,
        batch["cu_num_logits"], batch["idx_mapping"], batch["temperature"], batch["seed"],
        batch["pos"], None, None, None, 0, None, 0.3, blocks)
    # Step 0's argmax is block 0's token 0 (from the local stats given here), not draft 3.
    assert sampled.tolist() == [[0, -7, -7, -7]] and steps.tolist() == [0]
    assert lse.tolist() == [0.0] and dlse.tolist() == [0.0]


def test_unserved_modes_raise():
    with pytest.raises(RuntimeError, match="FLy"):
        kernels._rejection_kernel(*([None] * 34), FLY_WINDOW_SIZE=2)
    with pytest.raises(RuntimeError, match="watermark"):
        kernels._resample_kernel(*([None] * 27), WATERMARK=True)


# --- the rejection sampler preserves the target distribution ------------------------------------

TARGET = torch.tensor([1.5, 0.2, -0.3, 0.9, -1.2, 0.4])
DRAFT = torch.tensor([0.1, 1.4, 0.3, -0.8, 0.9, -0.2])


def _verification(n, steps=1, believed=None, block=False, seed=7):
    """n requests at temperature 1 with ``steps`` drafts each, drawn from softmax(DRAFT); the
    target's logits are TARGET and TARGET reversed in turn (a target that ignores its context);
    verification is told the draft distribution ``believed`` (default: the true one). Returns
    ``sampled`` and ``num_sampled``."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(torch.softmax(DRAFT, 0), n * steps, replacement=True,
                               generator=g).view(n, steps)
    width = steps + 1
    cu = torch.arange(n + 1, dtype=torch.int32) * width
    target = torch.stack([TARGET if i % 2 == 0 else TARGET.flip(0) for i in range(width)])
    draft_sampled = torch.cat((torch.zeros(n, 1, dtype=torch.int64), drafts), 1).flatten()
    cache = (DRAFT if believed is None else believed).repeat(n, steps, 1)
    sampled, num_sampled, *_ = rejection_sample(
        target.repeat(n, 1), cache, None, draft_sampled, cu, torch.arange(width * n),
        torch.arange(n), torch.arange(n).repeat_interleave(width),
        torch.arange(width).repeat(n), torch.ones(n), torch.arange(n) * 7919 + seed, steps,
        block=block, vocab_block=4, resample_block=4)
    return sampled, num_sampled


def _one_step_verification(n, believed=None):
    """Each request's first token and, for requests whose draft was accepted, the bonus."""
    sampled, num_sampled = _verification(n, believed=believed)
    return sampled[:, 0], sampled[num_sampled == 2, 1]


def test_verified_tokens_follow_the_target_distribution():
    first, bonus = _one_step_verification(6000)
    statistic, p_value = _chi_square(first, torch.softmax(TARGET, 0))
    assert p_value > SIGNIFICANCE, (statistic, p_value)
    statistic, p_value = _chi_square(bonus, torch.softmax(TARGET.flip(0), 0))
    assert p_value > SIGNIFICANCE, (statistic, p_value)


@pytest.mark.parametrize("believed,preserved", [(None, True), (torch.zeros(6), False)],
                         ids=["true_draft_distribution", "wrong_residual"])
def test_block_verification_keeps_the_target_distribution(believed, preserved):
    # Two drafts per request; the first emitted token must follow the target's first step.
    sampled, _ = _verification(6000, steps=2, believed=believed, block=True)
    statistic, p_value = _chi_square(sampled[:, 0], torch.softmax(TARGET, 0))
    assert (p_value > SIGNIFICANCE) == preserved, (statistic, p_value)


def test_one_hot_drafts_keep_the_target_distribution():
    # ngram-style: the draft is a point mass, here always token 1.
    n = 6000
    cu = torch.arange(n + 1, dtype=torch.int32) * 2
    target = torch.stack((TARGET, TARGET)).repeat(n, 1)
    draft_sampled = torch.tensor([0, 1]).repeat(n)
    sampled, *_ = rejection_sample(
        target, None, None, draft_sampled, cu, torch.arange(2 * n), torch.arange(n),
        torch.arange(n).repeat_interleave(2), torch.tensor([0, 1]).repeat(n), torch.ones(n),
        torch.arange(n) * 31 + 5, 1, vocab_block=4, resample_block=4)
    statistic, p_value = _chi_square(sampled[:, 0], torch.softmax(TARGET, 0))
    assert p_value > SIGNIFICANCE, (statistic, p_value)


def test_a_wrong_residual_fails_the_chi_square_test():
    # Negative control: verification believes the draft distribution is uniform, so both the
    # acceptance test and the residual max(p - q, 0) use the wrong q.
    first, _ = _one_step_verification(6000, believed=torch.zeros_like(DRAFT))
    statistic, p_value = _chi_square(first, torch.softmax(TARGET, 0))
    assert p_value < SIGNIFICANCE, (statistic, p_value)


# --- rejection_sampler.py's gather and flatten ---------------------------------------------------

def test_gather_draft_sampled_by_hand():
    input_ids = torch.tensor([11, 12, 13, 14, 15, 16], dtype=torch.int32)
    positions = torch.tensor([3, 4, 5, 7, 8, 9])
    logits_indices = torch.tensor([1, 2, 3, 4, 5])
    expanded = torch.tensor([0, 0, 1, 1, 1])
    local_pos = torch.tensor([0, 1, 0, 1, 2])
    prefill_len = torch.tensor([4, 9])  # request 1's step started inside its prefill
    draft = torch.full((6,), -5, dtype=torch.int32)
    pos = torch.full((6,), -5)
    kernels._gather_draft_sampled_kernel(draft, pos, input_ids, positions, logits_indices,
                                         expanded, local_pos, prefill_len, 5, BLOCK_SIZE=1024)
    # Request 0: 5 - 1 = 4 >= 4, a real draft. Request 1: 8 - 1 < 9 and 9 - 2 < 9: placeholders.
    assert draft.tolist() == [12, 13, 14, -1, -1, -5]
    assert pos.tolist() == [4, 5, 7, 8, 9, -5]


def test_flatten_sampled_by_hand():
    sampled = torch.tensor([[4, 5, 6], [7, 8, 9], [1, 2, 3]])
    flat = torch.full((7,), -1)
    kernels._flatten_sampled_kernel(flat, sampled, 3, torch.tensor([2, 1, 3], dtype=torch.int32),
                                    torch.tensor([0, 3, 4, 7], dtype=torch.int32), num_warps=1)
    assert flat.tolist() == [4, 5, -1, 7, 1, 2, 3]


# --- local stats, cumulative ratio, residual mass ------------------------------------------------

def test_local_logits_stats_by_hand():
    target = torch.tensor([[0.0, 2.0, 1.0, 3.0, 3.0], [1.0, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0]])
    outs = [torch.full((3, 2), -7, dtype=torch.int64)] + [torch.full((3, 2), -7.0)
                                                          for _ in range(4)]
    draft = torch.log(torch.tensor([[[0.5, 0.5, 0.0, 0.0, 0.0]], [[0.2] * 5]]))
    kernels._compute_local_logits_stats_kernel(
        outs[0], 2, outs[1], 2, outs[2], 2, outs[3], 2, outs[4], 2, target, 5, draft, 5, 5,
        None, torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.tensor([0.0, 2.0]), 5, 3,
        BLOCK_SIZE=3, HAS_DRAFT_LOGITS=True)
    argmax, t_max, t_sum, d_max, d_sum = outs
    # Row 0 greedy: block 0 = tokens 0..2 (argmax 1), block 1 = tokens 3, 4 (first max: 3).
    assert argmax[0].tolist() == [1, 3] and t_max[0].tolist() == [2.0, 3.0]
    assert t_sum[0].tolist() == [-7.0, -7.0]  # not written at temperature 0
    # Row 1 is request 0's bonus logit, row 2 request 1's bonus: nothing written.
    assert argmax[1:].tolist() == [[-7, -7]] * 2 and t_max[1:].tolist() == [[-7.0, -7.0]] * 2
    assert d_max.tolist() == [[-7.0, -7.0]] * 3


def test_local_logits_stats_at_temperature_by_hand():
    target = torch.tensor([[0.0, 1.0, 2.0, -INF], [0.0] * 4])
    draft = torch.tensor([[[2.0, 0.0, 4.0, 0.0]]])
    outs = [torch.full((2, 2), -7, dtype=torch.int64)] + [torch.full((2, 2), -7.0)
                                                          for _ in range(4)]
    kernels._compute_local_logits_stats_kernel(
        outs[0], 2, outs[1], 2, outs[2], 2, outs[3], 2, outs[4], 2, target, 4, draft, 4, 4,
        None, torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([2.0]), 4, 2,
        BLOCK_SIZE=2, HAS_DRAFT_LOGITS=True)
    argmax, t_max, t_sum, d_max, d_sum = outs
    assert argmax[0].tolist() == [-7, -7]  # only greedy rows store the argmax
    assert t_max[0].tolist() == [1.0, 2.0]
    assert t_sum[0].tolist() == pytest.approx([np.exp(-1) + 1, 1.0])
    # Draft logits divided by T = 2 first: [1, 0 | 2, 0].
    assert d_max[0].tolist() == [1.0, 2.0]
    assert d_sum[0].tolist() == pytest.approx([1 + np.exp(-1), 1 + np.exp(-2)])


def test_cumulative_log_p_carries_over_placeholders_and_clamps_at_zero():
    # One request, three drafts; target = draft except step 1 doubles p of its draft.
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5], [0.5, 0.5]]).log()
    q = torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.5, 0.5]]]).log()
    blocks = 1
    t_max, t_sum = p.amax(1, keepdim=True), torch.exp(p - p.amax(1, keepdim=True)).sum(1, True)
    d_max = torch.stack([q[0, 0], q[0, 1], q[0, 2], q[0, 2]]).amax(1, keepdim=True)
    d_sum = torch.exp(torch.stack([q[0, 0], q[0, 1], q[0, 2], q[0, 2]]) - d_max).sum(1, True)
    out = torch.full((4,), -7.0)
    kernels._compute_cumulative_log_p_kernel(
        out, p, 2, t_max, blocks, t_sum, blocks, torch.tensor([0, 0, -1, 1]), q, 6, 2, None,
        d_max, blocks, d_sum, blocks, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0]),
        torch.tensor([1.0]), blocks, HAS_DRAFT_LOGITS=True, num_warps=1)
    # Step 0: log(0.5 / 0.25) = +0.69 clamps to 0; step 1 placeholder carries 0; step 2:
    # log(0.5 / 0.5) = 0. The bonus logit (3) is not written.
    assert out.tolist() == pytest.approx([0.0, 0.0, 0.0, -7.0])
    out.fill_(-7.0)
    kernels._compute_cumulative_log_p_kernel(
        out, p, 2, t_max, blocks, t_sum, blocks, torch.tensor([0, 1, 1, 0]), q, 6, 2, None,
        d_max, blocks, d_sum, blocks, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0]),
        torch.tensor([1.0]), blocks, HAS_DRAFT_LOGITS=True, num_warps=1)
    # Step 0: log(0.5 / 0.75); step 1: + log(0.75 / 0.5) = 0; step 2: + log(0.5 / 0.5).
    first = float(np.log(0.5 / 0.75))
    assert out.tolist() == pytest.approx([first, 0.0, 0.0, -7.0], abs=1e-6)


def test_residual_mass_by_hand():
    # Request of 3 logits (two drafts); logit 1 is computed: p_prev = exp(log 0.5).
    p = torch.tensor([[0.5, 0.5], [0.8, 0.2], [0.5, 0.5]]).log()
    q = torch.tensor([[[0.5, 0.5], [0.1, 0.9]]]).log()
    t_max = p.amax(1, keepdim=True)
    t_sum = torch.exp(p - t_max).sum(1, True)
    qs = torch.stack([q[0, 0], q[0, 1], q[0, 1]])
    d_max = qs.amax(1, keepdim=True)
    d_sum = torch.exp(qs - d_max).sum(1, True)
    out = torch.full((3, 1), -7.0)
    kernels._compute_local_residual_mass_kernel(
        out, 1, torch.tensor([0.5, 0.0, 0.0]).log(), p, 2, t_max, 1, t_sum, 1, q, 4, 2, None,
        d_max, 1, d_sum, 1, torch.tensor([0, 1, 0]), torch.tensor([0, 0, 0]),
        torch.tensor([0, 1, 2]), torch.tensor([1.0]), 2, 3, 1, BLOCK_SIZE=2)
    # max(0.5 * 0.8 - 0.1, 0) + max(0.5 * 0.2 - 0.9, 0) = 0.3; logits 0 (first) and 2 (bonus)
    # are skipped.
    assert out[:, 0].tolist() == pytest.approx([-7.0, 0.3, -7.0])


# --- draft_logits.py ----------------------------------------------------------------------------

def test_assign_rows_and_stale_drafts_by_hand():
    shard = torch.full((6,), -1, dtype=torch.int32)
    rows = torch.full((6,), -9, dtype=torch.int32)
    inverse = torch.full((3,), -1, dtype=torch.int32)
    # Batch positions 0..3 of requests 5, 2, 0, 4 over 2 shards; this is shard 1.
    kernels._assign_rows_kernel(torch.tensor([5, 2, 0, 4]), shard, rows, inverse, 4,
                                NUM_SHARDS=2, SHARD_IDX=1, BLOCK_SIZE=1024)
    assert shard.tolist() == [0, -1, 1, -1, 1, 0]
    assert rows.tolist() == [-1, -9, 0, -9, 1, -1]
    assert inverse.tolist() == [2, 4, -1]
    inverse[0] = 3  # request 2's row was given to request 3 since
    stale = torch.zeros(5, dtype=torch.bool)
    kernels._stale_drafts_kernel(stale, torch.tensor([2, 2, 4, 4, 5]),
                                 torch.tensor([0, 1, 0, 1, 1]), rows, inverse, 5,
                                 BLOCK_SIZE=1024)
    assert stale.tolist() == [False, True, False, False, True]


# --- ngram --------------------------------------------------------------------------------------

def loop_ngram(tokens, idx_mapping, total_len, num_sampled, last_sampled, L, min_n, max_n,
               block_l, k):
    """_ngram_scan_kernel's (row, block) programs, then _ngram_finalize_kernel's rows."""
    blocks = -(-L // block_l)
    scratch = np.zeros((len(idx_mapping), blocks), dtype=np.int64)
    drafts = np.zeros((len(idx_mapping), k), dtype=np.int64)
    for b, req in enumerate(idx_mapping):
        seq_len = int(total_len[req])
        row = tokens[req]
        eligible = num_sampled[b] > 0 and seq_len >= min_n
        for blk in range(blocks):
            if not (eligible and blk * block_l <= seq_len - min_n - 1):
                continue
            best = 0
            for p in range(blk * block_l, (blk + 1) * block_l):
                for n in range(min_n, max_n + 1):
                    if p <= seq_len - n - 1 and all(
                            row[p + j] == row[seq_len - n + j] for j in range(n)):
                        best = max(best, n * (L + 1) + p + 1)
            scratch[b, blk] = best
        score = scratch[b].max()
        start = 0
        if score > 0:
            n, p = divmod(score - 1, L + 1)
            start = p + n
        for i in range(k):
            ok = num_sampled[b] > 0 and score > 0 and i < seq_len - start
            drafts[b, i] = row[min(start + i, L - 1)] if ok else last_sampled[req]
    return scratch, drafts


def run_ngram(tokens, idx_mapping, total_len, num_sampled, last_sampled, L, min_n, max_n,
              block_l, k, max_reqs=6):
    blocks = -(-L // block_l)
    scratch = torch.full((max_reqs, blocks), -7, dtype=torch.int64)
    drafts = torch.full((max_reqs, k), -7, dtype=torch.int64)
    kernels._ngram_scan_kernel(tokens, tokens.stride(0), idx_mapping, total_len, num_sampled,
                               scratch, scratch.stride(0), L, min_n, max_n,
                               1 << (max_n - 1).bit_length(), block_l, num_warps=4, num_stages=2)
    kernels._ngram_finalize_kernel(tokens, tokens.stride(0), idx_mapping, total_len, num_sampled,
                                   last_sampled, scratch, scratch.stride(0), drafts, L, blocks, k,
                                   1 << (k - 1).bit_length(), 1 << (blocks - 1).bit_length(),
                                   num_warps=2, num_stages=1)
    return scratch, drafts


def test_ngram_by_hand():
    L = 16
    tokens = torch.zeros(3, L, dtype=torch.int32)
    tokens[0, :9] = torch.tensor([5, 6, 7, 8, 1, 5, 6, 7, 2])  # suffix "7 2": no match
    tokens[1, :9] = torch.tensor([1, 2, 3, 9, 4, 1, 2, 3, 9])  # "2 3 9" seen at 1, then 4 1
    tokens[2, :6] = torch.tensor([3, 3, 3, 3, 3, 3])  # rightmost longest match wins
    total_len = torch.tensor([9, 9, 6], dtype=torch.int32)
    last = torch.tensor([2, 9, 3])
    scratch, drafts = run_ngram(tokens, torch.tensor([0, 1, 2]), total_len,
                                torch.tensor([1, 1, 1], dtype=torch.int32), last, L, 2, 3, 4, 3)
    assert drafts[0].tolist() == [2, 2, 2]  # no match: the last sampled token
    assert drafts[1].tolist() == [4, 1, 2]  # n = 3 at p = 1: tokens from 4 on
    # Row 2: n = 3 matches at p = 0, 1, 2 (p <= 6 - 3 - 1); rightmost p = 2, drafts from 5: [3]
    # then past the length: the last sampled token.
    assert drafts[2].tolist() == [3, 3, 3]
    assert scratch[2, 0] == 3 * (L + 1) + 2 + 1
    assert drafts[3:].tolist() == [[-7] * 3] * 3  # rows past the batch untouched


@pytest.mark.parametrize("seed", range(3))
def test_ngram_equals_the_kernels_loop(seed):
    g = torch.Generator().manual_seed(seed)
    L, max_reqs, k = 40, 6, 4
    tokens = torch.randint(0, 3, (max_reqs, L), generator=g, dtype=torch.int32)
    total_len = torch.randint(0, L + 1, (max_reqs,), generator=g, dtype=torch.int32)
    total_len[0] = 1
    idx_mapping = torch.randperm(max_reqs, generator=g)[:5]
    num_sampled = torch.tensor([1, 0, 2, 1, 1], dtype=torch.int32)
    last = torch.randint(100, 200, (max_reqs,), generator=g)
    for min_n, max_n, block_l in ((1, 3, 16), (2, 2, 64), (3, 5, 8)):
        scratch, drafts = run_ngram(tokens, idx_mapping, total_len, num_sampled, last, L, min_n,
                                    max_n, block_l, k)
        expected_scratch, expected = loop_ngram(tokens.numpy(), idx_mapping.numpy(),
                                                total_len.numpy(), num_sampled.numpy(),
                                                last.numpy(), L, min_n, max_n, block_l, k)
        assert scratch[:5].tolist() == expected_scratch.tolist()
        assert drafts[:5].tolist() == expected.tolist()


# --- standalone_ar (draft_model) ------------------------------------------------------------------

def loop_standalone_prefill(ids, positions, last_sampled, idx_mapping, qsl, seq_lens, rejected,
                            max_reqs, max_len, out_ids, out_pos, last_idx, out_qsl, out_seq):
    n = len(idx_mapping)
    for i in range(n):
        qs, qn = qsl[i], qsl[i + 1]
        valid = qn - qs - rejected[i]
        out_start = qs + i
        for j in range(qn - qs + 1):
            out_ids[out_start + j] = (last_sampled[idx_mapping[i]] if j == valid
                                      else ids[qs + j] if j < valid else 0)
            out_pos[out_start + j] = min(positions[qs] + j, max_len - 1)
        last_idx[i] = out_start + valid
        out_qsl[i] = out_start
        out_seq[i] = min(seq_lens[i] + 1, max_len)
        if i == n - 1:
            out_qsl[n:max_reqs + 1] = out_start + qn - qs + 1
            out_seq[n:max_reqs] = 0
            last_idx[n:max_reqs] = 0


def test_standalone_prefill_inputs_equal_the_loop_and_hand_values():
    ids = torch.tensor([10, 11, 12, 20, 21, 30], dtype=torch.int32)
    positions = torch.tensor([5, 6, 7, 3, 4, 62])
    last = torch.tensor([[0], [99], [88], [77]], dtype=torch.int32)  # MRV2's [max_reqs, 1]
    idx_mapping = torch.tensor([3, 1, 2])
    qsl = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    seq_lens = torch.tensor([8, 5, 63], dtype=torch.int32)
    rejected = torch.tensor([1, 0, 0], dtype=torch.int32)
    outs = dict(out_ids=torch.full((10,), -7, dtype=torch.int32), out_pos=torch.full((10,), -7),
                last_idx=torch.full((5,), -7), out_qsl=torch.full((6,), -7, dtype=torch.int32),
                out_seq=torch.full((5,), -7, dtype=torch.int32))
    expected = {name: t.clone().numpy() for name, t in outs.items()}
    kernels.standalone_ar_prepare_prefill_inputs(
        ids, positions, last, idx_mapping, *outs.values(), qsl, seq_lens, rejected, 5, 64,
        BLOCK_SIZE=8)
    loop_standalone_prefill(ids.numpy(), positions.numpy(), last.view(-1).numpy(),
                            idx_mapping.numpy(),
                            qsl.numpy(), seq_lens.numpy(), rejected.numpy(), 5, 64,
                            *expected.values())
    for name, value in outs.items():
        assert value.tolist() == expected[name].tolist(), name
    # Request 3: 2 accepted [10, 11], correction 77, one rejected slot 0.
    assert outs["out_ids"].tolist() == [10, 11, 77, 0, 20, 21, 99, 30, 88, -7]
    assert outs["out_pos"].tolist() == [5, 6, 7, 8, 3, 4, 5, 62, 63, -7]
    assert outs["last_idx"].tolist() == [2, 6, 8, 0, 0]
    assert outs["out_qsl"].tolist() == [0, 4, 7, 9, 9, 9]
    assert outs["out_seq"].tolist() == [9, 6, 64, 0, 0]


# --- target_dependent_ar (eagle, eagle3, mtp) ---------------------------------------------------

def test_target_dependent_prefill_inputs_by_hand():
    last_idx = torch.full((4,), -7)
    step = torch.tensor(3)
    draft_ids = torch.full((8,), -7, dtype=torch.int32)
    draft_pos = torch.full((8,), -7)
    draft_qsl = torch.full((5,), -7, dtype=torch.int32)
    draft_seq = torch.full((4,), -7, dtype=torch.int32)
    target_ids = torch.tensor([10, 11, 12, 20, 21, 22, 30, 0], dtype=torch.int32)
    target_pos = torch.tensor([4, 5, 6, 7, 8, 9, 2, 0])
    last_sampled = torch.tensor([0, 55, 66, 0], dtype=torch.int32)
    next_prefill = torch.tensor([0, 0, 0, 31], dtype=torch.int32)
    kernels.target_dependent_ar_prepare_prefill_inputs(
        last_idx, step, draft_ids, draft_pos, draft_qsl, draft_seq, target_ids, target_pos,
        torch.tensor([1, 2, 3]), last_sampled, next_prefill,
        torch.tensor([2, 1, 0], dtype=torch.int32), torch.tensor([1, 0, 0], dtype=torch.int32),
        torch.tensor([0, 3, 6, 7], dtype=torch.int32), torch.tensor([7, 10, 3], dtype=torch.int32),
        4, BLOCK_SIZE=1024)
    # Request 1 (one rejected): [11, 55] in slots 0-1, slot 2 untouched; request 2: [21, 22, 66];
    # request 3 (chunked prefill, nothing sampled): its next prompt token 31.
    assert draft_ids.tolist() == [11, 55, -7, 21, 22, 66, 31, -7]
    assert draft_pos.tolist() == [4, 5, -7, 7, 8, 9, 2, -7]
    assert last_idx.tolist() == [1, 5, 6, 0]
    assert draft_qsl.tolist() == [0, 3, 6, 7, 7]
    assert draft_seq.tolist() == [7, 10, 3, 0]
    assert int(step) == 0


def test_target_dependent_decode_inputs_by_hand():
    draft_tokens = torch.tensor([[5, 6], [7, 8]])
    input_ids = torch.full((4,), -7, dtype=torch.int32)
    positions = torch.tensor([10, 63, -7, -7])
    sample_pos = torch.tensor([20, 30, 40, 50])
    qsl = torch.full((5,), -7, dtype=torch.int32)
    seq_lens = torch.full((4,), -7, dtype=torch.int32)
    kernels._prepare_decode_inputs_kernel(
        draft_tokens[:2, 0], draft_tokens.stride(0), torch.tensor([12, 64], dtype=torch.int32),
        torch.tensor([1, 0], dtype=torch.int32), input_ids, positions, sample_pos, qsl, seq_lens,
        64, 4, BLOCK_SIZE=1024, ADVANCE_DRAFT_POSITIONS=True)
    assert input_ids.tolist() == [5, 7, -7, -7]
    assert positions.tolist() == [11, 63, -7, -7]  # clamped below the model length
    assert sample_pos.tolist() == [21, 31, 40, 50]
    assert seq_lens.tolist() == [12, 64, 0, 0]  # 12 - 1 + 1; min(64 + 1, 64)
    assert qsl.tolist() == [0, 1, 2, 2, 2]


@pytest.mark.parametrize("step,last", [(0, False), (2, True)])
def test_update_draft_inputs_by_hand(step, last):
    out = torch.full((2, 3), -7)
    next_hidden = torch.zeros(3, 2)
    input_ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    positions = torch.tensor([10, 63, 5])
    sample_pos = torch.tensor([20, 30, 40])
    seq_lens = torch.tensor([11, 64, 6], dtype=torch.int32)
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    kernels._update_draft_inputs_kernel(
        out, 3, next_hidden, 2, input_ids, positions, sample_pos, seq_lens,
        torch.tensor([8, 9]), torch.tensor(step), hidden, 2, 2, torch.tensor(64), 3,
        BLOCK_SIZE=1024, ADVANCE_DRAFT_POSITIONS=True)
    assert out[:, step].tolist() == [8, 9]
    if last:  # the final step only stores its drafts
        assert input_ids.tolist() == [1, 2, 3] and positions.tolist() == [10, 63, 5]
        assert sample_pos.tolist() == [20, 30, 40] and next_hidden.sum() == 0
        return
    assert input_ids.tolist() == [8, 9, 3]
    assert positions.tolist() == [11, 63, 5] and seq_lens.tolist() == [12, 64, 6]
    assert sample_pos.tolist() == [21, 31, 40]
    assert next_hidden.tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]


# --- vLLM's own host code over the overrides (0.34) ---------------------------------------------

def _vllm_rejection_sample(monkeypatch):
    """vLLM 0.34's rejection_sample(), its kernels replaced by KernelOverrides as register_kernels
    leaves them, called on one of this file's batches."""
    from vllm.triton_utils import triton
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler, rejection_sampler_utils
    from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache

    monkeypatch.setattr(triton, "next_power_of_2", lambda n: 1 << (n - 1).bit_length(),
                        raising=False)
    for module in (rejection_sampler, rejection_sampler_utils):
        for impl in kernels.KERNELS[module.__name__]:
            monkeypatch.setattr(module, impl.__name__,
                                KernelOverride(getattr(module, impl.__name__), impl))

    def sample(batch, block=False):
        cache = None
        if batch["draft_logits"] is not None:
            cache = DraftLogitsCache.__new__(DraftLogitsCache)
            cache.values, cache.row_mapping = batch["draft_logits"], None
        return rejection_sampler_utils.rejection_sample(
            batch["target_logits"], cache, batch["draft_sampled"], batch["cu_num_logits"],
            batch["pos"], batch["idx_mapping"], batch["expanded_idx_mapping"],
            batch["expanded_local_pos"], batch["temperature"], batch["seed"], 3,
            use_block_verification=block)

    return sample


def _sampled_as_lists(sampled, num_sampled) -> list[list[int]]:
    return [sampled[r, :n].tolist() for r, n in enumerate(num_sampled.tolist())]


@pytest.mark.mrv2_only
def test_vllm_rejection_sample_runs_the_overrides(monkeypatch):
    """vLLM 0.34's rejection_sample() and gather_draft_sampled(), their kernels replaced by
    KernelOverrides as register_kernels leaves them, give what this file's transcription of the
    host code gives."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler

    vllm_sample = _vllm_rejection_sample(monkeypatch)
    for block in (False, True):
        batch = _batch(21)
        sampled, num_sampled = vllm_sample(batch, block)
        expected, expected_num, *_ = rejection_sample(**batch, block=block)
        assert num_sampled.tolist() == expected_num.tolist()
        assert _sampled_as_lists(sampled, num_sampled) == _sampled_as_lists(expected, expected_num)
    draft, pos = rejection_sampler.gather_draft_sampled(
        torch.tensor([11, 12, 13]), torch.tensor([3, 4, 6]), torch.tensor([0, 1, 2]),
        torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), torch.tensor([4]))
    assert draft.tolist() == [11, -1, 13] and pos.tolist() == [3, 4, 6]  # 4 - 1 < 4 <= 6 - 2


# --- all-greedy batches on one argmax (ascend_patch.npu.runner.v2.sampler) ----------------------

@pytest.mark.parametrize("drafts,argmaxes,tokens,accepted", GREEDY_CASES)
def test_greedy_verification_by_hand_on_one_argmax(drafts, argmaxes, tokens, accepted):
    from ascend_patch.npu.runner.v2.sampler import greedy_verification

    case = _greedy_case(drafts, argmaxes)
    sampled, num_sampled = greedy_verification(case["target_logits"], case["draft_sampled"],
                                               case["cu_num_logits"], 3)
    assert num_sampled.dtype == torch.int32 and num_sampled.tolist() == [accepted + 1]
    assert sampled[0, : len(tokens)].tolist() == tokens


@pytest.mark.mrv2_only
@pytest.mark.parametrize("seed", range(6))
def test_greedy_verification_equals_vllms_kernels(monkeypatch, seed):
    """Greedy batches of prefills (one logit) and 1 to 3 drafts per request, drafts and
    placeholders mixed, without and with draft logits (a narrower draft vocabulary is cut by the
    wrapper, not here): the accepted drafts and the tokens vLLM's rejection_sample gives; a
    draft column read one row behind (the control) does not."""
    from ascend_patch.npu.runner.v2.sampler import greedy_verification

    vllm_sample = _vllm_rejection_sample(monkeypatch)
    batch = _batch(seed, temperatures=(0.0,), draft_logits=bool(seed % 2), drafts=(3, 0, 2, 3, 1, 3))
    batch["draft_sampled"][3] = -1  # a placeholder in the first request's drafts
    expected = _sampled_as_lists(*vllm_sample(batch))
    ours = greedy_verification(batch["target_logits"], batch["draft_sampled"],
                               batch["cu_num_logits"], 3)
    assert _sampled_as_lists(*ours) == expected
    assert any(len(tokens) > 1 for tokens in expected)  # drafts were accepted
    behind = greedy_verification(batch["target_logits"], batch["draft_sampled"].roll(1),
                                 batch["cu_num_logits"], 3)
    assert _sampled_as_lists(*behind) != expected
