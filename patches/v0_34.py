"""Patch set v0_34: Model Runner V2, the only runner from vLLM 0.34 (the releases:
``compat_matrix.yaml``).

0.34 removed the V1 model runner (``gpu_model_runner.py``, ``gpu_input_batch.py``,
``block_table.py``, the V1 sampler and ``v1/spec_decode/``). This set is v0_29's runner-neutral
declarations (``v0_29.NEUTRAL``: platform, attention, MoE, quantization, LoRA, graphs, KV
allocation; less those limited to releases before 0.34) with Model Runner V2's
(:mod:`ascend_patch.patches.runner_v2`) in place of the V1 runner's, and the recurrent layers'
state copies that 0.34 added (``recurrent.STATE_COPIES``).
"""

from ascend_patch.overlay.declarations import Seam, admits
from ascend_patch.patches import graphs, recurrent, runner_v2, v0_29

RUNNER = "v2"


def _on_0_34(declarations) -> list:
    """The declarations that hold on 0.34: not limited to releases before it."""
    return [d for d in declarations if admits(d, "0.34")]


PATCHES = [*_on_0_34(v0_29.NEUTRAL), *recurrent.STATE_COPIES, *runner_v2.RUNNER]

SEAMS = [
    Seam("vllm.v1.kv_offload.base:DevicePointers",
         "the NPU offloading worker turns the device addresses vLLM resolves for a transfer from "
         "0.34 back into block ids (block ids before)", since="0.34",
         implementation="ascend_patch.npu.distributed.kv_transfer.offload:NPUOffloadingWorker"),
]

MANIFEST = [*PATCHES, *_on_0_34(v0_29.NEUTRAL_MANIFEST), *runner_v2.GRAPH_DEVICE_API, *graphs.SEAMS, *SEAMS]
"""Everything the overlay changes or relies on for these releases: the loader verifies all of
it before applying any, and ``doctor``, ``probe`` and ``docs/patches.md`` list it."""
