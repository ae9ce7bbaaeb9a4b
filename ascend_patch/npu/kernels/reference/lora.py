"""Reference kernel of LoRA's batched gather matmul (BGMV), ``npu_batch_gather_matmul_``: each row of
``x`` through its own adapter's A and B, added in place into a column range of ``self``. It enforces
the op's documented input contract, then computes the documented output (the signature of the
:mod:`ascend_patch.npu.kernels.npu` twin).

Contract source (cited next to each check by the tag in brackets): [BGMV-WHEEL] the
``npu_batch_gather_matmul`` / ``npu_batch_gather_matmul_`` docstrings in the torch-npu 2.11-2.14
wheels' ``torch_npu/_op_plugin_docs.py`` (the schema: ``csrc/aten/npu_native_functions_by_codegen.yaml``).
Two points the doc leaves to its example, read from it: ``y_slice_size`` equals weight_b's H2 (the
example updates 4096 of 6144 columns with a 4096-row weight_b), and an index of -1 is valid (the
example draws indices from {-1, 0, 1} for W = 2); that a -1 row is left unchanged, punica's meaning,
is not stated, so on hardware it is unverified.
"""

import torch

from ascend_patch.npu.kernels import limits
from ascend_patch.npu.kernels.composed import gathered_matmul, slot_rows
from ascend_patch.npu.kernels.contracts import (
    check_dims,
    check_dtype,
    check_non_empty,
    check_tensor,
    require,
)


def batch_gather_matmul_(self, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3,
                         y_offset=0, y_slice_size=-1):
    """``self[:, y_offset : y_offset + H2] += scale * (x[t] @ A[i, L]ᵀ) @ B[i, L]ᵀ`` per row ``t`` with
    ``i = indices[t]`` (just ``x[t] @ B[i, L]ᵀ`` without weight_a), rows with ``i = -1`` unchanged;
    returns ``self``."""
    op = "npu_batch_gather_matmul_"
    for name, tensor in (("self", self), ("x", x), ("weight_b", weight_b), ("indices", indices)):
        check_tensor(op, name, tensor)
        check_non_empty(op, name, tensor)  # [BGMV-WHEEL] 不支持空Tensor
    check_dims(op, "self", self, 2)  # [BGMV-WHEEL] [batch_size, y_column]
    check_dims(op, "x", x, 2)  # [batch_size, H1]
    check_dims(op, "weight_b", weight_b, 4)  # [W, L, H2, R], or [W, L, H2, H1] without weight_a
    check_dims(op, "indices", indices, 1)  # [batch_size]
    for name, tensor in (("self", self), ("x", x), ("weight_b", weight_b)):
        check_dtype(op, name, tensor, (torch.float16,))  # [BGMV-WHEEL] 数据类型Float16
    check_dtype(op, "indices", indices, (torch.int32,))  # [BGMV-WHEEL] 数据类型Int32
    batch, columns = self.shape
    hidden = x.shape[1]
    require(x.shape[0] == batch and indices.shape[0] == batch, op, "x, indices",
            f"{batch} rows like self", (x.shape[0], indices.shape[0]))
    require(hidden % limits.BGMV_ALIGN == 0, op, "x", "H1 a multiple of 16", hidden)
    slots, layers, size, inner = weight_b.shape
    require(size % limits.BGMV_ALIGN == 0 and size < columns, op, "weight_b",
            f"H2 a multiple of 16 and below y's {columns} columns", size)  # [BGMV-WHEEL] H2<y_column
    if weight_a is None:
        require(inner == hidden, op, "weight_b", f"[W, L, H2, {hidden}] without weight_a",
                tuple(weight_b.shape))
    else:
        check_tensor(op, "weight_a", weight_a)
        check_dims(op, "weight_a", weight_a, 4)  # [W, L, R, H1]
        check_dtype(op, "weight_a", weight_a, (torch.float16,))
        require(tuple(weight_a.shape) == (slots, layers, inner, hidden), op, "weight_a",
                f"[{slots}, {layers}, {inner}, {hidden}] (W, L like weight_b, R its last dim, H1 x's)",
                tuple(weight_a.shape))
        require(inner % limits.BGMV_ALIGN == 0
                and limits.BGMV_MIN_RANK <= inner <= limits.BGMV_MAX_RANK, op, "weight_a",
                "R a multiple of 16 in [16, 128]", inner)
    require(0 <= layer_idx < layers, op, "layer_idx", f"in [0, {layers})", layer_idx)
    require(0 <= y_offset and y_offset + size <= columns, op, "y_offset",
            f"a column range of {size} inside y's {columns}", y_offset)
    require(y_slice_size == size, op, "y_slice_size", f"weight_b's H2 ({size})", y_slice_size)
    require(bool(((indices >= -1) & (indices < slots)).all()), op, "indices",
            f"in [-1, {slots})", indices.tolist())  # a value contract: read on the host
    slots, rows = slot_rows(indices), x.float()
    if weight_a is not None:
        rows = gathered_matmul(rows, weight_a[:, layer_idx].float(), slots)
    delta = gathered_matmul(rows, weight_b[:, layer_idx].float(), slots)
    self[:, y_offset: y_offset + size] += (scale * delta).to(self.dtype)
    return self
