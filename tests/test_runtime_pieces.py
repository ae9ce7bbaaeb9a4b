"""Unit checks of the engine's own pieces against independent math.

The KV re-view, the torch slot mapping (vLLM's is a Triton kernel), the emulated
HBM books and activation tracker, and the sampler's filter are each checked on
inputs built here; the engine tests exercise them end to end.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from ascend_patch.npu.device import EmulatedRuntime
from ascend_patch.npu.kv_cache import ascend_layer_view, compute_slot_mapping


def test_layer_view_reinterprets_the_same_bytes():
    blocks, heads, tokens, dim = 3, 2, 4, 5
    flat = torch.arange(blocks * tokens * heads * 2 * dim, dtype=torch.float32)
    # vLLM's LBNHC layout: physical [blocks, tokens, heads, K|V], logical [B, H, N, C].
    view = flat.view(blocks, tokens, heads, 2 * dim).permute(0, 2, 1, 3)
    planes = ascend_layer_view(view)
    assert planes.shape == (2, blocks, tokens, heads, dim)
    assert planes.is_contiguous() and planes.data_ptr() == flat.data_ptr()
    assert planes[0].is_contiguous() and planes[1].is_contiguous()
    planes[1, 2, 3, 1, 4] = -1.0
    assert flat[-1] == -1.0, "the planes alias vLLM's buffer, nothing was copied"


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


def test_sampler_filter_matches_vllm_and_falls_back_above_the_npu_k_limit():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from ascend_patch.npu.sample.sampler import filter_top_k_top_p

    generator = torch.Generator().manual_seed(0)
    for vocab, k in ((512, [5, 512, 40]), (3000, [5, 3000, 1500])):
        logits = torch.randn(3, vocab, generator=generator)
        k_t = torch.tensor(k, dtype=torch.int32)
        p = torch.tensor([0.9, 0.5, 1.0])
        ours = filter_top_k_top_p(logits.clone(), k_t, p)
        theirs = apply_top_k_top_p_pytorch(logits.clone(), k_t.long(), p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), vocab
