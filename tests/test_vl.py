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
