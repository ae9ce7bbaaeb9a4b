"""The NPU kernel seam: every torch_npu op the overlay uses, behind one set of module functions.

Two backends implement the same signatures, and the NPU platform binds one when vLLM resolves it;
until then every op raises :class:`KernelBackendError` (fail closed, never a silent default):

- ``"reference"`` (emulated, :mod:`ascend_patch.npu.kernels.reference`): plain torch that
  enforces each op's documented input contract (:mod:`.limits`) and computes its documented output.
  It runs the emulated engine on CPU and makes contract violations fail loudly off-hardware.
- ``"npu"`` (:mod:`.npu`): direct calls of the documented torch_npu ops, imported lazily.

The module-level functions are rebound in one place (:func:`_bind`): :func:`use` binds a backend,
and :func:`swapped` wraps every op for the length of a block (:func:`count_launches`,
:func:`record_calls`, the emulated graph's capture), so a call is a plain attribute lookup with no
per-call dispatch. Call them through the module (``kernels.rms_norm(...)``): a name imported with
``from ascend_patch.npu.kernels import rms_norm`` keeps whatever backend was active at import time.

Docs: docs/reference.md, "Modes"; docs/design.md, "What the overlay does on the NPU".
"""

import collections
import contextlib
import functools
import json

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves, tree_map

from . import npu, reference
from .contracts import KernelContractError

OPS = (
    "scatter_pa_kv_cache",
    "fused_infer_attention_score",
    "fused_infer_attention_score_decode",
    "fused_infer_attention_score_decode_workspace",
    "fused_infer_attention_score_verify",
    "fused_infer_attention_score_verify_workspace",
    "fusion_attention",
    "paged_attention",
    "paged_attention_workspace",
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rotary_mul",
    "mrope",
    "top_k_top_p",
    "moe_gating_top_k_softmax",
    "moe_gating_top_k_softmax_v2",
    "moe_gating_top_k",
    "moe_init_routing_v2",
    "grouped_matmul",
    "moe_token_unpermute",
    "moe_finalize_routing",
    "dynamic_quant",
    "quantize",
    "quant_matmul",
    "fused_infer_attention_score_mla",
    "fused_infer_attention_score_mla_decode",
    "fused_infer_attention_score_mla_decode_workspace",
    "multi_head_latent_attention",
    "kv_rmsnorm_rope_cache",
    "interleave_rope",
    "batch_gather_matmul_",
    "recurrent_gated_delta_rule",
    "swap_blocks",
)


def _as_device_op(kernel):
    """A reference kernel as the emulated device's memory books see it: one op that allocates
    its outputs. The plain torch that computes them (float64 accumulators, gathered blocks...)
    would live in an NPU op's workspace, not among the activations vLLM profiles, so while a
    dispatch mode watches (the emulated HBM's activation tracker) the kernel runs unwatched and
    its new outputs are reallocated where it sees them."""

    @functools.wraps(kernel)
    def op(*args, **kwargs):
        if _get_current_dispatch_mode() is None:
            return kernel(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        with _disable_current_modes():
            out = kernel(*args, **kwargs)
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor)
                        and t.untyped_storage().data_ptr() not in inputs else t, out)

    return op


