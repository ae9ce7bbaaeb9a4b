"""The Mixture-of-Experts reference kernels against independent plain-torch oracles written here
(loops over tokens, slots and experts, following each op's documented formula), against vLLM's
own native ``grouped_topk``, and end to end against the MoE definition; then their contracts."""

import re

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import KernelContractError

# The oracles round to the op's dtype once; a kernel summing in another order may land one rounding
# step of that dtype away (2^-7 of the value in bf16, 2^-10 in fp16; atol: fp16's subnormal step).
# Measured (2026-12-05, this file's Hypothesis draws): bf16 equal to the rounded oracle in all 73
# comparisons, fp16 within 1e-4 of the value.
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-7, "rtol": 2**-7},
             torch.float16: {"atol": 1e-7, "rtol": 2**-10}}
float_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
seeds = st.integers(0, 2**31 - 1)


def assert_close(actual, expected, dtype=None):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype or expected.dtype])


def grid_logits(generator, shape, dtype, steps):
    """Logits on a coarse grid, so equal scores (ties) are common and exactly representable."""
    return (torch.randint(-steps, steps + 1, shape, generator=generator) * 0.25).to(dtype)


def descending_ids(scores, count):
    """Ids of the ``count`` best scores of a 1-D tensor, lowest id first among equals."""
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:count]


# --- npu_moe_gating_top_k_softmax -----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), experts=st.integers(1, 40), k=st.integers(1, 8),
       dtype=float_dtypes, three_d=st.booleans(), with_finished=st.booleans(),
       steps=st.sampled_from([1, 3, 50]), seed=seeds)
def test_gating_top_k_softmax_is_the_top_k_of_the_softmax(rows, experts, k, dtype, three_d,
                                                          with_finished, steps, seed):
    k = min(k, experts)
    generator = torch.Generator().manual_seed(seed)
    shape = (2, rows, experts) if three_d else (rows, experts)
    x = grid_logits(generator, shape, dtype, steps)
    finished = torch.rand(shape[:-1], generator=generator) < 0.3 if with_finished else None

    y, expert_idx, row_idx = kernels.moe_gating_top_k_softmax(x, finished, k=k)

    assert y.shape == expert_idx.shape == row_idx.shape == (*shape[:-1], k)
    assert (y.dtype, expert_idx.dtype, row_idx.dtype) == (dtype, torch.int32, torch.int32)
    flat_x, flat_y = x.reshape(-1, experts).float(), y.reshape(-1, k)
    flat_ids, flat_rows = expert_idx.reshape(-1, k), row_idx.reshape(-1, k)
    done = finished.reshape(-1) if with_finished else torch.zeros(len(flat_x), dtype=torch.bool)
    count = len(flat_x)
    for row in range(count):
        scores = flat_x[row].exp() / flat_x[row].exp().sum()
        # Not renormalised: y holds the softmax values themselves, best first.
        best = sorted(scores.tolist(), reverse=True)[:k]
        assert_close(flat_y[row], torch.tensor(best).to(dtype), dtype)
        assert flat_rows[row].tolist() == [slot * count + row for slot in range(k)]
        if done[row]:
            assert flat_ids[row].tolist() == [experts] * k  # finished rows name no expert
            continue
        ids = flat_ids[row].tolist()
        assert len(set(ids)) == k and all(0 <= i < experts for i in ids)
        # Tie-robust: every chosen expert scores at least as high as every other one.
        others = [i for i in range(experts) if i not in ids]
        if others:
            assert float(scores[ids].min()) >= float(scores[others].max()) - 1e-7



# --- npu_moe_gating_top_k_softmax_v2 --------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), experts=st.integers(1, 40), k=st.integers(1, 8),
       dtype=float_dtypes, three_d=st.booleans(), steps=st.sampled_from([1, 3, 50]), seed=seeds)
def test_gating_top_k_softmax_v2_renorm_is_the_top_k_of_the_softmax_renormalised(
        rows, experts, k, dtype, three_d, steps, seed):
    """renorm=1 (top-k, then softmax) against the routing vLLM's renormalising routers compute:
    the top k of the softmax, divided by their sum; renorm=0 is the v1 op."""
    k = min(k, experts)
    generator = torch.Generator().manual_seed(seed)
    shape = (2, rows, experts) if three_d else (rows, experts)
    x = grid_logits(generator, shape, dtype, steps)

    y, expert_idx, softmax = kernels.moe_gating_top_k_softmax_v2(x, k=k, renorm=1)

    assert y.shape == expert_idx.shape == (*shape[:-1], k) and softmax.shape == (0,)
    assert (y.dtype, expert_idx.dtype) == (dtype, torch.int32)
    flat_x, flat_y, flat_ids = x.reshape(-1, experts).float(), y.reshape(-1, k), expert_idx.reshape(-1, k)
    for row in range(len(flat_x)):
        scores = flat_x[row].exp() / flat_x[row].exp().sum()
        ids = flat_ids[row].tolist()
        assert len(set(ids)) == k and all(0 <= i < experts for i in ids)
        others = [i for i in range(experts) if i not in ids]
        if others:
            assert float(scores[ids].min()) >= float(scores[others].max()) - 1e-7
        assert_close(flat_y[row], (scores[ids] / scores[ids].sum()).to(dtype), dtype)

    plain = kernels.moe_gating_top_k_softmax_v2(x, k=k, renorm=0, output_softmax=True)
    v1 = kernels.moe_gating_top_k_softmax(x, k=k)
    assert torch.equal(plain[0], v1[0]) and torch.equal(plain[1], v1[1])
    torch.testing.assert_close(plain[2], x.float().softmax(-1))


# --- npu_moe_gating_top_k -------------------------------------------------------------------------


