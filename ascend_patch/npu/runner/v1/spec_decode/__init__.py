"""The V1 runner's speculative-decoding Triton kernels on the NPU: the implementations
(:mod:`.kernels`, plain torch) and how each release reaches them (:mod:`.install`). Which
configurations are served is runner-neutral (:mod:`ascend_patch.npu.spec_decode.config`).

Docs: docs/design.md, "What the overlay does on the NPU"; docs/contributing.md, "Repository layout".
"""
