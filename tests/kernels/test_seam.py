"""The seam itself: backend switching, real-path calls bound against the published op schemas,
the launch counter, lazy import."""

import ast
import collections
import functools
import importlib.machinery
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import reference
from ascend_patch.npu.kernels import npu
from tests import npu_wheels

REPO_ROOT = Path(__file__).resolve().parents[2]

# --- the published schemas ------------------------------------------------------------------------

# The torch_npu op each real-path function calls, by its name on torch_npu. The schemas are the
# wheel's own (tests/npu_wheels.py): the yaml ops' from npu_native_functions_by_codegen.yaml, the
# ATB ops' from libop_plugin_atb.so, of the newest torch-npu the matrix names.
OPS_CALLED = (
    "npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "npu_rms_norm",
    "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_mrope", "npu_top_k_top_p",
    "npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k_softmax_v2", "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul", "npu_moe_token_unpermute", "npu_moe_finalize_routing",
    "npu_dynamic_quant", "npu_quantize", "npu_quant_matmul", "_npu_paged_attention",
    "_npu_paged_attention_get_workspace", "atb.npu_multi_head_latent_attention",
    "npu_fused_infer_attention_score.out", "_npu_fused_infer_attention_score_get_max_workspace",
    "npu_kv_rmsnorm_rope_cache_v2", "npu_interleave_rope",
)
NEWEST = npu_wheels.matrix_versions()[-1]

# How torch_npu binds them (read from the wheel by npu_wheels.stand_in): every op is
# torch.ops.npu.<name> or torch.ops.atb.<name> itself, so a call binds by the schema's own
# argument names: a leading `Tensor self` is `self=`, never torchgen's `input=` (finding 10).
_PYTHON_TYPES = {"Tensor": torch.Tensor, "int": int, "SymInt": int, "float": (int, float),
                 "bool": bool, "str": str}
# An `int` that names a dtype takes a torch.dtype: the torch_npu docs call these ops so, e.g.
# `npu_quant_matmul(..., output_dtype=torch.bfloat16)` and `npu_quantize(x, scale, None,
# torch.qint8, -1, False)` (torch_npu-npu_quant_matmul.md, torch_npu-npu_quantize.md).
_DTYPE_ARGUMENT = re.compile(r"(\w+_)?dtype|dst_type")


def _split_arguments(text: str) -> list[str]:
    """The schema's argument list at its top-level commas (not those inside brackets or quotes)."""
    arguments, current, depth, quote = [], "", 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            arguments.append(current.strip())
            current = ""
            continue
        current += char
    return [argument for argument in (*arguments, current.strip()) if argument]


def parse_schema(schema: str) -> tuple[str, inspect.Signature]:
    """``name(Type arg, *, Type? arg=default) -> returns`` as a Python signature whose annotations
    are the schema types; arguments after ``*`` are keyword-only."""
    name, arguments = re.fullmatch(r"([\w.]+)\((.*)\) -> .+", schema).groups()
    parameters, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for argument in _split_arguments(arguments):
        if argument == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        declaration, has_default, default = argument.partition("=")
        schema_type, arg_name = declaration.rsplit(" ", 1)
        parameters.append(inspect.Parameter(
            arg_name, kind, annotation=schema_type,
            default=ast.literal_eval(default) if has_default else inspect.Parameter.empty))
    return name, inspect.Signature(parameters)


def accepts(schema_type: str, value, name: str = "") -> bool:
    """Whether the binding takes ``value`` for an argument ``name`` of ``schema_type``."""
    base = re.sub(r"\(.*?\)", "", schema_type)  # alias annotations: Tensor(a!) is a Tensor
    if base.endswith("?"):
        if value is None:
            return True
        base = base[:-1]
    if base == "int" and isinstance(value, torch.dtype):
        return bool(_DTYPE_ARGUMENT.fullmatch(name))
    listed = re.fullmatch(r"(.+)\[(\d*)\]", base)  # int[] or a fixed size: int[2]
    if listed:
        item, size = listed.groups()
        return (isinstance(value, (list, tuple)) and all(accepts(item, v) for v in value)
                and (not size or not value or len(value) == int(size)))
    if isinstance(value, bool) and base != "bool":
        return False
    return isinstance(value, _PYTHON_TYPES[base])


