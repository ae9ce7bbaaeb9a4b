"""KV offload to host memory through vLLM's own OffloadingConnector and the NPU offloading spec,
on the emulated NPU (vLLM 0.26+; a v0_20 release's CI run reads the engines without and with offload,
the refusals and the engine-free tests, marked v0_20_features).

One driver run (one fresh interpreter, in-process engines one after another). The device cache
is 8 blocks of 128 tokens (``num_gpu_blocks_override``); a set of four 300-token prompts needs 12
blocks, so it runs in waves and a second set of four evicts every block of the first from the
device. Each engine asks the first set (P), the second (F), then P again:

- without offload, the third run finds nothing of P in the device prefix cache (F evicted it) and
  recomputes everything: 0 cached tokens;
- with ``kv_offloading_size`` (vLLM's flag, which it turns into its OffloadingConnector; the
  platform names the NPU spec), P's full blocks were copied to host memory when computed, so the
  third run loads them back: 2 blocks (256 tokens) per prompt, 1024 tokens in all, counted by
  vLLM as external prefix-cache hits, 8 blocks of 2 layers x 128 KiB loaded; the tokens equal the
  engine without offload and HF greedy;
- negative control: the offload engine asks F again (evicting P from the device once more),
  zeroes every host block, and asks P a last time. The same 1024 tokens come from the host, and
  the tokens no longer equal HF's: the host bytes are what the model attends to;
- the offload engine in bf16, whose decodes replay ACL graphs, serves the same hits from host
  memory, and so does a tensor-parallel engine of two workers, each with its own host memory;
- an MLA model (tiny DeepSeek-V3) serves the same hits: its layers' caches are latent and rope
  planes, which the worker copies plane by plane. Zeroing only the host's rope rows changes the
  tokens (a worker that restored only the latent plane would serve wrong keys just as silently).

Without an engine: the offloading worker moves exactly the block it is given, K and V halves as
the attention kernels wrote them, into the host chunk rows vLLM's CPU worker would use, and a
wrong block mapping loads other bytes; an MLA block's latent and rope rows, which vLLM's row of
that block does not hold, go to host and back; an OffloadingConnector named without a spec gets
the NPU spec from vLLM's own spec factory.
"""

from __future__ import annotations

import pytest
import torch

from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from ascend_patch.npu import kernels
from ascend_patch.npu.attention.kv_layout import kernel_caches, kernel_slots
from tests.helpers.engine import assert_tracks_hf_logits, only_marked_tests, run_engine

PROMPTS, PROMPT_LENGTH, BLOCK = 4, 300, 128
MAX_TOKENS = 12
DEVICE_BLOCKS = 8
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "enable_prefix_caching": True,
          "num_gpu_blocks_override": DEVICE_BLOCKS, "disable_log_stats": False}
OFFLOAD = {**ENGINE, "kv_offloading_size": 0.02}  # GiB of host memory: 80 blocks of 256 KiB
COUNTERS = ["vllm:external_prefix_cache_hits", "vllm:kv_offload_load_bytes",
            "vllm:kv_offload_store_bytes"]
# tiny-llama: 2 layers, 2 KV heads of 64, float32: one block of one layer is K and V of 128 tokens.
LAYERS, BLOCK_BYTES = 2, 2 * BLOCK * 2 * 64 * 4
# tiny-deepseek-v3: 2 MLA layers, float32: one block of one layer is 128 tokens of latent 512 + rope 64.
MLA_BLOCK_BYTES = BLOCK * (512 + 64) * 4


V0_20_FEATURES = pytest.mark.v0_20_features
V0_20 = ("plain", "offloaded", "mla")
"""The engines the tests marked v0_20_features read (a v0_20-set release in CI): without offload,
with it, and an MLA model's with it, besides the refusals."""


