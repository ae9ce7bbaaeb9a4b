"""What the Ascend attention backends share: the backend's face to vLLM (name, dtypes, output
buffer) with the one ``get_kv_cache_shape`` seam, the constructor of the decoder and encoder-only
impls with their refusals, and the one cache of the kernels' causal masks.

Each backend names the shape of one KV-cache block (:meth:`AscendBackend.kv_block_shape`);
vLLM 0.20–0.28 ask for the whole cache through ``get_kv_cache_shape``, which 0.29 removed, so
only the releases that still call it get the hook (the manifest's ``Seam`` on
``AttentionBackend.get_kv_cache_shape``).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType

from ascend_patch.npu.attention import paths
from ascend_patch.npu.kernels import limits

Metadata = TypeVar("Metadata")
_masks: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def causal_mask(device: torch.device, dtype: torch.dtype = torch.int8,
                size: int = limits.CAUSAL_MASK_SIZE) -> torch.Tensor:
    """The kernels' compressed ``size × size`` mask, nonzero (masked) exactly above the diagonal
    (by default FIA's, for ``sparse_mode`` 3 and 4): one per device, dtype and size for every
    layer (the reference kernels verify a mask's content once per tensor)."""
    key = (device, dtype, size)
    if key not in _masks:
        # A normal tensor, not an inference-mode one, so kernels can cache checks on it.
        with torch.inference_mode(False):
            _masks[key] = torch.ones(size, size, dtype=dtype, device=device).triu_(1)
    return _masks[key]


class AscendBackend(AttentionBackend):
    """The Ascend backends' face to vLLM: the output buffer taken, the dtypes, the cache update
    inside ``forward``, and the KV-cache shape on the releases that ask for it."""

    accept_output_buffer = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def kv_block_shape(cls, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """One block of this backend's KV cache, the cache being ``[num_blocks, *this]``."""
        raise NotImplementedError

    if hasattr(AttentionBackend, "get_kv_cache_shape"):  # seam: until vLLM 0.29
        # vLLM 0.20–0.28 view each layer's raw KV bytes in the shape the backend names here
        # (with the default identity stride order). 0.29 removed the hook.

        @classmethod
        def get_kv_cache_shape(
            cls,
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            return (num_blocks, *cls.kv_block_shape(block_size, num_kv_heads, head_size))


class AscendImpl(AttentionImpl[Metadata]):
    """The constructor and ``forward`` vLLM calls for the decoder and encoder-only layers (MLA
    layers have their own): what no kernel path of the impl takes is refused in one line, the
    rest recorded; ``forward`` refuses fused output quantization, zeroes the output of the
    memory-profiling pass and hands every real step to :meth:`attend`."""

    served_attn_type: str = AttentionType.DECODER
    """The one attention type the impl serves."""
    label: str = "Ascend attention backend"
    """How refusals name the impl."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str | None = None,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported,
    ) -> None:
        attn_type = self.served_attn_type if attn_type is None else attn_type
        paths.refuse_unsupported(self.label, {
            "ALiBi": alibi_slopes is not None,
            f"attention type {attn_type}": attn_type != self.served_attn_type,
        }, unsupported)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        # vLLM's window: the query's own key and the sliding_window - 1 before it (and, in
        # encoder-only layers, after it).
        self.sliding_window = sliding_window
        self.soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Metadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        if attn_metadata is None:  # the memory-profiling pass
            return output.fill_(0)
        self.attend(layer, query, key, value, kv_cache, attn_metadata, output)
        return output

    def attend(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, meta: Metadata, output: torch.Tensor) -> None:
        """One step of the layer's attention written into ``output`` (rows past the step's real
        tokens are padding)."""
        raise NotImplementedError
