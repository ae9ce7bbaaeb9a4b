"""The NPU path against the real torch-npu wheels (tests/npu_wheels.py): every call the emulated
engine makes through the kernel seam, replayed through ``ascend_patch/npu/kernels/npu.py`` into a
stand-in torch_npu whose ops are the wheel's own schemas and meta kernels, must bind on every
torch-npu release the matrix names and return the shapes and dtypes the reference returned.

The calls are recorded (``kernels.record_calls``) from one engine-driver process running a compact
workload per family: dense with prefix caching, chunked prefill and decode graphs (bf16 and fp16),
the sampler's top-k/top-p, sliding-window attention, a head size npu_mrope does not take
(npu_rotary_mul), MLA, MoE (softmax and grouped biased routing), W8A8 (static, dynamic and MoE),
an encoder-only embedder (npu_fusion_attention) and LoRA in fp16 (npu_batch_gather_matmul_). The
replay runs on meta tensors: binding is the real dispatcher's, the shapes and dtypes the wheel's
meta kernels'. Ops the wheel has no meta kernel for (the ATB paged attention) are checked for
binding only.

The tests after the replay check, per release, what the wheels settle about single ops: binding
by the schema's own names, the release-dependent npu_moe_gating_top_k, the traced top-p-only
call, and the reference contracts against the meta kernels and the wheels' own docs.
"""

from __future__ import annotations

import re
from importlib.metadata import version as installed_version

import pytest
import torch
from packaging.version import Version

from ascend_patch.kit import pooling, tiny_adapters, tiny_encoders
from ascend_patch.kit import quantized_models as quantize
from ascend_patch.kit.oracle import prompt_token_ids
from ascend_patch.npu import kernels
from ascend_patch.npu.attention.encoder import AscendEncoderMetadata, AscendEncoderOnlyImpl
from ascend_patch.npu.kernels import reference
from ascend_patch.npu.kernels import npu
from ascend_patch.overlay import matrix
from tests import npu_wheels
from tests.helpers.engine import MODELS_DIR, run_engine

VERSIONS = npu_wheels.matrix_versions()

PROMPT_LENGTHS = [3, 17, 150]
MAX_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# The sampler's three calls, each a run of its own (a batch mixing them makes one call of both):
# top-k and top-p, top-p alone, top-k alone.
SAMPLED = [{"temperature": 0.8, "max_tokens": MAX_TOKENS, "seed": 1, **filters}
           for filters in ({"top_k": 5, "top_p": 0.9}, {"top_p": 0.9}, {"top_k": 5})]
# 64-token chunks: the 150-token prompt prefills in three steps beside the others' decodes; the
# second run is served from the prefix cache.
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "gpu_memory_utilization": 0.9,
          "enable_prefix_caching": True, "enable_chunked_prefill": True,
          "max_num_batched_tokens": 64}
# family -> (model, dtype, extra engine arguments, samplings of the runs after the first)
FAMILIES = {
    "dense": ("tiny-llama", "bfloat16", {}, [GREEDY, *SAMPLED]),
    # n-gram drafts: FULL graphs capture verification rows on the TND FIA .out form.
    "dense fp16": ("tiny-qwen2", "float16", {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}}, [GREEDY]),
    "windowed": ("tiny-mistral", "bfloat16", {}, [GREEDY]),
    # Head size 80, no multiple of 32: query and key rotate on npu_rotary_mul, not npu_mrope.
    "head size 80": ("tiny-llama-hd80", "bfloat16", {}, []),
    "mla": ("tiny-deepseek-v3", "bfloat16", {}, [GREEDY]),  # FULL graphs: FIA's MLA decode form
    "mla eager": ("tiny-deepseek-v3", "bfloat16", {"enforce_eager": True}, []),  # ATB MLA decode
    "moe grouped": ("tiny-deepseek-v3-moe", "bfloat16", {}, [GREEDY]),
    "moe softmax": ("tiny-qwen3-moe", "bfloat16", {}, [GREEDY]),
    # Qwen3-MoE renormalises (npu_moe_gating_top_k_softmax_v2), Qwen2-MoE does not (the v1 op);
    # fp16 combines on npu_moe_finalize_routing.
    "moe fp16": ("tiny-qwen2-moe", "float16", {}, []),
    "w8a8": ("w8a8", "bfloat16", {"quantization": "ascend"}, [GREEDY]),
    "w8a8 moe": ("w8a8-moe", "bfloat16", {}, [GREEDY]),
}
# Recurrent layers are served on vLLM 0.33 and later: Qwen3-Next's gated-DeltaNet decode in bf16
# takes npu_recurrent_gated_delta_rule (no prefix caching of its states).
RECURRENT_SERVED = Version(installed_version("vllm")).release >= (0, 33)
RECURRENT_TORCH_NPU = {entry.torch_npu for entry in matrix.load().versions.values()
                       if Version(entry.vllm).release >= (0, 33)}
