"""Unit checks of the engine's own pieces against independent math.

The KV re-view and the kernels' K/V views of it, the torch slot mapping (vLLM's is a Triton kernel), the emulated
HBM books and activation tracker, and the sampler's filter are each checked on
inputs built here; the engine tests exercise them end to end.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from ascend_patch.npu import kernels
from ascend_patch.npu.emulation.runtime import EmulatedRuntime
from ascend_patch.npu.attention.kv_layout import ascend_layer_view, kernel_block_table, kernel_caches, kernel_slots
from ascend_patch.npu.runner import top_k_top_p as sampler
from ascend_patch.npu.runner.v1.slot_mapping import compute_slot_mapping

pytestmark = pytest.mark.usefixtures("reference_kernels")


def test_layer_view_reinterprets_the_same_bytes():
    blocks, heads, tokens, dim = 3, 2, 4, 5
    flat = torch.arange(blocks * tokens * heads * 2 * dim, dtype=torch.float32)
    # vLLM's LBNHC layout: physical [blocks, tokens, heads, K|V], logical [B, H, N, C].
    view = flat.view(blocks, tokens, heads, 2 * dim).permute(0, 2, 1, 3)
    cache = ascend_layer_view(view)
    assert cache.shape == (blocks, 2, tokens, heads, dim)
    assert cache.is_contiguous() and cache.data_ptr() == flat.data_ptr()
    page = tokens * heads * 2 * dim
    assert cache.stride(0) == page, "block-outermost: block b's page is vLLM's page b"
    cache[2, 1, 3, 1, 4] = -1.0
    assert flat[-1] == -1.0, "the cache aliases vLLM's buffer, nothing was copied"


def test_kernel_caches_are_contiguous_k_and_v_over_doubled_blocks():
    """The kernels' K and V caches (contiguous, as npu_scatter_pa_kv_cache and FIA require) read
    block b's K and V halves at kernel block 2b, and kernel slots land in the block's own halves."""
    blocks, tokens, heads, dim = 4, 8, 2, 3
    cache = torch.randn(blocks, 2, tokens, heads, dim)
    key_cache, value_cache = kernel_caches(cache)
    for view in (key_cache, value_cache):
        assert view.is_contiguous() and view.shape == (2 * blocks - 1, tokens, heads, dim)
        assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    ids = torch.tensor([[3, 0, 2]], dtype=torch.int32)
    kernel_ids = kernel_block_table(ids)
    assert kernel_ids.dtype == torch.int32
    assert torch.equal(key_cache[kernel_ids[0].long()], cache[ids[0].long(), 0])
    assert torch.equal(value_cache[kernel_ids[0].long()], cache[ids[0].long(), 1])
    slots = torch.tensor([0, 7, 8, 29, 31])
    rows = kernel_slots(slots, tokens)
    keys = torch.randn(len(slots), heads, dim)
    key_cache.view(-1, heads, dim)[rows] = keys
    value_cache.view(-1, heads, dim)[rows] = -keys
    blocks_of, offsets = slots // tokens, slots % tokens
    assert torch.equal(cache[blocks_of, 0, offsets], keys)
    assert torch.equal(cache[blocks_of, 1, offsets], -keys)
    with pytest.raises(ValueError, match=r"contiguous \[blocks, 2, tokens, heads, head_size\]"):
        kernel_caches(cache.transpose(0, 1))


def test_layer_view_refuses_interleaved_layers():
    # [blocks, layers, tokens, heads, K|V]: two layers share each block, so one layer's
    # pages are not one dense region.
    buffer = torch.zeros(3, 2, 4, 2, 10)
    view = buffer[:, 0].permute(0, 2, 1, 3)
    with pytest.raises(ValueError, match="not one dense region"):
        ascend_layer_view(view)
    with pytest.raises(ValueError, match="equal K and V widths"):
        ascend_layer_view(torch.zeros(2, 2, 4, 7))


def _slots_oracle(query_start, positions, table, block_size, width):
    out = [-1] * width
    for req in range(len(query_start) - 1):
        for t in range(query_start[req], query_start[req + 1]):
            p = positions[t]
            out[t] = table[req][p // block_size] * block_size + p % block_size
    return out


@pytest.mark.parametrize("block_size", [16, 128])
def test_slot_mapping_matches_the_kernels_formula(block_size):
    generator = torch.Generator().manual_seed(block_size)
    lengths, computed = [3, 1, 7, 2], [0, 300, 129, 5]
    query_start = [0]
    positions = []
    for n, c in zip(lengths, computed):
        query_start.append(query_start[-1] + n)
        positions += list(range(c, c + n))
    columns = 320 // block_size + 1
    table = torch.randperm(4 * columns, generator=generator).view(4, columns).to(torch.int32)
    width = 20
    block_table = SimpleNamespace(
        dcp_world_size=1,
        pcp_world_size=1,
        block_size=block_size,
        block_table=SimpleNamespace(gpu=table),
        slot_mapping=SimpleNamespace(gpu=torch.zeros(width, dtype=torch.int64)),
    )
    replacement = compute_slot_mapping(None)
    replacement(block_table, len(lengths), torch.tensor(query_start, dtype=torch.int32),
                torch.tensor(positions))
    expected = _slots_oracle(query_start, positions, table.tolist(), block_size, width)
    assert block_table.slot_mapping.gpu.tolist() == expected


def test_emulated_hbm_books_follow_tensor_lifetimes():
    runtime = EmulatedRuntime(hbm_bytes=1000)
    holder = torch.zeros(1)
    runtime.charge("weights", 600, holder)
    assert runtime.mem_get_info() == (400, 1000)
    with pytest.raises(torch.OutOfMemoryError, match=r"KV cache needs .*\(raise ASCEND_PATCH_EMULATED_HBM\)"):
        runtime.charge("KV cache", 500, torch.zeros(1))
    del holder
    gc.collect()
    assert runtime.memory_allocated() == 0, "the charge ended with its tensor"


def test_emulated_hbm_books_read_charged_storages_at_their_current_size():
    """What sleep mode relies on: a storage resized in place (freed to 0 bytes, regrown) changes
    what the books hold, by kind; the charge still ends with its lifetime."""
    runtime = EmulatedRuntime(hbm_bytes=1000)
    weights, kv = torch.zeros(100, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)
    runtime.charge_storages("weights", [weights.untyped_storage()], weights)
    runtime.charge_storages("KV cache", [kv.untyped_storage()], kv)
    assert runtime.in_use_by_kind() == {"weights": 100, "KV cache": 300}
    kv.untyped_storage().resize_(0)
    assert runtime.in_use_by_kind() == {"weights": 100, "KV cache": 0}
    assert runtime.mem_get_info() == (900, 1000)
    kv.untyped_storage().resize_(300)
    assert runtime.memory_allocated() == 400
    del weights
    gc.collect()
    assert runtime.in_use_by_kind() == {"KV cache": 300}


def test_activation_tracker_measures_the_transient_peak():
    runtime = EmulatedRuntime(hbm_bytes=1 << 30)
    keep = torch.zeros(1)
    runtime.charge("weights", 1000, keep)
    x = torch.randn(64, 256)
    with runtime.track_activations():
        a = x @ torch.ones(256, 256)  # the 256 KiB ones die after this line; a is 64 KiB
        b = torch.relu(a)  # 64 KiB more while a lives
        del a
        c = b.sum()
    del b, c
    stats = runtime._memory_stats()
    assert stats["allocated_bytes.all.current"] == 1000, "activations are transient"
    # The high-water mark: ones and a alive together (320 KiB), above a and b (128 KiB).
    assert stats["allocated_bytes.all.peak"] == 1000 + 256 * 1024 + 64 * 1024


def test_a_reference_kernel_allocates_only_its_outputs_on_the_emulated_device():
    """The plain torch inside a reference kernel (here npu_quant_matmul's float64 accumulator,
    8x its bf16 output) is the op's workspace on an NPU, not a profiled activation."""
    runtime = EmulatedRuntime(hbm_bytes=1 << 30)
    x1 = torch.randint(-127, 128, (256, 512), dtype=torch.int8)
    x2 = torch.randint(-127, 128, (512, 1024), dtype=torch.int8)
    scale = torch.rand(1024)
    with runtime.track_activations():
        out = kernels.quant_matmul(x1, x2, scale, output_dtype=torch.bfloat16)
    assert runtime._memory_stats()["allocated_bytes.all.peak"] == out.numel() * 2
    # Exact integer products, scaled per column; the op rounds through fp32 to bf16: one bf16 step.
    expected = ((x1.long() @ x2.long()).double() * scale.double()).to(torch.bfloat16)
    torch.testing.assert_close(out.double(), expected.double(), atol=0, rtol=2**-7)


