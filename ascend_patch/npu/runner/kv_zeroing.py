"""Zeroing freshly allocated KV blocks in the Ascend layouts, for both runner generations.

vLLM zeroes new blocks (hybrid models, mixed-precision KV) with ``KVBlockZeroer``, a Triton
kernel over ``[blocks, ...]`` caches addressed by raw pointers. Each Ascend cache is zeroed with
one ``index_fill_`` per plane of ``[blocks, ...]``: a standard layer's whole cache (``[blocks, 2,
...]``, K and V halves in each block), or the MLA latent and rope planes.
"""

from __future__ import annotations

import torch


class AscendKVBlockZeroer:
    """Zeroes KV blocks by id in every cache plane of ``kv_cache_config``'s layers."""

    def __init__(self, static_forward_context: dict, kv_cache_config, device: torch.device) -> None:
        from ascend_patch.npu.attention.mla import AscendMLAImpl, latent_planes

        planes = {}
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                layer = static_forward_context.get(name)
                kv = getattr(layer, "kv_cache", None)  # not a seam: not every layer caches
                if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                    continue
                if isinstance(getattr(layer, "impl", None), AscendMLAImpl):  # not a seam: ours
                    layer_planes = latent_planes(kv, layer.impl.kv_lora_rank)
                else:
                    layer_planes = (kv,)
                planes.update((plane.data_ptr(), plane) for plane in layer_planes)
        self.planes = list(planes.values())
        self.num_blocks = kv_cache_config.num_blocks
        self.device = device

    def zero_block_ids(self, block_ids) -> None:
        if len(block_ids) == 0 or not self.planes:
            return
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        for plane in self.planes:
            ratio = plane.shape[0] // self.num_blocks  # kernel blocks per block
            kernel_ids = (ids[:, None] * ratio + torch.arange(ratio, device=self.device)).flatten()
            plane.index_fill_(0, kernel_ids, 0)

    def warmup(self, num_kv_blocks: int) -> None:
        """MRV2's warm-up (0.34) zeroes block 0, the null block, as vLLM's zeroer does to compile
        its kernel: here it runs the same index fills a real step does."""
        if num_kv_blocks > 0:
            self.zero_block_ids([0])
