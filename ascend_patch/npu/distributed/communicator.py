"""``NPUCommunicator``: the device collectives of the NPU platform.

vLLM's ``GroupCoordinator`` builds each group's device process group with the
platform's ``dist_backend`` — HCCL (registered by torch_npu) on Ascend, gloo on
the emulated NPU — and hands it to this communicator. ``DeviceCommunicatorBase``
already runs all_reduce, all_gather, reduce_scatter, gather, broadcast and
send/recv through ``torch.distributed`` on that group, and both backends
implement those directly, so they are inherited unchanged. What the base leaves
unimplemented, the variable-size gathers used by sequence parallelism and MoE
dispatch, is built here from those same collectives.

With data parallelism (0.20+: ``use_all2all`` on the expert group's communicator) the experts'
tokens cross the DP ranks through vLLM's own ``AgRsAll2AllManager``: it gathers every rank's
tokens and router logits with this communicator's ``all_gatherv`` and sums the expert outputs
back with ``reduce_scatterv``, over the device group (HCCL on the NPU, gloo emulated). vLLM's
other managers (DeepEP, NIXL-EP, FlashInfer, MoRI, MoonEP) are CUDA or ROCm kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)


class NPUCommunicator(DeviceCommunicatorBase):
    def __init__(self, cpu_group, device=None, device_group=None, unique_name="", **kwargs):
        # kwargs: global_ranks/global_world_size (0.20+), use_all2all (0.27+).
        super().__init__(cpu_group, device, device_group, unique_name, **kwargs)
        if device_group is not None and self.world_size > 1:
            from vllm.platforms import current_platform

            backend = dist.get_backend(device_group)
            if backend != current_platform.dist_backend:
                raise RuntimeError(
                    f"NPU device group {unique_name!r} uses the {backend!r} backend, expected "
                    f"{current_platform.dist_backend!r} (torch.distributed was initialised "
                    "without the platform's dist_backend)"
                )
        if self.use_all2all:
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            # ascend_patch.npu.distributed.check_config refuses any other --all2all-backend.
            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    # The expert group's dispatch and combine go through the manager when DP needs one; the
    # base class's identities otherwise (arguments passed on as given: 0.20+ signatures).
    def dispatch_router_logits(self, *args, **kwargs):
        if self.all2all_manager is None:
            return super().dispatch_router_logits(*args, **kwargs)
        return self.all2all_manager.dispatch_router_logits(*args, **kwargs)

    def dispatch(self, *args, **kwargs):
        if self.all2all_manager is None:
            return super().dispatch(*args, **kwargs)
        return self.all2all_manager.dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        if self.all2all_manager is None:
            return super().combine(*args, **kwargs)
        return self.all2all_manager.combine(*args, **kwargs)

    def destroy(self):
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None

    def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        """All-gather along ``dim`` where rank ``r`` contributes ``sizes[r]`` rows."""
        if isinstance(input_, list):
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        dim = dim % input_.dim()
        if sizes is None:
            return self.all_gather(input_, dim)
        if input_.shape[dim] != sizes[self.rank_in_group]:
            raise ValueError(
                f"all_gatherv: this rank holds {input_.shape[dim]} rows on dim {dim}, "
                f"sizes says {sizes[self.rank_in_group]}"
            )
        widest = max(sizes)
        pad = [0, 0] * (input_.dim() - dim - 1) + [0, widest - input_.shape[dim]]
        gathered = self.all_gather(torch.nn.functional.pad(input_, pad), dim)
        parts = gathered.split(widest, dim)
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim)

    def reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
        """Reduce across ranks, then keep this rank's ``sizes[rank]`` rows along ``dim``."""
        dim = dim % input_.dim()
        if sizes is None:
            return self.reduce_scatter(input_, dim)
        if sum(sizes) != input_.shape[dim]:
            raise ValueError(f"reduce_scatterv: sizes {sizes} do not add up to {input_.shape[dim]}")
        reduced = input_.clone()
        dist.all_reduce(reduced, group=self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return reduced.narrow(dim, start, sizes[self.rank_in_group]).contiguous()
