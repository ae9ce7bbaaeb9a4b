"""Disaggregated prefill through vLLM's own ExampleConnector on the emulated NPU, and the KV
connector and data-parallel configurations the platform refuses.

One driver run (one fresh interpreter, in-process engines one after another): a producer engine
prefills and its connector saves each layer's KV to shared storage; a consumer engine loads it and
decodes. The oracle is HF transformers on the same weights: the saved K and V of every layer equal
HF's cache (post-rotary keys, values) token for token, so the connector read the K and V halves
attention wrote, not another plane or block; the consumer's tokens equal HF greedy and it served
the prompts' full blocks from the connector (prefix caching is off). The same with a tiny
DeepSeek-V3 (MLA), whose layers' latent and rope planes the Ascend connector hands vLLM's as
per-token rows. The refusals start engines
that stop at configuration, in one line each: rank 0 of vLLM's offline data-parallel example on
an MoE model stops there instead of asserting in vLLM's get_ep_all2all_manager; before vLLM 0.26,
whose offloading interface the NPU spec does not implement, so does KV offload
(tests/test_kv_offload.py runs it on 0.26+).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file

from ascend_patch.kit.oracle import hf_greedy, hf_model, prompt_token_ids
from tests.helpers.engine import run_engine

# Each prompt reaches past its first 128-token block, so blocks beyond the first are saved, and
# each saves a different number of blocks (which tells the saved prefixes apart).
PROMPT_LENGTHS = [420, 300, 200]
MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "enable_prefix_caching": False}
# KV offload is declared for vLLM 0.26-0.33 (patches/v0_20.py); earlier releases refuse it.
OFFLOAD_REFUSED = Version(Version(version("vllm")).base_version) < Version("0.26")

pytestmark = pytest.mark.v0_20_features


def _connector(role: str, storage) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


@pytest.fixture(scope="module")
def disaggregated(tiny_models, tmp_path_factory):
    llama, deepseek = tiny_models["tiny-llama"], tiny_models["tiny-deepseek-v3"]
    tmp = tmp_path_factory.mktemp("kv_transfer")
    storage, mla_storage = tmp / "storage", tmp / "mla_storage"
    prompts = prompt_token_ids(llama, PROMPT_LENGTHS)
    mla_prompts = prompt_token_ids(deepseek, PROMPT_LENGTHS)
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    prefill = {**greedy, "max_tokens": 1}
    refused = {  # refused at configuration, so before the engines that start
        "nixl": (llama, {**ENGINE, "kv_transfer_config": {"kv_connector": "NixlConnector",
                                                          "kv_role": "kv_both"}}, {}),
        "block_size": (llama, {**ENGINE, "block_size": 256,
                               "kv_transfer_config": _connector("kv_both", storage)}, {}),
        "mla": (deepseek, {**ENGINE, "kv_transfer_config": {
            "kv_connector": "MyConnector", "kv_connector_module_path": "my_connectors", "kv_role": "kv_both"}}, {}),
        "sleep": (llama, {**ENGINE, "enable_sleep_mode": True,
                          "kv_transfer_config": _connector("kv_both", storage)}, {}),
    }
    if OFFLOAD_REFUSED:
        refused["offload"] = (llama, {**ENGINE, "kv_offloading_size": 0.02}, {})
    spec = {"engines": [
        *({"model": str(model), "kwargs": kwargs, "env": env, "runs": []} for model, kwargs, env in refused.values()),
        {"model": str(llama), "kwargs": {**ENGINE, "kv_transfer_config": _connector("kv_producer", storage)},
         "runs": [{"prompts": prompts, "sampling": [prefill]}]},
        {"model": str(llama), "kwargs": {**ENGINE, "kv_transfer_config": _connector("kv_consumer", storage)},
         "runs": [{"prompts": prompts, "sampling": [greedy]}]},
        {"model": str(deepseek), "kwargs": {**ENGINE, "kv_transfer_config": _connector("kv_producer", mla_storage)},
         "runs": [{"prompts": mla_prompts, "sampling": [prefill]}]},
        {"model": str(deepseek), "kwargs": {**ENGINE, "kv_transfer_config": _connector("kv_consumer", mla_storage)},
         "runs": [{"prompts": mla_prompts, "sampling": [greedy]}]},
    ]}
    *refusals, producer, consumer, mla_producer, mla_consumer = run_engine(spec, tmp)["engines"]
    return {"llama": llama, "prompts": prompts, "storage": storage, "producer": producer,
            "consumer": consumer, "refused": dict(zip(refused, refusals)), "deepseek": deepseek,
            "mla_prompts": mla_prompts, "mla_storage": mla_storage, "mla_producer": mla_producer,
            "mla_consumer": mla_consumer}


def test_saved_kv_is_what_attention_wrote(disaggregated):
    """Every layer's saved [tokens, K|V, heads, head_size] equals HF's keys and values."""
    prompts, storage = disaggregated["prompts"], disaggregated["storage"]
    assert disaggregated["producer"]["block_size"] == 128
    model = hf_model(disaggregated["llama"])
    folders = sorted(p for p in storage.iterdir() if p.is_dir())
    assert len(folders) == len(prompts), f"one saved prefix per prompt, found {folders}"
    by_length = {}
    for folder in folders:
        files = sorted(folder.glob("*.safetensors"))
        assert len(files) == model.config.num_hidden_layers
        by_length[load_file(files[0])["kv_cache"].shape[0]] = folder
    for prompt in prompts:
        saved_tokens = (len(prompt) - 1) // 128 * 128
        with torch.no_grad():
            cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
        for layer, hf_layer in enumerate(cache.layers):
            saved = load_file(by_length[saved_tokens] / f"model.layers.{layer}.self_attn.attn.safetensors")["kv_cache"]
            assert saved.shape == (saved_tokens, 2, *hf_layer.keys.shape[1:2], hf_layer.keys.shape[-1])
            keys = hf_layer.keys[0].transpose(0, 1)[:saved_tokens]
            values = hf_layer.values[0].transpose(0, 1)[:saved_tokens]
            torch.testing.assert_close(saved[:, 0], keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(saved[:, 1], values, atol=1e-4, rtol=1e-4)


def test_consumer_decodes_from_the_producers_kv(disaggregated):
    run = disaggregated["consumer"]["runs"][0]
    prompts = disaggregated["prompts"]
    assert run["cached"] == [(len(p) - 1) // 128 * 128 for p in prompts], "the connector's hits"
    assert run["tokens"] == hf_greedy(disaggregated["llama"], prompts, MAX_TOKENS)


def test_an_mla_consumer_decodes_from_the_producers_latent_rows(disaggregated):
    """A tiny DeepSeek-V3 (MLA): the producer saves each layer's [tokens, 1, latent 512 + rope 64]
    rows, gathered from the two planes, the consumer serves the prompts' full blocks from them and
    its tokens equal HF greedy."""
    prompts, storage = disaggregated["mla_prompts"], disaggregated["mla_storage"]
    assert "error" not in disaggregated["mla_consumer"], disaggregated["mla_consumer"]["error"]
    shapes = sorted(tuple(load_file(folder / "model.layers.1.self_attn.attn.safetensors")["kv_cache"].shape)
                    for folder in storage.iterdir())
    assert shapes == sorted(((len(p) - 1) // 128 * 128, 1, 576) for p in prompts)
    run = disaggregated["mla_consumer"]["runs"][0]
    assert run["cached"] == [(len(p) - 1) // 128 * 128 for p in prompts], "the connector's hits"
    assert run["tokens"] == hf_greedy(disaggregated["deepseek"], prompts, MAX_TOKENS)


def test_an_mla_layers_rows_are_its_latent_and_rope_rows():
    """The rows the Ascend connector hands vLLM's ExampleConnector for an MLA layer: indexed
    ``[blocks, :, offsets]`` as the connector does, each token's latent row then rope row as the
    MLA cache-write kernel stored them in the two planes; assigning them back writes both planes.
    The same index of the region as vLLM shapes it ([blocks, 1, 128, 576]) reads other bytes."""
    from ascend_patch.npu import kernels
    from ascend_patch.npu.attention.mla import latent_planes
    from ascend_patch.npu.distributed.kv_transfer.example import LatentRows

    kernels.use("reference")
    cache = torch.zeros(4, 1, 128, 576)
    latent, rope = latent_planes(cache, 512)
    generator = torch.Generator().manual_seed(0)
    slots = torch.tensor([130, 131, 400, 5])
    kv_c, k_pe = torch.randn(4, 1, 512, generator=generator), torch.randn(4, 1, 64, generator=generator)
    kernels.scatter_pa_kv_cache(kv_c, k_pe, latent, rope, slots)
    index = (slots // 128, slice(None), slots % 128)
    rows = LatentRows(cache, 512)[index]
    torch.testing.assert_close(rows, torch.cat([kv_c, k_pe], dim=-1), rtol=0, atol=0)
    assert not torch.equal(cache[index], rows)
    other = torch.zeros_like(cache)
    LatentRows(other, 512)[index] = rows
    torch.testing.assert_close(other, cache, rtol=0, atol=0)


@pytest.mark.parametrize(("case", "message"), [
    ("nixl", "the NixlConnector KV connector is not supported on Ascend"),
    ("block_size", "--block-size 256 is not supported with a KV connector on Ascend"),
    ("mla", "the MyConnector KV connector is not supported for MLA models on Ascend"),
    ("sleep", "sleep mode with a KV connector is not supported on Ascend by ascend-patch"),
    *([("offload", "KV offload (OffloadingConnector, --kv-offloading-size) is not supported on Ascend "
                   "by ascend-patch with this vLLM")] if OFFLOAD_REFUSED else []),
])
def test_unsupported_serving_is_refused_in_one_line(disaggregated, case, message):
    error = disaggregated["refused"][case]["error"]
    assert message in error and "\n" not in error, error


MOONCAKE = Version(version("vllm")).base_version.rsplit(".", 1)[0] == "0.33"
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
    """vLLM 0.33's MooncakeConnectorWorker over two tiny-Llama-sized layers (2 KV heads, head size
    64, 4 blocks of 128 tokens) allocated as on the NPU: vLLM's single int8 buffer, LBNHC layer
    views, each re-viewed by ascend_patch as ``[blocks, 2, 128, heads, head_size]``."""
    from collections import OrderedDict

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mooncake
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import MooncakeKVConnectorStats
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from ascend_patch.npu.kv_cache import ascend_layer_view

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


@pytest.mark.skipif(not MOONCAKE, reason="the platform serves vLLM 0.33's MooncakeConnector only")
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
    from ascend_patch.npu.kv_cache import kernel_caches, kernel_slots

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


@pytest.mark.parametrize("emulated", [False, True])
def test_mooncake_is_served_with_the_ascend_protocol_or_refused(emulated):
    """vLLM 0.33's MooncakeConnector, alone or in a MultiConnector, gets the Ascend transport on
    the NPU (tcp emulated) unless one is named; other releases refuse it in one line."""
    from ascend_patch.npu.distributed.kv_transfer import _check_connector

    extra, named = {}, {"mooncake_protocol": "rdma"}
    multi = {"connectors": [{"kv_connector": "MooncakeConnector"}]}
    if not MOONCAKE:
        with pytest.raises(NotImplementedError, match="the MooncakeConnector KV connector is not supported on "
                                                      "Ascend by ascend-patch: ") as refused:
            _check_connector("MooncakeConnector", None, extra, emulated)
        assert "\n" not in str(refused.value)
        return
    for name, config in (("MooncakeConnector", extra), ("MooncakeConnector", named), ("MultiConnector", multi)):
        _check_connector(name, None, config, emulated)
    protocol = "tcp" if emulated else "ascend"
    assert (extra, named) == ({"mooncake_protocol": protocol}, {"mooncake_protocol": "rdma"})
    assert multi["connectors"][0]["kv_connector_extra_config"] == {"mooncake_protocol": protocol}
