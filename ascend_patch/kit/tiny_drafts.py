"""Tiny speculative-decoding drafts, built locally beside the tiny targets (random weights: what
the tests check is that speculation leaves the target's greedy tokens unchanged).

- ``tiny-llama-eagle``: an EAGLE-1 head for ``tiny-llama`` as vLLM's ``EagleLlamaForCausalLM``
  loads it (``vllm/model_executor/models/llama_eagle.py``): ``fc`` [hidden, 2 × hidden] over the
  token's embedding and the target's hidden state, one Llama layer without its input norm
  (``layers.0.*``); embedding and LM head are the target's (vLLM shares them when the draft has
  none).
- ``tiny-llama-eagle3``: an EAGLE-3 head as ``Eagle3LlamaForCausalLM`` loads it
  (``llama_eagle3.py``): ``fc`` over the target's hidden states after each of its two layers
  (``eagle_aux_hidden_state_layer_ids``), one layer (``midlayer.*``) whose attention takes the
  normed embedding and hidden state side by side (q/k/v [*, 2 × hidden]) with its
  ``hidden_norm``, a final ``norm`` and its own ``lm_head``.
- ``tiny-deepseek-v3-mtp``: ``tiny-deepseek-v3-moe``'s recipe (MLA at DeepSeek's dimensions, a
  dense and a routed layer) with ``num_nextn_predict_layers=1``. Hugging Face's DeepseekV3 does
  not create the MTP layer, so it is written into the safetensors under the names vLLM's
  ``deepseek_mtp.py`` loads: ``model.layers.2.{enorm,hnorm,eh_proj,shared_head.norm,
  shared_head.head}`` and a full routed decoder layer ``model.layers.2.{self_attn,mlp,...}``
  (drawn as the third layer of the same recipe with three layers).
- ``tiny-llama-shifted`` and its EAGLE-1 head ``tiny-llama-shifted-eagle``, a pair whose drafts
  are known without running the drafter: a one-layer Llama whose embedding rows have unit RMS
  (so its input norm, all ones, leaves them as they are), and a head that is that layer (``fc``
  passes the embedding through and drops the hidden state). EAGLE feeds the head each token at
  the position before its own, so the head is the target run over the sequence without its
  first token (rotary attention depends on relative positions only): its draft after ``S`` is
  the target's greedy token after ``S[1:]``. :func:`shifted_drafts` computes them.
- ``tiny-deepseek-v3-shifted-mtp``: the same for DeepSeek MTP, a one-layer tiny DeepSeek-V3
  (MLA at DeepSeek's dimensions, a routed MoE layer, unit-RMS embedding rows, attention output
  scaled by :data:`SHIFTED_MTP_ATTENTION`) whose MTP layer is that layer, ``eh_proj`` passing
  the embedding through: the MTP layer sees each token at the position before its own, as the
  shifted EAGLE head does, and vLLM zeroes the embedding at position 0.

    python -m ascend_patch.kit.tiny_drafts OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ascend_patch.kit import tiny_models

_R = tiny_models.RECIPE
_LAYER = {  # a Llama layer of the tiny recipe, by its Hugging Face names: [out, in]
    "self_attn.q_proj.weight": (_R["num_attention_heads"] * _R["head_dim"], _R["hidden_size"]),
    "self_attn.k_proj.weight": (_R["num_key_value_heads"] * _R["head_dim"], _R["hidden_size"]),
    "self_attn.v_proj.weight": (_R["num_key_value_heads"] * _R["head_dim"], _R["hidden_size"]),
    "self_attn.o_proj.weight": (_R["hidden_size"], _R["num_attention_heads"] * _R["head_dim"]),
    "mlp.gate_proj.weight": (_R["intermediate_size"], _R["hidden_size"]),
    "mlp.up_proj.weight": (_R["intermediate_size"], _R["hidden_size"]),
    "mlp.down_proj.weight": (_R["hidden_size"], _R["intermediate_size"]),
}
_HIDDEN = _R["hidden_size"]
_AUX_LAYERS = [0, 1]
MTP_TARGET = "tiny-deepseek-v3-moe"

DRAFTS = {  # name -> (kind, the target it drafts for)
    "tiny-llama-eagle": ("eagle", "tiny-llama"),
    "tiny-llama-eagle3": ("eagle3", "tiny-llama"),
    "tiny-deepseek-v3-mtp": ("mtp", MTP_TARGET),
    "tiny-llama-shifted": ("shifted", None),
    "tiny-llama-shifted-eagle": ("shifted-eagle", "tiny-llama-shifted"),
    "tiny-deepseek-v3-shifted-mtp": ("shifted-mtp", None),
}
SHIFTED_MTP_ATTENTION = 0.25
"""The scale of ``tiny-deepseek-v3-shifted-mtp``'s attention output: small enough that the
context rarely changes the greedy token (most MTP drafts are accepted), large enough that it
sometimes does (some are rejected, and attention over the wrong slots changes the drafts)."""


def _eagle_weights(kind: str) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """Each tensor's shape and std (None: an RMSNorm's ones)."""
    std = _R["init_std"]
    if kind == "eagle":
        layer = {f"layers.0.{name}": (shape, std) for name, shape in _LAYER.items()}
        return {**layer, "layers.0.post_attention_layernorm.weight": ((_HIDDEN,), None),
                "fc.weight": ((_HIDDEN, 2 * _HIDDEN), std)}
    wide = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}
    layer = {f"midlayer.{name}": ((shape[0], 2 * shape[1]) if name in wide else shape, std)
             for name, shape in _LAYER.items()}
    norms = ("midlayer.input_layernorm", "midlayer.hidden_norm",
             "midlayer.post_attention_layernorm", "norm")
    return {**layer, **{f"{name}.weight": ((_HIDDEN,), None) for name in norms},
            "fc.weight": ((_HIDDEN, len(_AUX_LAYERS) * _HIDDEN), std),
            "lm_head.weight": ((_R["vocab_size"], _HIDDEN), std)}


def _config(target: Path, kind: str) -> dict:
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    if kind == "eagle3":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": _AUX_LAYERS}
    return config


def _write_eagle(out: Path, kind: str, target: Path) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(_R["seed"])
    tensors = {}
    for name, (shape, std) in sorted(_eagle_weights(kind).items()):
        tensors[name] = (torch.ones(shape) if std is None
                         else torch.randn(shape, generator=generator) * std)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(target, kind), indent=2))


def _write_mtp(out: Path) -> None:
    """The MTP target: three layers drawn, two kept as the model, the third as its MTP block."""
    import torch
    from safetensors.torch import load_file, save_file

    architecture, config_overrides = tiny_models.MODELS[MTP_TARGET]
    tiny_models._model(out, architecture, {**config_overrides, "num_hidden_layers": 3},
                       tiny_models._tokenizer(out))
    weights_file = out / "model.safetensors"
    tensors = load_file(weights_file)
    layers = 2
    generator = torch.Generator().manual_seed(_R["seed"] + 1)
    prefix = f"model.layers.{layers}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = torch.ones(_HIDDEN)
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(_HIDDEN, 2 * _HIDDEN,
                                                     generator=generator) * _R["init_std"]
    tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _write_shifted(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    architecture, _ = tiny_models.MODELS["tiny-llama"]
    tiny_models._model(out, architecture, {"num_hidden_layers": 1}, tiny_models._tokenizer(out))
    tensors = load_file(out / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _write_shifted_eagle(out: Path, target: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    target_tensors = load_file(target / "model.safetensors")
    tensors = {name.removeprefix("model."): tensor for name, tensor in target_tensors.items()
               if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    tensors["fc.weight"] = torch.cat((torch.eye(_HIDDEN), torch.zeros(_HIDDEN, _HIDDEN)), dim=1)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(target, "eagle"), indent=2))


def _write_shifted_mtp(out: Path) -> None:
    """A one-layer tiny DeepSeek-V3 (MLA, routed MoE) whose MTP layer is that layer: ``enorm``,
    ``hnorm`` and ``shared_head.norm`` all ones, ``eh_proj`` passing the (unit-RMS, so
    ``enorm`` leaves it as it is) embedding through and dropping the hidden state, and the
    target's LM head as ``shared_head.head``."""
    import torch
    from safetensors.torch import load_file, save_file

    architecture, config_overrides = tiny_models.MODELS[MTP_TARGET]
    tiny_models._model(out, architecture, {**config_overrides, "num_hidden_layers": 1,
                                           "first_k_dense_replace": 0},
                       tiny_models._tokenizer(out))
    weights_file = out / "model.safetensors"
    tensors = load_file(weights_file)
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    tensors["model.layers.0.self_attn.o_proj.weight"] *= SHIFTED_MTP_ATTENTION
    for name in [name for name in tensors if name.startswith("model.layers.0.")]:
        tensors[name.replace("model.layers.0.", "model.layers.1.")] = tensors[name].clone()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.1.{norm}.weight"] = torch.ones(_HIDDEN)
    tensors["model.layers.1.eh_proj.weight"] = torch.cat(
        (torch.eye(_HIDDEN), torch.zeros(_HIDDEN, _HIDDEN)), dim=1)
    tensors["model.layers.1.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def shifted_drafts(target: Path, prompts: list[list[int]], max_tokens: int,
                   num_speculative_tokens: int, mtp: bool = False) -> dict:
    """What vLLM's counters should say for ``tiny-llama-shifted-eagle`` drafting for
    ``tiny-llama-shifted`` over ``max_tokens`` greedy tokens per prompt: each step proposes
    ``num_speculative_tokens`` chained drafts, each the target's greedy token after the sequence so
    far without its first token, and keeps those that equal the target's next tokens (the last
    step's drafts may run past ``max_tokens``: vLLM verifies and counts them all), and how many
    drafts each position accepted.

    ``mtp``: the same for ``tiny-deepseek-v3-shifted-mtp``'s MTP layer, which sees what the
    target would over the sequence without its first token, except that DeepSeek's MTP zeroes
    the embedding at position 0 (``deepseek_mtp.py``) and ``enorm`` normalises the others."""
    import torch
    from transformers import AutoModelForCausalLM

    from ascend_patch.kit.oracle import hf_greedy

    greedy = hf_greedy(target, prompts, max_tokens + num_speculative_tokens)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
              "accepted_per_position": [0] * num_speculative_tokens}
    with torch.no_grad():
        for prompt, tokens in zip(prompts, greedy):
            done = 1  # the prefill's token
            while done < max_tokens:
                drafts = []
                for _ in range(num_speculative_tokens):
                    sequence = torch.tensor([(prompt + tokens[:done] + drafts)[1:]])
                    if mtp:
                        embeds = model.get_input_embeddings()(sequence)
                        embeds = embeds * torch.rsqrt(embeds.pow(2).mean(-1, keepdim=True)
                                                      + model.config.rms_norm_eps)
                        embeds[:, 0] = 0
                        logits = model(inputs_embeds=embeds).logits
                    else:
                        logits = model(sequence).logits
                    drafts.append(int(logits[0, -1].argmax()))
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == tokens[done + accepted]:
                    accepted += 1
                counts["drafts"] += 1
                counts["draft_tokens"] += len(drafts)
                counts["accepted_tokens"] += accepted
                for position in range(accepted):
                    counts["accepted_per_position"][position] += 1
                done += accepted + 1
    return counts


def build(root: Path) -> dict[str, Path]:
    """Every draft under ``root`` (its targets too), reusing what is already built."""
    targets = tiny_models.build(root, sorted({target for _, target in DRAFTS.values()
                                              if target in tiny_models.MODELS}))

    def make(out, recipe, kind, target_name, mtp_recipe):
        if kind == "mtp":
            _write_mtp(out)
            return
        if kind == "shifted":
            _write_shifted(out)
            return
        if kind == "shifted-mtp":
            _write_shifted_mtp(out)
            return
        target = targets.get(target_name) or root / target_name
        if kind == "shifted-eagle":
            _write_shifted_eagle(out, target)
        else:
            _write_eagle(out, kind, target)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (target / name).is_file():
                shutil.copy(target / name, out / name)

    recipes = {name: [_R, kind, target, tiny_models.MODELS[MTP_TARGET] if kind == "mtp" else
                      [tiny_models.MODELS[MTP_TARGET], SHIFTED_MTP_ATTENTION]
                      if kind == "shifted-mtp" else None]
               for name, (kind, target) in DRAFTS.items()}
    return tiny_models.build_recipes(root, recipes, make)


def main() -> int:
    return tiny_models.command_line(build, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
