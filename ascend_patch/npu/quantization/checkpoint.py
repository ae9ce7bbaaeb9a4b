"""Load-time checks for quantised checkpoints: what a layer needs must arrive, in its dtype.

vLLM's loaders copy a checkpoint tensor into a parameter with ``Tensor.copy_``, which casts any
dtype silently (a float tensor where int8 weights belong becomes garbage), and vLLM checks for
tensors that never arrived only for unquantised models. So every quantised parameter gets a
loader that checks the dtype first and records which shards arrived, and the method asks
:func:`require_loaded` before it builds the NPU form. Either failure names the module; the
engine does not start, so nothing half-loaded is ever served.
"""

from __future__ import annotations

import functools

import torch


class QuantizedCheckpointError(ValueError):
    """A quantised checkpoint lacks a tensor a layer needs, or stores one in the wrong dtype."""


class UnsupportedQuantizationError(NotImplementedError):
    """A layer is quantised with a scheme the NPU path does not run."""


def where(prefix: str) -> str:
    """``model: layer 'prefix'`` for error messages."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config().model_config  # None outside an engine's config
    model = (config.model if config is not None else None) or "this model"
    return f"{model}: layer {prefix!r}"


def checked_loader(load, prefix: str, name: str, dtypes: tuple[torch.dtype, ...], convert=None):
    """``load`` behind a dtype check that records each part of the parameter that arrived
    (its ``ascend_loaded`` set); ``convert`` maps the tensor before loading."""

    @functools.wraps(load)
    def weight_loader(param, loaded_weight, *args, **kwargs):
        if loaded_weight.dtype not in dtypes:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise QuantizedCheckpointError(
                f"{where(prefix)}: the checkpoint stores {name} as "
                f"{str(loaded_weight.dtype).removeprefix('torch.')}, expected {allowed}")
        if convert is not None:
            loaded_weight = convert(loaded_weight)
        result = load(param, loaded_weight, *args, **kwargs)
        if result is not False:  # MoE loaders return False for another rank's expert
            # The loader's other arguments name the part: (shard id) for a fused linear
            # layer, (weight name, shard id, expert id) for experts, nothing for a whole one.
            param.ascend_loaded.add(args + tuple(sorted(
                (key, value) for key, value in kwargs.items() if key != "return_success")))
        return result

    return weight_loader


def register(layer: torch.nn.Module, name: str, data: torch.Tensor, load, prefix: str,
             dtypes: tuple[torch.dtype, ...], convert=None, **attrs) -> torch.nn.Parameter:
    """A parameter loaded through :func:`checked_loader`."""
    param = torch.nn.Parameter(data, requires_grad=False)
    param.ascend_loaded = set()
    param.weight_loader = checked_loader(load, prefix, name, dtypes, convert)
    for key, value in attrs.items():
        setattr(param, key, value)
    layer.register_parameter(name, param)
    return param


def require_loaded(layer: torch.nn.Module, prefix: str, names, shards: int) -> None:
    """Every named parameter got ``shards`` parts (or one whole tensor) from the checkpoint."""
    missing = []
    for name in names:
        loaded = getattr(layer, name).ascend_loaded
        if len(loaded) < shards and () not in loaded:
            missing.append(name)
    if missing:
        raise QuantizedCheckpointError(
            f"{where(prefix)}: the checkpoint has no {', '.join(missing)} for it "
            f"({len(missing)} of the tensors its quantisation needs)")


def decode_fp32_bits(tensor: torch.Tensor) -> torch.Tensor:
    """msModelSlim's int64 ``deq_scale``: each fp32 scale's bit pattern read as int32 and widened
    (``deqscale2int64``); anything else as fp32."""
    if tensor.dtype == torch.int64:
        return tensor.to(torch.int32).view(torch.float32)
    return tensor.float()
