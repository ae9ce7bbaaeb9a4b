"""RMSNorm (with the fused residual add) on the kernel seam."""

from vllm.model_executor.layers.layernorm import RMSNorm

from ascend_patch.npu import kernels


class AscendRMSNorm(RMSNorm):
    def forward_oot(self, x, residual=None):
        if self.variance_size_override is not None or not self.has_weight:
            return self.forward_native(x, residual)  # the NPU ops normalise over the full width
        if self.weight.dtype != x.dtype:
            return self.forward_native(x, residual)  # the NPU ops take gamma in x's dtype only
        if residual is None:
            return kernels.rms_norm(x, self.weight.data, self.variance_epsilon)[0]
        y, _, summed = kernels.add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return y, summed