@functools.cache
def published() -> dict[str, str]:
    """Each called op's schema text, from the newest wheel."""
    wheel = npu_wheels.load(NEWEST)
    return {op: wheel.atb_schemas[op.removeprefix("atb.")] if op.removeprefix("atb.") in wheel.atb_schemas
            else wheel.schemas[op] for op in OPS_CALLED}


@functools.cache
def signatures() -> dict[str, inspect.Signature]:
    return {op: parse_schema(schema)[1] for op, schema in published().items()}


class PublishedTorchNpu(types.ModuleType):
    """Stands in for torch_npu with exactly the ops whose published schema is above. A call binds
    as the real binding does (argument names, positional vs keyword-only, required arguments,
    argument types) or raises, and is recorded as its bound arguments by schema name. Each op
    carries its schema as ``op.default._schema``, as a torch.ops packet does."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.results = {}

    def __getattr__(self, name):
        if name == "atb":  # the torch_npu.atb module of ATB ops
            return types.SimpleNamespace(**{op.partition(".")[2]: self._op(op)
                                            for op in signatures() if op.startswith("atb.")})
        return self._op(name)

    def _op(self, name):
        if name not in signatures():
            raise AttributeError(f"torch_npu has no published schema for {name!r} here")
        signature = signatures()[name]

        def op(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            for arg, value in arguments.items():
                schema_type = signature.parameters[arg].annotation
                if not accepts(schema_type, value, arg):
                    raise TypeError(f"{name}(): argument '{arg}' must be {schema_type}, "
                                    f"not {type(value).__name__}")
            self.calls.append((name, arguments))
            return self.results.get(name)

        op.default = types.SimpleNamespace(_schema=torch._C.parse_schema(published()[name]))
        for overload in signatures():  # torch_npu.<op>.out: an overload of the same packet
            if overload.startswith(f"{name}."):
                setattr(op, overload.rpartition(".")[2], self._op(overload))
        return op

    def only_call(self, name):
        """The one recorded call, which must be of ``name``; clears the record."""
        (called, arguments), = self.calls
        assert called == name
        self.calls.clear()
        return arguments


def assert_arguments(arguments, expected):
    """Every argument the call passed, by schema name: tensors the very objects, the rest equal
    and of the same type."""
    assert arguments.keys() == expected.keys()
    for arg, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert arguments[arg] is value, arg
        else:
            assert type(arguments[arg]) is type(value) and arguments[arg] == value, arg


@pytest.fixture
def torch_npu(monkeypatch):
    fake = PublishedTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    kernels.use("npu")
    yield fake


def test_schemas_parse_into_the_bindings_signatures():
    assert str(signatures()["npu_swiglu"]) == "(self: 'Tensor', dim: 'int' = -1)"
    scatter = signatures()["npu_scatter_pa_kv_cache"].parameters
    assert [p.name for p in scatter.values() if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "key", "value", "key_cache", "value_cache", "slot_mapping"]
    assert scatter["cache_mode"].kind is inspect.Parameter.KEYWORD_ONLY
    assert (scatter["cache_mode"].annotation, scatter["cache_mode"].default) == ("str?", "PA_NZ")
    paged = signatures()["_npu_paged_attention"].parameters
    assert paged["out"].annotation == "Tensor(a!)" and paged["out"].default is inspect.Parameter.empty
    assert paged["workspace"].kind is inspect.Parameter.KEYWORD_ONLY
    assert signatures()["npu_fused_infer_attention_score"].parameters["input_layout"].default == "BSH"


X, GAMMA = torch.zeros(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
SLOTS = torch.tensor([0, 1, 2], dtype=torch.int32)


@pytest.mark.parametrize("call, error", [
    (lambda t: t.npu_rms_norm(input=X, gamma=GAMMA), "missing a required argument: 'self'"),
    (lambda t: t.npu_scatter_pa_kv_cache(X, X, X, X, SLOTS, "Norm"), "too many positional"),
    (lambda t: t.npu_scatter_pa_kv_cache(X, X, X, X, SLOTS, block_size=128),
     "unexpected keyword argument 'block_size'"),
    (lambda t: t.npu_top_k_top_p(X, 0.9), "argument 'p' must be Tensor?, not float"),
    (lambda t: t.npu_swiglu(X, dim=True), "argument 'dim' must be int, not bool"),
    (lambda t: t.npu_swiglu(X, dim=torch.int8), "argument 'dim' must be int, not dtype"),
    (lambda t: t.npu_fused_infer_attention_score(X, X, X, actual_seq_lengths=SLOTS),
     "argument 'actual_seq_lengths' must be SymInt[]?, not Tensor"),
    (lambda t: t._npu_paged_attention(X, X, X, 2, 8, 0.125, X, SLOTS), "missing a required "
     "argument: 'out'"),
    (lambda t: t._npu_rotary_embedding(X, X, X, 64, X, True), "no published schema"),
    (lambda t: t.atb.npu_multi_head_latent_attention(X, X, X, X, SLOTS, SLOTS, 8, 0.1, 1),
     "argument 'context_lens' must be SymInt[], not Tensor"),
])
def test_a_call_the_real_binding_rejects_fails(call, error):
    fake = PublishedTorchNpu()
    with pytest.raises((TypeError, AttributeError), match=re.escape(error)):
        call(fake)
    assert fake.calls == []


def test_use_rebinds_every_op_and_reports_the_backend():
    assert kernels.active_backend() == "reference"
    assert all(inspect.unwrap(getattr(kernels, name)) is getattr(reference, name)
               for name in kernels.OPS)
    kernels.use("npu")
    assert kernels.active_backend() == "npu"
    assert all(getattr(kernels, name) is getattr(npu, name) for name in kernels.OPS)
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        kernels.use("cuda")


def test_real_path_calls_bind_to_the_published_schemas(torch_npu):
    """Each real implementation calls its torch_npu op in a way the op's published schema binds,
    with our values in the arguments the op documents for them. Without an NPU this is the most
    we can check: the stand-in cannot tell whether the op would accept the tensors or compute the
    right numbers (the reference kernels check that)."""
    bf16, int32 = torch.bfloat16, torch.int32
    cache = torch.zeros(4, 128, 2, 64, dtype=bf16)

    key, value = torch.zeros(3, 2, 64, dtype=bf16), torch.zeros(3, 2, 64, dtype=bf16)
    kernels.scatter_pa_kv_cache(key, value, cache, cache, SLOTS)
    # cache_mode "Norm": vLLM's ND caches (the schema's default "PA_NZ" is the NZ layout).
    assert_arguments(torch_npu.only_call("npu_scatter_pa_kv_cache"), {
        "key": key, "value": value, "key_cache": cache, "value_cache": cache,
        "slot_mapping": SLOTS, "cache_mode": "Norm"})

    torch_npu.results["npu_fused_infer_attention_score"] = expected = (object(), object())
    query = torch.zeros(5, 8, 64, dtype=bf16)
    mask = torch.ones(2048, 2048, dtype=torch.int8).triu(1)
    table = torch.zeros(2, 2, dtype=int32)
    paged = cache.view(4, 128, -1)
    result = kernels.fused_infer_attention_score(
        query, paged, paged, atten_mask=mask, block_table=table, actual_seq_lengths=[1, 5],
        actual_seq_lengths_kv=[200, 140], num_heads=8, num_key_value_heads=2, scale=0.125,
        input_layout="TND", block_size=128, sparse_mode=3)
    assert result is expected
    assert_arguments(torch_npu.only_call("npu_fused_infer_attention_score"), {
        "query": query, "key": paged, "value": paged, "atten_mask": mask, "block_table": table,
        "actual_seq_lengths": [1, 5], "actual_seq_lengths_kv": [200, 140], "num_heads": 8,
        "num_key_value_heads": 2, "scale": 0.125, "pre_tokens": 2147483647,
        "next_tokens": 2147483647, "input_layout": "TND", "block_size": 128, "sparse_mode": 3})
    # The sliding-window band of prefill and mixed batches.
    kernels.fused_infer_attention_score(
        query, paged, paged, atten_mask=mask, block_table=table, actual_seq_lengths=[1, 5],
        actual_seq_lengths_kv=[200, 140], num_heads=8, num_key_value_heads=2, scale=0.125,
        pre_tokens=99, next_tokens=0, input_layout="TND", block_size=128, sparse_mode=4)
    assert_arguments(torch_npu.only_call("npu_fused_infer_attention_score"), {
        "query": query, "key": paged, "value": paged, "atten_mask": mask, "block_table": table,
        "actual_seq_lengths": [1, 5], "actual_seq_lengths_kv": [200, 140], "num_heads": 8,
        "num_key_value_heads": 2, "scale": 0.125, "pre_tokens": 99, "next_tokens": 0,
        "input_layout": "TND", "block_size": 128, "sparse_mode": 4})
    # The windowed decode: one-token BSH queries with a (B, KV_S) mask.
    decode_query, window = torch.zeros(2, 1, 512, dtype=bf16), torch.zeros(2, 256, dtype=torch.bool)
    kernels.fused_infer_attention_score(
        decode_query, paged, paged, atten_mask=window, block_table=table,
        actual_seq_lengths_kv=[200, 140], num_heads=8, num_key_value_heads=2, scale=0.125,
        input_layout="BSH", block_size=128)
    assert_arguments(torch_npu.only_call("npu_fused_infer_attention_score"), {
        "query": decode_query, "key": paged, "value": paged, "atten_mask": window,
        "block_table": table, "actual_seq_lengths": None, "actual_seq_lengths_kv": [200, 140],
        "num_heads": 8, "num_key_value_heads": 2, "scale": 0.125, "pre_tokens": 2147483647,
        "next_tokens": 2147483647, "input_layout": "BSH", "block_size": 128, "sparse_mode": 0})

    query, out = torch.zeros(2, 8, 64, dtype=bf16), torch.empty(2, 8, 64, dtype=bf16)
    context_lens = torch.tensor([3, 9], dtype=int32)
    kernels.paged_attention(query, cache, cache, 2, 8, 0.125, table, context_lens, out)
    paged_arguments = {
        "query": query, "key_cache": cache, "value_cache": cache, "num_kv_heads": 2,
        "num_heads": 8, "scale_value": 0.125, "block_table": table, "context_lens": context_lens,
        "out": out}
    assert_arguments(torch_npu.only_call("_npu_paged_attention"), {**paged_arguments, "workspace": None})
    # A captured launch is given its workspace (ACL graphs: the buffer's address is fixed).
    torch_npu.results["_npu_paged_attention_get_workspace"] = workspace = torch.empty(64, dtype=torch.uint8)
    assert kernels.paged_attention_workspace(query, cache, cache, 2, 8, 0.125, table, context_lens,
                                             out) is workspace
    assert_arguments(torch_npu.only_call("_npu_paged_attention_get_workspace"), paged_arguments)
    kernels.paged_attention(query, cache, cache, 2, 8, 0.125, table, context_lens, out, workspace=workspace)
    assert_arguments(torch_npu.only_call("_npu_paged_attention"), {**paged_arguments, "workspace": workspace})

    kernels.rms_norm(X, GAMMA, 1e-5)
    assert_arguments(torch_npu.only_call("npu_rms_norm"),
                     {"self": X, "gamma": GAMMA, "epsilon": 1e-5})
    kernels.add_rms_norm(X, X, GAMMA, 1e-5)
    assert_arguments(torch_npu.only_call("npu_add_rms_norm"),
                     {"x1": X, "x2": X, "gamma": GAMMA, "epsilon": 1e-5})
    kernels.swiglu(X)
    assert_arguments(torch_npu.only_call("npu_swiglu"), {"self": X, "dim": -1})
    x, cos, sin = X[None], X[None] / 2, X[None] / 3
    kernels.rotary_mul(x, cos, sin, "interleave")
    assert_arguments(torch_npu.only_call("npu_rotary_mul"),
                     {"self": x, "r1": cos, "r2": sin, "rotary_mode": "interleave"})
    # MLA: the _v2 cache write (its schema marks both caches mutated), paged mode, one batch.
    kv, rope = torch.zeros(1, 1, 3, 576, dtype=bf16), torch.zeros(1, 1, 3, 64, dtype=bf16)
    gamma, slots = torch.ones(512, dtype=bf16), torch.arange(3)
    k_cache, ckv_cache = torch.zeros(4, 128, 1, 64, dtype=bf16), torch.zeros(4, 128, 1, 512, dtype=bf16)
    kernels.kv_rmsnorm_rope_cache(kv, gamma, rope, rope, slots, k_cache, ckv_cache, epsilon=1e-6,
                                  cache_mode="PA")
    assert_arguments(torch_npu.only_call("npu_kv_rmsnorm_rope_cache_v2"), {
        "kv": kv, "gamma": gamma, "cos": rope, "sin": rope, "index": slots, "k_cache": k_cache,
        "ckv_cache": ckv_cache, "epsilon": 1e-6, "cache_mode": "PA", "is_output_kv": False})
    kernels.interleave_rope(x, cos, sin)
    assert_arguments(torch_npu.only_call("npu_interleave_rope"), {"x": x, "cos": cos, "sin": sin})
    positions = torch.zeros(4, dtype=torch.int64)
    kernels.mrope(positions, X, X, X, 64, "interleave")
    assert_arguments(torch_npu.only_call("npu_mrope"), {  # the RoPE mode over vLLM's cos|sin cache
        "positions": positions, "query": X, "key": X, "cos_sin_cache": X, "head_size": 64,
        "mrope_section": [0, 0, 0], "rotary_mode": "interleave", "cache_mode": "default"})
    positions = torch.zeros(3, 4, dtype=torch.int64)
    kernels.mrope(positions, X, X, X, 128, "half", (16, 24, 24))
    assert_arguments(torch_npu.only_call("npu_mrope"), {  # the mrope mode of vLLM's M-RoPE
        "positions": positions, "query": X, "key": X, "cos_sin_cache": X, "head_size": 128,
        "mrope_section": [16, 24, 24], "rotary_mode": "half", "cache_mode": "default"})

    # MoE: npu_moe_finalize_routing's tensors go positionally, as its schema spells the last one
    # "export_for_source_row" (the doc: expert_for_source_row).
    logits = torch.zeros(4, 8)
    ids, counts = torch.zeros(4, 2, dtype=int32), torch.tensor([8, 0], dtype=torch.int64)
    weight, rows, order = torch.zeros(2, 16, 6), torch.zeros(8, 16), torch.arange(8).int()
    kernels.moe_gating_top_k_softmax(logits, k=2)
    assert_arguments(torch_npu.only_call("npu_moe_gating_top_k_softmax"),
                     {"x": logits, "finished": None, "k": 2})
    kernels.moe_gating_top_k_softmax_v2(logits, k=2, renorm=1)
    assert_arguments(torch_npu.only_call("npu_moe_gating_top_k_softmax_v2"),
                     {"x": logits, "k": 2, "finished": None, "renorm": 1, "output_softmax": False})
    bias = logits[0]
    kernels.moe_gating_top_k(logits, 2, bias=bias, k_group=1, group_count=2,
                             group_select_mode=1, norm_type=1, routed_scaling_factor=2.5)
    assert_arguments(torch_npu.only_call("npu_moe_gating_top_k"), {
        "x": logits, "k": 2, "bias": bias, "input_ids": None, "tid2eid": None, "k_group": 1,
        "group_count": 2, "group_select_mode": 1, "renorm": 0, "norm_type": 1, "out_flag": False,
        "routed_scaling_factor": 2.5, "eps": 1e-20})
    kernels.moe_init_routing_v2(X, ids, active_num=8, expert_num=8, expert_tokens_num_type=1,
                                expert_tokens_num_flag=True, active_expert_range=[0, 8])
    assert_arguments(torch_npu.only_call("npu_moe_init_routing_v2"), {
        "x": X, "expert_idx": ids, "scale": None, "offset": None, "active_num": 8,
        "expert_capacity": -1, "expert_num": 8, "drop_pad_mode": 0, "expert_tokens_num_type": 1,
        "expert_tokens_num_flag": True, "quant_mode": -1, "active_expert_range": [0, 8],
        "row_idx_type": 0})
    kernels.grouped_matmul([rows], [weight], group_list=counts, split_item=2, group_type=0,
                           group_list_type=1)
    call = torch_npu.only_call("npu_grouped_matmul")
    assert call["x"][0] is rows and call["weight"][0] is weight
    assert_arguments({k: v for k, v in call.items() if k not in ("x", "weight")}, {
        "bias": None, "scale": None, "offset": None, "antiquant_scale": None,
        "antiquant_offset": None, "per_token_scale": None, "group_list": counts,
        "activation_input": None, "activation_quant_scale": None, "activation_quant_offset": None,
        "split_item": 2, "group_type": 0, "group_list_type": 1, "act_type": 0,
        "output_dtype": None, "tuning_config": None})
    probs = logits[:, :2]
    kernels.moe_token_unpermute(rows, order, probs=probs)
    assert_arguments(torch_npu.only_call("npu_moe_token_unpermute"), {
        "permuted_tokens": rows, "sorted_indices": order, "probs": probs, "padded_mode": False,
        "restore_shape": None})
    kernels.moe_finalize_routing(rows, None, None, None, probs, order, ids, drop_pad_mode=2)
    assert_arguments(torch_npu.only_call("npu_moe_finalize_routing"), {
        "expanded_permuted_rows": rows, "skip1": None, "skip2": None, "bias": None,
        "scales": probs, "expanded_src_to_dst_row": order, "export_for_source_row": ids,
        "drop_pad_mode": 2})

    # The W8A8 ops: dtypes go as torch dtypes (the docs' own calls), tensors as the doc names.
    x, x_q, token_scale = X, torch.zeros(3, 64, dtype=torch.int8), torch.ones(3)
    kernels.dynamic_quant(x)
    assert_arguments(torch_npu.only_call("npu_dynamic_quant"), {
        "input": x, "smooth_scales": None, "group_index": None, "dst_type": None})
    scales, offsets = torch.ones(1, dtype=bf16), torch.zeros(1, dtype=bf16)
    kernels.quantize(x, scales, offsets, torch.qint8, axis=-1, div_mode=False)
    assert_arguments(torch_npu.only_call("npu_quantize"), {
        "self": x, "scales": scales, "zero_points": offsets, "dtype": torch.qint8, "axis": -1,
        "div_mode": False})
    weight, channel_scale = torch.zeros(64, 32, dtype=torch.int8), torch.ones(32)
    bias32 = torch.zeros(32, dtype=int32)
    kernels.quant_matmul(x_q, weight, channel_scale, pertoken_scale=token_scale, bias=bias32,
                         output_dtype=bf16)
    assert_arguments(torch_npu.only_call("npu_quant_matmul"), {
        "x1": x_q, "x2": weight, "scale": channel_scale, "offset": None,
        "pertoken_scale": token_scale, "bias": bias32, "output_dtype": bf16,
        "group_sizes": None})
    experts_int8 = torch.zeros(2, 16, 6, dtype=torch.int8)
    expert_scale, row_scale = torch.ones(2, 6, dtype=bf16), torch.ones(8)
    kernels.grouped_matmul([rows.to(torch.int8)], [experts_int8], scale=[expert_scale],
                           per_token_scale=[row_scale], group_list=counts, split_item=2,
                           group_type=0, group_list_type=1, output_dtype=bf16)
    call = torch_npu.only_call("npu_grouped_matmul")
    assert call["scale"][0] is expert_scale and call["per_token_scale"][0] is row_scale
    assert call["output_dtype"] is bf16

    logits, p, k = torch.zeros(2, 50), torch.tensor([0.5, 0.9]), torch.tensor([5, 9], dtype=int32)
    kernels.top_k_top_p(logits, p=p, k=k)
    assert_arguments(torch_npu.only_call("npu_top_k_top_p"), {"logits": logits, "p": p, "k": k})

    # MLA: the fused-attention op in the prefill's TND form (no rope inputs, Q/K 192, V 128,
    # softmax_lse when the context is chunked), and the ATB decode over the latent planes.
    q, k, v = (torch.zeros(5, 8, 192, dtype=bf16), torch.zeros(9, 8, 192, dtype=bf16),
               torch.zeros(9, 8, 128, dtype=bf16))
    torch_npu.results["npu_fused_infer_attention_score"] = expected
    result = kernels.fused_infer_attention_score_mla(
        q, k, v, atten_mask=mask, actual_seq_lengths=[1, 5], actual_seq_lengths_kv=[2, 9],
        num_heads=8, num_key_value_heads=8, scale=0.07, input_layout="TND", sparse_mode=3,
        softmax_lse_flag=True)
    assert result is expected
    assert_arguments(torch_npu.only_call("npu_fused_infer_attention_score"), {
        "query": q, "key": k, "value": v, "query_rope": None, "key_rope": None,
        "atten_mask": mask, "actual_seq_lengths": [1, 5], "actual_seq_lengths_kv": [2, 9],
        "num_heads": 8, "num_key_value_heads": 8, "scale": 0.07, "input_layout": "TND",
        "sparse_mode": 3, "softmax_lse_flag": True})
    latent, rope = torch.zeros(4, 128, 512, dtype=bf16), torch.zeros(4, 128, 64, dtype=bf16)
    q_nope, q_rope = torch.zeros(5, 8, 512, dtype=bf16), torch.zeros(5, 8, 64, dtype=bf16)
    ctkv, k_rope = latent.view(4, 128, 1, 512), rope.view(4, 128, 1, 64)
    kernels.multi_head_latent_attention(q_nope, q_rope, ctkv, k_rope, table, [200, 140], 8, 0.04, 1)
    assert_arguments(torch_npu.only_call("atb.npu_multi_head_latent_attention"), {
        "q_nope": q_nope, "q_rope": q_rope, "ctkv": ctkv, "k_rope": k_rope,
        "block_tables": table, "context_lens": [200, 140], "q_headnum": 8, "qk_scale": 0.04,
        "kv_headnum": 1})
    # Graph decodes: the .out forms (outputs by the schema's names, a workspace sized beforehand)
    # and the workspace query, for MLA (rope branch, BNSD) and for windowed GQA layers (BSH, mask).
    q, q_pe = torch.zeros(2, 32, 1, 512, dtype=bf16), torch.zeros(2, 32, 1, 64, dtype=bf16)
    out, lse, workspace = torch.zeros_like(q), torch.zeros(0), torch.zeros(0, dtype=torch.uint8)
    mla = {"query_rope": q_pe, "key_rope": rope, "block_table": table,
           "actual_seq_lengths_kv": [200, 140], "num_heads": 32, "num_key_value_heads": 1,
           "scale": 0.04, "input_layout": "BNSD", "block_size": 128}
    _assert_out_form_and_workspace(torch_npu, "fused_infer_attention_score_mla_decode", q, latent,
                                   mla, out, lse, workspace, atten_mask=None, sparse_mode=0)
    # MTP's verification rows on the same form: S = 1 + k queries, causal.
    q, q_pe = torch.zeros(2, 32, 3, 512, dtype=bf16), torch.zeros(2, 32, 3, 64, dtype=bf16)
    causal = {**mla, "query_rope": q_pe, "atten_mask": torch.zeros(2048, 2048, dtype=torch.int8),
              "sparse_mode": 3}
    _assert_out_form_and_workspace(torch_npu, "fused_infer_attention_score_mla_decode", q, latent,
                                   causal, torch.zeros_like(q), lse, workspace)
    query, window = torch.zeros(2, 1, 512, dtype=bf16), torch.zeros(2, 256, dtype=torch.bool)
    gqa = {"atten_mask": window, "block_table": table, "actual_seq_lengths_kv": [200, 140],
           "num_heads": 8, "num_key_value_heads": 2, "scale": 0.125, "block_size": 128}
    _assert_out_form_and_workspace(torch_npu, "fused_infer_attention_score_decode", query, paged,
                                   gqa, torch.zeros_like(query), lse, workspace,
                                   input_layout="BSH")
    # Verification rows (TND, host query ends and KV lengths), in a windowed layer: the band.
    rows = torch.zeros(8, 8, 64, dtype=bf16)
    verify = {"atten_mask": torch.zeros(2048, 2048, dtype=torch.int8), "block_table": table,
              "actual_seq_lengths": [4, 8], "actual_seq_lengths_kv": [200, 140], "num_heads": 8,
              "num_key_value_heads": 2, "scale": 0.125, "block_size": 128, "sparse_mode": 4,
              "pre_tokens": 99, "next_tokens": 0}
    _assert_out_form_and_workspace(torch_npu, "fused_infer_attention_score_verify", rows, paged,
                                   verify, torch.zeros_like(rows), lse, workspace,
                                   input_layout="TND")


def _assert_out_form_and_workspace(torch_npu, op, query, cache, call, out, lse, workspace,
                                   **fixed):
    """The seam's ``op`` reaches ``npu_fused_infer_attention_score.out`` and its ``op +
    "_workspace"`` twin the workspace query, each with ``call``, the seam's ``fixed`` arguments and
    (the .out form) its outputs by the schema's names."""
    getattr(kernels, op)(query, cache, cache, **call, attention_out=out, softmax_lse=lse,
                         workspace=workspace)
    assert_arguments(torch_npu.only_call("npu_fused_infer_attention_score.out"), {
        "query": query, "key": cache, "value": cache, **call, **fixed, "workspace": workspace,
        "attention_out": out, "softmax_lse": lse})
    getattr(kernels, f"{op}_workspace")(query, cache, cache, **call)
    assert_arguments(torch_npu.only_call("_npu_fused_infer_attention_score_get_max_workspace"),
                     {"query": query, "key": cache, "value": cache, **call, **fixed})


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


