"""The NPU custom ops: RMSNorm, SiluAndMul, rotary embedding, multimodal encoder attention and
the unquantized MoE method on the kernel seam.

Registered two ways, both sanctioned by vLLM:

- ``CustomOp.register_oot``: vLLM instantiates our subclass wherever a model builds
  ``RMSNorm``, ``SiluAndMul``, ``RotaryEmbedding``, ``MRotaryEmbedding`` or
  ``MMEncoderAttention``, and an out-of-tree platform
  dispatches enabled custom ops to ``forward_oot``;
- vLLM IR (:mod:`.ir`): ``rms_norm`` and ``fused_add_rms_norm`` get an ``ascend``
  implementation.

Nothing here can fall back to vLLM's CUDA/CPU ``_C`` kernels: a disabled custom op
runs ``forward_native``, which is plain torch.

Docs: docs/design.md, "What the overlay does on the NPU".
"""

from vllm.model_executor.custom_op import CustomOp

from ascend_patch.npu.ops import ir
from ascend_patch.npu.ops.activation import AscendSiluAndMul
from ascend_patch.npu.ops.fused_moe import AscendUnquantizedFusedMoEMethod
from ascend_patch.npu.ops.layernorm import AscendRMSNorm
from ascend_patch.npu.ops.mm_encoder_attention import AscendMMEncoderAttention
from ascend_patch.npu.ops.rotary_embedding import AscendMRotaryEmbedding, AscendRotaryEmbedding

_registered = False


def register() -> None:
    """Register the OOT ops and IR implementations, once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    for cls, name in ((AscendRMSNorm, "RMSNorm"), (AscendSiluAndMul, "SiluAndMul"),
                      (AscendRotaryEmbedding, "RotaryEmbedding"),
                      (AscendMRotaryEmbedding, "MRotaryEmbedding"),
                      (AscendMMEncoderAttention, "MMEncoderAttention"),
                      (AscendUnquantizedFusedMoEMethod, "UnquantizedFusedMoEMethod")):
        CustomOp.register_oot(_decorated_op_cls=cls, name=name)
    ir.register()
