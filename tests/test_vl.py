"""A vision-language model on the emulated NPU: tiny BLIP-2 (ViT, Q-Former, OPT decoder) with
synthetic images against HF transformers (fp32 greedy tokens equal, bf16 within bf16 rounding
of the fp32 logits), and its vision encoder's attention on ``npu_fusion_attention``
(:mod:`ascend_patch.npu.ops.mm_encoder_attention`).

One engine per dtype, in one driver process. Why not Qwen2.5-VL / Qwen3-VL here: README,
"Vision-language models".
"""

from __future__ import annotations

import pytest

from ascend_patch.kit import tiny_vl
from tests.helpers.engine import MODELS_DIR, assert_tracks_logits, only_marked_tests, run_engine

PROMPTS = ["Question: what does the picture show? Answer:", "A photo of"]
IMAGES = [1, 2]  # synthetic image seeds, one per prompt
MAX_TOKENS = 8
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "limit_mm_per_prompt": {"image": 1},
          "gpu_memory_utilization": 0.9}
V0_20 = ("float32",)
"""The engines the tests marked v0_20_features read (a v0_20-set release in CI)."""


@pytest.fixture(scope="module")
def model():
    return tiny_vl.build(MODELS_DIR)["tiny-blip2"]


@pytest.fixture(scope="module")
def prompts(model):
    return [tiny_vl.prompt_ids(model, text) for text in PROMPTS]


@pytest.fixture(scope="module")
def runs(model, prompts, tmp_path_factory, request):
    dtypes = V0_20 if only_marked_tests(request) else ("float32", "bfloat16")
    sampling = [{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}]
    spec = {"engines": [{"model": str(model), "kwargs": {**ENGINE, "dtype": dtype},
                         "runs": [{"prompts": prompts, "images": IMAGES, "sampling": sampling}]}
                        for dtype in dtypes]}
    engines = run_engine(spec, tmp_path_factory.mktemp("vl"))["engines"]
    for dtype, engine in zip(dtypes, engines):
        assert "error" not in engine, (dtype, engine["error"])
    return {dtype: engine["runs"][0] for dtype, engine in zip(dtypes, engines)}


@pytest.mark.v0_20_features
def test_fp32_greedy_with_images_equals_hf(runs, model, prompts):
    assert runs["float32"]["tokens"] == tiny_vl.hf_greedy(model, prompts, IMAGES, MAX_TOKENS)


def test_bf16_tracks_the_fp32_hf_logits(runs, model, prompts):
    generated = runs["bfloat16"]["tokens"]
    oracle = tiny_vl.hf_logits(model, prompts, IMAGES, generated)
    assert_tracks_logits([oracle], tiny_vl.with_image_tokens(model, prompts), generated)


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.v0_20_features),
                                   "bfloat16"])
def test_vision_attention_runs_one_fused_launch_per_layer_and_image_batch(runs, dtype):
    """Both requests' images are encoded in the first step, one batch: each ViT layer's attention
    is one npu_fusion_attention launch for the two images (the text decoder's attention runs its
    own kernels)."""
    launches = runs[dtype]["launches"]
    assert launches.get("fusion_attention") == tiny_vl.vision_layers(), launches


def test_the_oracle_sees_the_image(model, prompts):
    """The negative control of the comparisons: the same prompt with another image continues
    differently, so tokens equal to HF's mean the image went through the encoder."""
    first, other = (tiny_vl.hf_greedy(model, prompts[:1], [seed], MAX_TOKENS) for seed in (1, 3))
    assert first != other


# --- M-RoPE (the Qwen VL decoders' rotary) on npu_mrope, against M-RoPE written out here -----------

# (sections, interleaved, head size): Qwen2-VL / Qwen2.5-VL, a smaller documented section, Qwen3-VL.
MROPE_LAYERS = {"qwen2.5-vl": ([16, 24, 24], False, 128), "sections-8-12-12": ([8, 12, 12], False, 64),
                "qwen3-vl": ([24, 20, 20], True, 128)}
MROPE_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # bf16: vLLM rounds per op, the kernel once
MROPE_BASE = 1000000.0


def _mrope_layer(cls, sections, interleaved, head_size, dtype):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    # vLLM's CustomOp layers read the current config when built; this machine has no accelerator.
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return cls(head_size, head_size, 1024, MROPE_BASE, True, dtype, mrope_section=sections,
                   mrope_interleaved=interleaved)


