"""Speculative decoding on the NPU path: which configurations it serves exactly (:mod:`.config`),
whichever runner generation runs them.

vLLM builds the drafter (n-gram, draft model, EAGLE, MTP) and the rejection sampler itself; the
NPU implementations of the Triton kernels on that path belong to a runner generation
(:mod:`ascend_patch.npu.runner.v1.spec_decode`).

Docs: docs/design.md, "What the overlay does on the NPU".
"""

from ascend_patch.npu.spec_decode import config

__all__ = ["config"]
