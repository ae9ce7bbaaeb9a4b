"""A vision-language model on the emulated NPU: tiny BLIP-2 (ViT, Q-Former, OPT decoder) with
synthetic images, fp32 greedy tokens against HF transformers, and its vision encoder's attention
on ``npu_fusion_attention`` (:mod:`ascend_patch.npu.ops.mm_encoder_attention`).

One engine, one driver process. Why not Qwen2.5-VL / Qwen3-VL here: README, "Vision-language
models".
"""

from __future__ import annotations

import pytest

from ascend_patch.kit import tiny_vl
from tests.helpers.engine import MODELS_DIR, run_engine

PROMPTS = ["Question: what does the picture show? Answer:", "A photo of"]
IMAGES = [1, 2]  # synthetic image seeds, one per prompt
MAX_TOKENS = 8
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
          "limit_mm_per_prompt": {"image": 1}, "gpu_memory_utilization": 0.9}


@pytest.fixture(scope="module")
def model():
    return tiny_vl.build(MODELS_DIR)["tiny-blip2"]


@pytest.fixture(scope="module")
def prompts(model):
    return [tiny_vl.prompt_ids(model, text) for text in PROMPTS]


@pytest.fixture(scope="module")
def run(model, prompts, tmp_path_factory):
    sampling = [{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}]
    spec = {"engines": [{"model": str(model), "kwargs": ENGINE,
                         "runs": [{"prompts": prompts, "images": IMAGES, "sampling": sampling}]}]}
    engine = run_engine(spec, tmp_path_factory.mktemp("vl"))["engines"][0]
    assert "error" not in engine, engine["error"]
    return engine["runs"][0]


@pytest.mark.v0_20_features
def test_fp32_greedy_with_images_equals_hf(run, model, prompts):
    assert run["tokens"] == tiny_vl.hf_greedy(model, prompts, IMAGES, MAX_TOKENS)


@pytest.mark.v0_20_features
def test_vision_attention_runs_one_fused_launch_per_layer_and_image_batch(run):
    """Both requests' images are encoded in the first step, one batch: each ViT layer's attention
    is one npu_fusion_attention launch for the two images (the text decoder's attention runs its
    own kernels)."""
    assert run["launches"].get("fusion_attention") == tiny_vl.vision_layers(), run["launches"]


def test_the_oracle_sees_the_image(model, prompts):
    """The negative control of the greedy comparison: the same prompt with another image
    continues differently, so tokens equal to HF's mean the image went through the encoder."""
    first, other = (tiny_vl.hf_greedy(model, prompts[:1], [seed], MAX_TOKENS) for seed in (1, 3))
    assert first != other
