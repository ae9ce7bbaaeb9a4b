"""LoRA adapters on the NPU path: the punica wrapper vLLM's LoRA layers call (:mod:`.punica`)."""
