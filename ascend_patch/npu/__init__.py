"""The NPU wing: what stock vLLM runs once the overlay has patched it in.

Laid out like vLLM's and vllm-ascend's own trees, one room per concern, each owning its
configuration check (``check_config``): :mod:`.platform` (what ``current_platform`` becomes, its
hooks only), :mod:`.runner` (what belongs to one runner generation: the shared worker, V1 in
:mod:`.runner.v1`, Model Runner V2 in ``runner.v2``), :mod:`.attention` (backends, KV page
layout), :mod:`.ops` (custom ops, recurrent layers), :mod:`.quantization`, :mod:`.lora`,
:mod:`.spec_decode`, :mod:`.compilation` (ACL graphs, graph-mode policy), :mod:`.distributed`,
:mod:`.device` (the device runtime: a real NPU or the emulated one), :mod:`.kernels` (the one
seam that talks to torch_npu, with the reference kernels that are its executable contract) and
:mod:`.emulation` (what exists only to emulate the device on CPU).

Docs: docs/design.md, "What the overlay does on the NPU"; docs/contributing.md, "Repository layout".
"""
