"""Where vLLM launches its speculative-decoding Triton kernels, the NPU implementations instead.

How a kernel is reached has changed twice in 0.20–0.33, so there are three installers, each
declared in the patch sets for its releases:

- 0.20–0.29: the host code launches the module global, ``kernel[grid](...)``: :func:`npu_kernel`
  replaces it with a :class:`Launch` (the loader also rebinds the copies other modules imported);
- 0.30: every kernel is owned by a warm-up dispatcher built at import by
  ``triton_kernel_dispatcher_with_warmup(kernel=..., warmup_inputs=...)``, which launches
  ``owner.kernel[grid](**kwargs)`` and ignores the module global: :func:`dispatcher_with_npu_kernel`
  hands the decorator a :class:`Launch` instead of the kernel;
- 0.31+: vLLM's own registry (``vllm.triton_utils.dispatcher.register_kernels``), called from
  ``Platform.register_triton_kernel_overrides`` before any worker code runs, rebinds the module
  globals and the dispatchers' kernels to its ``KernelOverride``: :func:`register`.

Every installer first checks that the kernel's parameters are the implementation's, in order:
vLLM passes them by name or position, so a renamed or reordered parameter would otherwise feed
an implementation the wrong tensor.
"""

from __future__ import annotations

import importlib
import inspect

from ascend_patch.npu.runner.triton_kernels import kernel_arg_names, kernel_function
from ascend_patch.npu.runner.v1.spec_decode import kernels

IMPLEMENTATIONS = {f"{module}.{fn.__name__}": fn
                   for module, functions in kernels.KERNELS.items() for fn in functions}
"""The NPU implementation of each kernel, by the kernel's qualified name in vLLM."""


def _qualified_name(kernel) -> str:
    function = kernel_function(kernel)
    return f"{function.__module__}.{function.__name__}"


def implementation_of(kernel):
    """The NPU implementation standing in for ``kernel``, once its parameters are checked."""
    name = _qualified_name(kernel)
    implementation = IMPLEMENTATIONS[name]
    parameters = inspect.signature(implementation).parameters
    expected = tuple(parameters)
    found = kernel_arg_names(kernel)
    # A kernel may lack trailing flags a later release added (USE_FP64_GUMBEL, 0.23): their
    # defaults are the older kernel's behaviour.
    added = expected[len(found):]
    if (expected[: len(found)] != found
            or any(parameters[flag].default is inspect.Parameter.empty for flag in added)):
        raise RuntimeError(
            f"ascend-patch: vLLM's {name} takes ({', '.join(found)}), but its NPU implementation "
            f"takes ({', '.join(expected)}): this vLLM is not one ascend-patch was checked against")
    return implementation


class Launch:
    """What vLLM finds where it expects a Triton kernel: ``launch[grid](...)`` runs the NPU
    implementation (the grid is not needed: an implementation covers its tensors' batch). It
    carries the kernel's ``arg_names``, which 0.30's dispatchers read to bind a launch."""

    def __init__(self, implementation, kernel) -> None:
        self.implementation = implementation
        self.kernel = kernel
        self.arg_names = kernel_arg_names(kernel)
        self.__name__ = implementation.__name__
        self.__module__ = kernel_function(kernel).__module__

    def __getitem__(self, grid):
        return self.implementation

    def __call__(self, *args, **kwargs):
        return self.implementation(*args, **kwargs)


def npu_kernel(original) -> Launch:
    """Replacement of a spec-decode kernel's module global (vLLM 0.20–0.29)."""
    return Launch(implementation_of(original), original)


def dispatcher_with_npu_kernel(wrapped, instance, args, kwargs):
    """Wrapper of ``vllm.model_executor.warmup.jit_warmup_triton_helper:
    triton_kernel_dispatcher_with_warmup`` (vLLM 0.30): a dispatcher built for one of the
    spec-decode kernels owns its :class:`Launch` instead."""
    kernel = kwargs.get("kernel")
    if kernel is not None and _qualified_name(kernel) in IMPLEMENTATIONS:
        kwargs = {**kwargs, "kernel": npu_kernel(kernel)}
    return wrapped(*args, **kwargs)


def register() -> None:
    """Register every implementation with vLLM's kernel registry (vLLM 0.31+), once per process:
    a later engine finds the overrides in place."""
    from vllm.triton_utils.dispatcher import register_kernels

    overrides = {}
    for name, implementation in IMPLEMENTATIONS.items():
        module, _, attr = name.rpartition(".")
        current = getattr(importlib.import_module(module), attr)
        if getattr(current, "func", None) is implementation:  # not a seam: registered already
            continue
        overrides[name] = implementation_of(current)
    if overrides:
        register_kernels(overrides)
