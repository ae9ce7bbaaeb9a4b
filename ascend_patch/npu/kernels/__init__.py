"""The NPU kernel seam: every torch_npu op the overlay uses, behind one set of module functions.

Two backends implement the same signatures:

- ``"reference"`` (default, :mod:`.reference`): plain torch that enforces each op's documented input
  contract and computes its documented output. It runs the emulated engine on CPU and makes contract
  violations fail loudly off-hardware. The Mixture-of-Experts references live in :mod:`.moe`, the
  int8 quantisation ones in :mod:`.quant` and the multi-head latent attention ones in :mod:`.mla`
  (all re-exported by :mod:`.reference`).
- ``"npu"`` (:mod:`.npu`): direct calls of the documented torch_npu ops, imported lazily.

:func:`use` rebinds the module-level functions, so a call is a plain attribute lookup with no
per-call dispatch. Call them through the module (``kernels.rms_norm(...)``): a name imported with
``from ascend_patch.npu.kernels import rms_norm`` keeps whatever backend was active at import time.
"""

import collections
import contextlib
import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves, tree_map

from . import npu, reference
from .contracts import KernelContractError

OPS = (
    "scatter_pa_kv_cache",
    "fused_infer_attention_score",
    "paged_attention",
    "paged_attention_workspace",
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rotary_mul",
    "top_k_top_p",
    "moe_gating_top_k_softmax",
    "moe_gating_top_k",
    "moe_init_routing_v2",
    "grouped_matmul",
    "moe_token_unpermute",
    "moe_finalize_routing",
    "dynamic_quant",
    "quantize",
    "quant_matmul",
    "fused_infer_attention_score_mla",
    "multi_head_latent_attention",
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


_BACKENDS = {
    "reference": {name: _as_device_op(getattr(reference, name)) for name in OPS},
    "npu": {name: getattr(npu, name) for name in OPS},
}

# Bound explicitly (rather than only through use()) so readers and linters see the names.
scatter_pa_kv_cache = reference.scatter_pa_kv_cache
fused_infer_attention_score = reference.fused_infer_attention_score
paged_attention = reference.paged_attention
paged_attention_workspace = reference.paged_attention_workspace
rms_norm = reference.rms_norm
add_rms_norm = reference.add_rms_norm
swiglu = reference.swiglu
rotary_mul = reference.rotary_mul
top_k_top_p = reference.top_k_top_p
moe_gating_top_k_softmax = reference.moe_gating_top_k_softmax
moe_gating_top_k = reference.moe_gating_top_k
moe_init_routing_v2 = reference.moe_init_routing_v2
grouped_matmul = reference.grouped_matmul
moe_token_unpermute = reference.moe_token_unpermute
moe_finalize_routing = reference.moe_finalize_routing
dynamic_quant = reference.dynamic_quant
quantize = reference.quantize
quant_matmul = reference.quant_matmul
fused_infer_attention_score_mla = reference.fused_infer_attention_score_mla
multi_head_latent_attention = reference.multi_head_latent_attention

_active = "reference"


def use(backend: str) -> None:
    """Bind every op to ``backend`` ("reference" or "npu"). Selecting "npu" imports nothing."""
    global _active
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {sorted(_BACKENDS)}")
    globals().update(_BACKENDS[backend])
    _active = backend


def active_backend() -> str:
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
def count_launches():
    """Count seam calls per op while the block runs; on the real path each is one op launch.

    Yields a ``collections.Counter`` keyed by op name. The op functions are swapped for counting
    wrappers and the exact originals are restored on exit, so do not call :func:`use` inside.
    """
    counts = collections.Counter()
    originals = {name: globals()[name] for name in OPS}
    globals().update({name: _counting(name, fn, counts) for name, fn in originals.items()})
    try:
        yield counts
    finally:
        globals().update(originals)


def _counting(name, fn, counts):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


use("reference")  # the names above, as the device sees them

__all__ = [*OPS, "KernelContractError", "OPS", "active_backend", "contract_violation",
           "count_launches", "use"]
