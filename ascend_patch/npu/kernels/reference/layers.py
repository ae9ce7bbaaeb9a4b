"""Reference kernels of the layer ops: RMS norm (plain and with the residual add), SwiGLU and the
rotary embedding. Each enforces its torch_npu op's documented input contract, then computes that
op's documented output (the signatures of the ``ascend_patch.npu.kernels.npu`` twins).

Contract sources (cited next to each check by the tag in brackets; op-plugin is Ascend/op-plugin at
517f2e7d, docs under ``docs/zh/custom_APIs/torch_npu/``):

- [RMS] ``（beta）torch_npu-npu_rms_norm.md``; [RMS-WHEEL] its docstring in the torch-npu 2.11-2.14
  wheels' ``_op_plugin_docs.py`` ("gamma：...数据类型需要和self保持一致"; the .md's A2/A3 table also
  lists an fp32 gamma beside fp16/bf16 self, which the wheels' own doc does not allow);
  [ADD-RMS] ``torch_npu-npu_add_rms_norm.md``;
  [SWIGLU] ``（beta）torch_npu-npu_swiglu.md``.
- [ROTARY-MUL] the ``npu_rotary_mul`` docstring in the torch-npu wheels' ``torch_npu/_op_plugin_docs.py``
  (2.10.0.post4 to 2.14.0, identical: 4-D input, layouts BNSD/BSND/SBND and the cos/sin shapes
  each takes); ``op_plugin/ops/opapi/RotaryMulKernelNpuOpApi.cpp``.
- [MROPE] ``torch_npu-npu_mrope.md`` (its RoPE mode, one-dimensional positions; the torch-npu
  2.11-2.14 wheels' docstring says the same of shapes, dtypes and dims); [MROPE-BINDING]
  ``op_plugin/ops/opapi/RopeWithSinCosCacheKernelNpuOpApi.cpp``, whose check takes rotary_mode
  "half" or "interleave" only (the .md's "interleaved" is refused there); [MROPE-WHEEL] the
  torch-npu 2.14 wheel's docstring: positions (numTokens) is RoPE mode, (3, numTokens) mrope mode,
  whose sections sum to rotary_dim / 2; [MROPE-SECTIONS] CANN ops-transformer
  ``posembedding/rope_with_sin_cos_cache`` (README.md 约束说明, docs/aclnnRopeWithSinCosCacheV2.md):
  the sections the kernels take, one positions row per section, and the mrope formula.
"""

