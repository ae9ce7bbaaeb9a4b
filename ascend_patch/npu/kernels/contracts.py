"""The error type of the kernel seam and the small checks every reference kernel shares.

A violated torch_npu contract usually surfaces on hardware as an opaque ACL error code (561002
and friends) or, worse, as silently wrong numbers. The reference kernels turn each documented rule
into a ``KernelContractError`` that names the op, the argument, what was passed and what the
documentation asks for, so the emulator fails where the NPU would, and says why.

The checks run in every decode step, so they read shapes, dtypes and host-side lists, and touch
tensor values only where the contract is about values (ranges, duplicates).
"""

from collections.abc import Collection

import torch


class KernelContractError(ValueError):
    """An input breaks the documented contract of a torch_npu op."""


_SHOWN_ITEMS = 8


def fail(op: str, arg: str, expected: str, found: object) -> None:
    """Raise the seam's standard message: ``op: arg must be <expected>, got <found>``."""
    if isinstance(found, list) and len(found) > _SHOWN_ITEMS:  # e.g. a 4096-entry length list
        shown = ", ".join(map(str, found[:_SHOWN_ITEMS]))
        found = f"[{shown}, ...] ({len(found)} entries)"
    raise KernelContractError(f"{op}: {arg} must be {expected}, got {found}")


def require(condition: bool, op: str, arg: str, expected: str, found: object) -> None:
    if not condition:
        fail(op, arg, expected, found)


def check_tensor(op: str, arg: str, value: object) -> torch.Tensor:
    require(isinstance(value, torch.Tensor), op, arg, "a torch.Tensor", type(value).__name__)
    return value


def check_dtype(op: str, arg: str, tensor: torch.Tensor, allowed: Collection[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = " or ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
        fail(op, arg, names, tensor.dtype)


def check_dims(op: str, arg: str, tensor: torch.Tensor, low: int, high: int | None = None) -> None:
    """``tensor.dim()`` must lie in ``[low, high]`` (``high`` defaults to ``low``)."""
    high = low if high is None else high
    expected = f"{low}-D" if low == high else f"{low}-D to {high}-D"
    found = f"{tensor.dim()}-D {tuple(tensor.shape)}"
    require(low <= tensor.dim() <= high, op, arg, expected, found)


def check_contiguous(op: str, arg: str, tensor: torch.Tensor) -> None:
    require(tensor.is_contiguous(), op, arg, "contiguous", f"strides {tensor.stride()}")


def check_non_empty(op: str, arg: str, tensor: torch.Tensor) -> None:
    require(tensor.numel() > 0, op, arg, "non-empty", f"shape {tuple(tensor.shape)}")


def check_host(op: str, arg: str, tensor: torch.Tensor) -> None:
    require(tensor.device.type == "cpu", op, arg, "a host (CPU) tensor", tensor.device)


def check_int_list(op: str, arg: str, values: object) -> list[int]:
    """A host ``list[int]``; a device tensor here would force a sync the op is designed to avoid."""
    ok = isinstance(values, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    )
    require(ok, op, arg, "a host list[int]", type(values).__name__)
    return list(values)
