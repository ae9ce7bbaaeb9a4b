"""Model Runner V2's Triton kernels, run as their torch implementations on the NPU.

MRV2 prepares inputs and samples with Triton kernels (``vllm/v1/worker/gpu/``), which an NPU
without triton-ascend cannot launch. vLLM's own seam takes their place:
``Platform.register_triton_kernel_overrides`` runs in every worker before any worker code, and
``vllm.triton_utils.dispatcher.register_kernels`` rebinds each kernel, wherever it is bound, to a
``KernelOverride`` that turns ``kernel[grid](...)`` into a call of the implementation.

Every implementation is registered unconditionally (with triton-ascend installed vLLM would
otherwise launch Triton kernels it was never checked against), and only after its parameters
are checked against the installed kernel's, by name and in order: vLLM launches by keyword, so
a renamed or reordered parameter would otherwise feed an implementation the wrong tensor. The
manifest (``patches/runner_v2.py``) declares every kernel with those parameters, so a release
that changes one fails verification at ``import vllm``, not a launch.
"""

from __future__ import annotations

import importlib
import inspect

from ascend_patch.npu.runner.triton_kernels import kernel_arg_names
from ascend_patch.npu.runner.v2 import input_kernels, sample_kernels, spec_decode_kernels

FAMILIES = (input_kernels, sample_kernels, spec_decode_kernels)


def implementations() -> dict[str, object]:
    """The torch implementation of each kernel, by the kernel's qualified name in vLLM."""
    return {f"{module}.{fn.__name__}": fn
            for family in FAMILIES for module, functions in family.KERNELS.items()
            for fn in functions}


LAUNCH_OPTIONS = ("num_warps", "num_stages")
"""Triton launch options a call site may pass beside the kernel's arguments (``kernel[grid](...,
num_warps=4)``); an implementation that takes one ignores it."""


def check_parameters(name: str, kernel, implementation) -> None:
    found = kernel_arg_names(kernel)
    expected = tuple(p for p in inspect.signature(implementation).parameters if p not in LAUNCH_OPTIONS)
    if found != expected:
        raise RuntimeError(
            f"ascend-patch: vLLM's {name} takes ({', '.join(found)}), but its NPU implementation "
            f"takes ({', '.join(expected)}): this vLLM is not one ascend-patch was checked against")


def register() -> None:
    """Register every implementation with vLLM's kernel registry, once per process: a later
    engine in the same process finds the overrides in place."""
    from vllm.triton_utils.dispatcher import register_kernels

    overrides = {}
    for name, implementation in implementations().items():
        module, _, attr = name.rpartition(".")
        current = getattr(importlib.import_module(module), attr)
        if getattr(current, "func", None) is implementation:  # not a seam: registered already
            continue
        check_parameters(name, current, implementation)
        overrides[name] = implementation
    if overrides:
        register_kernels(overrides)


def triton_gate(original: bool) -> bool:
    """Replacement of ``vllm.v1.worker.gpu_worker:HAS_TRITON``: the worker's gate only."""
    return True


def no_uva(original):
    """Replacement factory of ``vllm.utils.platform_utils:is_uva_available``."""

    def is_uva_available() -> bool:
        return False

    return is_uva_available


def complete_triton_placeholder(wrapped, instance, args, kwargs) -> None:
    """Wrapper of ``TritonPlaceholder.__init__``: the stand-in vLLM binds as ``triton`` without
    Triton gains ``next_power_of_2``, which MRV2's host code calls to size launches (the
    placeholder has ``cdiv`` only). vLLM's own helper; it equals Triton's for every n ≥ 1."""
    from vllm.utils.math_utils import next_power_of_2

    wrapped(*args, **kwargs)
    instance.next_power_of_2 = next_power_of_2