import torch
import torch.nn.functional as F

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.contracts import (
    check_contiguous,
    check_dims,
    check_dtype,
    check_non_empty,
    check_tensor,
    require,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# --- norms and activation -------------------------------------------------------------------------

def rms_norm(self, gamma, epsilon=1e-6):
    """``y = x / sqrt(mean(x²) + eps) * gamma`` over gamma's trailing dims; returns (y, rstd)."""
    op = "npu_rms_norm"
    check_tensor(op, "self", self)
    check_tensor(op, "gamma", gamma)
    check_dims(op, "self", self, 2, 8)  # [RMS] self: shape 支持 2-8 维
    check_dtype(op, "self", self, _FLOATS)  # [RMS-WHEEL] float16、bfloat16、float32
    require(gamma.dtype == self.dtype, op, "gamma", f"{self.dtype} like self", gamma.dtype)  # [RMS-WHEEL]
    _check_trailing(op, "gamma", gamma, self)  # [RMS] gamma_shape = self_shape[n:]
    return _rms(self.float(), gamma, epsilon, self.dtype)


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """``x = x1 + x2``; returns ``(rms_norm(x) * gamma, rstd, x)``: x is the new residual."""
    op = "npu_add_rms_norm"
    for name, tensor in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        check_tensor(op, name, tensor)
        check_non_empty(op, name, tensor)  # [ADD-RMS] 不支持空Tensor
    check_dims(op, "x1", x1, 1, 8)  # [ADD-RMS] 1-8 维
    check_dtype(op, "x1", x1, _FLOATS)  # [ADD-RMS] float32、float16、bfloat16
    # [ADD-RMS] x = x1 + x2 element-wise; gamma 数据类型与 x1 一致, shape 为 x1 的后几维.
    require(x2.shape == x1.shape and x2.dtype == x1.dtype, op, "x2",
            f"{x1.dtype} of shape {tuple(x1.shape)} like x1", f"{x2.dtype} {tuple(x2.shape)}")
    require(gamma.dtype == x1.dtype, op, "gamma", f"{x1.dtype} like x1", gamma.dtype)
    _check_trailing(op, "gamma", gamma, x1)
    total = x1.float() + x2.float()
    y, rstd = _rms(total, gamma, epsilon, x1.dtype)
    return y, rstd, total.to(x1.dtype)


def _check_trailing(op, arg, gamma, x):
    require(1 <= gamma.dim() <= x.dim() and gamma.shape == x.shape[x.dim() - gamma.dim():], op, arg,
            f"trailing dims of {tuple(x.shape)}", tuple(gamma.shape))


def _rms(x, gamma, epsilon, dtype):
    """rstd is fp32 and keeps the normalised dims as 1s ([ADD-RMS] x1 (2,3,4,8), gamma (8) →
    rstd (2,3,4,1))."""
    dims = tuple(range(-gamma.dim(), 0))
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(dtype), rstd


def swiglu(self, dim=-1):
    """``silu(A) * B`` where A, B are the first and second halves of ``self`` along ``dim``."""
    op = "npu_swiglu"
    check_tensor(op, "self", self)
    check_dims(op, "self", self, 1, 8)  # [SWIGLU] 1-8 维
    check_dtype(op, "self", self, _FLOATS)  # [SWIGLU] float32、float16、bfloat16
    check_contiguous(op, "self", self)  # [SWIGLU] 不支持非连续的Tensor
    check_non_empty(op, "self", self)  # [SWIGLU] 不支持空Tensor
    rank = self.dim()
    require(-rank <= dim < rank, op, "dim", f"in [{-rank}, {rank - 1}]", dim)
    # [SWIGLU] shape 必须在 dim 对应维度上可被 2 整除.
    require(self.shape[dim] % 2 == 0, op, "self", f"even-sized on dim {dim}", tuple(self.shape))
    first, second = self.float().chunk(2, dim=dim)
    return (F.silu(first) * second).to(self.dtype)


# --- rotary embedding -----------------------------------------------------------------------------


# [ROTARY-MUL] 约束说明, jit_compile=False (the A2/A3 path): the input's layout is BNSD, BSND or
# SBND, and r1/r2 "对应input layout的支持情况" take these shapes (1: a broadcast axis).
_ROTARY_FACTORS = {
    "half": {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"),
             "SBND": ("S11D", "SB1D", "SBND")},
    "interleave": {"BNSD": ("11SD",), "BSND": ("1S1D",), "SBND": ("S11D",)},
}


def rotary_mul(self, r1, r2, rotary_mode="half"):
    """``x * r1 + rotate(x) * r2``; "half" rotates halves (NeoX), "interleave" pairs (GPT-J)."""
    op = "npu_rotary_mul"
    # [ROTARY-MUL] binding: rotary_mode must be "half" or "interleave".
    require(rotary_mode in ("half", "interleave"), op, "rotary_mode", "'half' or 'interleave'",
            repr(rotary_mode))
    check_tensor(op, "self", self)
    # [ROTARY-MUL] 参数说明: input, cos, sin "4维Tensor" (the wheel's doc, torch-npu 2.10-2.14);
    # a 3-D [T, N, D] query must be viewed as one of the 4-D layouts first.
    check_dims(op, "self", self, 4)
    check_dtype(op, "self", self, _FLOATS)
    head_dim = self.shape[-1]
    # [ROTARY-MUL] jit_compile=False: D < 896 且为 2 的倍数.
    require(head_dim % 2 == 0 and head_dim < limits.ROTARY_HEAD_DIM_BELOW, op, "self",
            f"an even last dim below {limits.ROTARY_HEAD_DIM_BELOW}", head_dim)
    check_tensor(op, "r1", r1)
    check_tensor(op, "r2", r2)
    # [ROTARY-MUL] "r2: 同r1" (and the CANN tiling: "cos shape and sin shape should be equal").
    require(r2.shape == r1.shape, op, "r2", f"shape {tuple(r1.shape)} like r1", tuple(r2.shape))
    readings = _rotary_layouts(op, self, r1, rotary_mode)
    # [ROTARY-MUL] half: "B, N < 1000"; interleave: "B * N < 1000". The op has no layout
    # argument: it reads the layout off the factors' broadcast axes, and a shape several
    # layouts explain computes the same product, so one reading within the limits suffices.
    below = limits.ROTARY_BATCH_HEADS_BELOW
    within = [(layout, b, n) for layout, b, n in readings
              if (b < below and n < below if rotary_mode == "half" else b * n < below)]
    limit = f"B and N below {below}" if rotary_mode == "half" else f"B * N below {below}"
    require(bool(within), op, "self", f"{limit} in {rotary_mode} mode",
            ", ".join(f"{layout} with B={b}, N={n}" for layout, b, n in readings))
    for name, factor in (("r1", r1), ("r2", r2)):
        check_dtype(op, name, factor, _FLOATS)  # mixed dtypes are cast to self's by the binding
        # [ROTARY-MUL] r1、r2 数据范围 [-1, 1].
        if factor.numel():
            low, high = factor.aminmax()
            require(-1 <= low and high <= 1, op, name, "within [-1, 1]",
                    f"range [{float(low)}, {float(high)}]")
    x = self.float()
    cos, sin = r1.to(self.dtype).float(), r2.to(self.dtype).float()
    if rotary_mode == "half":
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * cos + rotated * sin).to(self.dtype)