def _mrope_oracle(positions, x, sections, interleaved, head_size):
    """M-RoPE written out per frequency (NeoX halves, the rotary over the whole head): frequency
    ``j`` turns the pair ``(j, j + head_size / 2)`` of every head by ``p * base^(-2j / head_size)``
    (angle in fp32, as the models compute it), ``p`` the temporal, height or width position its
    section gives (interleaved, Qwen3-VL: height for j = 1 mod 3 below 3 x its section, width for
    j = 2 mod 3 below 3 x its, else temporal); ``[T]`` positions turn every frequency."""
    import torch

    half = head_size // 2
    if positions.dim() == 1:
        rows = [0] * half
        positions = positions[None]
    elif interleaved:
        rows = [1 if j % 3 == 1 and j < 3 * sections[1] else 2 if j % 3 == 2 and j < 3 * sections[2]
                else 0 for j in range(half)]
    else:
        rows = [row for row, size in enumerate(sections) for _ in range(size)]
    inv_freq = 1.0 / MROPE_BASE ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size)
    angle = positions[rows, :].T.float() * inv_freq  # [T, half]: token t, frequency j
    cos, sin = angle.cos().double()[:, None], angle.sin().double()[:, None]
    heads = x.view(x.shape[0], -1, head_size).double()
    first, second = heads[..., :half], heads[..., half:]
    turned = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return turned.reshape(x.shape)


def _mrope_inputs(head_size, dtype, rows, tokens=9, heads=4, kv_heads=2):
    """Query and key split out of one qkv buffer, as the models call the rotary; positions as the
    runner hands them: ``[3, T]`` (temporal, height, width) or ``[T]`` (text only)."""
    import torch

    generator = torch.Generator().manual_seed(tokens * head_size)
    positions = torch.randint(0, 4096, (3, tokens), generator=generator)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=generator).to(dtype)
    query, key, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    return (positions if rows == 3 else positions[0]), query, key


@pytest.mark.v0_20_features
@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layer", MROPE_LAYERS, ids=MROPE_LAYERS)
def test_mrotary_embedding_on_npu_mrope_follows_mrope_written_out(layer, dtype, rows, reference_kernels):
    """The registered MRotaryEmbedding, and vLLM's own forward_native, against M-RoPE written out
    here: one npu_mrope launch for query and key, its mrope mode with the layer's sections for
    ``[3, T]`` positions and its RoPE mode for ``[T]``; Qwen3-VL's interleaved sections, which the
    seam's cache_mode cannot lay out, run vLLM's native torch for ``[3, T]`` (no launch) and say
    why."""
    import torch
    from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding

    from ascend_patch.npu import kernels
    from ascend_patch.npu.ops.rotary_embedding import AscendMRotaryEmbedding

    sections, interleaved, head_size = MROPE_LAYERS[layer]
    dtype = getattr(torch, dtype)
    vllm_rope = _mrope_layer(MRotaryEmbedding, sections, interleaved, head_size, dtype)
    ours = _mrope_layer(AscendMRotaryEmbedding, sections, interleaved, head_size, dtype)
    positions, query, key = _mrope_inputs(head_size, dtype, rows)
    expected = [_mrope_oracle(positions, x, sections, interleaved, head_size) for x in (query, key)]
    native = vllm_rope.forward_native(positions, query.clone(), key.clone())

    with kernels.record_calls() as records:
        got = ours.forward_oot(positions, query, key)
    tolerance = MROPE_TOLERANCE[str(dtype).removeprefix("torch.")]
    for result, vllms, want in zip(got, native, expected):
        assert result.shape == vllms.shape == want.shape
        torch.testing.assert_close(result.double(), want, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(vllms.double(), want, atol=tolerance, rtol=tolerance)
    calls = [(call["op"], call["args"]["tuple"]) for call in records.values()]
    if interleaved and rows == 3:
        assert calls == [] and "cache_mode 'interleave'" in ours.native_reason()
        return
    ((op, args),) = calls
    assert op == "mrope" and args[6] == ({"list": sections} if rows == 3 else None), args[6]
    assert [args[i]["tensor"]["offset"] for i in (1, 2)] == [0, 4 * head_size]  # qkv's own views


@pytest.mark.v0_20_features
def test_mrotary_comparison_catches_wrong_sections(reference_kernels):
    """Negative control: the comparison above fails when the sections are assigned wrongly, both
    with another documented section split and with the positions rows swapped (height first)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding

    from ascend_patch.npu.ops.rotary_embedding import AscendMRotaryEmbedding

    vllm_rope = _mrope_layer(MRotaryEmbedding, [16, 24, 24], False, 128, torch.float32)
    other = _mrope_layer(AscendMRotaryEmbedding, [24, 20, 20], False, 128, torch.float32)
    ours = _mrope_layer(AscendMRotaryEmbedding, [16, 24, 24], False, 128, torch.float32)
    positions, query, key = _mrope_inputs(128, torch.float32, 3)
    expected, _ = vllm_rope.forward_native(positions, query.clone(), key.clone())
    for rope, rows in ((other, positions), (ours, positions[[1, 0, 2]])):
        got, _ = rope.forward_oot(rows, query, key)
        assert not torch.allclose(got, expected, atol=1e-2, rtol=1e-2)
    got, _ = ours.forward_oot(positions, query, key)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
