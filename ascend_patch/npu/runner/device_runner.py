"""What the NPU model runner of every generation adds to vLLM's: after loading, the report of
which attention layers run composed and how MoE layers route, and the weights charged to the
emulated HBM; during vLLM's profiling pass, its activations measured. vLLM's unmodified
``determine_available_memory`` then sizes the KV cache from real numbers."""

from __future__ import annotations

from vllm.platforms import current_platform

from ascend_patch.npu.attention.backend import report_attention_paths
from ascend_patch.npu.ops.fused_moe import report_routing


class NPURunnerMixin:
    """In front of a generation's vLLM runner class (V1's or Model Runner V2's)."""

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        report_attention_paths(self.compilation_config.static_forward_context,
                               self.model_config.dtype, self.model_config.model)
        report_routing(self.get_model(), self.model_config.model)
        charged = current_platform.runtime().charge_weights(self.get_model())
        if charged is not None:  # the emulated HBM's figure replaces vLLM's host-side one
            self.model_memory_usage = charged

    def profile_run(self, *args, **kwargs):
        with current_platform.runtime().track_activations():
            return super().profile_run(*args, **kwargs)
