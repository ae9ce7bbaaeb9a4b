"""Rotary embedding on the kernel seam: ``npu_mrope`` for query and key in one launch, else
``npu_rotary_mul`` once per tensor."""

import torch
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import limits


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
        rows = None if key is None else self._mrope_rows(positions, query, key)
        if rows is not None:
            mode = "half" if self.is_neox_style else "interleave"
            cache = self._match_cos_sin_cache_dtype(query)
            rotated = kernels.mrope(positions.flatten(), *rows, cache, self.head_size, mode)
            return rotated[0].view(query.shape), rotated[1].view(key.shape)
        cos, sin = self._step_cos_sin(positions, query)
        return self._rotate(query, cos, sin), None if key is None else self._rotate(key, cos, sin)

    def _mrope_rows(self, positions, query, key):
        """Query and key as the 2-D views npu_mrope takes, or None where it cannot serve them."""
        if not limits.mrope_takes(query.dtype, self.head_size, self.rotary_dim):
            return None
        tokens = positions.numel()
        if not all(_rows(x, tokens) for x in (query, key)):
            return None  # no 2-D view spans the heads (they are not evenly strided)
        return query.view(tokens, -1), key.view(tokens, -1)

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


def _rows(x: torch.Tensor, tokens: int) -> bool:
    """Whether ``x`` (tokens first) has a ``[tokens, -1]`` view: each later dim's stride spans the
    next one (dims of size 1 aside). Decided from the shape, not by trying the view, which
    torch.compile's tracing cannot catch when it fails."""
    dims = [(size, stride) for size, stride in zip(x.shape[1:], x.stride()[1:]) if size != 1]
    return x.shape[0] == tokens and all(
        outer == inner * size for (_, outer), (size, inner) in zip(dims, dims[1:]))