def gating_oracle(x, k, bias, k_group, group_count, group_select_mode, norm_type, scaling, eps):
    """The documented algorithm, one token at a time: returns (weights, ids) as lists."""
    scores = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
    selection = scores if bias is None else scores + bias.float()
    group_size = x.shape[1] // group_count
    weights, ids = [], []
    for row in range(x.shape[0]):
        groups = selection[row].view(group_count, group_size)
        ranked = [g.sort(descending=True).values for g in groups]
        if group_select_mode == 0:
            group_scores = [float(values[0]) for values in ranked]
        else:  # the fp32 sum of the best two, as the kernel adds them
            group_scores = [float(values[0] + values[1]) for values in ranked]
        chosen = descending_ids(group_scores, k_group) if group_count > 1 else [0]
        candidates = [e for e in range(x.shape[1]) if e // group_size in chosen]
        picked = sorted(candidates, key=lambda e: (-float(selection[row, e]), e))[:k]
        values = [float(scores[row, e]) for e in picked]
        if norm_type == 1:  # sigmoid is renormalised; softmax is not (renorm=0)
            total = sum(values) + eps
            values = [v / total for v in values]
        weights.append([v * scaling for v in values])
        ids.append(picked)
    return weights, ids


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("experts, group_count",
                         [(e, g) for e in (12, 16, 64) for g in divisors(e)])
def test_gating_top_k_for_every_grouping_of_the_experts(experts, group_count):
    """Each divisor of the expert count: a group of more than 2 experts routes as documented, with
    bias, both group scores, softmax and sigmoid; a group of 1 or 2 is refused."""
    generator = torch.Generator().manual_seed(experts * 100 + group_count)
    x = grid_logits(generator, (9, experts), torch.float32, 3)
    bias = grid_logits(generator, (experts,), torch.float32, 2)
    k_group = max(1, group_count // 2)
    k = min(4, experts // group_count * k_group)
    if experts // group_count <= 2:
        with pytest.raises(KernelContractError, match="more than 2 experts per group"):
            kernels.moe_gating_top_k(x, k, bias=bias, k_group=k_group, group_count=group_count)
        return
    for norm_type in (0, 1):
        for group_select_mode in (0, 1):
            settings_ = dict(k_group=k_group, group_count=group_count, norm_type=norm_type,
                             group_select_mode=group_select_mode)
            y, ids, _ = kernels.moe_gating_top_k(x, k, bias=bias, **settings_)
            weights, expected_ids = gating_oracle(x, k, bias, k_group, group_count,
                                                  group_select_mode, norm_type, 1.0, 1e-20)
            assert ids.tolist() == expected_ids
            assert_close(y, torch.tensor(weights))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 10), experts=st.sampled_from([3, 6, 8, 12, 16, 24, 32, 48, 64]),
       data=st.data(), dtype=float_dtypes, with_bias=st.booleans(),
       group_select_mode=st.sampled_from([0, 1]), norm_type=st.sampled_from([0, 1]),
       out_flag=st.booleans(), scaling=st.sampled_from([1.0, 2.5]), steps=st.sampled_from([2, 40]),
       seed=seeds)
def test_gating_top_k_matches_the_documented_algorithm(rows, experts, data, dtype, with_bias,
                                                       group_select_mode, norm_type, out_flag,
                                                       scaling, steps, seed):
    group_count = data.draw(st.sampled_from([g for g in divisors(experts) if experts // g > 2]))
    k_group = data.draw(st.integers(1, group_count))
    k = data.draw(st.integers(1, min(8, experts // group_count * k_group)))
    generator = torch.Generator().manual_seed(seed)
    x = grid_logits(generator, (rows, experts), dtype, steps)
    bias = grid_logits(generator, (experts,), dtype, 2) if with_bias else None

    y, ids, norm_out = kernels.moe_gating_top_k(
        x, k, bias=bias, k_group=k_group, group_count=group_count,
        group_select_mode=group_select_mode, norm_type=norm_type, out_flag=out_flag,
        routed_scaling_factor=scaling)

    weights, expected_ids = gating_oracle(x, k, bias, k_group, group_count, group_select_mode,
                                          norm_type, scaling, 1e-20)
    assert (y.dtype, ids.dtype, norm_out.dtype) == (dtype, torch.int32, torch.float32)
    assert ids.tolist() == expected_ids
    assert_close(y, torch.tensor(weights).to(dtype), dtype)
    assert norm_out.shape == (rows, experts)
    if out_flag:
        expected = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
        assert_close(norm_out, expected)
    else:
        assert norm_out.isnan().all()  # undefined without out_flag: poisoned


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 10), layout=st.sampled_from([(64, 8, 4, 6), (16, 4, 2, 4),
                                                       (24, 8, 3, 2), (32, 1, 1, 4)]),
       scoring=st.sampled_from(["softmax", "sigmoid"]), with_bias=st.booleans(),
       renormalize=st.booleans(), scaling=st.sampled_from([1.0, 2.5]), seed=seeds)
def test_gating_top_k_reproduces_vllm_grouped_topk_with_the_documented_mapping(
        rows, layout, scoring, with_bias, renormalize, scaling, seed):
    """vLLM's native grouped_topk is the oracle; the op is driven as the moe module docstring
    tells the integrator (group score mode from the bias, softmax renormalised in torch)."""
    experts, groups, top_groups, k = layout
    if scoring == "sigmoid" and not renormalize:
        return  # no op equivalent (the docstring says so)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, experts, generator=generator)
    bias = torch.randn(experts, generator=generator) * 0.1 if with_bias else None

    expected_weights, expected_ids = grouped_topk.__wrapped__(
        logits, logits, k, renormalize, num_expert_group=groups, topk_group=top_groups,
        scoring_func=scoring, routed_scaling_factor=scaling, e_score_correction_bias=bias)

    softmax_renorm = scoring == "softmax" and renormalize
    y, ids, _ = kernels.moe_gating_top_k(
        logits, k, bias=bias, k_group=top_groups, group_count=groups,
        group_select_mode=1 if with_bias else 0, norm_type=0 if scoring == "softmax" else 1,
        routed_scaling_factor=1.0 if softmax_renorm else scaling)
    if softmax_renorm:
        y = y / y.sum(-1, keepdim=True) * scaling

    def per_expert(weights, ids):
        return torch.zeros(rows, experts).scatter(1, ids.long(), weights.float())

    assert torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values)
    torch.testing.assert_close(per_expert(y, ids), per_expert(expected_weights, expected_ids),
                               atol=1e-5, rtol=1e-5)


# --- npu_moe_init_routing_v2 ----------------------------------------------------------------------


def routing_ids(generator, tokens, k, experts, pattern):
    """(tokens, k) int32 expert ids: spread over all, all on one expert, or on a few experts."""
    if pattern == "one":
        ids = torch.full((tokens, k), int(torch.randint(experts, (1,), generator=generator)))
    elif pattern == "few":
        ids = torch.randint(min(2, experts), (tokens, k), generator=generator)
    else:
        ids = torch.randint(experts, (tokens, k), generator=generator)
    return ids.to(torch.int32)


def routing_oracle(expert_idx, start, end):
    """Valid (expert, pair) in expert order then pair order; per-expert counts over [start, end)."""
    k = expert_idx.shape[1]
    pairs = [(int(e), token * k + slot) for token, row in enumerate(expert_idx)
             for slot, e in enumerate(row) if start <= int(e) < end]
    pairs.sort()
    counts = [sum(1 for e, _ in pairs if e == expert) for expert in range(start, end)]
    return [pair for _, pair in pairs], counts


@settings(max_examples=50, deadline=None)
@given(tokens=st.integers(1, 12), k=st.integers(1, 4), experts=st.integers(1, 12),
       pattern=st.sampled_from(["all", "one", "few"]), dtype=float_dtypes, data=st.data(),
       row_idx_type=st.sampled_from([0, 1]), with_scale=st.booleans(), seed=seeds)
def test_init_routing_v2_sorts_pairs_by_expert(tokens, k, experts, pattern, dtype, data,
                                               row_idx_type, with_scale, seed):
    start = data.draw(st.integers(0, experts - 1))
    end = data.draw(st.integers(start + 1, experts))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, generator=generator).to(dtype)
    expert_idx = routing_ids(generator, tokens, k, experts, pattern)
    scale = torch.rand(tokens, generator=generator) if with_scale else None

    expanded_x, expanded_row_idx, counts, expanded_scale = kernels.moe_init_routing_v2(
        x, expert_idx, scale=scale, active_num=tokens * k, expert_num=experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[start, end], row_idx_type=row_idx_type)

    order, expected_counts = routing_oracle(expert_idx, start, end)
    available = len(order)
    assert expanded_x.shape == (tokens * k, 8) and expanded_x.dtype == dtype
    assert torch.equal(expanded_x[:available], x[[pair // k for pair in order]])
    assert expanded_x[available:].isnan().all()
    assert expanded_row_idx.dtype == torch.int32 and expanded_row_idx.shape == (tokens * k,)
    if row_idx_type == 0:
        expected = [-1] * (tokens * k)
        for position, pair in enumerate(order):
            expected[pair] = position
        assert expanded_row_idx.tolist() == expected
    else:
        assert expanded_row_idx[:available].tolist() == order
    assert counts.dtype == torch.int64
    assert counts.tolist() == expected_counts
    if with_scale:
        assert torch.equal(expanded_scale[:available], scale[[pair // k for pair in order]])


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 12), k=st.integers(1, 3), experts=st.integers(1, 8),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       smooth=st.sampled_from([None, "shared", "per_expert"]), seed=seeds)
def test_init_routing_v2_dynamic_int8(tokens, k, experts, dtype, smooth, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, 16, generator=generator) * 4).to(dtype)
    x[0] = 0  # an all-zero row
    expert_idx = routing_ids(generator, tokens, k, experts, "all")
    scale = None
    if smooth is not None:
        scale = torch.rand(1 if smooth == "shared" else experts, 16, generator=generator) + 0.5

    expanded_x, _, counts, expanded_scale = kernels.moe_init_routing_v2(
        x, expert_idx, scale=scale, expert_num=experts, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=1)

    order, expected_counts = routing_oracle(expert_idx, 0, experts)
    assert expanded_x.dtype == torch.int8 and expanded_scale.dtype == torch.float32
    assert counts.tolist() == expected_counts
    for position, pair in enumerate(order):
        row = x[pair // k].float()
        if scale is not None:
            row = row * scale[0 if smooth == "shared" else int(expert_idx.view(-1)[pair])]
        row_scale = row.abs().max() / 127
        expected = torch.zeros(16) if row_scale == 0 else (row / row_scale).round()
        assert torch.equal(expanded_x[position].float(), expected)
        assert float(expanded_scale[position]) == pytest.approx(float(row_scale), rel=1e-6)
        # Dequantised, the row comes back within half a step.
        assert (expanded_x[position].float() * row_scale - row).abs().max() <= row_scale / 2 + 1e-6


# --- npu_grouped_matmul ---------------------------------------------------------------------------


def group_counts(generator, rows, experts, pattern):
    """Row counts per expert summing to ``rows``: random, all on one expert, or some empty."""
    if pattern == "one":
        counts = [0] * experts
        counts[int(torch.randint(experts, (1,), generator=generator))] = rows
        return counts
    owners = torch.randint(experts if pattern == "all" else max(1, experts // 2), (rows,),
                           generator=generator)
    return torch.bincount(owners, minlength=experts).tolist()


def grouped_oracle(x, weight, counts):
    """Row r times the weight of the expert whose group holds r, in float64."""
    owner = [expert for expert, count in enumerate(counts) for _ in range(count)]
    return torch.stack([x[row].double() @ weight[owner[row]].double()
                        for row in range(x.shape[0])]) if owner else \
        torch.zeros(0, weight.shape[2], dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 24), experts=st.integers(1, 9), dtype=float_dtypes,
       pattern=st.sampled_from(["all", "one", "some empty"]), list_type=st.sampled_from([0, 1]),
       transposed=st.booleans(), seed=seeds)
def test_grouped_matmul_multiplies_each_row_group_by_its_expert(rows, experts, dtype, pattern,
                                                                list_type, transposed, seed):
    if experts == 1:
        list_type = 0  # counts (type 1) may not have length 1
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 24, generator=generator).to(dtype)
    stored = torch.randn(experts, 40, 24, generator=generator).to(dtype)  # vLLM's [E, N, K]
    weight = stored.transpose(1, 2) if transposed else stored.transpose(1, 2).contiguous()
    counts = group_counts(generator, rows, experts, pattern)
    group_list = torch.tensor(counts if list_type == 1 else torch.tensor(counts).cumsum(0).tolist(),
                              dtype=torch.int64)

    (y,) = kernels.grouped_matmul([x], [weight], group_list=group_list, split_item=2,
                                      group_type=0, group_list_type=list_type)

    assert y.shape == (rows, 40) and y.dtype == dtype
    assert_close(y, grouped_oracle(x, weight, counts).to(dtype), dtype)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), experts=st.integers(2, 6),
       scale_dtype=st.sampled_from([torch.bfloat16, torch.float32]), per_token=st.booleans(),
       pattern=st.sampled_from(["all", "one", "some empty"]), seed=seeds)
def test_grouped_matmul_int8_dequantises_per_channel_and_per_token(rows, experts, scale_dtype,
                                                                   per_token, pattern, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, 32), generator=generator, dtype=torch.int8)
    weight = torch.randint(-127, 128, (experts, 32, 16), generator=generator, dtype=torch.int8)
    scale = (torch.rand(experts, 16, generator=generator) * 1e-3).to(scale_dtype)
    token_scale = torch.rand(rows, generator=generator) * 1e-2 if per_token else None
    counts = group_counts(generator, rows, experts, pattern)
    output_dtype = torch.bfloat16 if scale_dtype == torch.bfloat16 else torch.float16

    (y,) = kernels.grouped_matmul(
        [x], [weight], scale=[scale], per_token_scale=[token_scale] if per_token else None,
        group_list=torch.tensor(counts), split_item=3, group_type=0, group_list_type=1,
        output_dtype=output_dtype)

    owner = torch.tensor([e for e, count in enumerate(counts) for _ in range(count)])
    expected = grouped_oracle(x, weight, counts) * scale.double()[owner]
    if per_token:
        expected = expected * token_scale.double()[:, None]
    assert y.dtype == output_dtype
    assert_close(y, expected.to(output_dtype), output_dtype)

    (raw,) = kernels.grouped_matmul([x], [weight], group_list=torch.tensor(counts),
                                        split_item=2, group_type=0, group_list_type=1,
                                        output_dtype=torch.int32)
    assert raw.dtype == torch.int32
    assert torch.equal(raw, grouped_oracle(x, weight, counts).to(torch.int32))


# --- combine --------------------------------------------------------------------------------------


def unpermute_oracle(permuted, indices, probs, tokens, k):
    """Token t: the sum of its k rows ``permuted[indices[t * k + slot]]``, weighted by probs."""
    expected = torch.zeros(tokens, permuted.shape[1], dtype=torch.float64)
    for token in range(tokens):
        for slot in range(k):
            weight = float(probs[token, slot]) if probs is not None else 1.0
            expected[token] += weight * permuted[int(indices[token * k + slot])].double()
    return expected


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 12), k=st.integers(1, 4), with_probs=st.booleans(), seed=seeds)
def test_token_unpermute_gathers_and_weights_each_tokens_rows(tokens, k, with_probs, seed):
    """bf16 rows and probs: the dtype every torch-npu wheel the matrix names documents."""
    dtype = torch.bfloat16
    if not with_probs:
        k = 1
    generator = torch.Generator().manual_seed(seed)
    permuted = torch.randn(tokens * k, 8, generator=generator).to(dtype)
    indices = torch.randperm(tokens * k, generator=generator).to(torch.int32)
    probs = torch.rand(tokens, k, generator=generator).to(dtype) if with_probs else None

    out = kernels.moe_token_unpermute(permuted, indices, probs=probs)

    assert out.dtype == dtype and out.shape == (tokens, 8)
    assert_close(out, unpermute_oracle(permuted, indices, probs, tokens, k).to(dtype), dtype)


def finalize_oracle(rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row):
    """Token i: its skips plus, per slot, the scale times (its row + its expert's bias)."""
    tokens, k = expert_for_row.shape
    expected = torch.zeros(tokens, rows.shape[1], dtype=torch.float64)
    for i in range(tokens):
        for skip in (skip1, skip2):
            if skip is not None:
                expected[i] += skip[i].double()
        for slot in range(k):
            value = rows[int(src_to_dst[slot * tokens + i])].double()
            if bias is not None:
                value = value + bias[int(expert_for_row[i, slot])].double()
            expected[i] += (float(scales[i, slot]) if scales is not None else 1.0) * value
    return expected


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 10), k=st.integers(1, 4), experts=st.integers(1, 6),
       dtype=float_dtypes, skips=st.integers(0, 2), with_bias=st.booleans(),
       with_scales=st.booleans(), seed=seeds)
