"""The MLA layer's rope and cache-write ops: the contract-checked references of
``npu_kv_rmsnorm_rope_cache_v2`` (kv_a_layernorm, the rope key and the cache write in one launch)
and ``npu_interleave_rope`` (the query's rope part).

Both rotate a 64-lane rope vector the same documented way: reshape its lanes to ``[32, 2]``,
transpose (even lanes first, then odd), then ``x * cos + RotateHalf(x) * sin`` with cos/sin in
the "half" layout (frequency ``i`` on lanes ``i`` and ``32 + i``). That is vLLM's interleaved
(GPT-J) rope with its output lanes reordered, even then odd: a query and a key rotated so score
as vLLM's do (the dot product ignores a common lane order), so every reader of the rope cache
must rotate its queries this way too.

Contract sources (op-plugin is Ascend/op-plugin; docs under ``docs/context/``):

- [KV-ROPE] ``torch_npu-npu_kv_rmsnorm_rope_cache.md`` (Atlas A2/A3): kv ``[batch_size, 1,
  seq_len, 576]`` bf16/fp16 BNSD, hidden 576 = rms 512 + rope 64 only; gamma ``[512]``; cos/sin
  ``[batch_size, 1, seq_len, 64]``; index int64; PA modes: caches ``[block_num, block_size, 1,
  64 / 512]``, index ``[batch_size * seq_len]`` of global slots, never repeated (else undefined),
  ``block_num >= Ceil(seq_len / block_size) * batch_size``; without scales the caches are bf16 or
  fp16. The torch-npu 2.11-2.14 wheels ship no docstring for it; their schema of ``_v2`` (the
  form that declares ``Tensor(a!) k_cache, Tensor(b!) ckv_cache``) returns the two optional
  outputs ``[batch_size, 1, seq_len, 64]`` and ``[.., 512]`` (its meta kernel). The doc is
  silent on strides: the seam passes contiguous tensors.
- [INTERLEAVE] ``torch_npu-npu_interleave_rope.md`` (Atlas A2/A3): x ``(B, N, S, D)`` bf16/fp16,
  contiguous; cos/sin ``(B, N, S, D)`` with N = 1 and S 1 or x's, x's dtype, contiguous; D = 64.
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_tensor,
    require,
)

_HALF = (torch.float16, torch.bfloat16)
_PA_MODES = ("PA", "PA_BNSD")  # [KV-ROPE] the plain paged modes (the NZ ones lay caches out otherwise)


def rotate_reordered(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Both ops' rope of the last dim (64): lanes reordered even then odd, then RotateHalf with
    half-layout cos/sin, in fp32, rounded once to ``x``'s dtype."""
    half = x.shape[-1] // 2
    lanes = x.float().unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2)
    rotated = torch.cat((-lanes[..., half:], lanes[..., :half]), dim=-1)
    return (lanes * cos.float() + rotated * sin.float()).to(x.dtype)


def kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, epsilon=1e-5,
                          cache_mode="Norm", is_output_kv=False):
    """Normalise ``kv[..., :512]`` (RMS norm with ``gamma``), rotate ``kv[..., 512:]``, write both
    into the paged caches at ``index``; returns the rotated key and the normalised latent."""
    op = "npu_kv_rmsnorm_rope_cache_v2"
    if cache_mode not in _PA_MODES:
        raise NotImplementedError(f"{op}: the seam implements cache_mode 'PA'/'PA_BNSD' only, "
                                  f"got {cache_mode!r}")
    rms, rope = limits.LATENT_DIM, limits.ROPE_DIM
    for name, tensor in (("kv", kv), ("gamma", gamma), ("cos", cos), ("sin", sin),
                         ("k_cache", k_cache), ("ckv_cache", ckv_cache)):
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)
        check_dtype(op, name, tensor, _HALF)
        # [KV-ROPE] no scales: caches bf16/fp16; gamma/cos/sin as kv.
        require(tensor.dtype == kv.dtype, op, name, f"{kv.dtype} like kv", tensor.dtype)
    check_dims(op, "kv", kv, 4)
    batch, heads, seq, hidden = kv.shape
    require(heads == 1 and hidden == rms + rope, op, "kv",
            f"[batch_size, 1, seq_len, {rms + rope}]", tuple(kv.shape))
    require(tuple(gamma.shape) == (rms,), op, "gamma", f"shape ({rms},)", tuple(gamma.shape))
    for name, tensor in (("cos", cos), ("sin", sin)):
        require(tuple(tensor.shape) == (batch, 1, seq, rope), op, name,
                f"shape {(batch, 1, seq, rope)}", tuple(tensor.shape))
    check_dims(op, "k_cache", k_cache, 4)
    block_num, block_size = k_cache.shape[:2]
    require(tuple(k_cache.shape) == (block_num, block_size, 1, rope), op, "k_cache",
            f"[block_num, block_size, 1, {rope}]", tuple(k_cache.shape))
    require(tuple(ckv_cache.shape) == (block_num, block_size, 1, rms), op, "ckv_cache",
            f"shape {(block_num, block_size, 1, rms)}", tuple(ckv_cache.shape))
    blocks_needed = -(-seq // block_size) * batch
    require(block_num >= blocks_needed, op, "k_cache",
            f"block_num ≥ Ceil(seq_len / block_size) × batch_size = {blocks_needed}", block_num)
    check_tensor(op, "index", index)
    check_dtype(op, "index", index, (torch.int64,))
    check_dims(op, "index", index, 1)
    require(index.numel() == batch * seq, op, "index", f"length {batch * seq} (batch_size × "
            "seq_len)", index.numel())
    num_slots = block_num * block_size
    if index.numel():
        low, high = index.aminmax()
        require(0 <= low and high < num_slots, op, "index", f"within [0, {num_slots - 1}]",
                f"range [{int(low)}, {int(high)}]")
        unique = torch.unique(index).numel()
        require(unique == index.numel(), op, "index", "free of duplicates",
                f"{index.numel() - unique} duplicate slot(s)")

    latent = kv[..., :rms].float()
    normed = (latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + epsilon)
              * gamma.float()).to(kv.dtype)
    k_rope = rotate_reordered(kv[..., rms:], cos, sin)
    ckv_cache.view(num_slots, rms).index_copy_(0, index, normed.reshape(-1, rms))
    k_cache.view(num_slots, rope).index_copy_(0, index, k_rope.reshape(-1, rope))
    return k_rope, normed


def interleave_rope(x, cos, sin):
    """The rope of ``x``'s last dim (64) per head, cos/sin broadcast over heads (and over S when
    theirs is 1); a new tensor shaped like ``x``."""
    op = "npu_interleave_rope"
    for name, tensor in (("x", x), ("cos", cos), ("sin", sin)):
        check_tensor(op, name, tensor)
        check_contiguous(op, name, tensor)  # [INTERLEAVE] 不支持非连续的Tensor
        check_dtype(op, name, tensor, _HALF)
        require(tensor.dtype == x.dtype, op, name, f"{x.dtype} like x", tensor.dtype)
        check_dims(op, name, tensor, 4)  # (B, N, S, D)
    batch, _, seq, dim = x.shape
    require(dim == limits.ROPE_DIM, op, "x", f"D = {limits.ROPE_DIM}", dim)
    for name, tensor in (("cos", cos), ("sin", sin)):
        require(tensor.shape[0] == batch and tensor.shape[1] == 1 and tensor.shape[2] in (1, seq)
                and tensor.shape[3] == dim, op, name,
                f"shape ({batch}, 1, 1 or {seq}, {dim})", tuple(tensor.shape))
    require(sin.shape == cos.shape, op, "sin", f"shape {tuple(cos.shape)} like cos",
            tuple(sin.shape))
    return rotate_reordered(x, cos, sin)
