"""Quantise the tiny test models to W8A8 int8, in the two formats the NPU path loads.

There is no msModelSlim or llm-compressor here (and no hub), so the checkpoints are written from
the formats' documented facts:

- AscendV1 (msModelSlim ``AscendV1Saver``): ``quant_model_description.json`` (one type per tensor,
  plus ``version`` and ``model_quant_type``) beside ``quant_model_weights.safetensors``; a
  ``W8A8_DYNAMIC`` linear stores ``weight`` int8, ``weight_scale`` fp32 [N, 1] and a zero
  ``weight_offset``; a ``W8A8`` (static) one stores ``weight`` int8, ``input_scale`` and
  ``input_offset`` fp32 [1], ``deq_scale`` = input_scale × weight_scale (fp32 for a bf16 model,
  else its fp32 bits as int64) and ``quant_bias`` int32 = round(bias / deq_scale -
  input_offset × rowsum(weight)); a float ``bias`` is kept, typed ``FLOAT``.
- compressed-tensors (``format: int-quantized``): ``weight`` int8, ``weight_scale`` fp32 [N, 1]
  (channel) or [1] (tensor), static ``input_scale`` fp32 [1] and, asymmetric, ``input_zero_point``
  int8 [1]; the scheme in config.json's ``quantization_config``.

Weights are quantised symmetrically per output channel (or per tensor), static activations
calibrated per tensor from the float model's inputs to each layer on a few prompts.

    python -m ascend_patch.kit.quantized_models MODEL_DIR OUT_DIR {ascend,compressed-tensors}
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_weight(weight: torch.Tensor, per_channel: bool = True):
    """Symmetric int8: ``(W_q int8 [N, K], scale fp32 [N, 1] or [1])``."""
    peak = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)
    scale = (peak / 127).clamp(min=1e-12).float()
    view = scale if per_channel else scale.reshape(1, 1)
    return (weight / view).round().clamp(-127, 127).to(torch.int8), scale


def calibrate(model_dir: Path, token_ids: list[list[int]]) -> dict[str, tuple[float, float]]:
    """Per linear layer (by module name), the min and max of its inputs over the prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ranges: dict[str, tuple[float, float]] = {}

    def observe(name):
        def hook(module, args):
            low, high = float(args[0].min()), float(args[0].max())
            old = ranges.get(name, (low, high))
            ranges[name] = (min(old[0], low), max(old[1], high))
        return hook

    handles = [module.register_forward_pre_hook(observe(name))
               for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in LINEARS]
    with torch.no_grad():
        for ids in token_ids:
            model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return ranges


def activation_params(low: float, high: float) -> tuple[float, int]:
    """Asymmetric per-tensor int8: ``(scale, zero point)`` mapping [low, high] onto [-128, 127]."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max(high - low, 1e-8) / 255
    return scale, int(round(-128 - low / scale))


def mixed_types(module: str) -> str:
    """Every AscendV1 layer type in one two-layer model: layer 0 static attention and a dynamic
    MLP, layer 1 float attention and a static MLP."""
    layer = int(module.split(".")[2])
    if "self_attn" in module:
        return "W8A8" if layer == 0 else "FLOAT"
    return "W8A8_DYNAMIC" if layer == 0 else "W8A8"


def _modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The quantisable linear modules of a checkpoint (attention, dense MLP and experts)."""
    return sorted(name.removesuffix(".weight") for name in tensors
                  if name.endswith(".weight") and name.split(".")[-2] in LINEARS)


def _copy_config(model_dir: Path, out: Path, quantization_config: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.suffix in (".json", ".txt", ".jinja") and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))


