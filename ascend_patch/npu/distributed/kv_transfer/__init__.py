"""Which KV connectors the NPU platform serves, checked once at start-up.

vLLM hands every connector each layer's KV cache tensor as the attention backend shaped it. The
Ascend cache of a standard attention layer is ``[num_blocks, 2, block_size, kv_heads, head_size]``
(:mod:`ascend_patch.npu.attention.kv_layout`): block-outermost, which is what vLLM's ``ExampleConnector``
indexes from vLLM 0.23 (``layer[slot // block_size, :, slot % block_size]``, the shared-storage
connector of vLLM's disaggregated-prefill example).

Served:
- ``ExampleConnector`` (vLLM 0.23 and later), and ``MultiConnector`` of served connectors; for an
  MLA model the platform names :class:`.example.AscendExampleConnector` instead, vLLM's connector
  handed each MLA layer's latent and rope planes as per-token rows;
- ``OffloadingConnector`` (KV offload to host memory, also as ``--kv-offloading-size``) with the
  NPU offloading spec (:mod:`.offload`), which the platform names in its extra config, on a vLLM
  with the offloading worker interface of 0.26 and later;
- ``MooncakeConnector`` on vLLM 0.33 and later (its registration takes each layer's region as
  block rows of one page, the Ascend page), with the transfer engine's protocol defaulting to
  ``ascend`` on the NPU (``tcp`` emulated); a plan that would split or gather a block by KV heads (producer and
  consumer with different tensor-parallel KV splits) fails the transfer instead
  (:func:`mooncake_resharding`), as the Ascend page holds K then V with heads inside tokens;
- any connector vLLM does not ship (``kv_connector_module_path``, or registered by a plugin through
  ``KVConnectorFactory``): the deployment's own, such as an NPU transfer connector, which reads the
  layout above.

Refused in one line, each with its reason: KV offload before vLLM 0.26, through any other spec,
backend (``--kv-offloading-backend lmcache``) or connector (``VLLM_USE_SIMPLE_KV_OFFLOAD``), or
with more than one KV cache group (the hybrid KV-cache manager; refused when the worker
registers); MLA models with any connector but the example connector and KV offload (the NPU MLA
kernels read a layer's region as separate latent and rope planes, not the per-token pages the
connectors index; those two are handed or copy the planes); sleep mode with any connector (sleep frees the KV cache
storages the connector holds); a KV block size other than the kernel's 128; vLLM 0.20–0.22's
``ExampleConnector`` (it reads every backend but Triton's as FlashAttention's ``[2, blocks,
...]``); ``MooncakeConnector`` on other releases (0.26-0.28 assert a 4-dim backend cache shape,
the others are not verified); every other connector vLLM ships (CUDA transports, or not
verified on Ascend).

Docs: docs/distributed.md, "Disaggregated prefill (KV connectors)" and "KV offload to host memory".
"""

from __future__ import annotations

# LMCache 0.5.x: lmcache/v1/platform/devices/{cuda,npu}/device_ops.py.
_LMCACHE = ("LMCache copies KV with compiled device ops: lmcache.cuda_ops, or on an NPU those of "
            "the lmcache_ascend plugin (not on PyPI), which ascend-patch has not run")
_REASONS = {
    "NixlConnector": "NIXL registers device memory for CUDA/UCX transports and the platform names "
                     "no NIXL device (Platform.get_nixl_supported_devices)",
    "LMCacheConnectorV1": _LMCACHE,
    "LMCacheMPConnector": _LMCACHE,
    "P2pNcclConnector": "it sends KV over NCCL",
    "MoRIIOConnector": "it moves KV with ROCm's MoRI-IO",
}
# Every connector vLLM 0.20–0.33 registers (vllm/distributed/kv_transfer/kv_connector/factory.py).
_SHIPPED_BY_VLLM = {
    "ExampleConnector", "MultiConnector", "OffloadingConnector", "SimpleCPUOffloadConnector",
    "MooncakeConnector", "MooncakeStoreConnector", "NixlConnector", "NixlPullConnector",
    "NixlPushConnector", "LMCacheConnectorV1", "LMCacheMPConnector", "P2pNcclConnector",
    "MoRIIOConnector", "DecodeBenchConnector", "ExampleHiddenStatesConnector",
    "FlexKVConnectorV1", "HF3FSKVConnector", "HiSparseConnector"}
# The release whose MooncakeConnector registration and transfer plan were checked against the
# Ascend layout (tests/test_mooncake.py), named in messages; the gate is the declaration.
MOONCAKE_RELEASE = "0.33 and later"
_SERVED = ("ExampleConnector (vLLM 0.23+), OffloadingConnector, MooncakeConnector (vLLM "
           f"{MOONCAKE_RELEASE}), MultiConnector of those, or a connector of your own through "
           "kv_connector_module_path")


