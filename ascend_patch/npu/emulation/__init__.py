"""The emulation room: what exists only to run the NPU path on CPU (``ASCEND_PATCH=emulate``).

- :mod:`.platform`: ``EmulatedNPUPlatform``, the NPU platform on CPU tensors;
- :mod:`.runtime`: the emulated device runtime and its HBM books;
- :mod:`.graph`: the emulated NPU graph, which records a capture's device work and replays it.

Nothing on the hardware path imports it. The reference kernels, the seam's executable contract
that the emulated platform runs, live beside the seam (:mod:`ascend_patch.npu.kernels.reference`).

Docs: docs/reference.md, "Modes".
"""
