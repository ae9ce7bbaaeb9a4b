"""RMSNorm, SiluAndMul and rotary embedding on the kernel seam.

Registered two ways, both sanctioned by vLLM:

- ``CustomOp.register_oot``: vLLM instantiates our subclass wherever a model builds
  ``RMSNorm``, ``SiluAndMul`` or ``RotaryEmbedding``, and an out-of-tree platform
  dispatches enabled custom ops to ``forward_oot``;
- vLLM IR (0.20+): ``rms_norm`` and ``fused_add_rms_norm`` (0.21+) get an
  ``ascend`` implementation, put first by ``NPUPlatform.get_default_ir_op_priority``,
  so IR callers other than ``RMSNorm`` reach the seam too.

Nothing here can fall back to vLLM's CUDA/CPU ``_C`` kernels: a disabled custom op
runs ``forward_native``, which is plain torch.
"""

import torch
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from ascend_patch import kernels

IR_PROVIDER = "ascend"
IR_OPS = ("rms_norm", "fused_add_rms_norm")
"""The vLLM IR ops given an ``IR_PROVIDER`` implementation, where the release has them."""
_registered = False


class AscendRMSNorm(RMSNorm):
    def forward_oot(self, x, residual=None):
        if getattr(self, "variance_size_override", None) is not None or not getattr(self, "has_weight", True):
            return self.forward_native(x, residual)  # the NPU ops normalise over the full width
        if residual is None:
            return kernels.rms_norm(x, self.weight.data, self.variance_epsilon)[0]
        y, _, summed = kernels.add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return y, summed


class AscendSiluAndMul(SiluAndMul):
    def forward_oot(self, x):
        return kernels.swiglu(x, dim=-1)


class AscendRotaryEmbedding(RotaryEmbedding):
    """RoPE with ``npu_rotary_mul``: one launch per tensor, contiguous outputs, fp32 capable.

    cos/sin for the step's positions are gathered once and shared by every layer:
    models build one rotary module for all layers, and positions only change
    between forward passes.
    """

    _step = None  # (forward context, positions) the cached cos/sin belong to
    _cos_sin = None

    def _step_cos_sin(self, positions: torch.Tensor, query: torch.Tensor):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        step = (get_forward_context(), positions) if is_forward_context_available() else None
        if step is not None and self._step is not None and all(a is b for a, b in zip(step, self._step)):
            return self._cos_sin
        cache = self._match_cos_sin_cache_dtype(query)
        cos, sin = cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
        if self.is_neox_style:  # "half": lanes i and i + d/2 share a frequency
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        else:  # "interleave": lanes 2i and 2i + 1 share a frequency
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        self._cos_sin = (cos.unsqueeze(1), sin.unsqueeze(1))  # [T, 1, rotary_dim]: TND factors
        self._step = step
        return self._cos_sin

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(cos.shape[0], -1, self.head_size)
        mode = "half" if self.is_neox_style else "interleave"
        if self.rotary_dim == self.head_size:
            return kernels.rotary_mul(x, cos, sin, mode).view(shape)
        rotated = kernels.rotary_mul(x[..., : self.rotary_dim].contiguous(), cos, sin, mode)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1).view(shape)

    def forward_oot(self, positions, query, key=None):
        cos, sin = self._step_cos_sin(positions, query)
        return self._rotate(query, cos, sin), None if key is None else self._rotate(key, cos, sin)


def _register_ir_impls() -> None:
    try:
        from vllm import ir
    except ImportError:  # vLLM before the IR ops
        return

    @ir.ops.rms_norm.register_impl(
        IR_PROVIDER, supports_args=lambda x, weight, epsilon, variance_size=None: (
            variance_size is None and weight is not None
        )
    )
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> torch.Tensor:
        return kernels.rms_norm(x, weight, epsilon)[0]

    if not hasattr(ir.ops, "fused_add_rms_norm"):  # added in vLLM 0.21
        return

    @ir.ops.fused_add_rms_norm.register_impl(
        IR_PROVIDER, supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: (
            variance_size is None and weight is not None
        )
    )
    def fused_add_rms_norm(
        x: torch.Tensor,
        x_residual: torch.Tensor,
        weight: torch.Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, _, summed = kernels.add_rms_norm(x, x_residual, weight, epsilon)
        return y, summed


def register() -> None:
    """Register the OOT ops and IR implementations, once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    for cls, name in ((AscendRMSNorm, "RMSNorm"), (AscendSiluAndMul, "SiluAndMul"),
                      (AscendRotaryEmbedding, "RotaryEmbedding")):
        CustomOp.register_oot(_decorated_op_cls=cls, name=name)
    _register_ir_impls()