if RECURRENT_SERVED:
    FAMILIES["gated deltanet"] = ("tiny-qwen3-next", "bfloat16", {"enable_prefix_caching": False}, [])
# LoRA, fp16: two adapters and the base model in one batch; the merged QKV and gate/up slices
# take npu_batch_gather_matmul_ (rank 16 stacked).
LORA = ("tiny-llama", {**ENGINE, "dtype": "float16", "enable_lora": True, "max_loras": 2,
                       "max_lora_rank": 16}, ("tiny-llama-lora-a", None, "tiny-llama-lora-b"))
# Encoder-only attention: a batch of three sequences in one step, bf16.
ENCODER = ("tiny-xlm-roberta", {"runner": "pooling", "dtype": "bfloat16", "max_model_len": 256,
                                "max_num_seqs": 4, "gpu_memory_utilization": 0.9})


def _checkpoints(tiny_models, root):
    qwen2 = tiny_models["tiny-qwen2"]
    # Static W8A8 attention (npu_quantize before the matmul), dynamic W8A8 MLP (npu_dynamic_quant).
    w8a8 = quantize.ascend_v1(qwen2, root / "w8a8",
                              lambda module: "W8A8" if "self_attn" in module else "W8A8_DYNAMIC",
                              prompt_token_ids(qwen2, [64, 64]), bf16_model=True)
    moe = quantize.ascend_v1(tiny_models["tiny-qwen3-moe"], root / "w8a8-moe",
                             lambda module: "W8A8_DYNAMIC")
    return {**tiny_models, "w8a8": w8a8, "w8a8-moe": moe}


