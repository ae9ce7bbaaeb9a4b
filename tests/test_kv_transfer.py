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


@pytest.mark.parametrize("version, served", [("0.28.0", False), ("0.32.0", False), ("0.33.0", True),
                                              ("0.34.0", True)])
@pytest.mark.parametrize("emulated", [False, True])
def test_mooncake_is_served_with_the_ascend_protocol_or_refused(emulated, version, served):
    """vLLM's MooncakeConnector (0.33 and later), alone or in a MultiConnector, gets the Ascend transport on
    the NPU (tcp emulated) unless one is named; releases whose patch set does not install the
    re-sharding wrapper (patches/v0_29.py) refuse it in one line."""
    from ascend_patch.npu.distributed.kv_transfer import _check_connector
    from tests.helpers.patch_sets import patched_as_on

    extra, named = {}, {"mooncake_protocol": "rdma"}
    multi = {"connectors": [{"kv_connector": "MooncakeConnector"}]}
    with patched_as_on(version):
        if not served:
            with pytest.raises(NotImplementedError, match="the MooncakeConnector KV connector is not supported "
                                                          "on Ascend by ascend-patch: ") as refused:
                _check_connector("MooncakeConnector", None, extra, emulated)
            assert "\n" not in str(refused.value)
            return
        for name, config in (("MooncakeConnector", extra), ("MooncakeConnector", named),
                             ("MultiConnector", multi)):
            _check_connector(name, None, config, emulated)
    protocol = "tcp" if emulated else "ascend"
    assert (extra, named) == ({"mooncake_protocol": protocol}, {"mooncake_protocol": "rdma"})
    assert multi["connectors"][0]["kv_connector_extra_config"] == {"mooncake_protocol": protocol}
