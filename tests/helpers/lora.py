"""Mixed LoRA batches of the engine tests and their oracle: HF transformers on the base checkpoint
with each prompt's adapter merged into the weights by hand (:func:`ascend_patch.kit.tiny_adapters.merged`)."""

from __future__ import annotations

from pathlib import Path

from ascend_patch.kit import tiny_adapters
from ascend_patch.kit.oracle import hf_greedy
from tests.helpers.engine import MODELS_DIR

# Qwen3-MoE's two adapters (attention and every expert's gate/up/down) and the base model in one
# batch, per prompt the adapter's name or None.
MOE_ADAPTERS = ("tiny-qwen3-moe-lora-a", None, "tiny-qwen3-moe-lora-b", "tiny-qwen3-moe-lora-a")


def adapters(names) -> list[tuple[str | None, Path | None]]:
    """Per prompt, its adapter's name and built directory (None, None: the base model)."""
    built = tiny_adapters.build(MODELS_DIR, [name for name in names if name])
    return [(name, name and built[name]) for name in names]


def rows(names, adapter) -> list[int]:
    return [row for row, name in enumerate(names) if name == adapter]


def merged_greedy(base: Path, per_prompt: list[tuple[str | None, Path | None]],
                  prompts: list[list[int]], max_tokens: int, root: Path,
                  skip: str | None = None) -> list[list[int]]:
    """HF's greedy tokens per prompt with its adapter merged into ``base`` by hand (weights whose
    name holds ``skip`` left out: a test's control), the plain checkpoint's without one."""
    names = [name for name, _ in per_prompt]
    expected: list = [None] * len(prompts)
    for name, path in dict(per_prompt).items():
        model = base if path is None else tiny_adapters.merged(
            path, root / f"{name}-{skip or 'all'}", skip=skip)
        chosen = rows(names, name)
        for row, tokens in zip(chosen, hf_greedy(model, [prompts[row] for row in chosen], max_tokens)):
            expected[row] = tokens
    return expected
