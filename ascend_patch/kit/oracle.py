"""The CPU oracles: HF transformers on the tiny local models, and how close an engine must come.

An engine in fp16/bf16 cannot equal an fp32 oracle token for token (a rounding flips a near-tie
and the sequences part), so every check scores the engine's own sequences teacher-forced through
HF: each token the engine chose must be the oracle's best or short of it by at most a tolerance,
and most must be exactly the oracle's best. Two tolerances, as the engine tests use them:

- :func:`precision_tracking`: relative to what the dtype alone does, i.e. twice HF's own
  largest logit error in that dtype on the same sequence (the best and the chosen logit may
  both move), and the share of exact tokens at least HF's own share in that dtype, less 5 points;
- :func:`logit_tracking`: the drift of the best logit measured on bf16 engines
  (:data:`LOGIT_DRIFT`, 5 % of its magnitude), against one oracle or several (HF fp32, HF in
  the model dtype, a dequantised model), with a share of exact tokens; for routed (MoE) models
  1 token in 20 may miss every oracle, since a rounding can flip a router's near-tie, a
  discrete change no logit tolerance bounds.

Each returns a :class:`Tracking` with the verdict, a one-line message and the numbers (tokens,
exact tokens, the worst gap in logits — equal to the gap in log-probabilities — and its
tolerance), which ``ascend-patch verify`` records and the tests assert on.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Tracking:
    ok: bool
    message: str
    numbers: dict = field(default_factory=dict)


def prompt_token_ids(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given token lengths, cut from text the tokenizer was not trained on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = textwrap.dedent(importlib.util.find_spec("email.message").loader.get_source("email.message"))
    ids = tokenizer(text).input_ids
    prompts, start = [], 0
    for length in lengths:
        prompts.append(ids[start : start + length])
        start += length
    return prompts


def hf_model(model_dir: Path, dtype=None, **config):
    """The Hugging Face model (fp32 unless ``dtype``; ``config`` overrides config fields).
    Soft-capped attention logits (Gemma 2) need the eager attention: transformers' SDPA path
    silently drops the soft-cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None):
        config.setdefault("attn_implementation", "eager")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32, **config)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers greedy decoding, fp32: the independent oracle."""
    model = hf_model(model_dir)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            # An explicit all-ones mask: otherwise HF masks every prompt token that equals
            # the pad id, which chat prompts (with <s>/</s> inside) contain.
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=0,
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def hf_logits(model_dir: Path, sequences: list[list[int]], dtype: str = "float32") -> list:
    """Next-token logits (as fp32) at every position of each sequence (teacher forcing), from
    the model run in ``dtype``."""
    model = hf_model(model_dir, getattr(torch, dtype))
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0].float() for seq in sequences]


def _generated_rows(logits, prompt, tokens):
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def precision_tracking(model_dir: Path, prompts: list[list[int]], tokens: list[list[int]], dtype: str,
                       top_k: int | None = None) -> Tracking:
    """Tokens an engine in ``dtype`` chose, against HF fp32, with HF's own ``dtype`` drift as
    the yardstick: each token is HF fp32's argmax or short of it by at most twice HF's largest
    ``dtype`` logit error on that sequence, and the share of fp32 argmaxes is HF ``dtype``'s own
    share, give or take 5 points. With ``top_k`` (sampled tokens): each token is within the same
    margin of HF fp32's top-k, and no share is asked."""
    sequences = [p + t for p, t in zip(prompts, tokens)]
    exact_logits, rounded_logits = hf_logits(model_dir, sequences), hf_logits(model_dir, sequences, dtype)
    engine_hits = hf_hits = total = 0
    beyond, worst = [], (-1.0, 0.0, 0.0)  # (gap / tolerance, gap, tolerance)
    for n, (prompt, generated, exact, rounded) in enumerate(zip(prompts, tokens, exact_logits, rounded_logits)):
        rows, rounded_rows = _generated_rows(exact, prompt, generated), _generated_rows(rounded, prompt, generated)
        tolerance = 2 * float((rows - rounded_rows).abs().max()) if len(generated) else 0.0
        for i, (token, row) in enumerate(zip(generated, rows)):
            bound = row.topk(top_k or 1).values[-1]
            gap = max(float(bound - row[token]), 0.0)
            ratio = gap / tolerance if tolerance else (0.0 if gap == 0 else float("inf"))
            worst = max(worst, (ratio, gap, tolerance))
            if gap > tolerance:
                beyond.append((n, i, round(gap, 3), round(tolerance, 3)))
            engine_hits += int(token == int(row.argmax()))
        hf_hits += int((rounded_rows.argmax(-1) == rows.argmax(-1)).sum())
        total += len(generated)
    numbers = {"tokens": total, "exact": engine_hits, "oracle_exact_in_dtype": hf_hits,
               "worst_gap": round(worst[1], 4), "worst_gap_tolerance": round(worst[2], 4)}
    what = f"HF fp32's top-{top_k}" if top_k else "HF fp32's argmax"
    if not total:
        return Tracking(False, "no tokens were generated", numbers)
    if beyond:
        return Tracking(False, f"{len(beyond)} of {total} tokens further from {what} than twice HF "
                               f"{dtype}'s own error: {beyond[:8]}", numbers)
    if top_k:
        return Tracking(True, f"all {total} sampled tokens within {what} (worst gap {worst[1]:.3f} "
                              f"<= {worst[2]:.3f})", numbers)
    if engine_hits / total < hf_hits / total - 0.05:
        return Tracking(False, f"{engine_hits}/{total} tokens are HF fp32's argmax, HF {dtype} "
                               f"itself gets {hf_hits}/{total}", numbers)
    return Tracking(True, f"{engine_hits}/{total} tokens are HF fp32's argmax (HF {dtype}: "
                          f"{hf_hits}/{total}), worst gap {worst[1]:.3f} <= {worst[2]:.3f}", numbers)


