"""Disaggregated prefill of MLA models through vLLM's ``ExampleConnector``.

The connector reads and writes a layer's KV per token, indexing the layer's cache as
``layer[block_ids, :, offsets]`` (vLLM 0.23-0.33, for every attention metadata but vLLM's own MLA
backends'), which on a ``[blocks, heads, block_size, width]`` cache gives each token's rows. An
Ascend MLA layer's region holds every block's latent rows, then every block's rope rows (the two
caches the NPU MLA kernels take, :func:`ascend_patch.npu.attention.mla.latent_planes`), so that
index of it reads other bytes. :class:`AscendExampleConnector` is vLLM's connector, unchanged,
handed each MLA layer's cache as :class:`LatentRows`: ``[blocks, 1, block_size, latent + rope]``
per-token rows over the two planes, whose indexing gathers (and whose assignment scatters) each
token's latent row and rope row. The saved KV of an MLA layer is then ``[tokens, 1, latent +
rope]``. The platform names this connector for an MLA model whose config names vLLM's
(:func:`ascend_patch.npu.distributed.kv_transfer.check_config`).
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

class LatentRows:
    """An MLA layer's latent and rope planes as ``[blocks, 1, block_size, latent + rope]`` rows,
    for the one index ``[block_ids, :, offsets]`` (one block id and offset per token)."""

    def __init__(self, kv_cache: torch.Tensor, kv_lora_rank: int):
        from ascend_patch.npu.attention.mla import latent_planes

        self.device = kv_cache.device
        self.kv_lora_rank = kv_lora_rank
        self.planes = latent_planes(kv_cache, kv_lora_rank)  # [blocks, block_size, 1, width] each

    def _tokens(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(index, tuple) and len(index) == 3 and index[1] == slice(None)):
            raise TypeError(f"an Ascend MLA layer's cache is indexed per token as [block_ids, :, offsets], "
                            f"not {index!r}")
        return index[0], index[2]

    def __getitem__(self, index) -> torch.Tensor:
        blocks, offsets = self._tokens(index)
        return torch.cat([plane[blocks, offsets] for plane in self.planes], dim=-1)

    def __setitem__(self, index, rows: torch.Tensor) -> None:
        blocks, offsets = self._tokens(index)
        latent, rope = self.planes
        latent[blocks, offsets] = rows[..., : self.kv_lora_rank].to(latent.dtype)
        rope[blocks, offsets] = rows[..., self.kv_lora_rank:].to(rope.dtype)


class AscendExampleConnector(ExampleConnector):
    """vLLM's ExampleConnector with each Ascend MLA layer's cache handed over as :class:`LatentRows`.

    vLLM's ``MLAAttention`` calls the connector's per-layer save only from its opaque attention op;
    called directly (as on this platform) it never does, so the MLA layers not saved during the
    step are saved when the step ends (``wait_for_save``), after the forward wrote their KV."""

    # MLA layer name -> (its cache, kv_lora_rank), set when the worker registers the KV caches.
    _latent_layers: dict[str, tuple[torch.Tensor, int]] = {}
    _saved: frozenset[str] = frozenset()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_current_vllm_config

        from ascend_patch.npu.distributed.kv_transfer.offload import mla_regions

        super().register_kv_caches(kv_caches)
        regions = mla_regions(get_current_vllm_config())
        self._latent_layers = {name: (kv_cache, regions[kv_cache.data_ptr()][0])
                               for name, kv_cache in kv_caches.items()
                               if kv_cache.data_ptr() in regions}

    def shutdown(self) -> None:
        # Let go of the MLA caches with the engine: a worker-side connector can outlive it (on
        # Model Runner V2 the next engine in the process found them still charged to the device).
        self._latent_layers = {}
        super().shutdown()

    def _rows(self, layer_name: str, kv_layer):
        if layer_name not in self._latent_layers:
            return kv_layer
        return LatentRows(kv_layer, self._latent_layers[layer_name][1])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        if layer_name in self._latent_layers:
            self._saved |= {layer_name}
        super().save_kv_layer(layer_name, self._rows(layer_name, kv_layer), attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for name, (kv_cache, _) in self._latent_layers.items():
            if name not in self._saved:
                super().save_kv_layer(name, self._rows(name, kv_cache), None)
        self._saved = frozenset()
        super().wait_for_save()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # The connector reads each layer's cache off the layer: the MLA layers hold their rows
        # view while it loads.
        layers = forward_context.no_compile_layers
        bound = {name: layers[name].kv_cache for name in self._latent_layers if name in layers}
        try:
            for name, kv_cache in bound.items():
                layers[name].kv_cache = self._rows(name, kv_cache)
            super().start_load_kv(forward_context, **kwargs)
        finally:
            for name, kv_cache in bound.items():
                layers[name].kv_cache = kv_cache