def test_finalize_routing_follows_its_formula(tokens, k, experts, dtype, skips, with_bias,
                                              with_scales, seed):
    if not with_scales:
        k = 1
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens * k, 8, generator=generator).to(dtype)
    # [FINALIZE-WHEEL] skip1 only beside skip2: none, skip2 alone, or both.
    skip2, skip1 = (torch.randn(tokens, 8, generator=generator).to(dtype) if skips > i else None
                    for i in range(2))
    bias = torch.randn(experts, 8, generator=generator).to(dtype) if with_bias else None
    scales = torch.rand(tokens, k, generator=generator).to(dtype) if with_scales else None
    src_to_dst = torch.randperm(tokens * k, generator=generator).to(torch.int32)
    expert_for_row = torch.randint(experts, (tokens, k), generator=generator, dtype=torch.int32)

    out = kernels.moe_finalize_routing(rows, skip1, skip2, bias, scales, src_to_dst,
                                           expert_for_row)

    expected = finalize_oracle(rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row)
    assert out.dtype == dtype
    assert_close(out, expected.to(dtype), dtype)


# --- end to end -----------------------------------------------------------------------------------


def dense_moe(hidden, w13, w2, weights, ids):
    """The MoE definition: each token sums its experts' SwiGLU MLPs, weighted by the router."""
    intermediate = w2.shape[2]
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for weight, expert in zip(weights[token].tolist(), ids[token].tolist()):
            gate_up = w13[expert] @ hidden[token]
            act = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[token] += weight * (w2[expert] @ act)
    return out


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 16), layout=st.sampled_from([(4, 1), (8, 2), (16, 4), (6, 6)]),
       routing=st.sampled_from(["softmax", "grouped"]), list_type=st.sampled_from([0, 1]),
       seed=seeds)
