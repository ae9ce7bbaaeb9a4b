"""``NPUModelRunnerV2``: vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``) on the NPU device.

vLLM 0.34 removed the V1 runner; MRV2 is the only one. This subclass overrides only what is
device-specific, as the V1 runner's does: what every generation's NPU runner adds
(:class:`~ascend_patch.npu.runner.device_runner.NPURunnerMixin`), new KV blocks zeroed in the
Ascend layouts, and each step's attention metadata filed for the graph replays. Everything MRV2
launches as a Triton kernel runs a registered torch implementation
(:mod:`ascend_patch.npu.runner.v2.kernels`), and its pointer-table block tables run
:mod:`ascend_patch.npu.runner.v2.block_tables`; input preparation, attention metadata, sampling
and output processing stay vLLM's.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from ascend_patch.npu.attention.backend import dummy_forward
from ascend_patch.npu.runner.device_runner import NPURunnerMixin
from ascend_patch.npu.runner.kv_zeroing import AscendKVBlockZeroer
from ascend_patch.npu.runner.v2 import graphs


class NPUModelRunnerV2(NPURunnerMixin, GPUModelRunner):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._record_step_metadata()

    def _record_step_metadata(self) -> None:
        """File each step's attention metadata for the graph replays (:mod:`.graphs`): MRV2
        gives it only to ``set_forward_context``, and replays FULL graphs outside it, whose
        captured host-parameter launches must be renewed with it. The drafter prepares its
        prefill through the same model state."""
        graphs.forget_steps()
        prepare_attn = self.model_state.prepare_attn

        def prepare_and_record(*args, **kwargs):
            metadata = prepare_attn(*args, **kwargs)
            graphs.record_step_metadata(metadata)
            return metadata

        self.model_state.prepare_attn = prepare_and_record

    def _dummy_run(self, *args, **kwargs):
        # Unlike the V1 runner's warm-up, MRV2's runs attention over all-PAD slots (and an idle
        # data-parallel rank's step is one too): the backend keeps their KV writes in the null block.
        with dummy_forward():
            return super()._dummy_run(*args, **kwargs)

    def _init_kv_zero_meta(self) -> None:
        self.kv_block_zeroer = AscendKVBlockZeroer(self.compilation_config.static_forward_context,
                                                   self.kv_cache_config, self.device)