# --- the sampler's top-k/top-p filter ---------------------------------------------------------

# Device ops that make the host wait for the device: reading a value, or an output whose size
# depends on the data.
HOST_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default, torch.ops.aten.equal.default}


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs outside the seam's top_k_top_p: on hardware that is one asynchronous
    launch, while its emulated reference reads values to check the op's contract."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.syncs = 0
        self._in_kernel = False
        op = kernels.top_k_top_p

        def kernel(*args, **kwargs):
            self._in_kernel = True
            try:
                return op(*args, **kwargs)
            finally:
                self._in_kernel = False

        monkeypatch.setattr(kernels, "top_k_top_p", kernel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNC_OPS and not self._in_kernel:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _host_top_k(k: list[int]) -> torch.Tensor:
    """k as the sampler gets it from vLLM's InputBatch: a device tensor carrying the host copy
    that attach_host_top_k hands over."""
    tensor = torch.tensor(k, dtype=torch.int32)
    setattr(tensor, sampler.HOST_TOP_K, np.array(k, dtype=np.int32))
    return tensor


def _distinct_logits(rows: int, vocab: int, spread: float, generator) -> torch.Tensor:
    # Distinct values: vLLM sorts unstably and the op's documented sort is stable, so only ties
    # could order (and so cut) differently.
    return torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]).float() \
        * (spread / vocab)


