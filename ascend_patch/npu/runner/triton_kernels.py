"""What both runner generations' NPU stand-ins for vLLM's Triton kernels read of a kernel: its
parameter names and the function it compiles, with Triton installed or not."""

from __future__ import annotations

import inspect


def kernel_function(kernel):
    """The function a Triton ``JITFunction`` compiles, or the kernel itself without Triton (where
    ``@triton.jit`` leaves the function as it is)."""
    return getattr(kernel, "fn", kernel)  # not a seam: Triton present or not


def kernel_arg_names(kernel) -> tuple[str, ...]:
    """A kernel's parameter names: a Triton ``JITFunction``'s ``arg_names``, or the function's own."""
    names = getattr(kernel, "arg_names", None)  # not a seam: Triton present or not
    if names is None:
        names = inspect.signature(kernel_function(kernel)).parameters
    return tuple(names)
