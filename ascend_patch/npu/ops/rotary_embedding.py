"""Rotary embedding on the kernel seam: ``npu_mrope`` for query and key in one launch, else
``npu_rotary_mul`` once per tensor; vLLM's multimodal rotary (M-RoPE) on ``npu_mrope``'s mrope
mode where the op takes its sections."""

import logging

import torch
from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding, RotaryEmbedding

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import limits

logger = logging.getLogger("vllm.ascend_patch")


class AscendRotaryEmbedding(RotaryEmbedding):
    """RoPE of a step's query and key, contiguous outputs, fp32 capable.

    ``npu_mrope`` (its RoPE mode, vllm-ascend's call outside Triton) rotates both in one launch
    and gathers cos/sin from vLLM's cos|sin cache by position itself. It takes query and key as
    2-D ``[T, heads * head_size]`` tensors, strided ones included, so the views of one qkv buffer
    models split go in unchanged; its head size and rotary dim must be multiples of 32 (16 in
    fp32).

    Otherwise (other head sizes, a missing key, heads that no 2-D view spans, as MLA's slices of
    the query) ``npu_rotary_mul`` runs per tensor: it takes 4-D tensors only (BNSD, BSND or
    SBND), so a query or key of ``T`` tokens is viewed as BSND with one batch, ``[1, T, N, D]``
    (no copy), and cos/sin as ``[1, T, 1, D]``, the 1S1D layout both rotary modes accept for
    BSND. Those cos/sin are gathered once per step, in one launch, and shared by every layer:
    models build one rotary module for all layers, and positions only change between forward
    passes. What they are gathered from, vLLM's cos|sin cache laid out per rotary mode (each
    frequency on the two lanes it rotates), is built once, at the first forward.
    """

    _step = None  # (forward context, positions) the cached cos/sin belong to
    _cos_sin = None
    _table = None  # (vLLM's cos|sin cache, its cos and sin per lane [2, positions, rotary_dim])

    def forward_oot(self, positions, query, key=None):
        rows = None if key is None else _mrope_rows(self, positions.numel(), query, key)
        if rows is not None:
            mode = "half" if self.is_neox_style else "interleave"
            cache = self._match_cos_sin_cache_dtype(query)
            rotated = kernels.mrope(positions.flatten(), *rows, cache, self.head_size, mode)
            return rotated[0].view(query.shape), rotated[1].view(key.shape)
        cos, sin = self._step_cos_sin(positions, query)
        return self._rotate(query, cos, sin), None if key is None else self._rotate(key, cos, sin)

    def _step_cos_sin(self, positions: torch.Tensor, query: torch.Tensor):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        step = (get_forward_context(), positions) if is_forward_context_available() else None
        if step is not None and self._step is not None and all(a is b for a, b in zip(step, self._step)):
            return self._cos_sin
        cos, sin = self._lanes(query).index_select(1, positions.flatten())
        self._cos_sin = (cos[None, :, None], sin[None, :, None])  # [1, T, 1, rotary_dim]: 1S1D
        self._step = step
        return self._cos_sin

    def _lanes(self, query: torch.Tensor) -> torch.Tensor:
        """vLLM's cos|sin cache as ``[2, positions, rotary_dim]``: cos, then sin, per lane."""
        cache = self._match_cos_sin_cache_dtype(query)
        if self._table is None or self._table[0] is not cache:
            cos, sin = cache.chunk(2, dim=-1)
            if self.is_neox_style:  # "half": lanes i and i + d/2 share a frequency
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            else:  # "interleave": lanes 2i and 2i + 1 share a frequency
                cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
            self._table = (cache, torch.stack((cos, sin)))
        return self._table[1]

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        shape = x.shape
        x = x.view(1, cos.shape[1], -1, self.head_size)  # BSND, one batch of T tokens
        mode = "half" if self.is_neox_style else "interleave"
        if self.rotary_dim == self.head_size:
            return kernels.rotary_mul(x, cos, sin, mode).view(shape)
        rotated = kernels.rotary_mul(x[..., : self.rotary_dim].contiguous(), cos, sin, mode)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1).view(shape)


