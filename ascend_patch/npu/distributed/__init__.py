"""Device collectives on the NPU (HCCL, or gloo when emulated)."""