def check_config(vllm_config, emulated: bool = False) -> None:
    """Refuse, in one line, a KV connector or KV offload the platform cannot serve, and point vLLM's
    offloading connector at the NPU offloading spec. Runs in ``check_and_update_config``, before
    vLLM turns ``--kv-offloading-size`` into an ``OffloadingConnector`` (it keeps the extra config
    set here)."""
    offloading = vllm_config.cache_config.kv_offloading_size is not None
    if offloading:
        _check_offloading_size(vllm_config)
    transfer = vllm_config.kv_transfer_config
    if transfer is None or (transfer.kv_connector is None and not offloading):
        return
    if offloading:  # vLLM makes the connector its OffloadingConnector, whatever was named
        _check_connector("OffloadingConnector", None, transfer.kv_connector_extra_config)
    else:
        _check_connector(transfer.kv_connector, transfer.kv_connector_module_path,
                         transfer.kv_connector_extra_config, emulated)
    model = vllm_config.model_config
    if model is not None and model.enable_sleep_mode:
        raise NotImplementedError(
            "sleep mode with a KV connector is not supported on Ascend by ascend-patch: sleep frees "
            "the KV cache storages the connector registered, and the connector is not told")
    if model is not None and model.use_mla and not offloading:
        _serve_mla(transfer)
    from ascend_patch.npu.attention.paths import KERNEL_BLOCK_SIZE

    cache = vllm_config.cache_config
    block_size = cache.block_size
    if cache.user_specified_block_size and block_size != KERNEL_BLOCK_SIZE:
        raise NotImplementedError(
            f"--block-size {block_size} is not supported with a KV connector on Ascend: the "
            f"connectors index each layer's cache in KV blocks, and the Ascend cache is in "
            f"{KERNEL_BLOCK_SIZE}-token kernel blocks; use --block-size {KERNEL_BLOCK_SIZE}")


_EXAMPLE_CONNECTOR, _EXAMPLE_MODULE = "AscendExampleConnector", "ascend_patch.npu.distributed.kv_transfer.example"


def _serve_mla(transfer) -> None:
    """An MLA model's connector: vLLM's ExampleConnector becomes the Ascend one, which hands it each
    layer's latent and rope planes as per-token rows; KV offload copies the planes; others refused."""
    named = (transfer.kv_connector, transfer.kv_connector_module_path)
    if named == ("ExampleConnector", None):
        transfer.kv_connector, transfer.kv_connector_module_path = _EXAMPLE_CONNECTOR, _EXAMPLE_MODULE
    elif named != (_EXAMPLE_CONNECTOR, _EXAMPLE_MODULE) and not _offloads_only(transfer.kv_connector, transfer.kv_connector_module_path,
                            transfer.kv_connector_extra_config):
        raise NotImplementedError(
            f"the {transfer.kv_connector} KV connector is not supported for MLA models on Ascend: the "
            "NPU MLA kernels read a layer's cache as separate latent and rope planes, not the "
            "per-token pages the connectors index; served: ExampleConnector (vLLM 0.23+) and KV offload")


def _offloads_only(name: str, module_path: str | None, extra: dict) -> bool:
    """Whether the connector is vLLM's OffloadingConnector (with the NPU spec, which copies MLA
    planes), alone or in a MultiConnector of such."""
    if module_path is not None:
        return False
    if name == "MultiConnector":
        return all(_offloads_only(child.get("kv_connector"), child.get("kv_connector_module_path"),
                                  child.get("kv_connector_extra_config", {}))
                   for child in extra.get("connectors", []))
    return name == "OffloadingConnector"


def _check_connector(name: str, module_path: str | None, extra: dict, emulated: bool = False) -> None:
    if module_path is not None or name not in _SHIPPED_BY_VLLM:
        return  # the deployment's own connector: it reads the Ascend layout as documented
    if name == "MultiConnector":
        for child in extra.get("connectors", []):
            _check_connector(child.get("kv_connector"), child.get("kv_connector_module_path"),
                             child.setdefault("kv_connector_extra_config", {}), emulated)
        return
    if name == "ExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector

        if not hasattr(example_connector, "TritonAttentionMetadata"):  # seam: until 0.23
            return
        reason = ("this vLLM's ExampleConnector reads every backend's cache but Triton's as "
                  "[2, blocks, ...] (vLLM 0.23 and later read blocks first, as the Ascend cache is)")
    elif name == "OffloadingConnector":
        _use_npu_offloading_spec(extra)
        return
    elif name == "MooncakeConnector":
        reason = _mooncake_refusal()
        if reason is None:
            # vLLM's default is rdma; the Ascend transport moves NPU memory (tcp: host memory).
            extra.setdefault("mooncake_protocol", "tcp" if emulated else "ascend")
            return
    else:
        reason = _REASONS.get(name, "it is not verified on Ascend")
    raise NotImplementedError(f"the {name} KV connector is not supported on Ascend by "
                              f"ascend-patch: {reason}; served: {_SERVED}")


