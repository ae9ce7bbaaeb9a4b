"""vLLM's MooncakeConnector (0.33 and later) on the Ascend KV-cache layout (emulated): vLLM's own
worker registers each layer's cache and plans a block transfer, and the planned copy moves exactly
that block's keys and values. Served from 0.33 on, so it lives outside tests/test_kv_transfer.py,
whose tests all run on the pinned v0_20 release as well (its refusal of Mooncake is tested there).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from packaging.version import Version

MOONCAKE = Version(version("vllm")).release >= (0, 33)
# The Mooncake transfer engine (mooncake-transfer-engine on PyPI) links libcuda, libcudart and
# libibverbs, so it cannot load here: vLLM's connector worker is run without its __init__ (which
# starts the engine, threads and sockets), on an in-process engine that copies between
# registered regions as the real one does between hosts.
_MOONCAKE_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


class _Fabric:
    """Registered memory of every worker in this process; a write copies between two regions."""

    regions: list[tuple[int, int]] = []

    def batch_register_memory(self, ptrs: list[int], lengths: list[int]) -> int:
        self.regions += zip(ptrs, lengths)
        return 0

    def batch_transfer_sync_write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        import ctypes

        for source, target, length in zip(src, dst, lengths):
            for address in (source, target):  # the engine moves registered memory only
                assert any(base <= address and address + length <= base + size for base, size in self.regions)
            ctypes.memmove(target, source, length)
        return 0


def _mooncake_worker(engine_id: str):
    """vLLM's MooncakeConnectorWorker over two tiny-Llama-sized layers (2 KV heads, head size
    64, 4 blocks of 128 tokens) allocated as on the NPU: vLLM's single int8 buffer, LBNHC layer
    views, each re-viewed by ascend_patch as ``[blocks, 2, 128, heads, head_size]``."""
    from collections import OrderedDict

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mooncake
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import MooncakeKVConnectorStats
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from ascend_patch.npu.attention.kv_layout import ascend_layer_view

    class Worker(mooncake.MooncakeConnectorWorker):
        def shutdown(self):
            pass  # no engine, thread or socket was started

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    blocks, page = 4, spec.page_size_bytes
    config = KVCacheConfig(num_blocks=blocks, kv_cache_groups=[KVCacheGroupSpec(_MOONCAKE_LAYERS, spec)],
                           kv_cache_tensors=[KVCacheTensor(size=page * blocks * 2, layers=_MOONCAKE_LAYERS,
                                                           layer_stride=page * blocks, block_stride=page)])
    caches = {name: ascend_layer_view(view) for name, view in
              allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC, [128]).items()}
    worker = object.__new__(Worker)
    worker.__dict__.update(
        engine=_Fabric(), kv_cache_config=config, is_kv_consumer=True, is_kv_producer=False,
        _physical_blocks_per_logical_kv_block=1, _layer_specs=dict.fromkeys(_MOONCAKE_LAYERS, spec),
        use_mla=False, _prepared_transfer_regions={}, _layout_by_peer=OrderedDict(),
        _acked_layout_peers=set(), tp_rank=0, tp_size=1, pp_size=1, hostname="127.0.0.1", rpc_port=1,
        xfer_stats=MooncakeKVConnectorStats(),
        transfer_topo=TransferTopology(tp_rank=0, tp_size=1, block_size=128, engine_id=engine_id, is_mla=False,
                                       is_mamba=False, total_num_kv_heads=2, attn_backends=[]))
    worker.register_kv_caches(caches)  # the consumer's registration: no sender listener
    return worker, caches, page


@pytest.mark.each_runner  # the pinned 0.33.0 run checks it too
@pytest.mark.skipif(not MOONCAKE, reason="the platform serves vLLM's MooncakeConnector from 0.33")
def test_mooncake_moves_a_block_with_its_keys_and_values(reference_kernels):
    """vLLM's Mooncake worker registers each Ascend layer as one region of page-long blocks, and
    the transfer it plans for producer block 2 → consumer block 3 moves exactly that block: the
    consumer's attention views then read block 2's keys and values in block 3, in every layer,
    and no other consumer byte changes; its stats count one page per layer. The plan computed for
    a consumer with another KV-head split fails instead (the Ascend page is not heads-outermost);
    vLLM's own check would have let it through."""
    import asyncio

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mooncake

    from ascend_patch.npu import kernels
    from ascend_patch.npu.distributed.kv_transfer import mooncake_resharding
    from ascend_patch.npu.attention.kv_layout import kernel_caches, kernel_slots

    producer, produced, page = _mooncake_worker("prefill")
    consumer, consumed, _ = _mooncake_worker("decode")
    for worker, caches in ((producer, produced), (consumer, consumed)):
        assert worker.kv_caches_base_addr == [cache.data_ptr() for cache in caches.values()]
        assert worker.block_len_per_layer == worker.kv_block_len_per_layer == [page, page]
        assert page == produced[_MOONCAKE_LAYERS[0]][0].nbytes  # one Ascend block: its K half, its V half
    generator = torch.Generator().manual_seed(0)
    written = {}
    for name, cache in produced.items():
        key, value = (torch.randn(128, 2, 64, generator=generator) for _ in range(2))
        for block, sign in ((2, 1), (3, -1)):  # as attention writes: through the kernels' K and V views
            kernels.scatter_pa_kv_cache(sign * key, sign * value, *kernel_caches(cache),
                                        kernel_slots(torch.arange(block * 128, (block + 1) * 128), 128))
        written[name] = key, value
    for cache in consumed.values():
        cache.fill_(7.0)
    before = {name: cache.clone() for name, cache in consumed.items()}

    pull = consumer._build_pull_metadata(
        {"req": mooncake.PullReqMeta("req", "xfer", [[3]], "prefill", "127.0.0.1:1")}, include_layout=True)
    local, remote, error = producer._prepare_transfer_regions(pull)
    assert error is None
    src, dst, lengths, failed, _ = asyncio.run(producer._build_transfer_params(
        [("req", mooncake.SendBlockMeta("req", "xfer", [[2]], asyncio.Event()))], pull, local, remote))
    assert failed == [] and producer._send_blocks("decode", src, dst, lengths) == 0
    for name, cache in consumed.items():
        key_cache, value_cache = kernel_caches(cache)
        key, value = written[name]
        torch.testing.assert_close(key_cache[6], key, rtol=0, atol=0)  # kernel block 2b: block b's K
        torch.testing.assert_close(value_cache[6], value, rtol=0, atol=0)
        torch.testing.assert_close(cache[:3], before[name][:3], rtol=0, atol=0)
    stats = producer.xfer_stats
    assert (stats.num_successful_transfers, stats.data["bytes_transferred"]) == (1, [2 * page]), stats.data

    resharding = mooncake.MooncakeConnectorWorker._validate_head_resharding_layout
    vllms = getattr(resharding, "__wrapped__", resharding).__get__(producer)  # unpatched in this process
    assert vllms(2, local) is None and mooncake_resharding(vllms, producer, (1, local), {}) is None
    assert "Mooncake KV-head re-sharding is not supported on Ascend" in mooncake_resharding(
        vllms, producer, (2, local), {})
