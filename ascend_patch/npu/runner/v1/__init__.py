"""The V1 runner generation (vLLM 0.20-0.33): the model runner (:mod:`.model_runner`), the KV
slot mapping of its block table (:mod:`.slot_mapping`), the sampler hooks (:mod:`.sampler`) and
the NPU implementations of its speculative-decoding Triton kernels (:mod:`.spec_decode`).
Declared in ``patches/runner_v1.py``.

Docs: docs/contributing.md, "Repository layout".
"""