def test_moe_layer_built_from_the_ops_equals_the_dense_definition(tokens, layout, routing,
                                                                  list_type, seed):
    """gating -> init_routing_v2 -> grouped_matmul (gate_up) -> swiglu -> grouped_matmul (down)
    -> finalize_routing, in fp32, with vLLM's weight layouts, against a per-token expert loop."""
    experts, k = layout
    hidden_size, intermediate = 16, 12
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden_size, generator=generator) / 4
    w2 = torch.randn(experts, hidden_size, intermediate, generator=generator) / 4

    if routing == "softmax" or experts < 6:
        weights, ids, _ = kernels.moe_gating_top_k_softmax(logits, k=k)
    else:
        bias = torch.randn(experts, generator=generator) * 0.1
        weights, ids, _ = kernels.moe_gating_top_k(
            logits, min(k, 3), bias=bias, k_group=1, group_count=2, group_select_mode=1,
            norm_type=1, routed_scaling_factor=1.5)
        k = weights.shape[1]

    expanded, expanded_row_idx, counts, _ = kernels.moe_init_routing_v2(
        hidden, ids, active_num=tokens * k, expert_num=experts, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, experts])
    group_list = counts if list_type == 1 else counts.cumsum(0)
    gemm = dict(group_list=group_list, group_list_type=list_type, group_type=0, split_item=2)
    (gate_up,) = kernels.grouped_matmul([expanded], [w13.transpose(1, 2)], **gemm)
    (down,) = kernels.grouped_matmul([kernels.swiglu(gate_up)], [w2.transpose(1, 2)], **gemm)
    # fp32 rows combine on finalize_routing (drop_pad_mode 0 reads the index by column).
    by_column = expanded_row_idx.view(tokens, k).t().contiguous().view(-1)
    out = kernels.moe_finalize_routing(down, None, None, None, weights, by_column, None)

    torch.testing.assert_close(out, dense_moe(hidden, w13, w2, weights, ids), atol=1e-5,
                               rtol=1e-5)


