"""The NPU implementations of Model Runner V2's sampling kernels (ascend_patch.npu.runner.v2).

Oracles: per-row, per-block loops transcribed from the Triton kernels' source (vLLM 0.34
``v1/worker/gpu/sample/*.py``, ``gpu/structured_outputs.py``, ``gpu/metrics/logits.py``) with
fp32 arithmetic in numpy and the murmur3 hash in Python integers; values derived by hand; the
reference C MurmurHash3_x86_32 for the hash; and for Gumbel sampling the distribution it must
draw from, softmax(logits / T).
"""

from __future__ import annotations

import importlib
import inspect
import math

import numpy as np
import pytest
import torch

from ascend_patch.npu.runner.v2 import sample_kernels as kernels
from ascend_patch.npu.runner.triton_kernels import kernel_arg_names

F32 = np.float32
INF = float("inf")

# Parameters 0.34 added to a kernel 0.33 also has (0.33's list is the rest, in the same order).
ADDED_IN_0_34 = {
    "_gumbel_sample_kernel": ("logits_cache_row_mapping_ptr", "bias_ptr", "bias_stride",
                              "HAS_BIAS"),
}
NEW_IN_0_34 = {"_gumbel_combine_kernel"}

IMPLEMENTATIONS = [(module, fn) for module, fns in kernels.KERNELS.items() for fn in fns]


def _vllm_release() -> tuple[int, int]:
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("module,impl", IMPLEMENTATIONS,
                         ids=[fn.__name__ for _, fn in IMPLEMENTATIONS])
def test_parameters_are_the_installed_kernels(module, impl):
    names = tuple(inspect.signature(impl).parameters)
    owner = importlib.import_module(module)
    if _vllm_release() >= (0, 34):
        assert kernel_arg_names(getattr(owner, impl.__name__)) == names
    elif impl.__name__ in NEW_IN_0_34:
        assert not hasattr(owner, impl.__name__)
    else:
        added = ADDED_IN_0_34.get(impl.__name__, ())
        expected = tuple(name for name in names if name not in added)
        assert kernel_arg_names(getattr(owner, impl.__name__)) == expected


# --- murmur3 and the Gumbel kernels -------------------------------------------------------------

M32 = 0xFFFFFFFF


def py_murmur3(seed: int, pos: int, offset: int, domain: int = 0) -> int:
    """gumbel.py's murmur3_hash32 with Python integers."""
    def rotl(v, s):
        return ((v << s) | (v >> (32 - s))) & M32

    def mix(h, k):
        k = rotl((k * 0xCC9E2D51) & M32, 15)
        k = (k * 0x1B873593) & M32
        h = rotl(h ^ k, 13)
        return (h * 5 + 0xE6546B64) & M32

    h = domain
    for word in (seed & M32, (seed >> 32) & M32, pos & M32, offset & M32):
        h = mix(h, word)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def py_gumbel_noise(seed: int, pos: int, token: int) -> np.float32:
    r = py_murmur3(seed, pos, token)
    u = F32(r >> 16) * F32(1.52587890625e-05) + (F32(r & 0xFFFF) + F32(0.5)) * F32(
        2.3283064365386963e-10)
    p = F32(1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        p = F32(c) + u * p
    log1p_neg = -u * p if u < F32(0.25) else np.log(max(F32(1.0) - u, F32(5.960464477539063e-08)))
    return -np.log(-F32(log1p_neg))


def test_murmur3_is_the_reference_murmurhash3_x86_32():
    # MurmurHash3_x86_32 of the 16 bytes (seed low, seed high, pos, offset) seeded with the
    # domain, from Austin Appleby's reference C code compiled here.
    cases = {(0, 0, 0, 0): 2167721464, (42, 7, 3, 0): 966665676, (-1, 5, 100, 0): 3813001002,
             (1234567890123, (1 << 30) + 2, 9, 0): 2104787940,
             (42, 7, 3, 0x9E3779B9): 2162358523}
    for (seed, pos, offset, domain), expected in cases.items():
        assert py_murmur3(seed, pos, offset, domain) == expected
        got = kernels.murmur3_hash32(torch.tensor([[seed]]), torch.tensor([[pos]]),
                                     torch.tensor([[offset]]), domain)
        assert int(got) == expected


def loop_gumbel_sample(logits, mapping, temperature, seeds, pos, block, apply_temperature,
                       is_drafting=False):
    """_gumbel_sample_kernel's (row, block) programs, then _gumbel_combine_kernel's rows."""
    rows, vocab = logits.shape
    blocks = -(-vocab // block)
    local_argmax = np.zeros((rows, blocks), dtype=np.int64)
    local_max = np.zeros((rows, blocks), dtype=np.float32)
    for t in range(rows):
        req = int(mapping[t])
        temp = F32(temperature[req]) if req >= 0 else F32(0.0)
        seed = int(seeds[req]) if req >= 0 else 0
        p = int(pos[t]) + ((1 << 30) if is_drafting else 0)
        for b in range(blocks):
            best, best_idx = None, 0
            for lane in range(block):
                v = b * block + lane
                if v >= vocab:
                    x = F32(-INF)
                else:
                    x = F32(logits[t, v])
                    if temp != 0.0:
                        if apply_temperature:
                            x = x / temp
                        x = x + py_gumbel_noise(seed, p, v)
                if best is None or x > best:
                    best, best_idx = x, lane
            local_argmax[t, b] = b * block + best_idx
            local_max[t, b] = best
    sampled = [int(local_argmax[t, int(np.argmax(local_max[t]))]) for t in range(rows)]
    return local_argmax, local_max, sampled


def gumbel_sample(logits, mapping, temperature, seeds, pos, block=1024, apply_temperature=True,
                  **flags):
    """gumbel.py's gumbel_sample() host code (0.34) around the two NPU implementations."""
    rows, vocab = logits.shape
    blocks = -(-vocab // block)
    local_argmax = torch.full((rows, blocks), -7, dtype=torch.int64)
    local_max = torch.full((rows, blocks), -7.0)
    kernels._gumbel_sample_kernel(
        local_argmax, blocks, local_max, blocks, None, 0, 0, None, None, 0, None, logits,
        logits.stride(0), flags.pop("bias", None), vocab, mapping, seeds, pos, temperature,
        vocab, BLOCK_SIZE=block, APPLY_TEMPERATURE=apply_temperature, **flags)
    sampled = torch.full((rows,), -7, dtype=torch.int64)
    kernels._gumbel_combine_kernel(local_argmax, blocks, local_max, blocks, sampled, blocks,
                                   PADDED_NUM_BLOCKS=1 << (blocks - 1).bit_length())
    return local_argmax, local_max, sampled


def _gumbel_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 10, generator=g)
    logits[3, 6] = logits[3, 2] = 9.0  # a tie under greedy: the first wins
    mapping = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32)  # the last row is padding
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0], dtype=torch.float32)
    seeds = torch.tensor([42, -5, 1234567890123, 7], dtype=torch.int64)
    pos = torch.tensor([3, 0, 17, 5, 9], dtype=torch.int64)
    return logits, mapping, temperature, seeds, pos