def test_record_calls_keeps_each_distinct_call_with_its_result_and_restores_the_originals():
    originals = {name: getattr(kernels, name) for name in kernels.OPS}
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with kernels.record_calls() as records:
        kernels.swiglu(x)
        kernels.swiglu(torch.randn(4, 16, dtype=torch.bfloat16))
        kernels.rms_norm(x[:, :8].t(), torch.ones(4, dtype=torch.bfloat16), epsilon=1e-5)
    assert all(getattr(kernels, name) is fn for name, fn in originals.items())
    swiglu, rms_norm = records.values()
    assert swiglu == {"op": "swiglu", "count": 2, "kwargs": {},
                      "args": {"tuple": [{"tensor": {
                          "shape": [4, 16], "stride": [16, 1], "offset": 0, "dtype": "bfloat16",
                          "device": "cpu", "contiguous": True}}]},
                      "out": {"tensor": {"shape": [4, 8], "stride": [8, 1], "offset": 0,
                                         "dtype": "bfloat16", "device": "cpu", "contiguous": True}}}
    view = rms_norm["args"]["tuple"][0]["tensor"]
    assert (view["shape"], view["stride"], view["contiguous"]) == ([8, 4], [1, 16], False)
    assert rms_norm["kwargs"] == {"epsilon": 1e-5}
    assert [t["tensor"]["dtype"] for t in rms_norm["out"]["tuple"]] == ["bfloat16", "float32"]