# --- contracts ------------------------------------------------------------------------------------


def gating_softmax(**overrides):
    args = dict(x=torch.zeros(4, 8), finished=None, k=2)
    args.update(overrides)
    return kernels.moe_gating_top_k_softmax(**args)


def gating_softmax_v2(**overrides):
    args = dict(x=torch.zeros(4, 8), k=2, renorm=1)
    args.update(overrides)
    return kernels.moe_gating_top_k_softmax_v2(args.pop("x"), **args)


def gating(**overrides):
    args = dict(x=torch.zeros(4, 16), k=4, bias=torch.zeros(16), k_group=2, group_count=4,
                group_select_mode=1, norm_type=1)
    args.update(overrides)
    return kernels.moe_gating_top_k(args.pop("x"), args.pop("k"), **args)


def init_routing(**overrides):
    args = dict(x=torch.zeros(3, 8), expert_idx=torch.tensor([[0, 1], [1, 2], [3, 0]],
                                                             dtype=torch.int32),
                active_num=6, expert_num=4, expert_tokens_num_type=1,
                expert_tokens_num_flag=True, active_expert_range=[0, 4])
    args.update(overrides)
    return kernels.moe_init_routing_v2(args.pop("x"), args.pop("expert_idx"), **args)


def grouped_matmul(**overrides):
    args = dict(x=[torch.zeros(5, 8)], weight=[torch.zeros(3, 8, 6)],
                group_list=torch.tensor([2, 0, 3]), split_item=2, group_type=0,
                group_list_type=1)
    args.update(overrides)
    return kernels.grouped_matmul(args.pop("x"), args.pop("weight"), **args)


def unpermute(**overrides):
    args = dict(permuted_tokens=torch.zeros(6, 8, dtype=torch.bfloat16),
                sorted_indices=torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32),
                probs=torch.ones(3, 2, dtype=torch.bfloat16))
    args.update(overrides)
    return kernels.moe_token_unpermute(**args)


