"""Speculative decoding on the NPU path: what vLLM's V1 runner needs beyond its own drafters.

vLLM builds the drafter (n-gram, draft model) and the rejection sampler itself. The platform
supplies the Triton kernels of that path (:mod:`.kernels`, installed per release by
:mod:`.install`) and settles which configurations it can serve exactly (:mod:`.config`).
"""

from ascend_patch.npu.spec_decode import config

__all__ = ["config"]
