"""MRV2's block tables on the NPU (:mod:`ascend_patch.npu.runner.v2.block_tables`) against plain
transcriptions of vLLM 0.34's pointer-table kernels.

``_gather_block_tables_kernel`` and ``_compute_slot_mappings_kernel`` read tables of raw device
pointers, so the NPU overrides the ``BlockTables`` methods that launch them. Each case builds vLLM's
``BlockTables`` (the override in front, as the runner builds it) on the emulated NPU, stages real block ids through
vLLM's ``append_block_ids``/``apply_staged_writes`` (two KV-cache groups: the fused writer's path),
and compares the override's output with a per-request loop transcribed from the kernel, on padding
rows, rows a larger batch left, sliding-window null blocks, dummy requests (-1), a group without
slot mapping, and tokens past the batch. A negative control checks that the comparison notices an
off-by-one block size.
"""

from __future__ import annotations

import pytest

from tests.helpers.process import clean_env, run_json

SCRIPT = """
import json
import torch
import vllm  # the overlay activates (emulated NPU): NonUvaBuffer, CPU tensors
from vllm.platforms import current_platform
from vllm.v1.worker.gpu.block_table import BlockTables  # the overlay's, as the runner builds it

current_platform.register_triton_kernel_overrides()  # as every worker does first
PAD = -1
cpu = torch.device("cpu")
tables = BlockTables(
    block_sizes=[4, 2], max_num_reqs=5, max_num_batched_tokens=16, max_num_blocks_per_group=[6, 8],
    device=cpu, slot_mapping_enabled=[True, False], sliding_window_reach=[0, 3])
tables.append_block_ids(1, ([11, 12, 13], [21, 22, 23, 24]), overwrite=False)
tables.append_block_ids(3, ([31], [41, 42]), overwrite=False)
tables.append_block_ids(1, ([14], [25]), overwrite=False)   # appended after the first write
tables.append_block_ids(4, ([51, 52], [61]), overwrite=False)
tables.apply_staged_writes()
staged = [t.gpu.clone() for t in tables.block_tables]
counts = tables.num_blocks.gpu.clone()

def gather_loop(idx, padded, num_computed, before):
    out = [b.clone() for b in before]
    for g in range(2):
        width = staged[g].shape[1]
        for row in range(padded):
            if row >= len(idx):
                out[g][row] = 0
                continue
            req = idx[row]
            n = int(counts[g][req])
            null = 0
            reach = [0, 3][g]
            if num_computed is not None and reach > 0:
                null = max(num_computed[req] - reach, 0) // [4, 2][g]
            for col in range(n):
                out[g][row][col] = 0 if col < null else int(staged[g][req][col])
    return [o.tolist() for o in out]

# A larger batch first (rows 0-2), then a smaller one that must clear row 2.
first = [t.clone() for t in tables.gather_block_tables(torch.tensor([4, 1, 3], dtype=torch.int32), 3)]
before = [t.clone() for t in tables.input_block_tables]
num_computed = torch.tensor([0, 7, 0, 0, 0], dtype=torch.int32)
idx = [1, 3]
second = tables.gather_block_tables(torch.tensor(idx, dtype=torch.int32), 2,
                                    num_computed_tokens=num_computed)
expected = gather_loop(idx, 3, num_computed.tolist(), before)
gathered = [t.tolist() for t in tables.input_block_tables]

def slots_loop(idx, qsl, pos, width, block_sizes):
    out = []
    for g in range(2):
        row_out = [PAD] * width
        enabled = [True, False][g]
        for b, req in enumerate(idx):
            for t in range(qsl[b], qsl[b + 1]):
                if not enabled or req < 0:
                    row_out[t] = PAD
                    continue
                p = pos[t]
                row_out[t] = int(staged[g][req][p // block_sizes[g]]) * block_sizes[g] + p % block_sizes[g]
        out.append(row_out)
    return out

idx = [1, -1, 4]
qsl = [0, 3, 4, 6]
pos = [5, 6, 7, 0, 2, 3, 0, 0, 0, 0]
slots = tables.compute_slot_mappings(torch.tensor(idx, dtype=torch.int32),
                                     torch.tensor(qsl + [6], dtype=torch.int32),
                                     torch.tensor(pos), num_tokens_padded=8)
print(json.dumps({
    "class": type(tables).__qualname__,
    "staged": [t.tolist() for t in staged], "counts": counts.tolist(),
    "first": [t.tolist() for t in first],
    "gathered": gathered, "gather_expected": expected,
    "slots": tables.slot_mappings.tolist(), "slots_returned": slots.shape[1],
    "slots_expected": slots_loop(idx, qsl, pos, 16, [4, 2]),
    "slots_off_by_one": slots_loop(idx, qsl, pos, 16, [3, 2]),
}))
"""


@pytest.mark.mrv2_only
def test_npu_block_tables_equal_the_pointer_table_kernels():
    r = run_json(SCRIPT, env=clean_env(ASCEND_PATCH="emulate"))
    assert r["class"] == "NPUBlockTables"
    # vLLM's staged writes through the two-group path (one write per group's own tensor).
    assert r["staged"][0][1] == [11, 12, 13, 14, 0, 0] and r["staged"][1][1] == [21, 22, 23, 24, 25, 0, 0, 0]
    assert r["counts"] == [[0, 4, 0, 1, 2], [0, 5, 0, 2, 1]]
    assert r["first"][0] == [[51, 52, 0, 0, 0, 0], [11, 12, 13, 14, 0, 0], [31, 0, 0, 0, 0, 0]]
    # The smaller batch: rows a larger one left are cleared; group 1's window (reach 3, block
    # size 2) nulls request 1's blocks wholly below position 7 - 3 = 4: blocks 0 and 1.
    assert r["gathered"] == r["gather_expected"]
    assert r["gathered"][1][0][:5] == [0, 0, 23, 24, 25] and r["gathered"][0][2] == [0] * 6
    # Slots: request 1's positions 5-7 in block 12 (block size 4), a dummy request and a group
    # without slot mapping give PAD, and so does every token past the batch.
    assert r["slots"] == r["slots_expected"] and r["slots_returned"] == 8
    assert r["slots"][0][:6] == [49, 50, 51, -1, 206, 207] and set(r["slots"][0][6:]) == {-1}
    assert r["slots_off_by_one"] != r["slots_expected"]