def finalize(**overrides):
    args = dict(expanded_permuted_rows=torch.zeros(6, 8), skip1=None, skip2=torch.zeros(3, 8),
                bias=torch.zeros(4, 8), scales=torch.ones(3, 2),
                expanded_src_to_dst_row=torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32),
                expert_for_source_row=torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32))
    args.update(overrides)
    return kernels.moe_finalize_routing(**args)


SOFTMAX, GATING = "npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k"
SOFTMAX_V2 = "npu_moe_gating_top_k_softmax_v2"
INIT, GMM = "npu_moe_init_routing_v2", "npu_grouped_matmul"
UNPERMUTE, FINALIZE = "npu_moe_token_unpermute", "npu_moe_finalize_routing"

VIOLATIONS = {
    "softmax top-k int logits": (
        lambda: gating_softmax(x=torch.zeros(4, 8, dtype=torch.int32)),
        f"{SOFTMAX}: x must be float16 or bfloat16 or float32, got torch.int32"),
    "softmax top-k k over the experts": (
        lambda: gating_softmax(k=9), f"{SOFTMAX}: k must be in [1, 8], got 9"),
    "softmax top-k finished of the wrong shape": (
        lambda: gating_softmax(finished=torch.zeros(4, 1, dtype=torch.bool)),
        f"{SOFTMAX}: finished must be shape (4,) (x.shape[:-1]), got (4, 1)"),
    "softmax top-k v2 renorm 2": (
        lambda: gating_softmax_v2(renorm=2),
        f"{SOFTMAX_V2}: renorm must be 0 (softmax, then top-k) or 1 (top-k, then softmax), got 2"),
    "softmax top-k v2 k over the experts": (
        lambda: gating_softmax_v2(k=9), f"{SOFTMAX_V2}: k must be in [1, 8], got 9"),
    "softmax top-k v2 1-D logits": (
        lambda: gating_softmax_v2(x=torch.zeros(8)), f"{SOFTMAX_V2}: x must be 2-D to 3-D, got 1-D (8,)"),
    "grouped top-k bias of another dtype": (
        lambda: gating(bias=torch.zeros(16, dtype=torch.bfloat16)),
        f"{GATING}: bias must be torch.float32 of shape (16,), got torch.bfloat16 (16,)"),
    "grouped top-k experts not divisible": (
        lambda: gating(group_count=3), f"{GATING}: group_count must be a positive divisor of "
        "the expert count 16, got 3"),
    "grouped top-k k beyond the kept groups": (
        lambda: gating(k=9), f"{GATING}: k must be in [1, 8] (experts per group × k_group), "
        "got 9"),
    "grouped top-k renorm 1": (
        lambda: gating(renorm=1), f"{GATING}: renorm must be 0 (the only value supported), got 1"),
    "grouped top-k 3-D logits": (
        lambda: gating(x=torch.zeros(2, 4, 16)), f"{GATING}: x must be 2-D, got 3-D"),
    "init routing int64 expert ids": (
        lambda: init_routing(expert_idx=torch.zeros(3, 2, dtype=torch.int64)),
        f"{INIT}: expert_idx must be int32, got torch.int64"),
    "init routing expert id beyond expert_num": (
        lambda: init_routing(expert_idx=torch.tensor([[0, 1], [1, 5], [3, 0]], dtype=torch.int32)),
        f"{INIT}: expert_idx must be expert ids ≤ expert_num=4, got max 5"),
    "init routing range past expert_num": (
        lambda: init_routing(active_expert_range=[0, 6]),
        f"{INIT}: active_expert_range must be [start, end) with 0 ≤ start < end ≤ expert_num=4"),
    "init routing empty range": (
        lambda: init_routing(active_expert_range=[2, 2]),
        f"{INIT}: active_expert_range must be [start, end) with 0 ≤ start < end ≤ expert_num=4, "
        "got [2, 2]"),
    "init routing no experts": (
        lambda: init_routing(expert_num=0, active_expert_range=[]),
        f"{INIT}: expert_num must be in (0, 10240] (pass the expert count), got 0"),
    "init routing cumsum counts": (
        lambda: init_routing(expert_tokens_num_type=0),
        f"{INIT}: expert_tokens_num_type must be 1 (count) or 2 (key_value), the modes supported, "
        "got 0"),
    "init routing no counts": (
        lambda: init_routing(expert_tokens_num_flag=False),
        f"{INIT}: expert_tokens_num_flag must be True (the only value supported), got False"),
    "init routing drop/pad": (
        lambda: init_routing(drop_pad_mode=1),
        f"{INIT}: drop_pad_mode must be 0 (dropless, the only mode supported), got 1"),
    "init routing static int8": (
        lambda: init_routing(quant_mode=0),
        f"{INIT}: quant_mode must be -1 (none) or 1 (dynamic int8), the modes supported, got 0"),
    "init routing FP8 quant mode": (
        lambda: init_routing(quant_mode=14),
        f"{INIT}: quant_mode must be -1 (none) or 1 (dynamic int8), the modes supported, got 14"),
    "init routing default expert_num": (
        lambda: init_routing(expert_num=-1, active_expert_range=[]),
        f"{INIT}: expert_num must be in (0, 10240] (pass the expert count), got -1"),
    "init routing range as a tensor": (
        lambda: init_routing(active_expert_range=torch.tensor([0, 4])),
        f"{INIT}: active_expert_range must be a host list[int], got Tensor"),
    "init routing scale per token in dynamic mode": (
        lambda: init_routing(quant_mode=1, scale=torch.ones(3)),
        f"{INIT}: scale must be (4, 8) or (1, 8), got (3,)"),
    "grouped matmul counts that do not sum to the rows": (
        lambda: grouped_matmul(group_list=torch.tensor([2, 0, 2])),
        f"{GMM}: group_list must be counts summing to x[0].shape[0] = 5, got [2, 0, 2] (sum 4)"),
    "grouped matmul decreasing cumsum": (
        lambda: grouped_matmul(group_list=torch.tensor([2, 1, 5]), group_list_type=0),
        f"{GMM}: group_list must be a non-negative, non-decreasing cumsum (type 0), "
        "got [2, 1, 5]"),
    "grouped matmul int32 group list": (
        lambda: grouped_matmul(group_list=torch.tensor([2, 0, 3], dtype=torch.int32)),
        f"{GMM}: group_list must be int64, got torch.int32"),
    "grouped matmul one count per row group missing": (
        lambda: grouped_matmul(group_list=torch.tensor([2, 3])),
        f"{GMM}: group_list must be 3 entries (one per expert of weight[0]), got 2"),
    "grouped matmul transposed x": (
        lambda: grouped_matmul(x=[torch.zeros(8, 5).t()]), f"{GMM}: x[0] must be contiguous"),
    "grouped matmul weight dtype differs": (
        lambda: grouped_matmul(weight=[torch.zeros(3, 8, 6, dtype=torch.bfloat16)]),
        f"{GMM}: weight[0] must be torch.float32 like x[0], got torch.bfloat16"),
    "grouped matmul K mismatch": (
        lambda: grouped_matmul(weight=[torch.zeros(3, 6, 8)]),
        f"{GMM}: weight[0] must be shape (E, 8, N) (K of x[0]), got (3, 6, 8)"),
    "grouped matmul multi-output split": (
        lambda: grouped_matmul(split_item=0),
        f"{GMM}: split_item must be 2 or 3 (single output) for a 3-D weight, got 0"),
    "grouped matmul no group type": (
        lambda: grouped_matmul(group_type=None),
        f"{GMM}: group_type must be 0 (M-axis groups) for a 3-D weight, got None"),
    "grouped matmul more than 1024 groups": (
        lambda: grouped_matmul(weight=[torch.zeros(1025, 8, 6)],
                               group_list=torch.tensor([5] + [0] * 1024)),
        f"{GMM}: group_list must be 1 to 1024 groups, got 1025"),
    "grouped matmul weight sliced out of a wider tensor": (
        lambda: grouped_matmul(weight=[torch.zeros(3, 8, 12)[..., :6]]),
        f"{GMM}: weight[0] must be contiguous, or the transpose(1, 2) view of a contiguous "
        "[E, N, K] tensor, got strides (96, 12, 1)"),
    "grouped matmul int8 with a mismatched output dtype": (
        lambda: grouped_matmul(x=[torch.zeros(5, 8, dtype=torch.int8)],
                               weight=[torch.zeros(3, 8, 6, dtype=torch.int8)],
                               scale=[torch.ones(3, 6)], output_dtype=torch.bfloat16),
        f"{GMM}: output_dtype must be torch.float16 with a torch.float32 scale, "
        "got torch.bfloat16"),
    "grouped matmul per-channel scale of the wrong shape": (
        lambda: grouped_matmul(x=[torch.zeros(5, 8, dtype=torch.int8)],
                               weight=[torch.zeros(3, 8, 6, dtype=torch.int8)],
                               scale=[torch.ones(6, dtype=torch.bfloat16)],
                               output_dtype=torch.bfloat16),
        f"{GMM}: scale[0] must be shape (3, 6) (per expert and output channel), got (6,)"),
    "grouped matmul scale on a float matmul": (
        lambda: grouped_matmul(scale=[torch.ones(3, 6)]),
        f"{GMM}: scale/per_token_scale must be None for torch.float32 x (no quantisation)"),
    "unpermute duplicate indices (-1 made positive)": (
        lambda: unpermute(sorted_indices=torch.tensor([3, 0, 1, 1, 4, 2], dtype=torch.int32)),
        f"{UNPERMUTE}: sorted_indices must be free of duplicates, got 1 duplicate"),
    "unpermute invalid index -1": (
        lambda: unpermute(sorted_indices=torch.tensor([3, 0, -1, 1, 4, 2], dtype=torch.int32)),
        f"{UNPERMUTE}: sorted_indices must be within [0, 5], got range [-1, 4]"),
    "unpermute int64 indices": (
        lambda: unpermute(sorted_indices=torch.arange(6)),
        f"{UNPERMUTE}: sorted_indices must be int32, got torch.int64"),
    "unpermute fp16 rows": (
        lambda: unpermute(permuted_tokens=torch.zeros(6, 8, dtype=torch.float16)),
        f"{UNPERMUTE}: permuted_tokens must be bfloat16, got torch.float16"),
    "unpermute fp32 rows": (
        lambda: unpermute(permuted_tokens=torch.zeros(6, 8)),
        f"{UNPERMUTE}: permuted_tokens must be bfloat16, got torch.float32"),
    "unpermute fp32 probs": (
        lambda: unpermute(probs=torch.ones(3, 2)),
        f"{UNPERMUTE}: probs must be bfloat16, got torch.float32"),
    "unpermute probs not covering the rows": (
        lambda: unpermute(probs=torch.ones(2, 2, dtype=torch.bfloat16)),
        f"{UNPERMUTE}: probs must be shape (tokens, k) with tokens * k = 6 and k ≤ 512, "
        "got (2, 2)"),
    "unpermute padded mode": (
        lambda: unpermute(padded_mode=True),
        f"{UNPERMUTE}: padded_mode must be False (the only mode supported), got True"),
    "finalize scales in another dtype": (
        lambda: finalize(scales=torch.ones(3, 2, dtype=torch.bfloat16)),
        f"{FINALIZE}: scales must be torch.float32 of shape (3, 2), got torch.bfloat16 (3, 2)"),
    "finalize skip1 without skip2": (
        lambda: finalize(skip1=torch.zeros(3, 8), skip2=None),
        f"{FINALIZE}: skip1 must be None when skip2 is None, got a tensor"),
    "finalize row layout (drop_pad_mode 2)": (
        lambda: finalize(drop_pad_mode=2),
        f"{FINALIZE}: drop_pad_mode must be 0 (the only value supported), got 2"),
    "finalize drop/pad": (
        lambda: finalize(drop_pad_mode=1),
        f"{FINALIZE}: drop_pad_mode must be 0 (the only value supported), got 1"),
    "finalize index -1 in dropless mode": (
        lambda: finalize(expanded_src_to_dst_row=torch.tensor([3, 0, -1, 1, 4, 2],
                                                              dtype=torch.int32)),
        f"{FINALIZE}: expanded_src_to_dst_row must be within [0, 5], got range [-1, 4]"),
    "finalize bias without expert ids": (
        lambda: finalize(expert_for_source_row=None),
        f"{FINALIZE}: expert_for_source_row must be a tensor when bias is given"),
}