@st.composite
def mixed_batches(draw):
    """Rows with a top-k the op takes (k ≤ 1024), none (k = vocab, as vLLM passes it), or one
    above the op's limit; top-p for every row (1.0 where a request has none) or for no row."""
    vocab = draw(st.sampled_from([600, 1500, 4000]))
    rows = draw(st.integers(1, 6))
    k = []
    for _ in range(rows):
        kind = draw(st.sampled_from(["within", "none", "beyond"]))
        if kind == "none":
            k.append(vocab)
        elif kind == "beyond" and vocab > sampler.MAX_NPU_TOP_K + 1:
            k.append(draw(st.integers(sampler.MAX_NPU_TOP_K + 1, vocab - 1)))
        else:
            k.append(draw(st.integers(1, min(vocab, sampler.MAX_NPU_TOP_K))))
    p = draw(st.none() | st.lists(st.just(1.0) | st.floats(0.05, 1.0), min_size=rows, max_size=rows))
    return vocab, k, p, draw(st.floats(1.0, 30.0)), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(batch=mixed_batches())
def test_sampler_filter_equals_vllms_torch_path_and_launches_the_op_for_what_it_takes(batch):
    vocab, k, p, spread, seed = batch
    logits = _distinct_logits(len(k), vocab, spread, torch.Generator().manual_seed(seed))
    p_tensor = None if p is None else torch.tensor(p)
    with kernels.count_launches() as launches:
        ours = sampler.filter_top_k_top_p(logits.clone(), _host_top_k(k), p_tensor)
    theirs = apply_top_k_top_p_pytorch(logits.clone(), torch.tensor(k, dtype=torch.int32), p_tensor)
    assert torch.equal(ours, theirs)
    # One launch for the rows with k ≤ 1024, one top-p-only launch for rows without top-k.
    within = any(row_k <= sampler.MAX_NPU_TOP_K for row_k in k)
    without_top_k = any(row_k == vocab > sampler.MAX_NPU_TOP_K for row_k in k)
    assert launches["top_k_top_p"] == within + (without_top_k and p is not None)


@pytest.mark.parametrize(("k", "launches_per_step"), [
    ([5, 4000, 40, 4000], 2),  # top-k rows and rows without: the review's mixed batch
    ([5, 40, 1024, 7], 1),
    ([5, 4000, 2000, 7], 2),  # plus one row above the op's limit, on vLLM's torch path
])
def test_sampler_filter_needs_no_host_sync(monkeypatch, k, launches_per_step):
    steps, vocab = 5, 4000
    top_k, top_p = _host_top_k(k), torch.tensor([0.9, 0.5, 1.0, 0.8])
    generator = torch.Generator().manual_seed(0)
    counter = HostSyncCounter(monkeypatch)  # before count_launches, which restores what it found
    with kernels.count_launches() as launches, counter:
        for _ in range(steps):
            logits = _distinct_logits(len(k), vocab, 10.0, generator)
            sampler.filter_top_k_top_p(logits, top_k, top_p)
    assert counter.syncs == 0
    assert launches["top_k_top_p"] == launches_per_step * steps


def test_sampler_filter_without_host_top_k_takes_vllms_torch_path(monkeypatch):
    """A k tensor no InputBatch made (vLLM's dummy sampler run builds its own) carries no host
    copy: all rows go to the sort-based path, still without a sync."""
    logits = _distinct_logits(2, 1500, 10.0, torch.Generator().manual_seed(1))
    k, p = torch.tensor([5, 1500], dtype=torch.int32), torch.tensor([0.7, 0.9])
    counter = HostSyncCounter(monkeypatch)
    with kernels.count_launches() as launches, counter:
        ours = sampler.filter_top_k_top_p(logits.clone(), k, p)
    assert counter.syncs == 0 and launches["top_k_top_p"] == 0
    assert torch.equal(ours, apply_top_k_top_p_pytorch(logits.clone(), k, p))
