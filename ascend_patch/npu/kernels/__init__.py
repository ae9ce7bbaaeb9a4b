"""The NPU kernel seam: every torch_npu op the overlay uses, behind one set of module functions.

Two backends implement the same signatures:

- ``"reference"`` (default, :mod:`.reference`): plain torch that enforces each op's documented input
  contract and computes its documented output. It runs the emulated engine on CPU and makes contract
  violations fail loudly off-hardware. The Mixture-of-Experts references live in :mod:`.moe`
  (re-exported by :mod:`.reference`).
- ``"npu"`` (:mod:`.npu`): direct calls of the documented torch_npu ops, imported lazily.

:func:`use` rebinds the module-level functions, so a call is a plain attribute lookup with no
per-call dispatch. Call them through the module (``kernels.rms_norm(...)``): a name imported with
``from ascend_patch.npu.kernels import rms_norm`` keeps whatever backend was active at import time.
"""

import collections
import contextlib
import functools

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
)

_BACKENDS = {"reference": reference, "npu": npu}

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

_active = "reference"


def use(backend: str) -> None:
    """Bind every op to ``backend`` ("reference" or "npu"). Selecting "npu" imports nothing."""
    global _active
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {sorted(_BACKENDS)}")
    module = _BACKENDS[backend]
    globals().update({name: getattr(module, name) for name in OPS})
    _active = backend


def active_backend() -> str:
    return _active


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


__all__ = [*OPS, "KernelContractError", "OPS", "active_backend", "count_launches", "use"]
