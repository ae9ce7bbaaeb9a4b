"""Top-k/top-p masking on the kernel seam, for both runner generations.

``npu_top_k_top_p`` takes k in [1, 1024] only, while vLLM gives a request without top-k k = vocab
size. Which rows the op can take is decided from a host copy of k that each runner generation hands
to the k tensor it builds (:data:`HOST_TOP_K`: the V1 runner's ``InputBatch.top_k_cpu``, Model
Runner V2's ``SamplingStates.top_k.np``); the first mask with that tensor turns it into a
:class:`TopKRoute` kept on the tensor. A step therefore reads no device value, and routing costs a
few attribute lookups. Rows beyond the op's k limit take vLLM's sort-based torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import limits

# npu_top_k_top_p: k is int32 in [1, 1024].
MAX_NPU_TOP_K = limits.TOP_K_MAX

# Attributes set on the k tensor a runner builds for one step (a fresh tensor each time).
HOST_TOP_K = "_ascend_host_top_k"
_ROUTE = "_ascend_top_k_route"


@dataclass(frozen=True)
class TopKRoute:
    """Which rows of a batch go where, for one k tensor and vocab size."""

    vocab: int
    op_k: torch.Tensor | None
    """int32 k for the NPU op, each row's k capped at the op's limit; None if no row has k
    within it. Rows above the limit get their result from one of the two paths below."""
    without_top_k: torch.Tensor | None
    """[rows, 1] bool: rows with k ≥ vocab (no top-k), which take the op's top-p-only form."""
    beyond_limit: torch.Tensor | None
    """Row indices with 1024 < k < vocab: a top-k the op cannot do, left to vLLM's torch path."""

    @classmethod
    def from_host(cls, host_k: np.ndarray, vocab: int, device: torch.device) -> TopKRoute:
        within = host_k <= MAX_NPU_TOP_K
        without = (host_k >= vocab) & ~within
        beyond = ~within & ~without
        op_k = None
        if within.any():
            op_k = torch.from_numpy(np.minimum(host_k, MAX_NPU_TOP_K).astype(np.int32)).to(device)
        return cls(
            vocab=vocab,
            op_k=op_k,
            without_top_k=torch.from_numpy(without[:, None]).to(device) if without.any() else None,
            beyond_limit=torch.from_numpy(np.flatnonzero(beyond)).to(device) if beyond.any() else None,
        )


def _route(k: torch.Tensor, vocab: int) -> TopKRoute | None:
    route = getattr(k, _ROUTE, None)  # not a seam: ours, set below
    if route is not None and route.vocab == vocab:
        return route
    host_k = getattr(k, HOST_TOP_K, None)  # not a seam: ours, set with the metadata
    if host_k is None:
        return None
    route = TopKRoute.from_host(host_k, vocab, k.device)
    setattr(k, _ROUTE, route)
    return route


def filter_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
    """Mask every logit outside each row's top-k, then top-p set, to -inf."""
    if p is not None and p.dtype != logits.dtype:
        p = p.to(logits.dtype)
    if k is None:
        return kernels.top_k_top_p(logits, p=p, k=None)
    route = _route(k, logits.shape[1])
    if route is None or (route.op_k is None and route.without_top_k is None):
        # No host copy of k (vLLM's dummy sampler run builds its own), or every row's top-k is
        # beyond the op: vLLM's sort-based path, which needs no host values.
        return apply_top_k_top_p_pytorch(logits, k, p)
    filtered = None
    if route.op_k is not None:
        filtered = kernels.top_k_top_p(logits, p=p, k=route.op_k)
    if route.without_top_k is not None:
        top_p_only = logits if p is None else kernels.top_k_top_p(logits, p=p, k=None)
        filtered = top_p_only if filtered is None else torch.where(route.without_top_k, top_p_only, filtered)
    if route.beyond_limit is not None:
        rows = route.beyond_limit
        filtered.index_copy_(0, rows, apply_top_k_top_p_pytorch(
            logits.index_select(0, rows), k.index_select(0, rows),
            None if p is None else p.index_select(0, rows)))
    return filtered
