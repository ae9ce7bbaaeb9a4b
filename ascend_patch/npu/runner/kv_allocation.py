"""KV-cache allocation both runner generations share while vLLM shares it: the wrapper of
``vllm.v1.worker.utils.allocate_kv_cache`` (vLLM 0.29+), which re-views each layer's bytes in the
Ascend page layout (:mod:`ascend_patch.npu.attention.kv_layout`) and charges the buffers to the
emulated HBM.
"""

from __future__ import annotations

import torch

from ascend_patch.npu.attention.kv_layout import ascend_layer_view, latent_layer_view


def charge(layer_caches: dict[str, torch.Tensor]) -> None:
    """Charge the buffers behind the layer caches to the device, until the first
    layer cache dies (the layer caches keep their buffers alive)."""
    from ascend_patch.npu import device
    from ascend_patch.npu.storage import unique_storages

    if layer_caches:
        device.current_runtime().charge_storages("KV cache", unique_storages(layer_caches.values()),
                                                 next(iter(layer_caches.values())))


def allocate_kv_cache(wrapped, instance, args, kwargs):
    """Wrapper of ``vllm.v1.worker.utils.allocate_kv_cache`` (vLLM 0.29+). A recurrent layer's
    ``[blocks, 1, 1, page]`` state pages stay as vLLM views them: the layer unpacks its conv
    and SSM states from each page itself (``MambaBase.bind_kv_cache``)."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    specs = _layer_specs(args[0] if args else kwargs["kv_cache_config"])
    views = {}
    for name, view in wrapped(*args, **kwargs).items():
        spec = specs.get(name)
        if isinstance(spec, MLAAttentionSpec):
            views[name] = latent_layer_view(view)
        elif isinstance(spec, MambaSpec):
            views[name] = view
        else:
            views[name] = ascend_layer_view(view)
    charge(views)
    return views


def ascend_pages_are_kernel_blocks(wrapped, instance, args, kwargs):
    """Wrapper of ``AttentionGroup.map_kv_cache_to_kernel_blocks`` (vLLM 0.32+). A KV-cache block
    longer than the backend's kernel block (``--block-size 256``; a hybrid model's attention
    block, raised to its recurrent state's page) is allocated as kernel blocks already, which
    :func:`allocate_kv_cache` re-views as Ascend pages ``[kernel blocks, 2, tokens, heads,
    head_size]``. vLLM looks for the tokens at dim -2 of its own ``[B, H, N, C]`` view, finds the
    heads and refuses; such a page needs no mapping."""
    kv_cache = args[0] if args else kwargs["kv_cache"]
    if kv_cache.dim() == 5 and kv_cache.shape[2] == instance.kernel_block_size:
        return kv_cache
    return wrapped(*args, **kwargs)

def _layer_specs(kv_cache_config) -> dict:
    """Each layer's KV-cache spec, by layer name."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs.update(spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs)
                     else dict.fromkeys(group.layer_names, spec))
    return specs