@pytest.mark.parametrize("call, message", VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_violation_is_rejected_with_a_clear_message(call, message):
    with pytest.raises(KernelContractError, match=re.escape(message)):
        call()


def _baseline_gating_softmax():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    y, ids, _ = gating_softmax(x=x)
    weights, expected_ids = x.softmax(-1).topk(2)
    return [(y, weights), (ids, expected_ids.to(torch.int32))]


def _baseline_gating():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    y, ids, _ = gating(x=x)
    weights, expected_ids = gating_oracle(x, 4, torch.zeros(16), 2, 4, 1, 1, 1.0, 1e-20)
    return [(y, torch.tensor(weights)), (ids, torch.tensor(expected_ids, dtype=torch.int32))]


def _baseline_init_routing():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    expert_idx = torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32)
    expanded_x, row_idx, counts, _ = init_routing(x=x, expert_idx=expert_idx)
    order, expected_counts = routing_oracle(expert_idx, 0, 4)
    positions = [order.index(pair) for pair in range(6)]  # row_idx_type 0: pair -> position
    return [(expanded_x, x[[pair // 2 for pair in order]]),
            (row_idx, torch.tensor(positions, dtype=torch.int32)),
            (counts, torch.tensor(expected_counts))]


def _baseline_grouped_matmul():
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 8, generator=generator), torch.randn(3, 8, 6, generator=generator)
    (y,) = grouped_matmul(x=[x], weight=[weight])
    return [(y, grouped_oracle(x, weight, [2, 0, 3]).float())]


def _baseline_unpermute():
    generator = torch.Generator().manual_seed(0)
    permuted = torch.randn(6, 8, generator=generator).to(torch.bfloat16)
    probs = torch.rand(3, 2, generator=generator).to(torch.bfloat16)
    indices = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    out = unpermute(permuted_tokens=permuted, probs=probs)
    return [(out, unpermute_oracle(permuted, indices, probs, 3, 2).to(torch.bfloat16))]


def _baseline_finalize():
    generator = torch.Generator().manual_seed(0)
    rows, skip2, bias = (torch.randn(n, 8, generator=generator) for n in (6, 3, 4))
    scales = torch.rand(3, 2, generator=generator)
    src_to_dst = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    experts = torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32)
    out = finalize(expanded_permuted_rows=rows, skip2=skip2, bias=bias, scales=scales)
    return [(out, finalize_oracle(rows, None, skip2, bias, scales, src_to_dst, experts).float())]


BASELINES = {"gating softmax": _baseline_gating_softmax, "gating": _baseline_gating,
             "init routing": _baseline_init_routing, "grouped matmul": _baseline_grouped_matmul,
             "unpermute": _baseline_unpermute, "finalize": _baseline_finalize}


@pytest.mark.parametrize("baseline", BASELINES.values(), ids=BASELINES.keys())
def test_the_baselines_are_valid_and_compute_their_op(baseline):
    """Each violation above is one change away from a call that passes and computes its op."""
    for actual, expected in baseline():
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        if expected.is_floating_point():
            assert_close(actual, expected)
        else:
            assert torch.equal(actual, expected)


NOT_IMPLEMENTED = {
    "grouped top-k hash routing": (
        lambda: gating(input_ids=torch.zeros(4, dtype=torch.int32),
                       tid2eid=torch.zeros(8, 4, dtype=torch.int32)), "hash routing"),
    "init routing key_value counts": (
        lambda: init_routing(expert_tokens_num_type=2), "expert_tokens_num_type=2"),
    "init routing Active scenario": (lambda: init_routing(active_num=4), "active_num=4"),
    "grouped matmul several weights": (
        lambda: grouped_matmul(weight=[torch.zeros(8, 6), torch.zeros(8, 6)]), "only the MoE form"),
    "grouped matmul bias": (lambda: grouped_matmul(bias=[torch.zeros(6)]), "bias"),
    "grouped matmul int64 quant scale": (
        lambda: grouped_matmul(x=[torch.zeros(5, 8, dtype=torch.int8)],
                               weight=[torch.zeros(3, 8, 6, dtype=torch.int8)],
                               scale=[torch.ones(3, 6, dtype=torch.int64)]), "int64"),
}


@pytest.mark.parametrize("call, mode", NOT_IMPLEMENTED.values(), ids=NOT_IMPLEMENTED.keys())
def test_documented_modes_the_seam_does_not_implement_say_so(call, mode):
    with pytest.raises(NotImplementedError, match=re.escape(mode)):
        call()
