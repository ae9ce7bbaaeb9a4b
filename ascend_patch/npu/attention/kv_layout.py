"""The KV-cache page layout of the Ascend attention backend, beside the code that reads it.

Every standard attention layer's cache is ``[num_blocks, 2, block_size, kv_heads, head_size]``,
contiguous: block-outermost, each block's page its K half then its V half. vLLM's connector code
indexes blocks on the first dimension: the example connector reads ``layer[block, :, offset]``
from vLLM 0.23 (0.20–0.22 read FlashAttention's ``[2, blocks, ...]`` and are refused,
:mod:`ascend_patch.npu.distributed.kv_transfer`), and 0.33's offloading code names this shape and
these strides "K and V in separate page halves, NHD"
(``offloading/canonical_mapping.py::_split_kv_regions``).

The NPU kernels take separate K and V caches ``[blocks, block_size, kv_heads, head_size]`` that
are contiguous (npu_scatter_pa_kv_cache: "输入参数不支持非连续"; npu_fused_infer_attention_score:
key/value "不支持非连续Tensor", shapes "必须完全一致"; ATB's AtTensor2AtbTensor checks
``is_contiguous()``), so the K half of every block cannot be handed over as one strided tensor.
:func:`kernel_caches` hands them two contiguous views of the same bytes instead, each of
``2 * num_blocks - 1`` half-page blocks: in both, kernel block ``2b`` is block ``b``'s K half
(key view, from the start) and V half (value view, one half-page later). The kernels then read
block ``b`` through block-table entry ``2b`` (:func:`kernel_block_table`) and write slot ``s``
at ``s + (s // block_size) * block_size`` (:func:`kernel_slots`); the odd blocks of each view
are the other plane, which no table or slot ever names.

vLLM 0.20–0.28 view each layer's buffer in the shape the backend's ``get_kv_cache_shape``
names, which is this one. From 0.29 vLLM allocates one int8 backing buffer and hands each layer a
strided ``[blocks, kv_heads, block_tokens, K|V content]`` view; the backend asks for a
layer-outermost layout (LBNHC), so each layer owns one dense region whose pages are each
block's bytes, and :mod:`ascend_patch.npu.runner.kv_allocation` re-views that region in
the layout above (:func:`ascend_layer_view`). vLLM still decides
sizes, placement and sharing; only the interpretation inside a page changes (the cache is empty
at this point). MLA layers keep vLLM's view: their one latent vector per token has no K/V split,
and the MLA backend reads the region as two planes (:mod:`ascend_patch.npu.attention.mla`), which
is why only the connectors that read the planes serve them: the NPU offloading spec and the
Ascend example connector (:mod:`ascend_patch.npu.distributed.kv_transfer`).
"""

from __future__ import annotations

import math

import torch


_NOT_DENSE = ("Ascend KV cache: the layer's cache is not one dense region (strides {strides} for "
              "shape {shape}); set VLLM_KV_CACHE_LAYOUT to a layer-outermost layout such as LBNHC")


def ascend_layer_view(view: torch.Tensor) -> torch.Tensor:
    """vLLM's per-layer ``[B, H, N, C]`` view → ``[B, 2, N, H, C // 2]`` over the same bytes."""
    if view.dim() != 4 or view.shape[-1] % 2:
        raise ValueError(
            f"Ascend KV cache: expected a [blocks, heads, tokens, K+V] layer view with equal "
            f"K and V widths, got shape {tuple(view.shape)}"
        )
    blocks, heads, tokens, content = view.shape
    return _dense_region(view).view(blocks, 2, tokens, heads, content // 2)


def kernel_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[B, 2, N, H, D]`` layer cache as the kernels' ``(key_cache, value_cache)``: two
    contiguous ``[2B - 1, N, H, D]`` views of its bytes, one half-page apart, in which kernel
    block ``2b`` is block ``b``'s K (key view) and V (value view) half."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"Ascend KV cache: expected a contiguous [blocks, 2, tokens, heads, head_size] "
                         f"layer cache, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    blocks, _, *half_shape = kv_cache.shape
    half = kv_cache[0, 0].numel()
    flat = kv_cache.view(-1)
    shape = (2 * blocks - 1, *half_shape)
    return flat[: (2 * blocks - 1) * half].view(shape), flat[half:].view(shape)


def kernel_block_table(block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block ids → the kernel blocks of :func:`kernel_caches` (``2b``), still int32 (into ``out``)."""
    return torch.mul(block_table, 2, out=out)


def kernel_slots(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots ``b * block_size + o`` → ``2b * block_size + o``, their place in :func:`kernel_caches`."""
    return slots + slots.div(block_size, rounding_mode="floor") * block_size


def latent_layer_view(view: torch.Tensor) -> torch.Tensor:
    """An MLA layer's ``[B, 1, N, kv_lora_rank + rope]`` view, unchanged once it is known to be
    contiguous: ``MLAAttention`` binds it itself, and the MLA backend reads its bytes as two
    planes (``ascend_patch.npu.attention.mla.latent_planes``)."""
    if not view.is_contiguous():
        raise ValueError(_NOT_DENSE.format(strides=view.stride(), shape=tuple(view.shape)))
    return view


def _dense_region(view: torch.Tensor) -> torch.Tensor:
    """The layer's bytes as one flat tensor, or a ValueError naming the layout to use."""
    numel = view.numel()
    # Dense: some order of the non-trivial dims has the strides of a contiguous tensor
    # (a dim of size 1 never moves, so its stride says nothing).
    order = sorted((d for d in range(4) if view.shape[d] > 1), key=view.stride, reverse=True)
    dense = all(
        view.stride(d) == math.prod(view.shape[e] for e in order[i + 1 :])
        for i, d in enumerate(order)
    )
    if not dense:
        raise ValueError(_NOT_DENSE.format(strides=view.stride(), shape=tuple(view.shape)))
    return view.as_strided((numel,), (1,), view.storage_offset())
