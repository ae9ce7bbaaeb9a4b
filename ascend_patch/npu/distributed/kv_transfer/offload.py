"""KV offload to host memory on the NPU: an offloading spec for vLLM's own ``OffloadingConnector``.

vLLM's connector keeps the books (which block hashes are on the host, LRU eviction, scheduling
loads of prefix hits); its ``CPUOffloadingSpec`` moves the bytes with CUDA/XPU kernels and
refuses every other platform in ``get_worker``. :class:`NPUOffloadingSpec` keeps vLLM's spec for
the books (the same host sizing and manager) and brings its own worker, which copies blocks through
the kernel seam (``kernels.swap_blocks``). vLLM loads it from the connector's extra config
(``spec_name``/``spec_module_path``, ``vllm/v1/kv_offload/factory.py``), which the platform fills
in (:func:`ascend_patch.npu.distributed.kv_transfer.check_config`). The interface it implements
(``OffloadingWorker.submit_store/submit_load``, host chunks of ``blocks_per_chunk`` blocks) is
vLLM's from 0.26 on; 0.30 renamed the host chunk count (``num_blocks`` to ``num_chunks``).

What the worker copies: vLLM hands it each layer's cache as ``[num_blocks, page_bytes]`` int8
rows over the layer's region (``OffloadingConnectorWorker.register_kv_caches``; 0.33's
``canonical_mapping`` certifies an MLA page as ``block_size`` rows of ``kv_lora_rank + rope``).
The Ascend cache of a standard attention layer is block-outermost (``[num_blocks, 2, block_size,
kv_heads, head_size]``, :mod:`ascend_patch.npu.attention.kv_layout`), so row ``b`` is all of block ``b``: its
K half, then its V half. An MLA layer's region is not: the NPU MLA kernels take the latent and
rope caches as two contiguous tensors under one block table, so the region holds every block's
latent rows, then every block's rope rows (:func:`ascend_patch.npu.attention.mla.latent_planes`),
and vLLM's row ``b`` would be latent bytes of other blocks. The worker copies such a layer plane by
plane instead, block ``b`` of each to the same host row of one host tensor per plane: it finds the
MLA regions by their address among the MLA layers' caches. A host chunk holds ``blocks_per_chunk``
rows per host tensor; the host bytes are read by this worker only. The copies are synchronous on
the current stream: a job is finished when it is submitted.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload import base as kv_offload_base
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ascend_patch.npu import kernels

SPEC_NAME = "NPUOffloadingSpec"
RESOLVED_ADDRESSES = hasattr(kv_offload_base, "DevicePointers")  # seam: block ids before vLLM 0.34
"""Whether vLLM hands the worker a transfer's device side as addresses (``DevicePointers``)."""


class NPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec, with the NPU worker in place of its CUDA/XPU one."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from vllm.config import get_current_vllm_config
            from vllm.utils.torch_utils import PIN_MEMORY

            config = get_current_vllm_config()
            mla = mla_regions(config)
            if config.model_config.use_mla and any(t.tensor.data_ptr() not in mla for t in kv_caches.tensors):
                raise NotImplementedError(  # never copy an MLA region as vLLM's block rows
                    "KV offload of this MLA model is not supported on Ascend by ascend-patch: a KV "
                    "cache tensor is not the region of an Ascend MLA layer")
            self._worker = NPUOffloadingWorker(kv_caches, self.blocks_per_chunk, self._host_chunks(),
                                               PIN_MEMORY, mla)
        return self._worker

    def _host_chunks(self) -> int:
        """How many host chunks vLLM sized: ``num_chunks`` from 0.30, when its CPU load/store spec
        took ``chunk_ids``; ``num_blocks`` (counting the same chunks) in 0.26-0.29."""
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        if hasattr(CPULoadStoreSpec, "chunk_ids"):  # seam
            return self.num_chunks
        return self.num_blocks


def mla_regions(vllm_config) -> dict[int, tuple[int, int]]:
    """The address of each MLA layer's cache region → ``(kv_lora_rank, kv_lora_rank + rope)``, from
    the layers of the config vLLM sets while its worker registers the KV caches."""
    from ascend_patch.npu.attention.mla import AscendMLAImpl

    regions = {}
    for layer in vllm_config.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)  # not a seam: only attention layers have one
        kv = getattr(layer, "kv_cache", None)  # not a seam: not every layer caches
        if isinstance(impl, AscendMLAImpl) and isinstance(kv, torch.Tensor):
            regions[kv.data_ptr()] = (impl.kv_lora_rank, kv.shape[-1])
    return regions


