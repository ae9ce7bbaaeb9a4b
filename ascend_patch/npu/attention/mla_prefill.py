"""The MLA prefill backend vLLM 0.21+ makes every ``MLAAttention`` layer build, on Ascend.

``MLAAttention.__init__`` instantiates a prefill backend whatever its impl. On a platform without
a CUDA device capability vLLM picks FLASH_ATTN (``mla/prefill/selector.py`` 0.21–0.31,
``Platform.get_mla_prefill_backend_cls`` from 0.32), whose constructor asserts that
``flash_attn_varlen_func`` imports. :class:`ascend_patch.npu.attention.mla.AscendMLAImpl` runs
prefills itself, so this backend only has to construct; nothing in it is ever called.

Kept apart from the MLA backend because ``mla/prefill/base.py`` only exists from vLLM 0.21.
"""

from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend


class AscendMLAPrefillBackend(MLAPrefillBackend):
    @staticmethod
    def get_name() -> str:
        return "ASCEND"

    def run_prefill_new_tokens(self, *args, **kwargs):
        raise NotImplementedError("AscendMLAImpl.forward_mha runs MLA prefills on Ascend")

    def run_prefill_context_chunk(self, *args, **kwargs):
        raise NotImplementedError("AscendMLAImpl.forward_mha runs MLA prefills on Ascend")


def select_prefill_backend(original):
    """Replacement of ``mla/prefill/selector.py:get_mla_prefill_backend`` for vLLM 0.21–0.31,
    which have no platform hook for the choice."""

    def get_mla_prefill_backend(vllm_config):
        return AscendMLAPrefillBackend

    return get_mla_prefill_backend