@pytest.mark.parametrize("apply_temperature", [True, False])
@pytest.mark.parametrize("block", [4, 16])
def test_gumbel_sampling_equals_the_kernels_loop(block, apply_temperature):
    logits, mapping, temperature, seeds, pos = _gumbel_batch()
    expected = loop_gumbel_sample(logits.numpy(), mapping.numpy(), temperature.numpy(),
                                  seeds.numpy(), pos.numpy(), block, apply_temperature)
    local_argmax, local_max, sampled = gumbel_sample(logits, mapping, temperature, seeds, pos,
                                                     block, apply_temperature)
    assert local_argmax.tolist() == expected[0].tolist()
    torch.testing.assert_close(local_max, torch.from_numpy(expected[1]), rtol=1e-6, atol=1e-6)
    assert sampled.tolist() == expected[2]
    # Greedy (T = 0) and padding rows take the plain argmax; the tie goes to the first token.
    assert sampled[3] == 2 and sampled[4] == int(logits[4].argmax())


def test_the_sampled_token_is_the_full_rows_noised_argmax_whatever_the_block_size():
    logits, mapping, temperature, seeds, pos = _gumbel_batch()
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1))
    full_row = []
    for t in range(5):
        req = int(mapping[t])
        temp = float(temperature[req]) if req >= 0 else 0.0
        if temp == 0.0:
            full_row.append(int(logits[t].argmax()))
            continue
        noise = [py_gumbel_noise(int(seeds[req]), int(pos[t]), v) for v in range(3000)]
        full_row.append(int((logits[t] / temp + torch.tensor(noise)).argmax()))
    for block in (1024, 256, 7):
        assert gumbel_sample(logits, mapping, temperature, seeds, pos, block)[2].tolist() == full_row


def test_drafting_draws_other_noise_than_the_target():
    logits, mapping, temperature, seeds, pos = _gumbel_batch()
    expected = loop_gumbel_sample(logits.numpy(), mapping.numpy(), temperature.numpy(),
                                  seeds.numpy(), pos.numpy(), 4, True, is_drafting=True)
    local_argmax, _, sampled = gumbel_sample(logits, mapping, temperature, seeds, pos, 4,
                                             IS_DRAFTING=True)
    assert local_argmax.tolist() == expected[0].tolist() and sampled.tolist() == expected[2]


def test_a_wrong_noise_stream_fails_the_loop_comparison():
    # Negative control: the same rows with every position shifted by one differ from the loop.
    logits, mapping, temperature, seeds, pos = _gumbel_batch()
    expected = loop_gumbel_sample(logits.numpy(), mapping.numpy(), temperature.numpy(),
                                  seeds.numpy(), pos.numpy(), 4, True)
    local_argmax, _, _ = gumbel_sample(logits, mapping, temperature, seeds, pos + 1, 4)
    assert local_argmax[:3].tolist() != expected[0][:3].tolist()


def test_gumbel_sample_with_bias_and_fp64_by_hand():
    # T = 0 rows, so no noise: argmax of logits + bias rounded to the logits dtype, per block of 2.
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.25, 0.0]], dtype=torch.bfloat16)
    bias = torch.tensor([[0.0, -5.0, 0.0], [0.0, 0.0, 4.0]], dtype=torch.bfloat16)
    local_argmax, local_max, sampled = gumbel_sample(
        logits, torch.tensor([0, 0]), torch.tensor([0.0]), torch.tensor([1]),
        torch.tensor([0, 0]), block=2, bias=bias, HAS_BIAS=True)
    assert local_argmax.tolist() == [[0, 2], [0, 2]]
    assert local_max.tolist() == [[1.0, 2.0], [0.5, 4.0]]
    assert sampled.tolist() == [2, 2]
    # fp64: the same draw's uniform comes from two hashes (53 bits) and -log(-log(u)).
    rows = 1
    local_argmax = torch.zeros(rows, 1, dtype=torch.int64)
    local_max = torch.zeros(rows, 1, dtype=torch.float64)
    logits = torch.tensor([[0.0, 0.0]])
    kernels._gumbel_sample_kernel(
        local_argmax, 1, local_max, 1, None, 0, 0, None, None, 0, None, logits, 2, None, 0,
        torch.tensor([0]), torch.tensor([42]), torch.tensor([7]), torch.tensor([1.0]), 2,
        BLOCK_SIZE=2, USE_FP64=True)
    noise = []
    for token in range(2):
        random53 = ((py_murmur3(42, 7, token, 0x9E3779B9) << 32)
                    | py_murmur3(42, 7, token)) >> 11
        noise.append(-math.log(-math.log((random53 + 0.5) * 2.0 ** -53)))
    assert int(local_argmax[0, 0]) == int(np.argmax(noise))
    assert float(local_max[0, 0]) == pytest.approx(max(noise), rel=1e-12)


def test_gumbel_sample_writes_the_logits_cache():
    # Drafting with a cache: each row's logits (before temperature) go to cache[row, col], a
    # padding row (slot -1) and a slot the row mapping drops (-1) write nothing; the column is
    # mixed into the seed as seed ^ (col << 32).
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    cache = torch.full((2, 3, 4), -1.0)
    mapping = torch.tensor([1, -1, 0])
    row_mapping = torch.tensor([-1, 0])
    col = torch.tensor([2, 0, 1])
    temperature = torch.tensor([0.5, 0.5])
    seeds = torch.tensor([11, 3])
    pos = torch.tensor([4, 4, 4])
    local_argmax = torch.zeros(3, 1, dtype=torch.int64)
    local_max = torch.zeros(3, 1)
    kernels._gumbel_sample_kernel(
        local_argmax, 1, local_max, 1, cache, 12, 4, col, None, 0, row_mapping, logits, 3, None,
        0, mapping, seeds, pos, temperature, 3, BLOCK_SIZE=4, IS_DRAFTING=True,
        PER_TOKEN_COL=True)
    expected = torch.full((2, 3, 4), -1.0)
    expected[0, 2, :3] = logits[0]
    assert torch.equal(cache, expected)
    salted = 3 ^ (2 << 32)
    scores = [float(F32(logits[0, v]) / F32(0.5) + py_gumbel_noise(salted, 4 + (1 << 30), v))
              for v in range(3)]
    assert int(local_argmax[0, 0]) == int(np.argmax(scores))


