"""msModelSlim AscendV1 linear layers: ``W8A8`` (static) and ``W8A8_DYNAMIC``.

The tensors each type stores are listed in :mod:`.modelslim`. Every one is loaded through a
dtype-checking loader, and the layer's NPU form (:mod:`.w8a8`) is built once all have arrived.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear

from ascend_patch.npu.quantization import checkpoint, w8a8

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class AscendW8A8LinearMethod(LinearMethodBase):
    """An AscendV1 ``W8A8`` (static) or ``W8A8_DYNAMIC`` linear layer."""

    def __init__(self, prefix: str, static: bool) -> None:
        self.prefix = prefix
        self.static = static

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        load = extra_weight_attrs["weight_loader"]
        rows = sum(output_partition_sizes)
        self.shards = len(output_partition_sizes)
        self.act_dtype = params_dtype

        def add(name, data, dtypes, convert=None, **attrs):
            checkpoint.register(layer, name, data, load, self.prefix, dtypes, convert, **attrs)

        add("weight", torch.empty(rows, input_size_per_partition, dtype=torch.int8), (torch.int8,),
            input_dim=1, output_dim=0)
        add("weight_scale", torch.empty(rows, 1, dtype=torch.float32), _FLOATS, output_dim=0)
        add("weight_offset", torch.empty(rows, 1, dtype=torch.float32), _FLOATS, output_dim=0)
        if not self.static:
            return
        add("deq_scale", torch.empty(rows, dtype=torch.float32), (torch.float32, torch.int64),
            checkpoint.decode_fp32_bits, output_dim=0)
        add("quant_bias", torch.empty(rows, dtype=torch.int32), (torch.int32,), output_dim=0)
        # One per fused shard: the shards see the same input, so they must agree (checked).
        fused = {"needs_scalar_to_array": True} if self.shards > 1 else {}
        add("input_scale", torch.empty(self.shards, dtype=torch.float32), _FLOATS, **fused)
        add("input_offset", torch.empty(self.shards, dtype=torch.float32), _FLOATS, **fused)

    def process_weights_after_loading(self, layer) -> None:
        needed = (["weight", "deq_scale", "quant_bias", "input_scale", "input_offset"]
                  if self.static else ["weight", "weight_scale"])
        checkpoint.require_loaded(layer, self.prefix, needed, self.shards)
        if not self.static:
            w8a8.finish_dynamic(layer, layer.weight.data, layer.weight_scale.data)
            w8a8.drop(layer, "weight_scale", "weight_offset")
            return
        input_scale, input_offset = layer.input_scale.data, layer.input_offset.data
        if not (torch.equal(input_scale, input_scale[:1].expand_as(input_scale))
                and torch.equal(input_offset, input_offset[:1].expand_as(input_offset))):
            raise checkpoint.QuantizedCheckpointError(
                f"{checkpoint.where(self.prefix)}: its parts quantise the same input with "
                f"different input scales/offsets ({input_scale.tolist()}, {input_offset.tolist()})")
        # quant_bias carries the float bias and the zero-point correction of the whole input:
        # a row-parallel layer adds it on one rank only, as vLLM does its bias.
        first_rank = not isinstance(layer, RowParallelLinear) or layer.tp_rank == 0
        w8a8.finish_static(layer, layer.weight.data, layer.deq_scale.data, input_scale[:1],
                           input_offset[:1], layer.quant_bias.data if first_rank else None,
                           self.act_dtype)
        w8a8.drop(layer, "weight_scale", "weight_offset", "deq_scale", "quant_bias",
                  "input_scale", "input_offset")

    def apply(self, layer, x, bias=None):
        # A static layer's quant_bias already holds its float bias (msModelSlim folds it in).
        return w8a8.apply(layer, x, None if self.static else bias)

