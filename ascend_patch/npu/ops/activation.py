"""SiluAndMul on the kernel seam (``npu_swiglu``)."""

from vllm.model_executor.layers.activation import SiluAndMul

from ascend_patch.npu import kernels


class AscendSiluAndMul(SiluAndMul):
    def forward_oot(self, x):
        return kernels.swiglu(x, dim=-1)