LOGIT_DRIFT = 0.05
"""How far below an oracle's best logit, as a share of that logit's magnitude, the logit of a
token a bf16 engine chose may lie. Measured on vLLM 0.33.0 (emulated, 2026-12-05) over the 2,673
tokens the engine tests and ``ascend-patch verify`` score with :func:`logit_tracking`: at most
4.35 % (one token of the bf16 KV-offload run beside decode graphs), next 2.96 % (W8A8 MoE in
bf16), 2.88 % (W8A8 in bf16) and 2.5 % (Mistral's windowed layers in bf16). It is what a bf16
forward pass accumulates, far more than bf16's rounding of the logit itself (8 significant bits,
0.4 %)."""


def logit_tracking(oracles: list[list], prompts: list[list[int]], generated: list[list[int]],
                   min_exact: float = 0.9, routed: bool = False) -> Tracking:
    """Every token the engine chose is, for at least one oracle (per oracle: the next-token
    logits at every position of each prompt + generated sequence), its argmax or short of it by
    at most :data:`LOGIT_DRIFT` of the top logit's magnitude, and at least ``min_exact`` of the
    tokens are an oracle's argmax. ``routed``: at most 1 token in 20 may miss every oracle."""
    exact = total = 0
    misses, worst = [], (-1.0, 0.0, 0.0)  # (gap / tolerance, gap, tolerance) of the closest oracle
    for n, (prompt, tokens) in enumerate(zip(prompts, generated)):
        for i, token in enumerate(tokens):
            rows = [oracle[n][len(prompt) - 1 + i].float() for oracle in oracles]
            scored = []
            for row in rows:
                best = float(row.max())
                gap, tolerance = best - float(row[token]), LOGIT_DRIFT * abs(best)
                ratio = gap / tolerance if tolerance else (0.0 if gap == 0 else float("inf"))
                scored.append((ratio, gap, tolerance))
            closest = min(scored)
            worst = max(worst, closest)
            if closest[0] > 1:
                misses.append((n, i, [round(gap, 3) for _, gap, _ in scored]))
            exact += int(any(token == int(row.argmax()) for row in rows))
            total += 1
    allowed = total // 20 if routed else 0
    numbers = {"tokens": total, "exact": exact, "beyond_tolerance": len(misses),
               "allowed_beyond_tolerance": allowed, "worst_gap": round(worst[1], 4),
               "worst_gap_tolerance": round(worst[2], 4)}
    if len(misses) > allowed:
        return Tracking(False, f"{len(misses)} of {total} tokens beyond the bf16 drift: {misses}", numbers)
    if not total or exact / total < min_exact:
        return Tracking(False, f"{exact}/{total} tokens are an oracle's argmax", numbers)
    return Tracking(True, f"{exact}/{total} tokens are an oracle's argmax, {len(misses)} beyond "
                          f"the drift (allowed {allowed}), worst gap {worst[1]:.3f} <= {worst[2]:.3f}"
                          if not misses else f"{exact}/{total} tokens are an oracle's argmax, "
                          f"{len(misses)} beyond the drift (allowed {allowed})", numbers)