# The seam ops of the layers torch.compile traces (the pieces of a PIECEWISE model between
# attention layers), as torch ops the way torch_npu's are: their schemas (the kernels.npu twins')
# and a fake kernel of each op's documented output shapes, which is all tracing runs. The contract
# checks read tensor values (cos/sin within [-1, 1], positions within the cache), which dynamo
# cannot trace; they run when the compiled piece calls the op.
_TRACED = {
    "rms_norm": ("(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
                 lambda self, gamma, epsilon=1e-6: (torch.empty_like(self), _rstd(self, gamma))),
    "add_rms_norm": ("(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
                     lambda x1, x2, gamma, epsilon=1e-6: (torch.empty_like(x1), _rstd(x1, gamma),
                                                          torch.empty_like(x1))),
    "swiglu": ("(Tensor self, int dim=-1) -> Tensor",
               lambda self, dim=-1: self.new_empty(self.shape[:dim % self.dim()]
                                                   + (self.shape[dim] // 2,)
                                                   + self.shape[dim % self.dim() + 1:])),
    "rotary_mul": ("(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
                   lambda self, r1, r2, rotary_mode="half": self.new_empty(self.shape)),
    "mrope": ("(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, "
              "str rotary_mode='half', int[]? mrope_section=None) -> (Tensor, Tensor)",
              lambda positions, query, key, cos_sin_cache, head_size, rotary_mode="half",
              mrope_section=None: (query.new_empty(query.shape), key.new_empty(key.shape))),
}
_LIBRARY = "ascend_patch_emulated"


def _rstd(x, gamma):
    """npu_rms_norm's fp32 rstd: x's shape with gamma's (normalised) dims kept as 1s."""
    return x.new_empty(x.shape[: x.dim() - gamma.dim()] + (1,) * gamma.dim(), dtype=torch.float32)


def _define_traced() -> dict:
    """The :data:`_TRACED` ops as torch ops whose kernel is the seam op bound when it runs (so
    counting, recording and graph capture see the launches a compiled piece makes)."""
    ops = {}
    for name, (schema, fake) in _TRACED.items():
        torch.library.define(f"{_LIBRARY}::{name}", schema)
        torch.library.impl(f"{_LIBRARY}::{name}", "CompositeExplicitAutograd",
                           functools.partial(_call_bound, name))
        torch.library.register_fake(f"{_LIBRARY}::{name}", fake)
        ops[name] = getattr(getattr(torch.ops, _LIBRARY), name)
    return ops


def _call_bound(name, *args, **kwargs):
    return globals()[name](*args, **kwargs)


def _traceable(name, kernel):
    """``kernel``, which under torch.compile's tracing is its torch op instead (see :data:`_TRACED`)."""
    if name not in _TRACED:
        return kernel

    @functools.wraps(kernel)
    def op(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _TRACED_OPS[name](*args, **kwargs)
        return kernel(*args, **kwargs)

    return op


_TRACED_OPS = _define_traced()
_BACKENDS = {
    "reference": {name: _traceable(name, _as_device_op(getattr(reference, name))) for name in OPS},
    "npu": {name: getattr(npu, name) for name in OPS},
}


class KernelBackendError(RuntimeError):
    """A seam op was called before the NPU platform chose the kernel backend."""


def _unselected(name):
    """What every op is until :func:`use` runs: an error, never a silent default. A reference
    kernel handed device tensors would compute on the NPU in plain torch, slowly and outside
    every op contract; torch_npu handed CPU tensors would fail far from the cause."""

    def op(*args, **kwargs):
        raise KernelBackendError(
            f"ascend_patch.npu.kernels.{name} was called before a kernel backend was chosen: the "
            "NPU platform chooses it ('npu' on Ascend, 'reference' when emulating) when vLLM "
            "resolves current_platform; outside an engine call ascend_patch.npu.kernels.use() first")

    op.__name__ = op.__qualname__ = name
    return op


def _bind(functions: dict) -> None:
    """Rebind the seam's module-level ops: the one place they change."""
    globals().update(functions)


_bind({name: _unselected(name) for name in OPS})
_active: str | None = None


def use(backend: str) -> None:
    """Bind every op to ``backend`` ("reference" or "npu"). Selecting "npu" imports nothing."""
    global _active
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {sorted(_BACKENDS)}")
    _bind(_BACKENDS[backend])
    _active = backend


def active_backend() -> str | None:
    """The backend :func:`use` bound, or None while none is chosen (every op then raises)."""
    return _active


def contract_violation(name: str, *args, **kwargs) -> str | None:
    """What op ``name``'s documented contract refuses in these arguments (its reference twin's
    message), or None: whether an op can take a configuration, decided before any step runs.
    Host tensors stand in for device ones."""
    try:
        getattr(reference, name)(*args, **kwargs)
    except KernelContractError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def swapped(wrap):
    """Swap every op for ``wrap(name, fn)`` while the block runs; the exact originals are
    restored on exit, so do not call :func:`use` inside."""
    originals = {name: globals()[name] for name in OPS}
    _bind({name: functools.wraps(fn)(wrap(name, fn)) for name, fn in originals.items()})
    try:
        yield
    finally:
        _bind(originals)


@contextlib.contextmanager
def count_launches():
    """Count seam calls per op while the block runs; on the real path each is one op launch.

    Yields a ``collections.Counter`` keyed by op name.
    """
    counts = collections.Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    with swapped(counting):
        yield counts


@contextlib.contextmanager
def record_calls():
    """Record every distinct seam call while the block runs, for checking the calls against the
    real torch_npu schemas and meta kernels off-hardware (tests/npu_wheels.py).

    Yields a dict of records keyed by their JSON text, each ``{"op", "args", "kwargs", "out",
    "count"}``: the arguments and what the active backend returned, as :func:`describe` puts
    them. Outside the block the ops are the plain functions again.
    """
    records = {}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            described = {"op": name, "args": describe(args), "kwargs": describe(kwargs)}
            out = fn(*args, **kwargs)
            described["out"] = describe(out)
            key = json.dumps(described, sort_keys=True)
            records.setdefault(key, {**described, "count": 0})["count"] += 1
            return out

        return wrapper

    with swapped(recording):
        yield records


def describe(value):
    """A seam argument or result as JSON: a tensor as its layout (shape, stride, offset, dtype,
    device, contiguity), a dtype as ``{"dtype": name}``, containers item by item, scalars, strings
    and None as they are."""
    if isinstance(value, torch.Tensor):
        return {"tensor": {"shape": list(value.shape), "stride": list(value.stride()),
                           "offset": value.storage_offset(), "dtype": _dtype_name(value.dtype),
                           "device": value.device.type, "contiguous": value.is_contiguous()}}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, dict):
        return {key: describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [describe(item) for item in value]}
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = [*OPS, "KernelBackendError", "KernelContractError", "OPS", "active_backend",
           "contract_violation", "count_launches", "describe", "record_calls", "swapped", "use"]
