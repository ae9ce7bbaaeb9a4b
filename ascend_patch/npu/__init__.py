"""The NPU wing: what stock vLLM runs once the overlay has patched it in.

Laid out like vLLM's and vllm-ascend's own trees: :mod:`.platform` (what
``current_platform`` becomes), :mod:`.worker` and :mod:`.model_runner`,
:mod:`.attention`, :mod:`.ops` (custom ops), :mod:`.sample`, :mod:`.kv_cache`,
:mod:`.distributed`, :mod:`.device` (the device runtime: a real NPU or the emulated
one) and :mod:`.kernels`, the one seam that talks to torch_npu.
"""
