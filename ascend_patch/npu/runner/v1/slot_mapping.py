"""KV slots of the V1 runner's block table, computed with torch ops where vLLM launches a Triton
kernel (``BlockTable.compute_slot_mapping``).
"""

from __future__ import annotations

import torch


def compute_slot_mapping(original):
    """Replacement for ``BlockTable.compute_slot_mapping``: vLLM's is a Triton kernel.

    Token ``t`` of request ``r`` at position ``p`` goes to slot
    ``block_table[r, p // block_size] * block_size + p % block_size``; the rest
    of the buffer is padding (-1), which the attention backend never passes on.
    """

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        if hasattr(self, "slot_mapping_mode"):  # seam SlotMappingMode: vLLM 0.26+
            from vllm.v1.worker.block_table import SlotMappingMode

            if self.slot_mapping_mode == SlotMappingMode.NONE:
                return
            context_parallel = self.dcp_world_size
        else:  # before 0.26 prefill context parallelism interleaves the slots too
            context_parallel = self.dcp_world_size * self.pcp_world_size
        if context_parallel != 1:
            raise NotImplementedError("context parallelism is not supported on Ascend yet")
        num_tokens = positions.shape[0]
        ends = query_start_loc[1 : num_reqs + 1]
        tokens = torch.arange(num_tokens, device=positions.device)
        request = torch.searchsorted(ends.to(torch.int64), tokens, right=True).clamp_(max=max(num_reqs - 1, 0))
        table = self.block_table.gpu
        slots = table[request, positions // self.block_size].to(torch.int64) * self.block_size
        slots += positions % self.block_size
        out = self.slot_mapping.gpu
        out[:num_tokens] = torch.where(tokens < ends[-1], slots, -1) if num_reqs else -1
        out[num_tokens:].fill_(-1)

    return compute_slot_mapping