class NPUOffloadingWorker(OffloadingWorker):
    """Copies blocks between the device KV cache and host tensors: one per standard layer's cache
    tensor, two (latent, rope) per MLA layer's."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 pin_memory: bool, mla: dict[int, tuple[int, int]] | None = None):
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError(
                f"KV offload with {len(kv_caches.group_data_refs)} KV cache groups (hybrid "
                "KV-cache manager) is not supported on Ascend by ascend-patch: one group only")
        self.blocks_per_chunk = blocks_per_chunk
        rows = [t.tensor for t in kv_caches.tensors]
        # The cache tensor of each data ref, in the order of the addresses vLLM 0.34 resolves.
        self._ref_rows = [rows[ref.tensor_idx] for ref in kv_caches.group_data_refs[0]]
        self.bytes_per_block = sum(t.shape[1] for t in rows)
        # [num_blocks, bytes] views of the device cache, each with the name of what it holds.
        self.device_tensors, self.planes = [], []
        for tensor in rows:
            if tensor.data_ptr() in (mla or {}):
                self.device_tensors += _mla_planes(tensor, *mla[tensor.data_ptr()])
                self.planes += ["latent", "rope"]
            else:
                self.device_tensors.append(tensor)
                self.planes.append("page")
        # A host row per device block: chunk c's sub-block j is row c * blocks_per_chunk + j.
        self.host_tensors = [torch.zeros((num_chunks * blocks_per_chunk, t.shape[1]), dtype=t.dtype,
                                         device="cpu", pin_memory=pin_memory) for t in self.device_tensors]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, device_side, dst_spec: LoadStoreSpec) -> bool:
        pairs = self._pairs(device_side, dst_spec.block_ids)
        return self._copy(job_id, self.device_tensors, self.host_tensors, pairs)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_side, expedited: bool = False) -> bool:
        pairs = self._pairs(device_side, src_spec.block_ids)[:, ::-1]
        return self._copy(job_id, self.host_tensors, self.device_tensors, pairs)

    def _pairs(self, device_side, chunk_ids: np.ndarray) -> np.ndarray:
        """(device block, host row) pairs: the request's blocks from its ``block_indices[0]``-th on
        lie in consecutive chunk sub-blocks, the first chunk's first ``skip`` belonging to
        blocks before them (as vLLM's CPU worker enumerates them)."""
        block_ids, count, first = self._device_blocks(device_side)
        skip = first % self.blocks_per_chunk
        rows = (chunk_ids.astype(np.int64)[:, None] * self.blocks_per_chunk
                + np.arange(self.blocks_per_chunk)).ravel()[skip: skip + count]
        return np.stack([block_ids, rows], axis=1)

    def _device_blocks(self, device_side) -> tuple[np.ndarray, int, int]:
        """The device side of a transfer as (block ids, count, first logical block): a
        ``GPULoadStoreSpec`` of block ids before vLLM 0.34; from 0.34 the addresses vLLM resolved
        from them (``DevicePointers``: per data ref, ``base + block * row stride``), turned back
        into the block ids, which every data ref must agree on."""
        if not RESOLVED_ADDRESSES:
            (count,), (first,) = device_side.group_sizes, device_side.block_indices
            return device_side.block_ids.astype(np.int64), count, first
        (count,), (first,) = device_side.group_block_counts, device_side.block_indices
        ptrs = device_side.ptrs.astype(np.int64).reshape(len(self._ref_rows), count)
        # Read now, not at construction: sleep mode can give the caches new storage.
        bases = np.array([[row.data_ptr()] for row in self._ref_rows], dtype=np.int64)
        strides = np.array([[row.stride(0)] for row in self._ref_rows], dtype=np.int64)
        ids = (ptrs - bases) // strides
        if (ids != ids[0]).any() or (
                count and not 0 <= ids[0].min() <= ids[0].max() < self._ref_rows[0].shape[0]):
            raise ValueError("KV offload: the device addresses vLLM resolved are not the same blocks "
                             "of every KV cache tensor")
        return ids[0], count, first

    def _copy(self, job_id: int, sources, destinations, pairs: np.ndarray) -> bool:
        start = time.perf_counter()
        mapping = torch.from_numpy(np.ascontiguousarray(pairs))
        for src, dst in zip(sources, destinations):
            kernels.swap_blocks(src, dst, mapping)
        self._finished.append(TransferResult(job_id, True, len(pairs) * self.bytes_per_block,
                                             time.perf_counter() - start))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished when it was submitted


def _mla_planes(rows: torch.Tensor, kv_lora_rank: int, width: int) -> list[torch.Tensor]:
    """vLLM's ``[num_blocks, page]`` rows over an MLA layer's region → the ``[num_blocks, latent
    bytes]`` and ``[num_blocks, rope bytes]`` planes the MLA kernels read, over the same bytes."""
    from ascend_patch.npu.attention.mla import latent_planes

    blocks, page = rows.shape
    if rows.stride() != (page, 1) or page % width:
        raise NotImplementedError(
            f"KV offload of an MLA layer whose cache is not one dense region of {blocks} pages of "
            f"{page} bytes (strides {rows.stride()}) is not supported on Ascend by ascend-patch")
    # In bytes, a page is block_size * element size rows of `width`: the planes split it as in elements.
    return [plane.reshape(blocks, -1) for plane in latent_planes(rows.view(blocks, -1, width), kv_lora_rank)]
