"""Top-k/top-p sampling on the kernel seam.

vLLM's ``TopKTopPSampler`` picks its forward in ``__init__`` by platform and gives
out-of-tree platforms ``forward_native``. The wrapper below lets that run, then
routes the instance to :func:`forward_npu`: the top-k/top-p mask comes from
``npu_top_k_top_p`` and everything after it — processed-logprob modes, softmax and
the exponential-noise sampling that needs no host sync — is vLLM's own
``forward_native`` with the filters already applied.
"""

from __future__ import annotations

import types

import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from ascend_patch.npu import kernels

# npu_top_k_top_p: k is int32 in [1, 1024].
MAX_NPU_TOP_K = 1024


def filter_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
    """Mask every logit outside each row's top-k, then top-p set, to -inf."""
    if k is not None and logits.shape[1] > MAX_NPU_TOP_K and int(k.max()) > MAX_NPU_TOP_K:
        # A row asks for more than the NPU op's k limit (requests without top-k
        # carry k = vocab size): torch's sort-based path, same semantics.
        return apply_top_k_top_p_pytorch(logits, k, p)
    if k is not None and k.dtype != torch.int32:
        k = k.to(torch.int32)
    if p is not None and p.dtype != logits.dtype:
        p = p.to(logits.dtype)
    return kernels.top_k_top_p(logits, p=p, k=k)


def forward_npu(self, logits, generators, k, p):
    if k is not None or p is not None:
        logits = filter_top_k_top_p(logits, k, p)
    return self.forward_native(logits, generators, None, None)


def init_wrapper(wrapped, instance, args, kwargs):
    """Wrapper of ``TopKTopPSampler.__init__``."""
    wrapped(*args, **kwargs)
    instance.forward = types.MethodType(forward_npu, instance)
