"""Model Runner V2's block tables on the NPU: the gather and the slot mapping in torch.

MRV2's ``BlockTables`` launches two Triton kernels that take **tables of raw device
pointers** (``_make_ptr_tensor``: one uint64 address per KV-cache group), which no torch op
can dereference. The kernel registry cannot stand in for them, so the owning methods are
overridden instead, reading the same tensors the pointers address (``self.block_tables[g].gpu``,
or the caller's ``out`` tuple, which speculators and the PCP manager pass beside their
``out_ptrs``). Semantics are vLLM 0.34's ``_gather_block_tables_kernel`` and
``_compute_slot_mappings_kernel`` (and the multi-group ``FusedStagedWriter``'s
``_apply_write_kernel`` launch): a group at a time (a handful), every request of the batch in
one op, no host read of a device value.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.utils import PAD_SLOT_ID


class NPUBlockTablesMixin:
    """Put in front of vLLM's ``BlockTables`` by :func:`npu_block_tables`."""

    def apply_staged_writes(self) -> None:
        if self.num_kv_cache_groups <= 1:
            return super().apply_staged_writes()
        # Several groups: vLLM's fused writer addresses them through a pointer table; each
        # group's own single-tensor write (the registered torch kernel) does the same.
        for table in self.block_tables:
            table.apply_write()
        self.num_blocks.copy_to_uva()

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: int, out=None,
                            out_ptrs=None, num_computed_tokens=None) -> tuple[torch.Tensor, ...]:
        if self.num_kv_cache_groups == 0:
            return ()
        num_reqs = idx_mapping.shape[0]
        num_rows = num_reqs_padded
        if out is None:
            out = tuple(self.input_block_tables)
            num_rows = max(num_rows, self._num_dirty_rows)
            self._num_dirty_rows = num_reqs
        mask_window = self.has_sliding_window_groups and num_computed_tokens is not None
        rows = idx_mapping.long()
        for group, (source, target) in enumerate(zip(self.block_tables, out)):
            table = source.gpu
            columns = torch.arange(table.shape[1], device=table.device)
            counts = self.num_blocks.gpu[group].index_select(0, rows).long()
            written = columns < counts[:, None]  # the kernel leaves the rest of a row alone
            block_ids = table.index_select(0, rows)
            reach = self._sliding_window_reach[group]
            if mask_window and reach > 0:
                # Entries wholly below the window of the first scheduled token: the null block.
                first = num_computed_tokens.index_select(0, rows).long()
                below = (first - reach).clamp_min(0) // self.block_sizes[group]
                block_ids = block_ids.masked_fill(columns < below[:, None], 0)
            target[:num_reqs] = torch.where(written, block_ids, target[:num_reqs])
            target[num_reqs:num_rows] = 0  # padded rows, and rows a larger batch left
        return tuple(table[:num_reqs_padded] for table in out)

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, num_tokens_padded: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
        slot_mappings = self.slot_mappings if out is None else out
        if self.num_kv_cache_groups == 0:
            return slot_mappings[:, :num_tokens_padded]
        if self.cp_size != 1:
            raise NotImplementedError("decode context parallelism is not served on the NPU")
        num_reqs = idx_mapping.shape[0]
        width = slot_mappings.shape[1]
        # Each token's request: the batch row whose query range holds it; tokens past the last
        # row's end (padding, stale chunked-prefill entries) are PAD, as the kernel's last
        # program writes them.
        bounds = query_start_loc[1:num_reqs + 1]
        tokens = torch.arange(width, device=positions.device)
        row_of = torch.searchsorted(bounds, tokens, right=True).clamp_max(max(num_reqs - 1, 0))
        requests = idx_mapping.long().index_select(0, row_of) if num_reqs else row_of
        real = (tokens < query_start_loc[num_reqs]) & (requests >= 0)
        token_positions = torch.zeros(width, dtype=torch.long, device=positions.device)
        covered = min(width, positions.shape[0])
        token_positions[:covered] = positions[:covered]
        for group, source in enumerate(self.block_tables):
            if not self._slot_mapping_enabled[group]:
                slot_mappings[group].fill_(PAD_SLOT_ID)
                continue
            block_size = self.block_sizes[group]
            table = source.gpu
            blocks = table[requests.clamp_min(0), (token_positions // block_size).clamp_max(
                table.shape[1] - 1)].long()
            slots = blocks * block_size + token_positions % block_size
            slot_mappings[group] = torch.where(real, slots, PAD_SLOT_ID)
        return slot_mappings[:, :num_tokens_padded]


def npu_block_tables(original: type) -> type:
    """Replacement of ``vllm.v1.worker.gpu.block_table:BlockTables`` (and of the name
    ``GPUModelRunner.initialize_kv_cache`` builds it by): the same class with the torch gather
    and slot mapping in front."""
    return type("BlockTables", (NPUBlockTablesMixin, original),
                {"__module__": __name__, "__qualname__": "NPUBlockTables"})
