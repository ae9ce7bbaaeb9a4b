"""The emulation room: what exists only to run the NPU path on CPU (``ASCEND_PATCH=emulate``).

- :mod:`.platform`: ``EmulatedNPUPlatform``, the NPU platform on CPU tensors;
- :mod:`.runtime`: the emulated device runtime and its HBM books;
- :mod:`.graph`: the emulated NPU graph, which records a capture's device work and replays it;
- :mod:`.reference`: the reference kernels, which enforce each torch_npu op's documented contract.

Nothing on the hardware path imports it, except the reference kernels that check whether an op
can take a configuration (:func:`ascend_patch.npu.kernels.contract_violation`).
"""