def mrope(positions, query, key, cos_sin_cache, head_size, rotary_mode="half", mrope_section=None):
    """RoPE of query and key in one call, cos|sin gathered from the cache by position: each head's
    first ``rotary_dim`` lanes rotate ("half": NeoX halves, "interleave": GPT-J pairs), the rest
    pass. In mrope mode (``mrope_section`` not [0, 0, 0]) each section of the cos|sin lanes comes
    from its own positions row (cache_mode "default", the only one the seam passes). The outputs
    are new [tokens, heads * head_size] tensors."""
    op = "npu_mrope"
    # [MROPE-BINDING] rotary_mode only support half or interleave.
    require(rotary_mode in ("half", "interleave"), op, "rotary_mode", "'half' or 'interleave'",
            repr(rotary_mode))
    # [MROPE-WHEEL] the binding's default [0, 0, 0] is RoPE mode; any other section is mrope mode.
    section = [0, 0, 0] if mrope_section is None else list(mrope_section)
    check_tensor(op, "positions", positions)
    check_dtype(op, "positions", positions, (torch.int32, torch.int64))
    check_tensor(op, "cos_sin_cache", cos_sin_cache)
    check_dims(op, "cos_sin_cache", cos_sin_cache, 2)  # (max_seq_len, rotary_dim)
    check_dtype(op, "cos_sin_cache", cos_sin_cache, _FLOATS)
    max_positions, rotary_dim = cos_sin_cache.shape
    if section == [0, 0, 0]:
        # [MROPE] positions: RoPE mode, 1-D (num_tokens), int32 or int64.
        check_dims(op, "positions", positions, 1)
    else:
        # [MROPE-SECTIONS] only the listed sections, summing to rotary_dim / 2; positions
        # (len(section), num_tokens).
        require(limits.mrope_section_takes(section, rotary_dim), op, "mrope_section",
                f"one of {[list(s) for s in limits.MROPE_SECTIONS]} summing to rotary dim "
                f"{rotary_dim} / 2", section)
        check_dims(op, "positions", positions, 2)
        require(positions.shape[0] == len(section), op, "positions",
                f"{len(section)} rows, one per mrope section", tuple(positions.shape))
    tokens = positions.shape[-1]
    for name, x in (("query", query), ("key", key)):
        # [MROPE] 2-D (num_tokens, heads * head_size), non-contiguous allowed; the float type of
        # query, key and cos_sin_cache must agree.
        check_tensor(op, name, x)
        check_dims(op, name, x, 2)
        require(x.dtype == cos_sin_cache.dtype, op, name, f"{cos_sin_cache.dtype} like cos_sin_cache",
                x.dtype)
        require(x.shape[0] == tokens and x.shape[1] % head_size == 0, op, name,
                f"shape ({tokens}, heads * {head_size})", tuple(x.shape))
    # [MROPE] rotary_dim <= head_size, both multiples of 32 (fp16/bf16) or 16 (fp32).
    require(limits.mrope_takes(query.dtype, head_size, rotary_dim), op, "cos_sin_cache",
            f"a rotary dim <= head size {head_size}, both multiples of "
            f"{limits.MROPE_DIM_MULTIPLE[str(query.dtype).removeprefix('torch.')]}", rotary_dim)
    # [MROPE] every position indexes a cache row (out of range: "越界报错").
    if tokens:
        low, high = positions.aminmax()
        require(0 <= low and high < max_positions, op, "positions", f"within [0, {max_positions})",
                f"range [{int(low)}, {int(high)}]")
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    if section != [0, 0, 0]:
        # [MROPE-SECTIONS] cacheMode 0: lanes of section i from positions row i.
        cos, sin = (torch.cat([part[i] for i, part in enumerate(x.split(section, dim=-1))], dim=-1)
                    for x in (cos, sin))
    cos, sin = cos[:, None], sin[:, None]
    return tuple(_rope_heads(x, cos, sin, head_size, rotary_mode) for x in (query, key))


def _rope_heads(x, cos, sin, head_size, rotary_mode):
    """[MROPE] 计算公式, RoPE mode: o1 = x1 * cos - x2 * sin, o2 = x2 * cos + x1 * sin."""
    heads = x.float().reshape(x.shape[0], -1, head_size)
    rotary_dim = 2 * cos.shape[-1]
    lanes, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
    if rotary_mode == "half":
        x1, x2 = lanes.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = lanes[..., 0::2], lanes[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype).view(x.shape)


def _rotary_layouts(op, x, factor, rotary_mode):
    """The layouts of ``x`` whose documented factor shapes ``factor`` has, as (layout, B, N)."""
    readings = []
    for layout, patterns in _ROTARY_FACTORS[rotary_mode].items():
        sizes = {**dict(zip(layout, x.shape)), "1": 1}
        shapes = [tuple(sizes[axis] for axis in pattern) for pattern in patterns]
        if tuple(factor.shape) in shapes:
            readings.append((layout, sizes["B"], sizes["N"]))
    allowed = "; ".join(f"{layout}: {', '.join(patterns)}"
                        for layout, patterns in _ROTARY_FACTORS[rotary_mode].items())
    require(bool(readings), op, "r1", f"one of {rotary_mode} mode's cos/sin layouts for the input "
            f"{tuple(x.shape)} ({allowed})", tuple(factor.shape))
    return readings
