"""Top-k/top-p sampling on the kernel seam.

vLLM's ``TopKTopPSampler`` picks its forward in ``__init__`` by platform and gives
out-of-tree platforms ``forward_native``. The wrapper below lets that run, then
routes the instance to :func:`forward_npu`: the top-k/top-p mask comes from
``npu_top_k_top_p`` and everything after it — processed-logprob modes, softmax and
the exponential-noise sampling that needs no host sync — is vLLM's own
``forward_native`` with the filters already applied.

Which rows the op can take is decided from the host copy of k that vLLM's ``InputBatch``
already keeps (``top_k_cpu``): :func:`attach_host_top_k` hands it to the k tensor of each new
sampling metadata (:mod:`ascend_patch.npu.runner.top_k_top_p` routes the rows).
"""

from __future__ import annotations

import types

from ascend_patch.npu.runner.top_k_top_p import HOST_TOP_K, filter_top_k_top_p


def forward_npu(self, logits, generators, k, p):
    if k is not None or p is not None:
        logits = filter_top_k_top_p(logits, k, p)
    return self.forward_native(logits, generators, None, None)


def init_wrapper(wrapped, instance, args, kwargs):
    """Wrapper of ``TopKTopPSampler.__init__``."""
    wrapped(*args, **kwargs)
    instance.forward = types.MethodType(forward_npu, instance)


def attach_host_top_k(wrapped, instance, args, kwargs):
    """Wrapper of ``InputBatch._make_sampling_metadata``: the metadata's top_k tensor carries
    the host values it was just copied from, so the sampler can route rows without a sync."""
    metadata = wrapped(*args, **kwargs)
    if metadata.top_k is not None:
        setattr(metadata.top_k, HOST_TOP_K, instance.top_k_cpu[: instance.num_reqs].copy())
    return metadata