def test_combine_by_hand():
    local_argmax = torch.tensor([[5, 17, 33, 50], [1, 20, 40, 60], [2, 21, 41, 61]])
    local_max = torch.tensor([[1.0, 3.0, 3.0, 2.0],
                              [1.0, INF, float("nan"), float("nan")],
                              [-INF, -INF, -INF, -INF]])
    sampled = torch.full((3,), -1)
    kernels._gumbel_combine_kernel(local_argmax, 4, local_max, 4, sampled, 4)
    # first maximum; the first NaN over a larger value; all -inf: the first block.
    assert sampled.tolist() == [17, 40, 2]


def test_combine_reads_only_num_blocks():
    local_argmax = torch.tensor([[5, 17, 99]])
    local_max = torch.tensor([[1.0, 2.0, 50.0]])
    sampled = torch.zeros(1, dtype=torch.int64)
    kernels._gumbel_combine_kernel(local_argmax, 3, local_max, 3, sampled, 2)
    assert sampled.tolist() == [17]


def test_seeded_sampling_is_deterministic_per_position():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    logits = torch.cat([logits, logits])  # the same request twice: same seed, same positions
    mapping = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    temperature = torch.ones(4)
    seeds = torch.tensor([1, 2, 3, 4])
    pos = torch.tensor([10, 11, 12, 13, 10, 11, 12, 13])
    _, _, first = gumbel_sample(logits, mapping, temperature, seeds, pos, block=16)
    _, _, again = gumbel_sample(logits, mapping, temperature, seeds, pos, block=16)
    assert torch.equal(first, again) and torch.equal(first[:4], first[4:])
    # One request, one seed, flat logits: positions 0..n-1 give independent uniform draws.
    n, vocab = 2000, 10
    flat = torch.zeros(n, vocab)
    _, _, draws = gumbel_sample(flat, torch.zeros(n, dtype=torch.int64), torch.ones(1),
                                torch.tensor([99]), torch.arange(n), block=4)
    statistic, p_value = _chi_square(draws, torch.full((vocab,), 1.0 / vocab))
    assert p_value > SIGNIFICANCE
    # consecutive positions are not correlated: pairs (draw[i], draw[i+1]) are uniform too.
    pairs = draws[:-1] * vocab + draws[1:]
    assert _chi_square(pairs, torch.full((vocab * vocab,), 1.0 / vocab ** 2))[1] > SIGNIFICANCE


SIGNIFICANCE = 1e-3
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])