@pytest.fixture(scope="module")
def offload(request, tiny_models, tmp_path_factory):
    llama = tiny_models["tiny-llama"]
    tmp = tmp_path_factory.mktemp("kv_offload")
    ids = prompt_token_ids(llama, [PROMPT_LENGTH] * 2 * PROMPTS)
    first, second = ids[:PROMPTS], ids[PROMPTS:]
    deepseek = tiny_models["tiny-deepseek-v3"]
    mla_ids = prompt_token_ids(deepseek, [PROMPT_LENGTH] * 2 * PROMPTS)
    mla_first, mla_second = mla_ids[:PROMPTS], mla_ids[PROMPTS:]
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}

    def ask(prompts):
        return {"prompts": prompts, "sampling": [greedy], "counters": COUNTERS}

    refused = {
        "lmcache": (llama, {**OFFLOAD, "kv_offloading_backend": "lmcache"}, {}),
        "simple": (llama, OFFLOAD, {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"}),
        "cuda_spec": (llama, {**ENGINE, "kv_transfer_config": {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 24}}}, {}),
    }
    engines = {
        "plain": (llama, ENGINE, [ask(first), ask(second), ask(first)]),
        "offloaded": (llama, OFFLOAD, [
            ask(first), ask(second), ask(first), ask(second), {"kind": "zero_offloaded_kv"}, ask(first)]),
        "graphed": (llama, {**OFFLOAD, "dtype": "bfloat16"}, [ask(first), ask(second), ask(first)]),
        "tp2": (llama, {**OFFLOAD, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                [ask(first), ask(second), ask(first)]),
        "mla": (deepseek, OFFLOAD, [ask(mla_first), ask(mla_second), ask(mla_first), ask(mla_second),
                                    {"kind": "zero_offloaded_kv", "planes": ["rope"]}, ask(mla_first)]),
        # Refused while its worker registers the KV caches, so after the engines that run: the
        # engine stops half-started.
        "hybrid": (tiny_models["tiny-gemma3-5to1"], {**OFFLOAD, "num_gpu_blocks_override": None}, []),
    }
    if only_marked_tests(request):
        engines = {key: engines[key] for key in (*V0_20, "hybrid")}
    spec = {"engines": [
        *({"model": str(model), "kwargs": kwargs, "env": env, "runs": []} for model, kwargs, env in refused.values()),
        *({"model": str(model), "kwargs": kwargs, "runs": runs} for model, kwargs, runs in engines.values()),
    ]}
    reports = run_engine(spec, tmp, timeout=1200)["engines"]
    ran = dict(zip(engines, reports[len(refused):]))
    hybrid = ran.pop("hybrid")
    return {"llama": llama, "prompts": first, "deepseek": deepseek, "mla_prompts": mla_first, **ran, "refused": {**dict(zip(refused, reports)), "hybrid": hybrid}}


@V0_20_FEATURES
def test_without_offload_the_evicted_prompts_are_recomputed(offload):
    assert "error" not in offload["plain"], offload["plain"]["error"]
    *_, again = offload["plain"]["runs"]
    assert again["cached"] == [0] * PROMPTS, "the second prompt set evicted the first from the device"
    assert again["counters"]["vllm:external_prefix_cache_hits"] == 0


@V0_20_FEATURES
def test_offloaded_blocks_are_served_from_host_memory(offload):
    engine = offload["offloaded"]
    assert "error" not in engine, engine["error"]
    first, _, again, *_ = engine["runs"]
    full_blocks = (PROMPT_LENGTH - 1) // BLOCK
    hits = PROMPTS * full_blocks * BLOCK
    assert first["counters"]["vllm:kv_offload_store_bytes"] == PROMPTS * full_blocks * LAYERS * BLOCK_BYTES
    assert again["cached"] == [full_blocks * BLOCK] * PROMPTS
    assert again["counters"]["vllm:external_prefix_cache_hits"] == hits
    assert again["counters"]["vllm:kv_offload_load_bytes"] == hits // BLOCK * LAYERS * BLOCK_BYTES
    oracle = hf_greedy(offload["llama"], offload["prompts"], MAX_TOKENS)
    assert first["tokens"] == oracle
    assert again["tokens"] == offload["plain"]["runs"][2]["tokens"] == oracle


@V0_20_FEATURES
def test_zeroed_host_blocks_change_the_tokens(offload):
    """The negative control: the same host hits, from zeroed host memory, give other tokens."""
    *_, zeroed = offload["offloaded"]["runs"]
    assert zeroed["cached"] == [(PROMPT_LENGTH - 1) // BLOCK * BLOCK] * PROMPTS
    assert zeroed["counters"]["vllm:external_prefix_cache_hits"] == PROMPTS * 2 * BLOCK
    oracle = hf_greedy(offload["llama"], offload["prompts"], MAX_TOKENS)
    assert all(tokens != expected for tokens, expected in zip(zeroed["tokens"], oracle))


@V0_20_FEATURES
def test_mla_blocks_are_served_from_host_memory_plane_by_plane(offload):
    """The MLA engine's third run loads the first set's 8 blocks (latent and rope rows of 2 layers)
    from host memory, and its tokens equal its first run's and HF greedy; with the host's rope rows
    zeroed, the same hits give other tokens for every prompt."""
    engine = offload["mla"]
    assert "error" not in engine, engine["error"]
    first, _, again, _, _, zeroed = engine["runs"]
    hits = PROMPTS * 2 * BLOCK
    assert first["counters"]["vllm:kv_offload_store_bytes"] == PROMPTS * 2 * LAYERS * MLA_BLOCK_BYTES
    assert again["cached"] == zeroed["cached"] == [2 * BLOCK] * PROMPTS
    assert again["counters"]["vllm:external_prefix_cache_hits"] == hits
    assert again["counters"]["vllm:kv_offload_load_bytes"] == PROMPTS * 2 * LAYERS * MLA_BLOCK_BYTES
    oracle = hf_greedy(offload["deepseek"], offload["mla_prompts"], MAX_TOKENS)
    assert first["tokens"] == again["tokens"] == oracle
    assert zeroed["counters"]["vllm:external_prefix_cache_hits"] == hits
    assert all(tokens != expected for tokens, expected in zip(zeroed["tokens"], oracle))


def test_offload_beside_decode_graphs_in_bf16(offload):
    """bf16 decodes on FULL_DECODE_ONLY ACL graphs (emulated): host loads write into the cache the
    graphs address, in place, so the replays read them; the tokens track HF within bf16 rounding."""
    engine = offload["graphed"]
    assert "error" not in engine, engine["error"]
    assert engine["cudagraph_mode"] == "FULL_DECODE_ONLY"
    *_, again = engine["runs"]
    assert again["counters"]["vllm:external_prefix_cache_hits"] == PROMPTS * 2 * BLOCK
    assert again["counters"]["vllm:kv_offload_load_bytes"] == PROMPTS * 2 * LAYERS * BLOCK_BYTES // 2
    assert again["graph_replays"] > 0
    assert_tracks_hf_logits(offload["llama"], offload["prompts"], again["tokens"])


def test_each_tensor_parallel_rank_offloads_its_heads(offload):
    """TP=2 (two worker processes): each rank keeps its KV head of every block in its own host
    memory; the loads of the same 1024 hits add up to the 2 MiB of TP=1, and the tokens equal HF's."""
    engine = offload["tp2"]
    assert "error" not in engine, engine["error"]
    first, _, again = engine["runs"]
    assert first["counters"]["vllm:kv_offload_store_bytes"] == PROMPTS * 2 * LAYERS * BLOCK_BYTES
    assert again["counters"]["vllm:external_prefix_cache_hits"] == PROMPTS * 2 * BLOCK
    assert again["counters"]["vllm:kv_offload_load_bytes"] == PROMPTS * 2 * LAYERS * BLOCK_BYTES
    assert again["tokens"] == hf_greedy(offload["llama"], offload["prompts"], MAX_TOKENS)


@V0_20_FEATURES
@pytest.mark.parametrize(("case", "message"), [
    ("lmcache", "KV offload with --kv-offloading-backend lmcache is not supported on Ascend"),
    ("simple", "KV offload with VLLM_USE_SIMPLE_KV_OFFLOAD=1 is not supported on Ascend"),
    ("cuda_spec", "the offloading spec CPUOffloadingSpec is not supported on Ascend"),
    ("hybrid", "KV offload with 6 KV cache groups (hybrid KV-cache manager) is not supported on Ascend"),
])
def test_unsupported_offload_is_refused_in_one_line(offload, case, message):
    error = offload["refused"][case]["error"]
    assert message in error and "\n" not in error, error


def _worker(blocks_per_chunk: int, num_chunks: int, blocks: int = 4):
    """The NPU offloading worker over one layer's Ascend cache ``[blocks, 2, 128, 2, 64]``, given
    to it as vLLM's connector gives it: ``[blocks, page bytes]`` int8 rows over the same storage."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from ascend_patch.npu.distributed.kv_transfer.offload import NPUOffloadingWorker

    kernels.use("reference")
    cache = torch.zeros(blocks, 2, BLOCK, 2, 64)
    page = cache[0].numel() * cache.element_size()
    rows = torch.tensor([], dtype=torch.int8).set_(cache.untyped_storage(), 0, (blocks, page), (page, 1))
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(rows, page)], [[CanonicalKVCacheRef(0, page)]])
    return cache, caches, NPUOffloadingWorker(caches, blocks_per_chunk, num_chunks, pin_memory=False)


def _handed(caches, block_ids: list[int], group_sizes: list[int], block_indices: list[int]):
    """A transfer's device side as the installed vLLM hands it to the worker: from 0.34 the
    addresses vLLM's own ``resolve_device_pointers`` makes of the block ids, before it the spec."""
    from vllm.v1.kv_offload import base

    spec = base.GPULoadStoreSpec(block_ids, group_sizes, block_indices)
    if not hasattr(base, "DevicePointers"):
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(spec, caches)


def _write(cache, block: int, key, value):
    """Write a block's 128 tokens as attention does: through the kernels' K and V views."""
    key_cache, value_cache = kernel_caches(cache)
    slots = kernel_slots(torch.arange(block * BLOCK, (block + 1) * BLOCK), BLOCK)
    kernels.scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)


@V0_20_FEATURES
def test_a_block_goes_to_host_and_back_with_its_keys_and_values():
    """Device block 2, written through the attention kernels' views, is stored to host chunk 1 and
    loaded into device block 3: block 3 then reads, through the same views, block 2's keys and
    values, and no other block changes. A wrong block mapping (chunk 0) loads other bytes."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    cache, caches, worker = _worker(blocks_per_chunk=1, num_chunks=2)
    generator = torch.Generator().manual_seed(0)
    key, value = (torch.randn(BLOCK, 2, 64, generator=generator) for _ in range(2))
    _write(cache, 2, key, value)
    _write(cache, 1, -key, -value)
    assert worker.submit_store(7, _handed(caches, [2], [1], [0]), CPULoadStoreSpec([1]))
    before = cache.clone()
    assert worker.submit_load(8, CPULoadStoreSpec([1]), _handed(caches, [3], [1], [0]))
    torch.testing.assert_close(cache[3, 0], key, rtol=0, atol=0)
    torch.testing.assert_close(cache[3, 1], value, rtol=0, atol=0)
    torch.testing.assert_close(cache[:3], before[:3], rtol=0, atol=0)
    assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [
        (7, True, 2 * BLOCK * 2 * 64 * 4), (8, True, 2 * BLOCK * 2 * 64 * 4)]
    worker.submit_load(9, CPULoadStoreSpec([0]), _handed(caches, [3], [1], [0]))
    assert not torch.equal(cache[3, 0], key)


@V0_20_FEATURES
def test_an_mla_block_goes_to_host_and_back_with_its_latent_and_rope_rows():
    """An MLA layer's region ``[4, 1, 128, 576]`` as vLLM hands it, read by the MLA kernels as a
    latent plane then a rope plane: block 2, written through the planes by the MLA cache-write
    kernel, goes to host chunk 1 and back into block 3, which then holds block 2's latent and rope
    rows, and no other block changes. vLLM's row of block 2 holds neither (it is latent rows of
    blocks 2 and 3): a worker copying vLLM's rows moves other bytes."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor)
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from ascend_patch.npu.attention.mla import latent_planes
    from ascend_patch.npu.distributed.kv_transfer.offload import NPUOffloadingWorker

    kernels.use("reference")
    blocks = 4
    cache = torch.zeros(blocks, 1, BLOCK, 576)
    page = cache[0].numel() * cache.element_size()
    rows = torch.tensor([], dtype=torch.int8).set_(cache.untyped_storage(), 0, (blocks, page), (page, 1))
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(rows, page)], [[CanonicalKVCacheRef(0, page)]])
    worker = NPUOffloadingWorker(caches, 1, 2, pin_memory=False, mla={cache.data_ptr(): (512, 576)})
    assert worker.planes == ["latent", "rope"]
    latent, rope = latent_planes(cache, 512)
    generator = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(BLOCK, 1, 512, generator=generator), torch.randn(BLOCK, 1, 64, generator=generator)
    for block, sign in ((2, 1), (1, -1)):
        kernels.scatter_pa_kv_cache(sign * kv_c, sign * k_pe, latent, rope,
                                    torch.arange(block * BLOCK, (block + 1) * BLOCK))
    assert worker.submit_store(7, _handed(caches, [2], [1], [0]), CPULoadStoreSpec([1]))
    before = cache.clone()
    assert worker.submit_load(8, CPULoadStoreSpec([1]), _handed(caches, [3], [1], [0]))
    torch.testing.assert_close(latent[3], kv_c, rtol=0, atol=0)
    torch.testing.assert_close(rope[3], k_pe, rtol=0, atol=0)
    for plane, plane_before in zip((latent, rope), latent_planes(before, 512)):
        torch.testing.assert_close(plane[:3], plane_before[:3], rtol=0, atol=0)
    assert [r.transfer_size for r in worker.get_finished()] == [page, page]
    rows_only = NPUOffloadingWorker(caches, 1, 2, pin_memory=False)  # vLLM's rows, not the planes
    rows_only.submit_store(9, _handed(caches, [2], [1], [0]), CPULoadStoreSpec([0]))
    rows_only.submit_load(10, CPULoadStoreSpec([0]), _handed(caches, [0], [1], [0]))
    assert not torch.equal(rope[0], k_pe) and not torch.equal(latent[0], kv_c)


