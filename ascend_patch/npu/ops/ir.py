"""``ascend`` implementations of vLLM IR's norm ops (vLLM 0.20+; ``fused_add_rms_norm`` 0.21+),
put first by ``NPUPlatform.get_default_ir_op_priority`` so IR callers other than ``RMSNorm``
reach the seam too."""

import torch

from ascend_patch.npu import kernels

PROVIDER = "ascend"
OPS = ("rms_norm", "fused_add_rms_norm")
"""The vLLM IR ops given a :data:`PROVIDER` implementation, where the release has them."""


def register() -> None:
    from vllm import ir

    # npu_rms_norm and npu_add_rms_norm take gamma in x's dtype only (the torch-npu wheels' own
    # docs), so Gemma's fp32 (1 + w) weight under a bf16/fp16 model stays with vLLM's native
    # implementation.
    @ir.ops.rms_norm.register_impl(
        PROVIDER, supports_args=lambda x, weight, epsilon, variance_size=None: (
            variance_size is None and weight is not None and weight.dtype == x.dtype
        )
    )
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> torch.Tensor:
        return kernels.rms_norm(x, weight, epsilon)[0]

    if not hasattr(ir.ops, "fused_add_rms_norm"):  # seam: vLLM 0.21+
        return

    @ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER, supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: (
            variance_size is None and weight is not None and weight.dtype == x.dtype
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
