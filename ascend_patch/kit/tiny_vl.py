"""A tiny vision-language checkpoint, built locally, synthetic images for it, and its HF oracle.

``tiny-blip2``: ``Blip2ForConditionalGeneration`` as Salesforce/blip2-opt ships it, at toy size:
a ViT of 2 layers (4 heads of 64, 56×56 images in 14×14 patches: 16 patches and a class token),
a 1-layer Q-Former turning them into 8 query tokens, and an OPT decoder on the byte-level BPE
tokenizer of :mod:`ascend_patch.kit.tiny_models` plus BLIP-2's ``<image>`` token. vLLM
inserts the 8 ``<image>`` tokens at the start of the prompt, as the HF processor does, and
replaces them with the Q-Former's outputs. Weights from N(0, 0.2) (LayerNorm gains one), so
greedy decoding neither collapses nor ignores the image. Its image processor is transformers'
PIL one (no torchvision needed).

The Qwen VL families are not built: in this environment vLLM cannot start them (see docs/design.md).

    python -m ascend_patch.kit.tiny_vl OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from ascend_patch.kit import tiny_models

RECIPE = {
    "image_size": 56,
    "patch_size": 14,
    "vision": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4},
    "qformer": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
                "num_attention_heads": 2, "cross_attention_frequency": 1},
    "text": {"hidden_size": 256, "ffn_dim": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "word_embed_proj_dim": 256, "max_position_embeddings": 2048},
    "num_query_tokens": 8,
    "seed": 0,
    "init_std": 0.2,
}
MODELS = {"tiny-blip2": ("Blip2ForConditionalGeneration", {})}
IMAGE_TOKEN = "<image>"


def vision_layers(name: str = "tiny-blip2") -> int:
    """The vision encoder's layers: one attention launch each per batch of images."""
    return RECIPE["vision"]["num_hidden_layers"]


def _model(out: Path, architecture: str, overrides: dict) -> None:
    import transformers

    tokenizer = tiny_models._tokenizer(out)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.save_pretrained(out)
    image_processor = transformers.BlipImageProcessorPil(
        size={"height": RECIPE["image_size"], "width": RECIPE["image_size"]})
    image_processor.save_pretrained(out)
    text = dict(RECIPE["text"], vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                model_type="opt", dropout=0.0, torch_dtype="float32")
    config = transformers.Blip2Config(
        vision_config=dict(RECIPE["vision"], image_size=RECIPE["image_size"],
                           patch_size=RECIPE["patch_size"]),
        qformer_config=RECIPE["qformer"], text_config=text,
        num_query_tokens=RECIPE["num_query_tokens"],
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), torch_dtype="float32",
        **overrides)
    model = tiny_models.seeded_model(architecture, config, RECIPE["seed"], lambda name: None
                                     if "norm" in name.lower() and name.endswith("weight")
                                     else RECIPE["init_std"])
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)


def build(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build ``names`` (default: every model) under ``root``, reusing what is already built."""
    def make(out, recipe, architecture, overrides):
        _model(out, architecture, overrides)

    return tiny_models.build_recipes(root, {name: [RECIPE, *MODELS[name]] for name in names or MODELS},
                                     make)


def image(seed: int, size: int = RECIPE["image_size"]):
    """A synthetic RGB image: uniform noise from ``seed``, ``size``×``size`` pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_ids(model_dir: Path, text: str) -> list[int]:
    """The text prompt's token ids, without the image tokens (vLLM and HF's processor put
    them in front)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False).input_ids


def _hf(model_dir: Path):
    """HF's image processor and fp32 model."""
    import torch
    import transformers

    processor = transformers.BlipImageProcessorPil.from_pretrained(model_dir)
    model = transformers.Blip2ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return processor, model


def with_image_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts as vLLM and HF's processor feed them: the image's ``<image>`` tokens first."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    return [[config.image_token_index] * config.num_query_tokens + ids for ids in prompts]


def hf_logits(model_dir: Path, prompts: list[list[int]], seeds: list[int],
              generated: list[list[int]]) -> list:
    """HF transformers' fp32 next-token logits at every position of each (image, prompt +
    generated) sequence, the image tokens first: [sequence length, vocab] per prompt."""
    import torch

    processor, model = _hf(model_dir)
    rows = []
    with torch.no_grad():
        for ids, seed, tokens in zip(with_image_tokens(model_dir, prompts), seeds, generated):
            pixels = processor(images=[image(seed)], return_tensors="pt").pixel_values
            rows.append(model(input_ids=torch.tensor([ids + tokens]), pixel_values=pixels).logits[0])
    return rows


def hf_greedy(model_dir: Path, prompts: list[list[int]], seeds: list[int], max_tokens: int) -> list[list[int]]:
    """HF transformers' fp32 greedy continuation of each (image, prompt) pair (the image's
    ``<image>`` tokens, then the prompt), ``max_tokens`` tokens whatever they are."""
    import torch

    processor, model = _hf(model_dir)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: every token compared
    out = []
    with torch.no_grad():
        for ids, seed in zip(with_image_tokens(model_dir, prompts), seeds):
            pixels = processor(images=[image(seed)], return_tensors="pt").pixel_values
            input_ids = torch.tensor([ids])
            generated = model.generate(input_ids=input_ids, pixel_values=pixels,
                                       attention_mask=torch.ones_like(input_ids),
                                       max_new_tokens=max_tokens, do_sample=False)
            out.append(generated[0, input_ids.shape[1]:].tolist())
    return out


if __name__ == "__main__":
    sys.exit(tiny_models.command_line(build, __doc__.splitlines()[0]))
