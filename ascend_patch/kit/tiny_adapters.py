"""Tiny LoRA adapters for the tiny models, in PEFT's on-disk format, built by hand (no ``peft``).

An adapter is ``adapter_config.json`` plus ``adapter_model.safetensors`` holding, per targeted
linear layer, ``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r];
PEFT (and vLLM's loader) apply ``W + (lora_alpha / r) · B @ A``. Unlike PEFT's initialisation (B = 0,
a no-op until trained) both factors are drawn N(0, ``std``), so each adapter changes greedy output.

:func:`merged` writes the oracle's side: the base checkpoint with every delta added into its
weights by hand, which Hugging Face transformers then runs as a plain model.

    python -m ascend_patch.kit.tiny_adapters OUT_DIR   # OUT_DIR/tiny-llama-lora-{a,b}, tiny-llama, ...

Deterministic, and reused when built from the same recipe (like the tiny models).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ascend_patch.kit import tiny_models

# Every linear layer of a Llama block: attention (q/k/v merge into vLLM's QKV, o alone) and MLP
# (gate/up merge, down alone), so merged and single slices are both adapted.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (base model, rank, lora_alpha, seed, std)
ADAPTERS = {
    "tiny-llama-lora-a": ("tiny-llama", 8, 16, 1, 0.2),
    "tiny-llama-lora-b": ("tiny-llama", 8, 8, 2, 0.2),
    # Attention and every expert's gate/up/down (the router, "gate", is no target).
    "tiny-qwen3-moe-lora-a": ("tiny-qwen3-moe", 8, 16, 3, 0.2),
    "tiny-qwen3-moe-lora-b": ("tiny-qwen3-moe", 8, 8, 4, 0.2),
}


def _adapter(out: Path, base: Path, rank: int, alpha: int, seed: int, std: float) -> None:
    import torch
    from safetensors.torch import save_file

    weights = _base_weights(base)
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for name in sorted(weights):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        out_features, in_features = weights[name].shape
        prefix = f"base_model.model.{module}"
        factors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
        factors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    save_file(factors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": alpha, "target_modules": list(TARGETS), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None}, indent=2))


def _base_weights(base: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(base.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def merged(adapter: Path, out: Path, skip: str | None = None) -> Path:
    """The adapter's base checkpoint with ``(lora_alpha / r) · B @ A`` added into each targeted
    weight, written to ``out`` (config and tokenizer copied): the oracle's model. Weights whose
    name contains ``skip`` keep the base's (a test's control)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    base = Path(config["base_model_name_or_path"])
    scaling = config["lora_alpha"] / config["r"]
    factors = load_file(adapter / "adapter_model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    for shard in sorted(base.glob("*.safetensors")):
        weights = load_file(shard)
        for name in weights:
            prefix = f"base_model.model.{name.removesuffix('.weight')}"
            if f"{prefix}.lora_A.weight" in factors and not (skip and skip in name):
                weights[name] = weights[name] + scaling * (
                    factors[f"{prefix}.lora_B.weight"] @ factors[f"{prefix}.lora_A.weight"])
        save_file(weights, out / shard.name, metadata={"format": "pt"})
    for other in base.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != ".recipe":
            shutil.copy(other, out / other.name)
    return out


def build(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build ``names`` (default: every adapter) and their base models under ``root``."""
    chosen = {name: ADAPTERS[name] for name in names or ADAPTERS}
    bases = tiny_models.build(root, sorted({base for base, *_ in chosen.values()}))

    def make(out, recipe, base, rank, alpha, seed, std):
        _adapter(out, bases[base], rank, alpha, seed, std)

    recipes = {name: [{"targets": TARGETS, "base": str(bases[spec[0]])}, *spec]
               for name, spec in chosen.items()}
    return {**bases, **tiny_models.build_recipes(root, recipes, make)}


def main() -> int:
    return tiny_models.command_line(build, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