def hf_logit_tracking(model_dir: Path, prompts: list[list[int]], generated: list[list[int]],
                      min_exact: float = 0.9, routed: bool = False, bf16_oracle: bool = False) -> Tracking:
    """:func:`logit_tracking` against HF fp32 and, for ``routed`` models (whose bf16 run flips
    other router ties than the engine) or with ``bf16_oracle`` (models whose bf16 rounding
    alone, HF's as much as ours, moves some logits further than the tolerance, e.g. MLA's
    512-wide latent products), also HF bf16 as a second oracle."""
    sequences = [p + t for p, t in zip(prompts, generated)]
    oracles = [hf_logits(model_dir, sequences)]
    if routed or bf16_oracle:
        oracles.append(hf_logits(model_dir, sequences, "bfloat16"))
    return logit_tracking(oracles, prompts, generated, min_exact, routed)


# -- W8A8 checkpoints: HF on the dequantised weights, activation quantisation simulated ------------


def dynamic_round_trip(x):
    """Per-token symmetric int8, round trip."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / safe).round().clamp(-127, 127) * scale


def _static_round_trip(scale, zero_point):
    return lambda x: ((x / scale + zero_point).round().clamp(-128, 127) - zero_point) * scale


def read_quantized_layers(checkpoint: Path) -> dict[str, tuple[torch.Tensor, object]]:
    """module -> (dequantised float weight [N, K], activation round trip), read independently
    of the engine from the format as written (AscendV1 or compressed-tensors int8)."""
    from safetensors.torch import load_file

    layers = {}
    description = checkpoint / "quant_model_description.json"
    if description.exists():
        tensors = load_file(checkpoint / "quant_model_weights.safetensors")
        for name, kind in json.loads(description.read_text()).items():
            module = name.removesuffix(".weight")
            if not name.endswith(".weight") or kind == "FLOAT":
                continue
            weight = tensors[name].double()
            if kind == "W8A8_DYNAMIC":
                layers[module] = (weight * tensors[f"{module}.weight_scale"].double(), dynamic_round_trip)
                continue
            deq = tensors[f"{module}.deq_scale"]
            deq = (deq.to(torch.int32).view(torch.float32) if deq.dtype == torch.int64 else deq)
            input_scale = float(tensors[f"{module}.input_scale"])
            offset = float(tensors[f"{module}.input_offset"])
            layers[module] = (weight * (deq.double() / input_scale)[:, None],
                              _static_round_trip(input_scale, offset))
        return layers
    tensors = load_file(checkpoint / "model.safetensors")
    for name in tensors:
        if not name.endswith(".weight_scale"):
            continue
        module = name.removesuffix(".weight_scale")
        weight = tensors[f"{module}.weight"].double() * tensors[name].double().reshape(-1, 1)
        if f"{module}.input_scale" in tensors:
            zero = tensors.get(f"{module}.input_zero_point", torch.zeros(1))
            layers[module] = (weight, _static_round_trip(float(tensors[f"{module}.input_scale"]), float(zero)))
        else:
            layers[module] = (weight, dynamic_round_trip)
    return layers


def _experts_forward(layers, prefix):
    """A Qwen3-MoE expert block whose experts see their inputs round-tripped like the layers'."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                x = hidden_states[t]
                weights = {p: layers[f"{prefix}.{e}.{p}"] for p in ("gate_proj", "up_proj",
                                                                    "down_proj")}
                gate = F.linear(weights["gate_proj"][1](x), weights["gate_proj"][0].to(x.dtype))
                up = F.linear(weights["up_proj"][1](x), weights["up_proj"][0].to(x.dtype))
                h = self.act_fn(gate) * up
                down = F.linear(weights["down_proj"][1](h), weights["down_proj"][0].to(x.dtype))
                out[t] += top_k_weights[t, j] * down
        return out
    return forward