def ascend_v1(model_dir: Path, out: Path, types, calibration: list[list[int]] | None = None,
              bf16_model: bool = False) -> Path:
    """An AscendV1 checkpoint. ``types(module) -> "W8A8" | "W8A8_DYNAMIC" | "FLOAT"``."""
    tensors = load_file(model_dir / "model.safetensors")
    chosen = {module: types(module) for module in _modules(tensors)}
    ranges = calibrate(model_dir, calibration) if "W8A8" in chosen.values() else {}
    written, description = {}, {}

    def write(name, kind, tensor):
        written[name] = tensor.contiguous()
        description[name] = kind

    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0]
        if chosen.get(module, "FLOAT") == "FLOAT":
            write(name, "FLOAT", tensor)
        elif name.endswith(".bias"):
            write(name, "FLOAT", tensor.float())
    for module, kind in chosen.items():
        if kind == "FLOAT":
            continue
        weight_q, weight_scale = quantize_weight(tensors[f"{module}.weight"])
        write(f"{module}.weight", kind, weight_q)
        if kind == "W8A8_DYNAMIC":
            write(f"{module}.weight_scale", kind, weight_scale)
            write(f"{module}.weight_offset", kind, torch.zeros_like(weight_scale))
            continue
        input_scale, input_offset = activation_params(*ranges[module])
        deq_scale = (input_scale * weight_scale).reshape(-1).float()
        bias = tensors.get(f"{module}.bias", torch.zeros(weight_q.shape[0])).float()
        correction = weight_q.float().sum(dim=1) * input_offset
        write(f"{module}.quant_bias", kind, (bias / deq_scale - correction).round().to(torch.int32))
        write(f"{module}.input_scale", kind, torch.tensor([input_scale], dtype=torch.float32))
        write(f"{module}.input_offset", kind, torch.tensor([float(input_offset)]))
        if not bf16_model:  # msModelSlim's deqscale2int64: the fp32 bits, widened
            deq_scale = deq_scale.view(torch.int32).to(torch.int64)
        write(f"{module}.deq_scale", kind, deq_scale)
    kinds = set(chosen.values())
    _copy_config(model_dir, out)
    save_file(written, out / "quant_model_weights.safetensors")
    (out / "quant_model_description.json").write_text(json.dumps({
        "version": "1.0.0",
        "model_quant_type": "W8A8" if "W8A8" in kinds else "W8A8_DYNAMIC",
        "group_size": 0, "metadata": {}, **description}, indent=2))
    return out


def compressed_tensors(model_dir: Path, out: Path, *, weights: str = "channel",
                       activations: str = "dynamic", symmetric: bool = True,
                       calibration: list[list[int]] | None = None) -> Path:
    """A compressed-tensors int8 W8A8 checkpoint of every attention/MLP/expert linear layer."""
    tensors = load_file(model_dir / "model.safetensors")
    modules = _modules(tensors)
    static = activations == "static"
    ranges = calibrate(model_dir, calibration) if static else {}
    written = {name: tensor for name, tensor in tensors.items()
               if name.rsplit(".", 1)[0] not in modules or name.endswith(".bias")}
    for module in modules:
        weight_q, weight_scale = quantize_weight(tensors[f"{module}.weight"], weights == "channel")
        written[f"{module}.weight"] = weight_q
        written[f"{module}.weight_scale"] = weight_scale
        if static:
            low, high = ranges[module]
            if symmetric:
                scale, zero_point = max(abs(low), abs(high)) / 127, None
            else:
                scale, zero_point = activation_params(low, high)
            written[f"{module}.input_scale"] = torch.tensor([scale], dtype=torch.float32)
            if zero_point is not None:
                written[f"{module}.input_zero_point"] = torch.tensor([zero_point], dtype=torch.int8)
    scheme = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": weights,
                    "dynamic": False, "group_size": None},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": symmetric,
                              "strategy": "tensor" if static else "token", "dynamic": not static,
                              "group_size": None},
    }
    _copy_config(model_dir, out, {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": scheme},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    })
    save_file({k: v.contiguous() for k, v in written.items()}, out / "model.safetensors")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("format", choices=("ascend", "compressed-tensors"))
    args = parser.parse_args()
    if args.format == "ascend":
        ascend_v1(args.model, args.out, lambda module: "W8A8_DYNAMIC")
    else:
        compressed_tensors(args.model, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