@pytest.fixture(scope="module")
def seam_calls(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("npu-wheels")
    models = _checkpoints(tiny_models, root)
    prompts = prompt_token_ids(tiny_models["tiny-llama"], PROMPT_LENGTHS)
    engines = [{"model": str(models[model]), "kwargs": {**ENGINE, "dtype": dtype, **extra},
                "runs": [{"prompts": prompts, "sampling": [sampling]} for sampling in [GREEDY, *later]]}
               for model, dtype, extra, later in FAMILIES.values()]
    encoder = tiny_encoders.build(MODELS_DIR, [ENCODER[0]])[ENCODER[0]]
    engines.append({"model": str(encoder), "kwargs": ENCODER[1], "runs": [
        {"kind": "embed", "prompts": pooling.token_ids(encoder, pooling.sentences(3, [2, 12, 40]))}]})
    lora_model, lora_kwargs, lora_adapters = LORA
    adapters = tiny_adapters.build(MODELS_DIR, list(filter(None, lora_adapters)))
    engines.append({"model": str(models[lora_model]), "kwargs": lora_kwargs, "runs": [
        {"prompts": prompts, "sampling": [GREEDY],
         "adapters": [name and str(adapters[name]) for name in lora_adapters]}]})
    result = run_engine({"engines": engines, "record_seam": True}, root, timeout=1200)
    assert result["platform"] == "EmulatedNPUPlatform"
    for family, engine in zip([*FAMILIES, "encoder", "lora"], result["engines"]):
        assert "error" not in engine, (family, engine["error"])
    return result["seam_calls"]


def test_the_workload_reaches_every_op_the_engine_calls(seam_calls):
    """Every seam op is called (bf16 experts combine on npu_moe_token_unpermute, fp16 ones on
    npu_moe_finalize_routing), and the sampler makes all three of its calls."""
    # swap_blocks (KV offload's block copies) calls aten, no torch_npu op: nothing to replay.
    assert {call["op"] for call in seam_calls} == set(kernels.OPS) - {"swap_blocks"} - (
        set() if RECURRENT_SERVED else {"recurrent_gated_delta_rule"})
    sampler = {tuple(name for name in ("p", "k") if call["kwargs"].get(name) is not None)
               for call in seam_calls if call["op"] == "top_k_top_p"}
    assert sampler == {("p", "k"), ("p",), ("k",)}


# --- the replay -----------------------------------------------------------------------------------


def _meta(description):
    """A recorded argument as a meta tensor of the same layout (or the value itself)."""
    if isinstance(description, dict):
        if "tensor" in description:
            t = description["tensor"]
            size = 1 + sum((n - 1) * s for n, s in zip(t["shape"], t["stride"]) if n)
            storage = torch.empty(t["offset"] + size, dtype=getattr(torch, t["dtype"]),
                                  device="meta")
            return storage.as_strided(t["shape"], t["stride"], t["offset"])
        if "dtype" in description:
            return getattr(torch, description["dtype"])
        if "list" in description:
            return [_meta(item) for item in description["list"]]
        return tuple(_meta(item) for item in description["tuple"])
    return description


def layout(description):
    """Shapes and dtypes of a result, tensor by tensor, as ``shape/dtype`` strings."""
    if isinstance(description, dict):
        if "tensor" in description:
            t = description["tensor"]
            return f"{tuple(t['shape'])}/{t['dtype']}"
        if "dtype" in description:
            return description["dtype"]
        return [layout(item) for item in description.get("list", description.get("tuple", []))]
    return description


# What the dispatcher says when an op has no Meta kernel (the op's qualified name first).
# (an overload's name whole: the .out form has no meta kernel where its default overload has one)
_NO_META_KERNEL = re.compile(r"^\w+::([\w.]+): attempted to run this operator with Meta tensors")


def replay(wheel, torch_npu, call) -> str | None:
    """Make the recorded call through the exact real-path function with ``torch_npu`` installed;
    None if it binds and the meta kernel's shapes and dtypes are the reference's, else why not."""
    args = _meta(call["args"])
    kwargs = {name: _meta(value) for name, value in call["kwargs"].items()}
    try:
        out = getattr(npu, call["op"])(*args, **kwargs)
    except NotImplementedError as exc:
        missing = _NO_META_KERNEL.match(str(exc))
        if missing and missing.group(1) not in wheel.meta:
            return None  # bound; the wheel has no meta kernel to give shapes
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with the call
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    found, expected = layout(kernels.describe(out)), layout(call["out"])
    return None if found == expected else f"returns {found}, the reference {expected}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_recorded_call_binds_and_matches_the_meta_kernel(version, seam_calls, monkeypatch):
    wheel = npu_wheels.load(version)
    torch_npu = npu_wheels.stand_in(wheel)
    monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
    failures = {}
    for call in seam_calls:
        if call["op"] == "recurrent_gated_delta_rule" and version not in RECURRENT_TORCH_NPU:
            continue  # called on vLLM 0.33 and later, whose torch-npu builds are the ones to ship it
        problem = replay(wheel, torch_npu, call)
        if problem:
            failures.setdefault((call["op"], problem), call)
    assert not failures, f"torch-npu {version}:\n" + "\n".join(
        f"{op}: {problem}\n    e.g. {op}{tuple(layout(call['args']))} "
        f"{ {name: layout(value) for name, value in call['kwargs'].items()} }"
        for (op, problem), call in failures.items())


# --- what the wheels settle -----------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_the_windowed_encoder_call_binds(version, reference_kernels, monkeypatch):
    """The band (sparse_mode 4) call of a windowed encoder layer, which no tiny checkpoint here
    makes, recorded from the impl and replayed like the workload's."""
    impl = AscendEncoderOnlyImpl(4, 64, 0.125, num_kv_heads=2, sliding_window=8)
    query, key = torch.zeros(30, 4, 64, dtype=torch.bfloat16), torch.zeros(30, 2, 64, dtype=torch.bfloat16)
    with kernels.record_calls() as records:
        impl.forward(None, query, key, key, torch.empty(0),
                     AscendEncoderMetadata(num_tokens=30, query_ends=[10, 30]), torch.empty_like(query))
    (call,) = records.values()
    assert call["kwargs"]["sparse_mode"] == 4
    wheel = npu_wheels.load(version)
    torch_npu = npu_wheels.stand_in(wheel)
    monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
    assert replay(wheel, torch_npu, call) is None


@pytest.mark.parametrize("version", VERSIONS)
def test_the_verification_rows_calls_bind(version, reference_kernels, monkeypatch):
    """The .out form and the workspace query of speculative verification rows (TND, causal or the
    band, 1 + k rows per sequence) as the backend makes them, recorded from the reference and
    replayed."""
    cache = torch.zeros(4, 128, 2 * 64, dtype=torch.bfloat16)
    query = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    call = dict(atten_mask=torch.ones(2048, 2048, dtype=torch.int8).triu_(1),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                actual_seq_lengths=[4, 8], actual_seq_lengths_kv=[40, 200], num_heads=4,
                num_key_value_heads=2, scale=0.125, block_size=128, sparse_mode=3)
    band = {**call, "sparse_mode": 4, "pre_tokens": 99, "next_tokens": 0}  # a windowed layer's
    with kernels.record_calls() as records:
        for form in (call, band):
            workspace = kernels.fused_infer_attention_score_verify_workspace(query, cache, cache,
                                                                             **form)
            kernels.fused_infer_attention_score_verify(
                query, cache, cache, **form, attention_out=torch.zeros_like(query),
                softmax_lse=torch.empty(0), workspace=workspace)
    assert len(records) == 4 and {record["op"] for record in records.values()} == {
        "fused_infer_attention_score_verify", "fused_infer_attention_score_verify_workspace"}
    wheel = npu_wheels.load(version)
    torch_npu = npu_wheels.stand_in(wheel)
    monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
    for record in records.values():
        assert replay(wheel, torch_npu, record) is None, record["op"]


def test_the_gated_delta_decode_call_binds(reference_kernels, monkeypatch):
    """A decode call of npu_recurrent_gated_delta_rule as the composed path makes it (bf16, one
    token per sequence, float32 gates), recorded from the reference and replayed against the
    torch-npu of every release that serves recurrent layers (0.33 and later)."""
    tokens, q = 3, torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    with kernels.record_calls() as records:
        kernels.recurrent_gated_delta_rule(
            q, q, torch.zeros(tokens, 4, 32, dtype=torch.bfloat16),
            torch.zeros(5, 4, 32, 32, dtype=torch.bfloat16),
            beta=torch.zeros(tokens, 4, dtype=torch.bfloat16), scale=32 ** -0.5,
            actual_seq_lengths=torch.ones(tokens, dtype=torch.int32),
            ssm_state_indices=torch.tensor([1, 4, 2], dtype=torch.int32),
            g=torch.zeros(tokens, 4))
    (call,) = records.values()
    for version in sorted(RECURRENT_TORCH_NPU):
        wheel = npu_wheels.load(version)
        torch_npu = npu_wheels.stand_in(wheel)
        monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
        assert replay(wheel, torch_npu, call) is None, version


def _meta_tensor(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("version", VERSIONS)
def test_ops_bind_by_their_schemas_own_names(version):
    """torch_npu.<op> is torch.ops.npu.<op> itself (finding 10): ``self=`` binds, ``input=``, the
    name torchgen's Python bindings would give it, does not."""
    wheel = npu_wheels.load(version)
    torch_npu = npu_wheels.stand_in(wheel)
    x, gamma = _meta_tensor(3, 64, dtype=torch.bfloat16), _meta_tensor(64, dtype=torch.bfloat16)
    y, rstd = torch_npu.npu_rms_norm(self=x, gamma=gamma)
    assert (y.shape, rstd.shape) == ((3, 64), (3, 1))
    with pytest.raises(RuntimeError, match="missing value for argument 'self'"):
        torch_npu.npu_rms_norm(input=x, gamma=gamma)
    assert torch_npu.npu_rms_norm is wheel.op("npu_rms_norm")


def _grouped_routing(**extra):
    return npu.moe_gating_top_k(_meta_tensor(4, 16), 2, bias=_meta_tensor(16), k_group=1,
                                group_count=2, group_select_mode=1, norm_type=1, **extra)


@pytest.mark.parametrize("version", VERSIONS)
def test_grouped_routing_follows_the_installed_torch_npu(version, monkeypatch):
    """Finding 1: torch-npu 2.11's npu_moe_gating_top_k has no input_ids/tid2eid; the call leaves
    them out there and passes them where the schema has them."""
    wheel = npu_wheels.load(version)
    torch_npu = npu_wheels.stand_in(wheel)
    monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
    arguments = {argument.name for argument in wheel.schema("npu_moe_gating_top_k").arguments}
    hashing = {"input_ids", "tid2eid"} <= arguments
    assert hashing == (version != "2.11.0")
    weights, ids, _ = _grouped_routing()
    assert (weights.shape, ids.shape, ids.dtype) == ((4, 2), (4, 2), torch.int32)
    ids_in = {"input_ids": _meta_tensor(4, dtype=torch.int32),
              "tid2eid": _meta_tensor(8, 2, dtype=torch.int32)}
    if hashing:
        assert _grouped_routing(**ids_in)[1].shape == (4, 2)
    else:
        with pytest.raises(ValueError, match=re.escape(
                "npu_moe_gating_top_k: the installed torch_npu takes no input_ids, tid2eid "
                "(hash routing needs torch-npu 2.13 or later)")):
            _grouped_routing(**ids_in)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_top_p_only_call_traces(version, monkeypatch):
    """Finding 8: the wheel's meta kernel of npu_top_k_top_p has no defaults, so ``k=None`` (left
    out by the dispatcher) broke a traced top-p-only call; eagerly it is still the op's own call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch_npu = npu_wheels.stand_in(npu_wheels.load(version))
    monkeypatch.setattr(npu, "_torch_npu", lambda: torch_npu)
    with FakeTensorMode():
        logits, p = torch.empty(2, 50, dtype=torch.bfloat16), torch.empty(2, dtype=torch.bfloat16)
        out = npu.top_k_top_p(logits, p=p)
    assert out.shape == (2, 50) and out.dtype == torch.bfloat16
    # Eagerly the call reaches torch_npu's op (bound; it has no CPU kernel).
    with pytest.raises(NotImplementedError, match=r"Could not run '\w+::npu_top_k_top_p' with "
                                                  r"arguments from the 'CPU' backend"):
        npu.top_k_top_p(torch.zeros(2, 50), p=torch.ones(2))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_fia_softmax_lse_without_its_flag_is_empty(version):
    """Finding 8: the reference's softmax_lse is the meta kernel's (0,) fp32, not the doc's [1]."""
    wheel = npu_wheels.load(version)
    query = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    key = torch.zeros(5, 2, 64, dtype=torch.bfloat16)
    _, lse = reference.fused_infer_attention_score(
        query, key, key, actual_seq_lengths=[5], actual_seq_lengths_kv=[5], num_heads=4,
        num_key_value_heads=2, scale=0.125)
    _, meta_lse = wheel.op("npu_fused_infer_attention_score")(
        query.to("meta"), key.to("meta"), key.to("meta"), actual_seq_lengths=[5],
        actual_seq_lengths_kv=[5], num_heads=4, num_key_value_heads=2, scale=0.125,
        input_layout="TND")
    assert (lse.shape, lse.dtype) == (meta_lse.shape, meta_lse.dtype) == ((0,), torch.float32)


def _accepts(call) -> bool:
    try:
        call()
    except (kernels.KernelContractError, RuntimeError):  # the reference's and torch._check's
        return False
    return True


@pytest.mark.parametrize("version", VERSIONS)
def test_quant_matmul_bias_dtypes_the_reference_takes_the_meta_kernel_takes(version):
    """Finding 9: every (output dtype, pertoken_scale, bias dtype) the reference accepts, the
    wheel's meta kernel accepts; the bf16 bias for fp16 output it used to accept, it refuses."""
    op = npu_wheels.load(version).op("npu_quant_matmul")
    x1, x2 = torch.zeros(4, 16, dtype=torch.int8), torch.zeros(16, 8, dtype=torch.int8)
    accepted = []
    for output in (torch.float16, torch.bfloat16, torch.int32):
        for pertoken in (None, torch.ones(4)):
            for bias_dtype in (torch.int32, torch.float16, torch.bfloat16, torch.float32):
                arguments = {"pertoken_scale": pertoken, "bias": torch.zeros(8, dtype=bias_dtype),
                             "output_dtype": output}
                if not _accepts(lambda: reference.quant_matmul(x1, x2, torch.ones(8),
                                                                         **arguments)):
                    continue
                accepted.append((output, pertoken is not None, bias_dtype))
                meta = {name: value.to("meta") if isinstance(value, torch.Tensor) else value
                        for name, value in arguments.items()}
                assert _accepts(lambda: op(x1.to("meta"), x2.to("meta"), torch.ones(8, device="meta"),
                                           **meta)), accepted[-1]
    assert (torch.float16, True, torch.float16) in accepted
    assert (torch.float16, True, torch.bfloat16) not in accepted


INIT_VARIANTS = [{}, {"active_expert_range": [2, 2]}, {"active_expert_range": [1, 3]},
                 {"quant_mode": 1}, {"quant_mode": 14}, {"quant_mode": 0}, {"drop_pad_mode": 1},
                 {"expert_tokens_num_type": 0}, {"expert_tokens_num_flag": False}]


@pytest.mark.parametrize("version", VERSIONS)
def test_init_routing_calls_the_reference_takes_the_meta_kernel_takes_alike(version):
    """Finding 9: each npu_moe_init_routing_v2 call the reference accepts, the wheel's meta kernel
    accepts with the same output shapes and dtypes (an empty active range it used to accept, the
    meta refuses; without expert_tokens_num_flag the meta's count is 0-D, a mode the wheel's doc
    calls unsupported)."""
    op = npu_wheels.load(version).op("npu_moe_init_routing_v2")
    x = torch.randn(3, 8)
    expert_idx = torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32)
    taken = []
    for variant in INIT_VARIANTS:
        arguments = {"active_num": 6, "expert_num": 4, "expert_tokens_num_type": 1,
                     "expert_tokens_num_flag": True, "active_expert_range": [0, 4], **variant}
        try:
            out = reference.moe_init_routing_v2(x, expert_idx, **arguments)
        except kernels.KernelContractError:
            continue
        taken.append(variant)
        meta = op(x.to("meta"), expert_idx.to("meta"), **arguments)
        assert layout(kernels.describe(meta)) == layout(kernels.describe(out)), variant
    assert taken == [{}, {"active_expert_range": [1, 3]}, {"quant_mode": 1}]


def test_the_atb_schemas_built_in_code_are_the_strings_older_wheels_keep_whole():
    """torch-npu 2.13 and later build the shorter ATB schema strings in code: put back together,
    they are exactly the strings torch-npu 2.11 keeps in its read-only data."""
    whole = npu_wheels.load("2.11.0").atb_schemas
    for version in VERSIONS:
        schemas = npu_wheels.load(version).atb_schemas
        for name in ("_npu_paged_attention", "_npu_paged_attention_get_workspace",
                     "npu_multi_head_latent_attention"):
            assert schemas[name] == whole[name], (version, name)


def test_each_matrix_row_pairs_a_torch_npu_built_for_its_torch():
    """The torch_npu of each row requires that row's torch (the wheel's METADATA); vLLM 0.20-0.26
    pin torch 2.11.0, so torch-npu 2.11.0 (not 2.10.x) is theirs."""
    import zipfile

    from ascend_patch.overlay import matrix

    for release, entry in matrix.load().versions.items():
        with zipfile.ZipFile(npu_wheels.fetch(entry.torch_npu)) as wheel:
            metadata = wheel.read(f"torch_npu-{entry.torch_npu}.dist-info/METADATA").decode()
        pinned = re.search(r"^Requires-Dist: torch ?==(\S+)$", metadata, re.MULTILINE).group(1)
        assert pinned.removesuffix("+cpu").removesuffix(".*") == entry.torch, release


# The wheel's own doc sentences the references settle their contracts on (finding 9), by op.
CITED = {
    "npu_rms_norm": ["gamma：Tensor类型，数据类型需要和self保持一致"],
    "npu_quant_matmul": ["bias:int32/None, int32/None, int32/bfloat16/float32/None, "
                         "int32/float16/float32/None, int32/None, int32/None",
                         "pertoken_scale:None, None, float32/None, float32, None, None",
                         "output_dtype:float16, int8, bfloat16, float16, float16, int32"],
    "npu_moe_init_routing_v2": ["drop_pad_mode：int类型，可选参数，表示是否为drop_pad场景，取值为0和1。0表示"
                                "dropless场景，该场景下不校验expert_capacity。1表示drop_pad场景。当前仅支持0。",
                                "当前仅支持1和2。", "默认False表示不输出。当前仅支持True。",
                                "当前仅支持-1和1。", "其他模式取值范围为(0, 10240]"],
    "npu_fusion_attention": ["varlen场景下长度最大支持1K", "T(B*S)取值范围1~1M", "取值范围1~768",
                             "Nq取值范围1~256", "不支持aclgraph", "输入key和value的shape必须一致",
                             "输入query、key、value、pse的数据类型必须一致", "Nq/Nkv必须是非0整数",
                             "优化后的压缩下三角矩阵(2048*2048)", "atten_mask中不能存在某一行全1的场景",
                             "支持actual_seq_qlen中某个Batch上的S长度为0", "忽略pre_tockens和next_tockens",
                             "数据类型支持bool、uint8"],
    "npu_batch_gather_matmul_": ["数据类型Float16", "数据类型Int32", "R需要是16的整数倍且取值范围为[16, 128]",
                                 "第三维需要小于y的第二维（H2<y_column）", "randint(-1, 2, size=4096)"],
    "npu_moe_gating_top_k_softmax_v2": ["当renorm参数设置为0时，对输入x做softmax操作，再做topk操作；当renorm参数"
                                        "设置为1时，对x做topk操作，后做softmax操作。",
                                        "数据类型支持float16、bfloat16、float32",
                                        "大小为0<k<=x的-1轴大小, k<=1024."],
    "npu_scatter_pa_kv_cache": ["输入参数不支持非连续"],
    "npu_moe_finalize_routing": ["drop_pad_mode: int类型, 可选参数, 表示是否支持丢弃模式, 取值范围为0",
                                 "skip2参数为None时, skip1参数必须也为None."],
}


def _doc(wheel, op: str) -> str:
    docs = wheel.text(npu_wheels.DOCS).replace("\r\n", "\n")  # the file has CRLF lines
    start = docs.index(f'_add_torch_npu_docstr(\n    "{op}",')
    return docs[start: docs.find("_add_torch_npu_docstr(", start + 1)]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_wheel_documents_what_the_references_cite(version):
    wheel = npu_wheels.load(version)
    missing = [(op, sentence) for op, sentences in CITED.items() for sentence in sentences
               if sentence not in _doc(wheel, op)]
    assert not missing