def dequantized_logits(float_dir: Path, checkpoint: Path, sequences, dtype=torch.float32):
    """Teacher-forced logits of HF's float model with each quantised layer's weight replaced by
    the checkpoint's dequantised one and its input round-tripped through its int8 scheme."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype)
    layers = read_quantized_layers(checkpoint)
    experts = set()
    for module, (weight, round_trip) in layers.items():
        if ".experts." in module:
            experts.add(module.split(".experts.")[0] + ".experts")
            continue
        linear = model.get_submodule(module)
        linear.weight.data = weight.to(dtype)
        linear.forward = (lambda self, x, rt=round_trip: F.linear(
            rt(x.double()).to(x.dtype), self.weight, self.bias)).__get__(linear)
    for prefix in experts:
        block = model.get_submodule(prefix)
        block.forward = types.MethodType(_experts_forward(
            {m: (w, (lambda x, rt=rt: rt(x.double()).to(x.dtype))) for m, (w, rt) in
             layers.items()}, prefix), block)
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


def quantised_not_float(quantised: list[list], floats: list[list], prompts: list[list[int]],
                        logprobs: list[list[list]]) -> Tracking:
    """An engine's log-probabilities (per prompt, per generated position, its top-k as
    ``[token, logprob, ...]``) lie nearer, on average, the quantised model's than the float
    model's; each model given as oracles like :func:`logit_tracking`'s (e.g. fp32 and the
    engine's dtype), the closest one counting for each value. The token checks cannot tell the
    two apart on a model whose argmaxes quantisation barely moves; its log-probabilities it moves
    everywhere (by about 0.2 on the tiny models, mean over the top 5)."""
    def mean_distance(oracles):
        rows = [[logits.float().log_softmax(-1) for logits in oracle] for oracle in oracles]
        distances = [min(abs(value - float(oracle[n][len(prompt) - 1 + i, token])) for oracle in rows)
                     for n, (prompt, positions) in enumerate(zip(prompts, logprobs))
                     for i, top in enumerate(positions) for token, value, *_ in top]
        return sum(distances) / len(distances), len(distances)

    if not any(logprobs):
        return Tracking(False, "no log-probabilities were reported")
    (to_quantised, count), (to_float, _) = mean_distance(quantised), mean_distance(floats)
    numbers = {"logprobs": count, "mean_to_quantised": round(to_quantised, 4),
               "mean_to_float": round(to_float, 4)}
    nearer = to_quantised < to_float
    return Tracking(nearer, f"{count} log-probabilities {'' if nearer else 'not '}nearer the quantised "
                            f"model's (mean distance {to_quantised:.4f}) than the float model's "
                            f"({to_float:.4f})", numbers)