def _chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of ``tokens`` against ``p`` and its p-value (``len(p) - 1`` degrees of
    freedom; the chi-square survival function is the regularised upper incomplete gamma)."""
    observed = torch.bincount(tokens.long(), minlength=p.shape[0]).double()
    expected = p.double() * tokens.shape[0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((p.shape[0] - 1) / 2, dtype=torch.float64)
    return float(statistic), float(torch.special.gammaincc(dof, statistic / 2))


def _sample_request(temperature: float, n: int = 6000) -> torch.Tensor:
    """n draws of one seeded request at positions 0..n-1, as MRV2's Sampler runs them:
    temperature applied in place first, then Gumbel-max without it."""
    logits = LOGITS.repeat(n, 1)
    mapping = torch.zeros(n, dtype=torch.int32)
    temp = torch.tensor([temperature])
    kernels._temperature_kernel(logits, logits.stride(0), mapping, temp, logits.shape[1])
    _, _, sampled = gumbel_sample(logits, mapping, temp, torch.tensor([2024]), torch.arange(n),
                                  block=4, apply_temperature=False)
    return sampled


def test_sampled_frequencies_follow_softmax_of_logits_over_temperature():
    statistic, p_value = _chi_square(_sample_request(0.6), torch.softmax(LOGITS / 0.6, 0))
    assert p_value > SIGNIFICANCE, (statistic, p_value)


def test_a_wrong_temperature_fails_the_chi_square_test():
    # Negative control: draws at T = 1 (temperature ignored) against softmax(logits / 0.6).
    statistic, p_value = _chi_square(_sample_request(1.0), torch.softmax(LOGITS / 0.6, 0))
    assert p_value < SIGNIFICANCE, (statistic, p_value)


# --- temperature, min-p -------------------------------------------------------------------------

def test_temperature_by_hand_and_against_the_loop():
    logits = torch.tensor([[2.0, -1.0, 0.3], [2.0, -1.0, 0.3], [2.0, -1.0, 0.3], [5.0, 1.0, 0.0]])
    mapping = torch.tensor([0, 1, 2, 0])
    temperature = torch.tensor([0.5, 0.0, 1.0])
    expected = logits.numpy().copy()
    for t in range(4):  # the kernel: rows with T in {0, 1} untouched, others / T in fp32
        temp = F32(temperature[int(mapping[t])])
        if temp not in (0.0, 1.0):
            expected[t] = expected[t].astype(F32) / temp
    unscaled = logits.clone()
    kernels._temperature_kernel(logits, 3, mapping, temperature, 3, BLOCK_SIZE=2)
    assert torch.equal(logits, torch.from_numpy(expected))
    # negative control: row 3 taking request 2's temperature (1) would be left as it was
    assert not torch.equal(logits[3], unscaled[3])
    assert logits[0].tolist() == pytest.approx([4.0, -2.0, 0.6])
    assert logits[1].tolist() == pytest.approx([2.0, -1.0, 0.3])


def test_temperature_leaves_columns_past_the_vocab():
    logits = torch.ones(1, 4)
    kernels._temperature_kernel(logits, 4, torch.tensor([0]), torch.tensor([0.5]), 3)
    assert logits.tolist() == [[2.0, 2.0, 2.0, 1.0]]


def loop_min_p(logits, mapping, min_p, block):
    out = logits.copy()
    rows, vocab = logits.shape
    for t in range(rows):
        mp = F32(min_p[int(mapping[t])])
        if mp == 0.0:
            continue
        best = -INF
        for i in range(0, vocab, block):
            for v in range(i, min(i + block, vocab)):
                if not np.isnan(logits[t, v]):
                    best = max(best, logits[t, v])
        threshold = F32(best) + F32(np.log(mp))
        for v in range(vocab):
            if logits[t, v] < threshold:
                out[t, v] = -INF
    return out


def test_min_p_by_hand_and_against_the_loop():
    # min_p 0.3 of max 0: threshold log(0.3) = -1.204 drops -3 only; min_p 0: untouched.
    logits = torch.tensor([[0.0, -0.69, -1.0, -3.0], [0.0, -0.69, -1.0, -3.0],
                           [4.0, float("nan"), 2.0, 3.9]])
    mapping = torch.tensor([0, 1, 2])
    min_p = torch.tensor([0.3, 0.0, 0.9])
    expected = loop_min_p(logits.numpy(), mapping.numpy(), min_p.numpy(), 2)
    # negative control: the requests' min_p swapped (row 0 takes 0.9) gives other logits
    wrong = loop_min_p(logits.numpy(), mapping.numpy(), min_p.flip(0).numpy(), 2)
    kernels._min_p_kernel(logits, 4, mapping, min_p, 4, BLOCK_SIZE=2)
    assert not np.array_equal(np.nan_to_num(logits.numpy()), np.nan_to_num(wrong))
    assert torch.equal(logits.isnan(), torch.from_numpy(np.isnan(expected)))
    assert torch.equal(logits.nan_to_num(), torch.from_numpy(expected).nan_to_num())
    assert logits[0].tolist() == pytest.approx([0.0, -0.69, -1.0, -INF])
    assert logits[1].tolist() == pytest.approx([0.0, -0.69, -1.0, -3.0])
    assert logits[2, [0, 2, 3]].tolist() == pytest.approx([4.0, -INF, 3.9])


# --- penalties ----------------------------------------------------------------------------------

def loop_penalties(logits, mapping, token_ids, local_pos, rep, freq, pres, prompt_mask, counts):
    out = logits.astype(F32).copy()
    rows, vocab = logits.shape
    for t in range(rows):
        r = int(mapping[t])
        if rep[r] == 1.0 and freq[r] == 0.0 and pres[r] == 0.0:
            continue
        start = t - int(local_pos[t])
        for v in range(vocab):
            count = int(counts[r, v])
            for prev in range(int(local_pos[t])):
                count += int(token_ids[start + prev + 1]) == v
            x = F32(logits[t, v])
            if rep[r] != 1.0:
                in_prompt = (int(prompt_mask[r, v // 32]) >> (v % 32)) & 1
                scale = F32(rep[r]) if (in_prompt or count > 0) else F32(1.0)
                x = x * (F32(1.0) / scale if x > 0 else scale)
            x = x - F32(freq[r]) * F32(count)
            x = x - F32(pres[r]) * F32(count > 0)
            out[t, v] = x
    return out


def _penalty_state():
    vocab = 40
    prompt_mask = torch.zeros(3, 2, dtype=torch.int32)
    prompt_mask[0, 0] = 1 << 1
    prompt_mask[1, 1] = -(1 << 31) | (1 << 2)  # tokens 63 (bit 31, outside the vocab) and 34
    prompt_mask[2, 0] = (1 << 3) | (1 << 5)
    counts = torch.zeros(3, vocab, dtype=torch.int32)
    counts[0, 2] = 2
    counts[1, 7] = 1
    rep = torch.tensor([2.0, 1.5, 1.0])
    freq = torch.tensor([0.5, 0.0, 0.0])
    pres = torch.tensor([0.25, 0.1, 0.0])
    return vocab, prompt_mask, counts, rep, freq, pres


def test_penalties_by_hand():
    vocab, prompt_mask, counts, rep, freq, pres = _penalty_state()
    logits = torch.zeros(1, vocab)
    logits[0, :4] = torch.tensor([1.0, 2.0, -1.0, 3.0])
    kernels._penalties_kernel(logits, vocab, torch.tensor([0]), torch.tensor([0]),
                              torch.tensor([0]), rep, freq, pres, prompt_mask, 2, counts, vocab,
                              vocab)
    # token 1 in the prompt: 2 / 2; token 2 seen twice: -1 * 2 - 0.5 * 2 - 0.25
    assert logits[0, :4].tolist() == [1.0, 1.0, -3.25, 3.0]


def test_penalties_count_repeated_drafts_and_equal_the_loop():
    vocab, prompt_mask, counts, rep, freq, pres = _penalty_state()
    g = torch.Generator().manual_seed(5)
    # request 0: rows at local positions 0, 1, 2 (drafts 3, 3); request 1: 0, 1; request 2
    # (no penalty): one row.
    mapping = torch.tensor([0, 0, 0, 1, 1, 2])
    local_pos = torch.tensor([0, 1, 2, 0, 1, 0])
    token_ids = torch.tensor([9, 3, 3, 4, 34, 5])
    logits = torch.randn(6, vocab, generator=g)
    expected = loop_penalties(logits.numpy(), mapping.numpy(), token_ids.numpy(),
                              local_pos.numpy(), rep.numpy(), freq.numpy(), pres.numpy(),
                              prompt_mask.numpy(), counts.numpy())
    before = logits.clone()
    kernels._penalties_kernel(logits, vocab, mapping, token_ids, local_pos, rep, freq, pres,
                              prompt_mask, 2, counts, vocab, vocab, BLOCK_SIZE=32)
    assert torch.equal(logits, torch.from_numpy(expected))
    assert torch.equal(logits[5], before[5])
    # row 2 saw draft 3 twice: divided (or multiplied) by 2, then -0.5 * 2 - 0.25
    x = float(before[2, 3])
    assert float(logits[2, 3]) == pytest.approx((x / 2 if x > 0 else x * 2) - 1.25)
    # a negative control: without the drafts the loop disagrees
    wrong = loop_penalties(before.numpy(), mapping.numpy(), token_ids.numpy(),
                           np.zeros(6, dtype=np.int64), rep.numpy(), freq.numpy(), pres.numpy(),
                           prompt_mask.numpy(), counts.numpy())
    assert not torch.equal(logits, torch.from_numpy(wrong))


def loop_bincount(mapping, all_token_ids, prompt_len, prefill_len, prompt_mask, counts):
    prompt_mask, counts = prompt_mask.copy(), counts.copy()
    for r in mapping:
        r = int(r)
        for i in range(int(prefill_len[r])):
            token = int(all_token_ids[r, i])
            if i < int(prompt_len[r]):
                word = int(prompt_mask[r, token // 32]) & M32 | (1 << (token % 32))
                prompt_mask[r, token // 32] = np.array(word, dtype=np.uint32).view(np.int32)
            else:
                counts[r, token] += 1
    return prompt_mask, counts


def test_bincount_by_hand_and_against_the_loop():
    all_token_ids = torch.tensor([[1, 33, 31, 1, 5, 5, 2, 0, 0],
                                  [63, 0, 7, 7, 7, 9, 9, 9, 9],
                                  [4, 4, 4, 4, 4, 4, 4, 4, 4]], dtype=torch.int32)
    prompt_len = torch.tensor([4, 2, 3], dtype=torch.int32)
    prefill_len = torch.tensor([7, 5, 3], dtype=torch.int32)
    prompt_mask = torch.zeros(3, 2, dtype=torch.int32)
    prompt_mask[2, 0] = 1 << 8  # a slot not in the mapping keeps its bits
    counts = torch.zeros(3, 64, dtype=torch.int32)
    mapping = torch.tensor([1, 0], dtype=torch.int32)
    expected = loop_bincount(mapping.numpy(), all_token_ids.numpy(), prompt_len.numpy(),
                             prefill_len.numpy(), prompt_mask.numpy(), counts.numpy())
    # negative control: a prompt one token shorter moves a token from the prompt to the outputs
    wrong = loop_bincount(mapping.numpy(), all_token_ids.numpy(), prompt_len.numpy() - 1,
                          prefill_len.numpy(), prompt_mask.numpy(), counts.numpy())
    kernels._bincount_kernel(mapping, all_token_ids, 9, prompt_len, prefill_len, prompt_mask, 2,
                             counts, 64, BLOCK_SIZE=4)
    assert not torch.equal(counts, torch.from_numpy(wrong[1]))
    assert torch.equal(prompt_mask, torch.from_numpy(expected[0]))
    assert torch.equal(counts, torch.from_numpy(expected[1]))
    # request 0: prompt {1, 33, 31} -> word 0 bits 1 and 31, word 1 bit 1; outputs 5, 5, 2
    assert prompt_mask[0].tolist() == [-(1 << 31) | 2, 2]
    assert counts[0, 5] == 2 and counts[0, 2] == 1 and counts[0].sum() == 3
    # request 1: prompt {63, 0}; outputs 7, 7, 7
    assert prompt_mask[1].tolist() == [1, -(1 << 31)] and counts[1, 7] == 3
    assert prompt_mask[2].tolist() == [1 << 8, 0] and counts[2].sum() == 0


# --- logit bias, allowed tokens, min tokens -----------------------------------------------------

def loop_bias(logits, mapping, allowed_n, allowed, bias_n, bias_ids, bias, pos, min_lens,
              stop_n, restore, stop_ids, check_all_masked):
    out = logits.copy()
    rows, vocab = logits.shape
    for t in range(rows):
        r = int(mapping[t])
        if allowed_n[r] > 0:
            keep = {int(allowed[r, j]): out[t, int(allowed[r, j])] for j in range(allowed_n[r])}
            out[t, :] = -INF
            for token, value in keep.items():
                out[t, token] = value
        for j in range(bias_n[r]):
            out[t, int(bias_ids[r, j])] = F32(out[t, int(bias_ids[r, j])]) + F32(bias[r, j])
        if stop_n[r] > 0 and int(pos[t]) + 1 < int(min_lens[r]):
            ids = [int(stop_ids[r, j]) for j in range(stop_n[r])]
            saved = [out[t, i] for i in ids]
            for i in ids:
                out[t, i] = -INF
            if check_all_masked and restore[r]:
                if not any(x > -INF for x in out[t]):
                    for i, x in zip(ids, saved):
                        if -INF < x < INF:
                            out[t, i] = x
    return out


def _bias_inputs():
    vocab = 6
    logits = torch.tensor([[0.5, 1.0, 2.0, 3.0, 4.0, 5.0],
                           [0.5, 1.0, 2.0, 3.0, 4.0, 5.0],
                           [0.5, 1.0, 2.0, 3.0, 4.0, 5.0],
                           [-INF, -INF, 2.0, -INF, -INF, -INF],
                           [-INF, -INF, 2.0, -INF, -INF, -INF]])
    mapping = torch.tensor([0, 1, 2, 3, 3])
    allowed_n = torch.tensor([2, 0, 0, 0], dtype=torch.int32)
    allowed = torch.tensor([[4, 1, 0], [5, 5, 5], [0, 0, 0], [0, 0, 0]], dtype=torch.int32)
    bias_n = torch.tensor([1, 2, 0, 0], dtype=torch.int32)
    bias_ids = torch.tensor([[1, 0], [0, 3], [0, 0], [0, 0]], dtype=torch.int32)
    bias = torch.tensor([[10.0, 0.0], [-1.0, 0.5], [9.0, 9.0], [0.0, 0.0]])
    pos = torch.tensor([0, 5, 3, 3, 9])
    min_lens = torch.tensor([0, 0, 5, 5], dtype=torch.int32)
    stop_n = torch.tensor([0, 0, 2, 1], dtype=torch.int32)
    restore = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    stop_ids = torch.tensor([[0, 0], [0, 0], [5, 4], [2, 0]], dtype=torch.int32)
    return (vocab, logits, mapping, allowed_n, allowed, bias_n, bias_ids, bias, pos, min_lens,
            stop_n, restore, stop_ids)


@pytest.mark.parametrize("check_all_masked", [False, True])
def test_bias_equals_the_kernels_loop(check_all_masked):
    (vocab, logits, mapping, allowed_n, allowed, bias_n, bias_ids, bias, pos, min_lens, stop_n,
     restore, stop_ids) = _bias_inputs()
    expected = loop_bias(logits.numpy(), mapping.numpy(), allowed_n.numpy(), allowed.numpy(),
                         bias_n.numpy(), bias_ids.numpy(), bias.numpy(), pos.numpy(),
                         min_lens.numpy(), stop_n.numpy(), restore.numpy(), stop_ids.numpy(),
                         check_all_masked)
    kernels._bias_kernel(logits, vocab, vocab, mapping, allowed_n, allowed, 3, bias_n, bias_ids,
                         2, bias, 2, pos, min_lens, stop_n, restore, stop_ids, 2, BLOCK_SIZE=4,
                         LOGITS_BLOCK_SIZE=4, CHECK_ALL_MASKED_ROWS=check_all_masked)
    assert torch.equal(logits, torch.from_numpy(expected))
    # by hand: row 0 keeps tokens 4 and 1, token 1 biased +10; row 1 biased -1 and +0.5;
    # row 2 before min_len: stop tokens 5, 4 banned; row 3's only finite logit is its stop token:
    # banned, or restored when the check runs; row 4 is past min_len.
    assert logits[0].tolist() == [-INF, 11.0, -INF, -INF, 4.0, -INF]
    assert logits[1].tolist() == [-0.5, 1.0, 2.0, 3.5, 4.0, 5.0]
    assert logits[2].tolist() == [0.5, 1.0, 2.0, 3.0, -INF, -INF]
    assert logits[3, 2] == (2.0 if check_all_masked else -INF)
    assert logits[4, 2] == 2.0


# --- bad words ----------------------------------------------------------------------------------

def loop_bad_words(logits, mapping, word_tokens, offsets, num_words, all_token_ids, prompt_len,
                   total_len, input_ids, local_pos):
    out = logits.copy()
    for t in range(logits.shape[0]):
        r = int(mapping[t])
        pos = int(local_pos[t])
        first = t - pos
        output_len = int(total_len[r]) - int(prompt_len[r])
        effective = output_len + pos
        for w in range(int(num_words[r])):
            start, end = int(offsets[r, w]), int(offsets[r, w + 1])
            prefix = end - start - 1
            if prefix > effective:
                continue
            match = True
            for i in range(prefix):
                actual_pos = effective - prefix + i
                if actual_pos >= output_len:
                    actual = int(input_ids[first + actual_pos - output_len + 1])
                else:
                    actual = int(all_token_ids[r, int(prompt_len[r]) + actual_pos])
                match &= int(word_tokens[r, start + i]) == actual
            if match:
                out[t, int(word_tokens[r, end - 1])] = -INF
    return out


def test_bad_words_by_hand_and_against_the_loop():
    vocab = 10
    # request 0: prompt [1, 2], outputs [5, 6]; words [6, 7] (matches), [5, 7] (does not),
    # [4] (always), [2, 5, 6, 8] (longer than the outputs: its prefix reaches into the prompt,
    # which does not count), stale offsets after the third word.
    # request 1: no bad words. request 2: output [3], rows at local positions 0 and 1 (draft 9);
    # word [9, 1] matches at position 1 only, [3, 9, 2] too.
    word_tokens = torch.tensor([[6, 7, 5, 7, 4, 2, 5, 6, 8, 0],
                                [0] * 10,
                                [9, 1, 3, 9, 2, 0, 0, 0, 0, 0]], dtype=torch.int32)
    offsets = torch.tensor([[0, 2, 4, 5, 9], [0, 0, 0, 0, 0], [0, 2, 5, 1, 0]],
                           dtype=torch.int32)
    num_words = torch.tensor([4, 0, 2], dtype=torch.int32)
    all_token_ids = torch.tensor([[1, 2, 5, 6, 0, 0], [1, 1, 1, 1, 1, 1], [7, 3, 0, 0, 0, 0]],
                                 dtype=torch.int32)
    prompt_len = torch.tensor([2, 3, 1], dtype=torch.int32)
    total_len = torch.tensor([4, 5, 2], dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, 2])
    local_pos = torch.tensor([0, 0, 0, 1])
    input_ids = torch.tensor([6, 1, 3, 9])
    logits = torch.zeros(4, vocab)
    expected = loop_bad_words(logits.numpy(), mapping.numpy(), word_tokens.numpy(),
                              offsets.numpy(), num_words.numpy(), all_token_ids.numpy(),
                              prompt_len.numpy(), total_len.numpy(), input_ids.numpy(),
                              local_pos.numpy())
    kernels._bad_words_kernel(logits, vocab, mapping, word_tokens, 10, offsets, 5, num_words,
                              all_token_ids, 6, prompt_len, total_len, input_ids, local_pos)
    assert torch.equal(logits, torch.from_numpy(expected))
    banned = [sorted(np.flatnonzero(row == -INF).tolist()) for row in logits.numpy()]
    assert banned == [[4, 7], [], [], [1, 2]]
    # negative control: ignoring the drafts (every row at local position 0) misses row 3's bans
    wrong = loop_bad_words(np.zeros((4, vocab), dtype=np.float32), mapping.numpy(),
                           word_tokens.numpy(), offsets.numpy(), num_words.numpy(),
                           all_token_ids.numpy(), prompt_len.numpy(), total_len.numpy(),
                           input_ids.numpy(), np.zeros(4, dtype=np.int64))
    assert not np.array_equal(logits.numpy(), wrong)


# --- logprobs -----------------------------------------------------------------------------------

def test_logprob_kernels_by_hand_with_ties():
    # logits [1, 1, 0]: log-softmax 1 - log(2e + 1) twice, -log(2e + 1); ranks count ties.
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, -INF, 2.0]])
    ids = torch.tensor([[1, 0, 2], [2, 1, 0]])
    output = torch.empty(2, 3)
    kernels._topk_log_softmax_kernel(output, logits, 3, ids, 3, 3, 3, BLOCK_SIZE=2,
                                     TOPK_BLOCK_SIZE=2)
    lse0 = math.log(2 * math.e + 1)
    lse1 = math.log(1 + math.exp(2))
    assert output[0].tolist() == pytest.approx([1 - lse0, 1 - lse0, -lse0])
    assert output[1].tolist() == pytest.approx([2 - lse1, -INF, -lse1])
    ranks = torch.zeros(2, dtype=torch.int64)
    kernels._ranks_kernel(ranks, logits, 3, torch.tensor([0, 0]), 3, BLOCK_SIZE=2)
    assert ranks.tolist() == [2, 2]


def loop_log_softmax_and_ranks(logits, ids, tokens):
    out = np.zeros(ids.shape, dtype=np.float32)
    ranks = []
    for r in range(logits.shape[0]):
        row = logits[r].astype(np.float64)
        lse = row.max() + math.log(sum(math.exp(x - row.max()) for x in row))
        out[r] = [row[int(i)] - lse for i in ids[r]]
        ranks.append(sum(int(x >= logits[r, int(tokens[r])]) for x in logits[r]))
    return out, ranks


def test_logprob_kernels_equal_the_loop():
    g = torch.Generator().manual_seed(8)
    logits = torch.randint(-3, 3, (5, 7), generator=g).float()  # many ties
    ids = torch.randint(0, 7, (5, 4), generator=g)
    tokens = torch.randint(0, 7, (5,), generator=g)
    expected, expected_ranks = loop_log_softmax_and_ranks(logits.numpy(), ids.numpy(),
                                                          tokens.numpy())
    output = torch.empty(5, 4)
    kernels._topk_log_softmax_kernel(output, logits, 7, ids, 4, 4, 7)
    torch.testing.assert_close(output, torch.from_numpy(expected), rtol=1e-6, atol=1e-6)
    # negative control: logits minus the row max without the log-sum-exp are caught
    shifted = logits.gather(1, ids) - logits.amax(dim=1, keepdim=True)
    assert not torch.allclose(shifted, torch.from_numpy(expected), rtol=1e-6, atol=1e-6)
    ranks = torch.zeros(5, dtype=torch.int64)
    kernels._ranks_kernel(ranks, logits, 7, tokens, 7)
    assert ranks.tolist() == expected_ranks
    # negative control: strict > instead of >= counts differently on these ties
    assert ranks.tolist() != [int((logits[r] > logits[r, tokens[r]]).sum()) for r in range(5)]


def test_fill_logprob_token_ids_by_hand():
    # rows 0, 2: request 1 asked for tokens [7, 8, 9]; row 1: request 0 has none -> its top-2.
    out = torch.zeros(3, 4, dtype=torch.int64)
    valid = torch.zeros(3, 4, dtype=torch.bool)
    sampled = torch.tensor([11, 12, 13])
    topk = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    per_req = torch.tensor([[0, 0, 0, 0], [7, 8, 9, 0]], dtype=torch.int32)
    kernels._fill_logprob_token_ids_kernel(
        out, 4, valid, 4, sampled, topk, 2, torch.tensor([1, 0, 1]),
        torch.tensor([0, 3], dtype=torch.int32), per_req, 4, NUM_TOPK=2, PADDED_COLS=4)
    assert out.tolist() == [[11, 7, 8, 9], [12, 3, 4, 0], [13, 7, 8, 9]]
    assert valid.tolist() == [[True] * 4, [True, True, True, False], [True] * 4]
    # NUM_TOPK = 0: only the custom ids (the topk tensor is not read).
    out = torch.full((2, 4), -1, dtype=torch.int64)
    valid = torch.zeros(2, 4, dtype=torch.bool)
    kernels._fill_logprob_token_ids_kernel(
        out, 4, valid, 4, torch.tensor([1, 2]), per_req, 4, torch.tensor([0, 1]),
        torch.tensor([0, 3], dtype=torch.int32), per_req, 4, NUM_TOPK=0, PADDED_COLS=4)
    assert out.tolist() == [[1, -1, -1, -1], [2, 7, 8, 9]]
    assert valid.tolist() == [[True, False, False, False], [True] * 4]


def test_prompt_logprobs_token_ids_by_hand():
    # request slot 1 computed 2 tokens and schedules 3: the tokens at 3, 4, 5; slot 0 computed 0
    # and schedules 2: tokens at 1, 2; the padding token after the batch is left alone.
    all_token_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16],
                                  [20, 21, 22, 23, 24, 25, 26]], dtype=torch.int32)
    out = torch.full((6,), -1, dtype=torch.int64)
    kernels._prompt_logprobs_token_ids_kernel(
        out, torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32), all_token_ids, 7, BLOCK_SIZE=2)
    assert out.tolist() == [23, 24, 25, 11, 12, -1]


# --- grammar bitmask, NaNs ----------------------------------------------------------------------

def loop_grammar_bitmask(logits, indices, cu, bitmask, vocab, mask_stride):
    out = logits.copy()
    for m in range(bitmask.shape[0]):
        req, position = divmod(int(indices[m]), mask_stride)
        if position >= int(cu[req + 1]) - int(cu[req]):
            continue
        row = int(cu[req]) + position
        for v in range(vocab):
            if not (int(bitmask[m, v // 32]) >> (v % 32)) & 1:
                out[row, v] = -INF
    return out


def test_grammar_bitmask_by_hand_and_against_the_loop():
    # two grammar requests (batch rows 0 and 2) with mask stride 2; request 0 has 2 logits,
    # request 2 has 1, so its second mask row is inactive.
    vocab = 40
    cu = torch.tensor([0, 2, 3, 4], dtype=torch.int32)
    indices = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    bitmask = torch.full((4, 2), -1, dtype=torch.int32)
    bitmask[0, 0] = ~(1 << 3)
    bitmask[1, 1] = 0b101
    bitmask[2, 0] = -(1 << 31)  # only token 31 of the first word allowed
    bitmask[3, 0] = 0
    logits = torch.zeros(4, vocab)
    expected = loop_grammar_bitmask(logits.numpy(), indices.numpy(), cu.numpy(),
                                    bitmask.numpy(), vocab, 2)
    kernels._apply_grammar_bitmask_kernel(logits, vocab, indices, cu, bitmask, 2, vocab,
                                          MASK_STRIDE=2, BLOCK_SIZE=32)
    assert torch.equal(logits, torch.from_numpy(expected))
    banned = [np.flatnonzero(row == -INF).tolist() for row in logits.numpy()]
    # row 1: word 1 allows 32 and 34 only; row 2 (request 1) has no mask; row 3 (request 2's
    # only logit) allows token 31 of word 0; mask 3 (request 2's second position) is inactive.
    assert banned == [[3], [33] + list(range(35, 40)), [], list(range(31))]
    # negative control: reading a set bit as "banned" is caught
    wrong = loop_grammar_bitmask(np.zeros((4, vocab), dtype=np.float32), indices.numpy(),
                                 cu.numpy(), ~bitmask.numpy(), vocab, 2)
    assert not np.array_equal(logits.numpy(), wrong)


def test_num_nans_by_hand():
    logits = torch.tensor([[float("nan"), 1.0, float("nan"), 5.0], [0.0, 1.0, 2.0, float("nan")]])
    num_nans = torch.full((3,), -1, dtype=torch.int32)
    kernels._num_nans_kernel(logits, 4, num_nans, 3, BLOCK_SIZE=2)
    assert num_nans.tolist() == [2, 0, -1]


# --- through vLLM's launch adapter --------------------------------------------------------------

LAUNCHES = {
    "_temperature_kernel": (lambda: dict(
        logits_ptr=torch.tensor([[2.0, 4.0]]), logits_stride=2,
        expanded_idx_mapping_ptr=torch.tensor([0]), temperature_ptr=torch.tensor([2.0]),
        vocab_size=2, BLOCK_SIZE=8192), "logits_ptr", [[1.0, 2.0]]),
    "_min_p_kernel": (lambda: dict(
        logits_ptr=torch.tensor([[0.0, -3.0]]), logits_stride=2,
        expanded_idx_mapping_ptr=torch.tensor([0]), min_p_ptr=torch.tensor([0.5]),
        vocab_size=2, BLOCK_SIZE=1024), "logits_ptr", [[0.0, -INF]]),
    "_num_nans_kernel": (lambda: dict(
        logits_ptr=torch.tensor([[float("nan"), 1.0]]), logits_stride=2,
        num_nans_ptr=torch.zeros(1, dtype=torch.int32), vocab_size=2, BLOCK_SIZE=8192),
        "num_nans_ptr", [1]),
}


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_vllm_kernel_override_launches_by_the_kernels_names(name):
    """``KernelOverride[grid](**kwargs)``, kwargs keyed by the kernel's parameter names, as vLLM's
    warm-up launches it, runs the implementation."""
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher",
                                     reason="vLLM 0.31+'s kernel registry")
    module, impl = next((m, f) for m, f in IMPLEMENTATIONS if f.__name__ == name)
    kernel = getattr(importlib.import_module(module), name)
    override = dispatcher.KernelOverride(kernel, impl)
    make, output, expected = LAUNCHES[name]
    launch = make()
    assert tuple(launch) == kernel_arg_names(kernel)
    override[(1, 1)](**launch)
    assert launch[output].tolist() == expected


def test_vllm_host_code_runs_the_overrides(monkeypatch):
    """vLLM's own launch sites (positional arguments, its block sizes) reach the implementations
    once the module globals are KernelOverrides, as register_kernels leaves them."""
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher",
                                     reason="vLLM 0.31+'s kernel registry")
    from vllm.triton_utils import triton
    from vllm.v1.worker.gpu.metrics import logits as metrics
    from vllm.v1.worker.gpu.sample import (bad_words, gumbel, logit_bias, logprob, min_p,
                                           penalties, prompt_logprob)

    # Without Triton, vLLM's placeholder module has cdiv but no next_power_of_2, which
    # apply_logit_bias, compute_token_logprobs and 0.34's gumbel_sample call on the host: the
    # runner has to supply it; here the test does.
    monkeypatch.setattr(triton, "next_power_of_2", lambda n: 1 << (n - 1).bit_length(),
                        raising=False)
    for module in (gumbel, min_p, penalties, logit_bias, bad_words, logprob, prompt_logprob,
                   metrics):
        for impl in kernels.KERNELS[module.__name__]:
            original = getattr(module, impl.__name__, None)
            if original is not None and kernel_arg_names(original) == tuple(
                    inspect.signature(impl).parameters):
                monkeypatch.setattr(module, impl.__name__,
                                    dispatcher.KernelOverride(original, impl))
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    assert metrics.get_num_nans(logits).tolist() == [0]
    gumbel.apply_temperature(logits, torch.tensor([0]), torch.tensor([0.5]))
    assert logits.tolist() == [[4.0, 2.0, -2.0, 1.0]]
    min_p.apply_min_p(logits, torch.tensor([0]), torch.tensor([0.04]))
    assert logits.tolist() == [[4.0, 2.0, -INF, 1.0]]  # below 4 + log(0.04) = 0.78
    counts = torch.zeros(1, 4, dtype=torch.int32)
    prompt_mask = torch.zeros(1, 1, dtype=torch.int32)
    penalties.bincount(torch.tensor([0]), torch.tensor([[1, 3, 3, 0]], dtype=torch.int32),
                       torch.tensor([1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                       prompt_mask, counts, 3)
    assert prompt_mask.tolist() == [[2]] and counts.tolist() == [[0, 0, 0, 2]]
    penalties.apply_penalties(logits, torch.tensor([0]), torch.tensor([0]), torch.tensor([0]),
                              torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.0]),
                              prompt_mask, counts)
    assert logits.tolist() == [[4.0, 2.0, -INF, -1.0]]
    ints = lambda *rows: torch.tensor(rows, dtype=torch.int32)  # noqa: E731
    logit_bias.apply_logit_bias(
        logits, torch.tensor([0]), torch.tensor([0]), ints(0), ints([0]), ints(1), ints([1]),
        torch.tensor([[0.5]]), ints(3), ints(1), ints(0), ints([0]))
    assert logits.tolist() == [[-INF, 2.5, -INF, -1.0]]  # +0.5 on 1, stop token 0 before min_len
    bad_words.apply_bad_words(
        logits, torch.tensor([0]), ints([2, 3]), ints([0, 2]), ints(1), ints([9, 2]), ints(1),
        ints(2), torch.tensor([0]), torch.tensor([0]), 1)
    assert logits.tolist() == [[-INF, 2.5, -INF, -INF]]  # output [2] then word [2, 3]
    scores = logprob.compute_topk_scores(torch.tensor([[1.0, 1.0, 0.0]]), 1, torch.tensor([2]))
    assert scores.selected_token_ranks.tolist() == [3]
    lse = math.log(2 * math.e + 1)
    assert scores.logprobs.tolist()[0] == pytest.approx([-lse, 1 - lse])
    token_ids = prompt_logprob.get_prompt_logprobs_token_ids(
        2, ints(0, 2), ints(0), ints(1), ints([5, 6, 7, 8]))
    assert token_ids.tolist() == [7, 8]