class AscendMRotaryEmbedding(MRotaryEmbedding):
    """vLLM's M-RoPE (the Qwen2-VL, Qwen2.5-VL and Qwen3-VL decoders') on ``npu_mrope``, query and
    key in one launch: its mrope mode for ``[3, T]`` positions (the cos|sin lanes of each section,
    temporal, height and width, from that section's positions row) and its RoPE mode for text-only
    ``[T]`` positions, on the same query/key views :class:`AscendRotaryEmbedding` hands it.

    vLLM's native torch serves the ``[3, T]`` positions of a layer whose sections the op does not
    take (:meth:`native_reason`, logged when the layer is built), and whatever no 2-D view spans
    or the op's head-size rule excludes, as for plain RoPE.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._native_reason = self.native_reason()
        if self._native_reason is not None:
            logger.info("ascend-patch: MRotaryEmbedding (sections %s%s) runs vLLM's native torch "
                        "for multimodal positions, not npu_mrope: %s", self.mrope_section,
                        ", interleaved" if self.mrope_interleaved else "", self._native_reason)

    def native_reason(self) -> str | None:
        """Why npu_mrope's mrope mode cannot serve this layer's ``[3, T]`` positions, or None."""
        if self.mrope_interleaved:
            return ("interleaved sections need npu_mrope's cache_mode 'interleave', which only "
                    "aclnnRopeWithSinCosCacheV2 runs (the binding refuses it on a CANN without it)")
        if not limits.mrope_section_takes(self.mrope_section, self.rotary_dim):
            return (f"npu_mrope takes the sections {[list(s) for s in limits.MROPE_SECTIONS]} "
                    f"(summing to rotary dim / 2) only")
        if not limits.mrope_takes(self.dtype, self.head_size, self.rotary_dim):
            return (f"head size {self.head_size} and rotary dim {self.rotary_dim} in {self.dtype}: "
                    "npu_mrope takes multiples of "
                    f"{limits.MROPE_DIM_MULTIPLE.get(str(self.dtype).removeprefix('torch.'))}")
        return None

    def forward_oot(self, positions, query, key=None, offsets=None):
        multimodal = positions.ndim == 2
        rows = None
        if key is not None and offsets is None and not (multimodal and self._native_reason):
            rows = _mrope_rows(self, positions.shape[-1], query, key)
        if rows is None:
            return self.forward_native(positions, query, key, offsets)
        mode = "half" if self.is_neox_style else "interleave"
        cache = self._match_cos_sin_cache_dtype(query)
        section = self.mrope_section if multimodal else None
        rotated = kernels.mrope(positions, *rows, cache, self.head_size, mode, section)
        return rotated[0].view(query.shape), rotated[1].view(key.shape)


def _mrope_rows(rope, tokens: int, query: torch.Tensor, key: torch.Tensor):
    """Query and key as the 2-D views npu_mrope takes, or None where it cannot serve them."""
    if not limits.mrope_takes(query.dtype, rope.head_size, rope.rotary_dim):
        return None
    if not all(_rows(x, tokens) for x in (query, key)):
        return None  # no 2-D view spans the heads (they are not evenly strided)
    return query.view(tokens, -1), key.view(tokens, -1)


def _rows(x: torch.Tensor, tokens: int) -> bool:
    """Whether ``x`` (tokens first) has a ``[tokens, -1]`` view: each later dim's stride spans the
    next one (dims of size 1 aside). Decided from the shape, not by trying the view, which
    torch.compile's tracing cannot catch when it fails."""
    dims = [(size, stride) for size, stride in zip(x.shape[1:], x.stride()[1:]) if size != 1]
    return x.shape[0] == tokens and all(
        outer == inner * size for (_, outer), (size, inner) in zip(dims, dims[1:]))
