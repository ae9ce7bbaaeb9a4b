"""The seam itself: backend switching, real-path call shapes, the launch counter, lazy import."""

import collections
import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import npu, reference

REPO_ROOT = Path(__file__).resolve().parents[2]


class RecordingTorchNpu(types.ModuleType):
    """Stands in for torch_npu: every attribute is an op that records its call."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.results = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def op(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self.results.get(name)

        return op

    def only_call(self):
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.fixture
def torch_npu(monkeypatch):
    fake = RecordingTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    npu._torch_npu.cache_clear()
    kernels.use("npu")
    yield fake
    npu._torch_npu.cache_clear()


def test_use_rebinds_every_op_and_reports_the_backend():
    assert kernels.active_backend() == "reference"
    assert all(getattr(kernels, name) is getattr(reference, name) for name in kernels.OPS)
    kernels.use("npu")
    assert kernels.active_backend() == "npu"
    assert all(getattr(kernels, name) is getattr(npu, name) for name in kernels.OPS)
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        kernels.use("cuda")


def test_real_path_call_shapes(torch_npu):
    """Each real implementation calls the documented torch_npu op with the documented argument
    names, values and types (schemas: op_plugin/config/op_plugin_functions.yaml and the ATB
    bindings in op_plugin/ops/atb/). Without an NPU, checking the call is the most we can do: the
    stand-in cannot tell whether the op would accept the tensors or compute the right numbers."""
    bf16, int32 = torch.bfloat16, torch.int32
    cache = torch.zeros(4, 128, 2, 64, dtype=bf16)

    key, value = torch.zeros(3, 2, 64, dtype=bf16), torch.zeros(3, 2, 64, dtype=bf16)
    slots = torch.tensor([0, 1, 2], dtype=int32)
    kernels.scatter_pa_kv_cache(key, value, cache, cache, slots)
    name, args, kwargs = torch_npu.only_call()
    assert name == "npu_scatter_pa_kv_cache" and args == ()
    assert kwargs == {"key": key, "value": value, "key_cache": cache, "value_cache": cache,
                      "slot_mapping": slots, "cache_mode": "Norm"}

    torch_npu.calls.clear()
    torch_npu.results["npu_fused_infer_attention_score"] = expected = (object(), object())
    query = torch.zeros(5, 8, 64, dtype=bf16)
    mask = torch.ones(2048, 2048, dtype=torch.int8).triu(1)
    table = torch.zeros(2, 2, dtype=int32)
    paged = cache.view(4, 128, -1)
    result = kernels.fused_infer_attention_score(
        query, paged, paged, atten_mask=mask, block_table=table, actual_seq_lengths=[1, 5],
        actual_seq_lengths_kv=[200, 140], num_heads=8, num_key_value_heads=2, scale=0.125,
        input_layout="TND", block_size=128, sparse_mode=3)
    name, args, kwargs = torch_npu.only_call()
    assert result is expected
    assert name == "npu_fused_infer_attention_score"
    assert args == (query, paged, paged)  # positional-only in the documented prototype
    assert kwargs == {"atten_mask": mask, "block_table": table, "actual_seq_lengths": [1, 5],
                      "actual_seq_lengths_kv": [200, 140], "num_heads": 8,
                      "num_key_value_heads": 2, "scale": 0.125, "input_layout": "TND",
                      "block_size": 128, "sparse_mode": 3}
    lengths = kwargs["actual_seq_lengths"] + kwargs["actual_seq_lengths_kv"]
    assert all(type(n) is int for n in lengths)
    assert kwargs["block_table"].dtype == int32

    torch_npu.calls.clear()
    query, out = torch.zeros(2, 8, 64, dtype=bf16), torch.empty(2, 8, 64, dtype=bf16)
    context_lens = torch.tensor([3, 9], dtype=int32)
    kernels.paged_attention(query, cache, cache, 2, 8, 0.125, table, context_lens, out)
    name, args, kwargs = torch_npu.only_call()
    assert name == "_npu_paged_attention" and args == ()
    assert kwargs == {"query": query, "key_cache": cache, "value_cache": cache,
                      "num_kv_heads": 2, "num_heads": 8, "scale_value": 0.125,
                      "block_table": table, "context_lens": context_lens, "out": out}
    assert kwargs["context_lens"].dtype == int32 and kwargs["context_lens"].device.type == "cpu"

    x, gamma = torch.zeros(3, 64, dtype=bf16), torch.ones(64, dtype=bf16)
    # MoE: npu_moe_finalize_routing's tensors go positionally, as its schema spells the last one
    # "export_for_source_row" (the doc: expert_for_source_row).
    logits = torch.zeros(4, 8)
    ids, counts = torch.zeros(4, 2, dtype=torch.int32), torch.tensor([8, 0], dtype=torch.int64)
    weight, rows, order = torch.zeros(2, 16, 6), torch.zeros(8, 16), torch.arange(8).int()
    for call, expected_call in [
        (lambda: kernels.rms_norm(x, gamma, 1e-5),
         ("npu_rms_norm", (x,), {"gamma": gamma, "epsilon": 1e-5})),
        (lambda: kernels.add_rms_norm(x, x, gamma, 1e-5),
         ("npu_add_rms_norm", (), {"x1": x, "x2": x, "gamma": gamma, "epsilon": 1e-5})),
        (lambda: kernels.swiglu(x),
         ("npu_swiglu", (x,), {"dim": -1})),
        (lambda: kernels.rotary_mul(x[None], x[None], x[None], "interleave"),
         ("npu_rotary_mul", (x[None], x[None], x[None]), {"rotary_mode": "interleave"})),
        (lambda: kernels.moe_gating_top_k_softmax(logits, k=2),
         ("npu_moe_gating_top_k_softmax", (logits,), {"finished": None, "k": 2})),
        (lambda: kernels.moe_gating_top_k(logits, 2, bias=logits[0], k_group=1, group_count=2,
                                              group_select_mode=1, norm_type=1,
                                              routed_scaling_factor=2.5),
         ("npu_moe_gating_top_k", (logits, 2),
          {"bias": logits[0], "input_ids": None, "tid2eid": None, "k_group": 1, "group_count": 2,
           "group_select_mode": 1, "renorm": 0, "norm_type": 1, "out_flag": False,
           "routed_scaling_factor": 2.5, "eps": 1e-20})),
        (lambda: kernels.moe_init_routing_v2(x, ids, active_num=8, expert_num=8,
                                                 expert_tokens_num_type=1,
                                                 expert_tokens_num_flag=True,
                                                 active_expert_range=[0, 8]),
         ("npu_moe_init_routing_v2", (x, ids),
          {"scale": None, "offset": None, "active_num": 8, "expert_capacity": -1, "expert_num": 8,
           "drop_pad_mode": 0, "expert_tokens_num_type": 1, "expert_tokens_num_flag": True,
           "quant_mode": -1, "active_expert_range": [0, 8], "row_idx_type": 0})),
        (lambda: kernels.grouped_matmul([rows], [weight], group_list=counts, split_item=2,
                                            group_type=0, group_list_type=1),
         ("npu_grouped_matmul", ([rows], [weight]),
          {"bias": None, "scale": None, "offset": None, "antiquant_scale": None,
           "antiquant_offset": None, "per_token_scale": None, "group_list": counts,
           "activation_input": None, "activation_quant_scale": None,
           "activation_quant_offset": None, "split_item": 2, "group_type": 0,
           "group_list_type": 1, "act_type": 0, "output_dtype": None, "tuning_config": None})),
        (lambda: kernels.moe_token_unpermute(rows, order, probs=logits[:, :2]),
         ("npu_moe_token_unpermute", (rows, order),
          {"probs": logits[:, :2], "padded_mode": False, "restore_shape": None})),
        (lambda: kernels.moe_finalize_routing(rows, None, None, None, logits[:, :2], order,
                                                  ids, drop_pad_mode=2),
         ("npu_moe_finalize_routing", (rows, None, None, None, logits[:, :2], order, ids),
          {"drop_pad_mode": 2})),
    ]:
        torch_npu.calls.clear()
        call()
        name, args, kwargs = torch_npu.only_call()
        expected_name, expected_args, expected_kwargs = expected_call
        assert name == expected_name
        assert len(args) == len(expected_args) and all(map(same, args, expected_args))
        assert kwargs.keys() == expected_kwargs.keys()
        assert all(same(kwargs[k], v) for k, v in expected_kwargs.items())

    torch_npu.calls.clear()
    logits, p, k = torch.zeros(2, 50), torch.tensor([0.5, 0.9]), torch.tensor([5, 9], dtype=int32)
    kernels.top_k_top_p(logits, p=p, k=k)
    name, args, kwargs = torch_npu.only_call()
    # Positional order is (logits, p, k): p and k go by keyword so they cannot be swapped.
    assert name == "npu_top_k_top_p" and args == (logits,) and kwargs == {"p": p, "k": k}


def test_real_rotary_embedding_call_shapes(torch_npu):
    """Full rotary is one in-place call; partial rotary hands the op the packed rotary lanes with
    head_size=rotary_dim and copies them back, leaving the pass-through lanes alone."""
    positions = torch.arange(3)
    query = torch.zeros(3, 4 * 64, dtype=torch.bfloat16)
    key = torch.zeros(3, 64, dtype=torch.bfloat16)
    cache = torch.rand(16, 64, dtype=torch.bfloat16)
    kernels.rotary_embedding(positions, query, key, 64, cache, True)
    name, args, kwargs = torch_npu.only_call()
    assert name == "_npu_rotary_embedding" and args == ()
    assert kwargs == {"positions": positions, "query": query, "key": key, "head_size": 64,
                      "cos_sin_cache": cache, "is_neox_style": True}

    torch_npu.calls.clear()

    def rotate_in_place(positions, query, key, head_size, cos_sin_cache, is_neox_style):
        torch_npu.calls.append(("_npu_rotary_embedding", (), dict(query=query.clone(),
                                                                 head_size=head_size)))
        query.add_(1)
        key.add_(1)

    torch_npu._npu_rotary_embedding = rotate_in_place
    partial = cache[:, :32].contiguous()
    kernels.rotary_embedding(positions, query, key, 64, partial, False)
    _, _, kwargs = torch_npu.only_call()
    assert kwargs["head_size"] == 32 and kwargs["query"].shape == (3, 4 * 32)
    lanes = query.view(3, 4, 64)
    assert torch.all(lanes[..., :32] == 1) and torch.all(lanes[..., 32:] == 0)
    key_lanes = key.view(3, 1, 64)
    assert torch.all(key_lanes[..., :32] == 1) and torch.all(key_lanes[..., 32:] == 0)


def test_count_launches_counts_per_op_and_restores_the_originals():
    originals = {name: getattr(kernels, name) for name in kernels.OPS}
    x = torch.randn(4, 16)
    with kernels.count_launches() as counts:
        kernels.rms_norm(x, torch.ones(16))
        kernels.rms_norm(x, torch.ones(16))
        kernels.swiglu(x)
        assert kernels.swiglu is not originals["swiglu"]
    assert counts == collections.Counter(rms_norm=2, swiglu=1)
    assert all(getattr(kernels, name) is fn for name, fn in originals.items())

    with pytest.raises(kernels.KernelContractError):
        with kernels.count_launches() as counts:
            kernels.swiglu(torch.zeros(3, 5))
    assert counts == collections.Counter(swiglu=1)
    assert all(getattr(kernels, name) is fn for name, fn in originals.items())


def test_count_launches_on_the_real_path(torch_npu):
    with kernels.count_launches() as counts:
        kernels.swiglu(torch.zeros(2, 8))
        kernels.top_k_top_p(torch.zeros(2, 8), k=torch.ones(2, dtype=torch.int32))
    assert counts == collections.Counter(swiglu=1, top_k_top_p=1)
    assert [name for name, _, _ in torch_npu.calls] == ["npu_swiglu", "npu_top_k_top_p"]


def test_selecting_the_npu_backend_does_not_import_torch_npu():
    code = (
        "import sys\n"
        "import ascend_patch.npu.kernels as kernels\n"
        "kernels.use('npu')\n"
        "assert kernels.active_backend() == 'npu'\n"
        "print('torch_npu' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "False"


def test_probe_without_torch_npu():
    assert npu.probe() == (False, "torch_npu is not installed")


def test_probe_and_device_queries_go_through_torch_npu(torch_npu):
    torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    torch_npu.__version__ = "2.9.0"
    properties = types.SimpleNamespace(uuid="npu-uuid-0", cube_core_num=24)
    torch_npu.npu = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 2,
        get_device_name=lambda index: f"Ascend910B{index}",
        get_device_properties=lambda index: properties,
    )
    assert npu.probe() == (True, "torch_npu 2.9.0 sees 2 NPU(s)")
    assert npu.device_name(0) == "Ascend910B0"
    assert npu.device_uuid(0) == "npu-uuid-0"
    assert npu.num_compute_units(0) == 24