_OFFLOAD_MODULE = "ascend_patch.npu.distributed.kv_transfer.offload"


def _check_offloading_size(vllm_config) -> None:
    """``--kv-offloading-size``: vLLM's native backend becomes the OffloadingConnector with the NPU
    spec; the others move KV with CUDA code."""
    import vllm.envs as envs
    from vllm.config import KVTransferConfig

    backend = vllm_config.cache_config.kv_offloading_backend
    if backend != "native":
        raise NotImplementedError(
            f"KV offload with --kv-offloading-backend {backend} is not supported on Ascend by "
            "ascend-patch: use the native backend (vLLM's OffloadingConnector with the NPU spec)")
    if envs.VLLM_USE_SIMPLE_KV_OFFLOAD:
        raise NotImplementedError(
            "KV offload with VLLM_USE_SIMPLE_KV_OFFLOAD=1 is not supported on Ascend by ascend-patch: "
            "SimpleCPUOffloadConnector copies with CUDA driver calls; unset it for the OffloadingConnector")
    if vllm_config.kv_transfer_config is None:
        vllm_config.kv_transfer_config = KVTransferConfig()


def _use_npu_offloading_spec(extra: dict) -> None:
    """Name the NPU spec in the connector's extra config (vLLM's default spec is CUDA/XPU only), on
    a vLLM whose offloading interface is the one it implements."""
    if not _offloading_interface():
        raise NotImplementedError(
            "KV offload (OffloadingConnector, --kv-offloading-size) is not supported on Ascend by "
            "ascend-patch with this vLLM: the NPU offloading spec implements the offloading "
            "interface of vLLM 0.26-0.33 (CPUOffloadingSpec in host chunks, "
            "OffloadingWorker.submit_store/submit_load; earlier releases hand out transfer handlers)")
    spec = extra.setdefault("spec_name", "NPUOffloadingSpec")
    module = extra.setdefault("spec_module_path", _OFFLOAD_MODULE)
    if (spec, module) != ("NPUOffloadingSpec", _OFFLOAD_MODULE):
        raise NotImplementedError(
            f"the offloading spec {spec} is not supported on Ascend by ascend-patch: the "
            f"OffloadingConnector takes NPUOffloadingSpec ({_OFFLOAD_MODULE}), which the platform "
            "sets when spec_name is left out")


def _offloading_interface() -> bool:
    """Whether this vLLM's offloading interface is the one the NPU spec implements: specs built
    from an ``OffloadingConfig`` with workers that store and load host chunks (0.26 and later;
    until 0.25 specs hand out per-direction transfer handlers)."""
    try:
        from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: F401  seam: 0.26+
    except ImportError:
        return False
    return True


def _mooncake_refusal() -> str | None:
    """Why this vLLM's MooncakeConnector cannot be served on the Ascend layout, or None: it is
    served where the active patch set installs :func:`mooncake_resharding` (patches/v0_29.py)."""
    from ascend_patch import release

    if f"{__name__}:{mooncake_resharding.__name__}" in release.patched:
        return None
    return (f"ascend-patch verified the Mooncake connector's registration and transfer plan on the "
            f"Ascend layout with vLLM {MOONCAKE_RELEASE} (the connector of 0.26-0.28 also "
            "asserts a 4-dim [blocks, heads, block_size, K|V] backend cache shape, and the Ascend "
            "cache is [blocks, 2, block_size, heads, head_size])")


_RESHARDING = ("Mooncake KV-head re-sharding is not supported on Ascend by ascend-patch: an Ascend "
               "KV page is [2, block_size, heads, head_size] (K then V, heads inside tokens), so "
               "a block cannot be split or gathered by KV heads; run the producer and the consumer "
               "with the same tensor-parallel size")


def mooncake_resharding(wrapped, instance, args, kwargs):
    """Wrapper of ``MooncakeConnectorWorker._validate_head_resharding_layout`` (vLLM 0.33+): vLLM
    plans a transfer between different KV-head splits as byte ranges of each block that hold
    whole heads, true of a heads-outermost page only. Such a plan on the Ascend page would move
    K and V bytes of other heads and tokens; the error makes vLLM fail the transfer instead."""
    error = wrapped(*args, **kwargs)
    remote_tp_size = args[0] if args else kwargs["remote_tp_size"]
    heads = instance.transfer_topo.total_num_kv_heads
    if error is None and min(instance.tp_size, heads) != min(remote_tp_size, heads):
        return _RESHARDING
    return error