def test_count_launches_on_the_real_path(torch_npu):
    with kernels.count_launches() as counts:
        kernels.swiglu(torch.zeros(2, 8))
        kernels.top_k_top_p(torch.zeros(2, 8), k=torch.ones(2, dtype=torch.int32))
    assert counts == collections.Counter(swiglu=1, top_k_top_p=1)
    assert [name for name, _ in torch_npu.calls] == ["npu_swiglu", "npu_top_k_top_p"]


def test_the_seam_fails_closed_until_a_backend_is_chosen():
    """A fresh interpreter (as a process vLLM spawns before its platform resolves): no op runs
    until a backend is chosen, so a reference kernel never silently computes on device tensors."""
    code = (
        "import torch\n"
        "import ascend_patch.npu.kernels as kernels\n"
        "assert kernels.active_backend() is None\n"
        "for name in kernels.OPS:\n"
        "    try:\n"
        "        getattr(kernels, name)(torch.zeros(2, 8))\n"
        "    except kernels.KernelBackendError as exc:\n"
        "        assert f'kernels.{name} was called before a kernel backend was chosen' in str(exc)\n"
        "    else:\n"
        "        raise AssertionError(name + ' ran without a backend')\n"
        "kernels.use('reference')\n"
        "print(kernels.swiglu(torch.zeros(2, 8)).shape)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch.Size([2, 4])"


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


def test_the_real_block_copy_is_aten_and_copies_what_the_reference_copies():
    """swap_blocks' real path calls no torch_npu op (torch_npu has no batched block copy): the same
    gather, copy and scatter run on host tensors, into the same bytes as the reference."""
    src = torch.randn(6, 2, 16, 64, generator=torch.Generator().manual_seed(0))
    mapping = torch.tensor([[5, 0], [1, 2], [4, 3]])
    copies = {}
    for backend in ("reference", "npu"):
        kernels.use(backend)
        copies[backend] = torch.zeros(4, 2, 16, 64)
        kernels.swap_blocks(src, copies[backend], mapping)
    torch.testing.assert_close(copies["npu"], copies["reference"], rtol=0, atol=0)
    assert torch.equal(copies["npu"][3], src[4]) and not copies["npu"][1].any()


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
