"""The Model Runner V2 generation (vLLM 0.34, ``vllm/v1/worker/gpu/``): the model runner
(:mod:`.model_runner`), its pointer-table block tables in torch (:mod:`.block_tables`), its FULL
graphs as ACL graphs (:mod:`.graphs`), top-k/top-p on the kernel seam (:mod:`.sampler`), and the
torch implementations of its Triton kernels (:mod:`.input_kernels`, :mod:`.sample_kernels`,
:mod:`.spec_decode_kernels`), registered through vLLM's seam by :mod:`.kernels`. Declared in
``patches/runner_v2.py``.

Docs: docs/contributing.md, "Repository layout".
"""