@V0_20_FEATURES
def test_chunks_of_two_blocks_skip_the_blocks_before_the_request_offset():
    """With two blocks per host chunk, a store starting at a request's second block fills the
    second half of its first chunk, as vLLM's CPU worker lays chunks out."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    cache, caches, worker = _worker(blocks_per_chunk=2, num_chunks=3)
    for block in range(4):
        cache[block] = block + 1
    worker.submit_store(1, _handed(caches, [3, 0, 2], [3], [1]), CPULoadStoreSpec([2, 0]))
    (host,) = worker.host_tensors
    as_blocks = host.view(torch.float32).view(6, *cache.shape[1:])
    assert [int(as_blocks[row].flatten()[0]) for row in range(6)] == [1, 3, 0, 0, 0, 4]


@V0_20_FEATURES
def test_an_offloading_connector_named_without_a_spec_gets_the_npu_spec_from_vllms_factory():
    """The platform names the NPU spec in the extra config of an OffloadingConnector (also inside a
    MultiConnector) that names none, and vLLM's own spec factory loads it from there."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from ascend_patch.npu.distributed.kv_transfer import _check_connector
    from ascend_patch.npu.distributed.kv_transfer.offload import NPUOffloadingSpec

    child = {"cpu_bytes_to_use": 1 << 24}
    _check_connector("MultiConnector", None, {"connectors": [
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": child}]})
    assert OffloadingSpecFactory.get_spec_cls(child) is NPUOffloadingSpec
    with pytest.raises(NotImplementedError, match="the offloading spec TieringOffloadingSpec is not supported"):
        _check_connector("OffloadingConnector", None, {"spec_name": "TieringOffloadingSpec"})


@V0_20_FEATURES
def test_an_mla_model_takes_kv_offload_and_no_other_connector():
    """The connectors an MLA model is served with: the OffloadingConnector, alone or in a
    MultiConnector of such; not one beside another connector, nor a deployment's own."""
    from ascend_patch.npu.distributed.kv_transfer import _offloads_only

    offload = {"kv_connector": "OffloadingConnector"}
    assert _offloads_only("OffloadingConnector", None, {})
    assert _offloads_only("MultiConnector", None, {"connectors": [offload]})
    assert not _offloads_only("MultiConnector", None, {"connectors": [
        offload, {"kv_connector": "ExampleConnector"}]})
    assert not _offloads_only("OffloadingConnector", "my.connector", {})
    assert not _offloads_only("ExampleConnector", None, {})
