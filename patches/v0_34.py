"""Patch set v0_34: Model Runner V2, the only runner from vLLM 0.34 (the releases:
``compat_matrix.yaml``).

0.34 removed the V1 model runner (``gpu_model_runner.py``, ``gpu_input_batch.py``,
``block_table.py``, the V1 sampler and ``v1/spec_decode/``). This set serves MRV2
(:mod:`ascend_patch.patches.runner_v2`); the platform, attention, MoE, quantization, graph and
KV-allocation declarations are v0_29's, less those that name the V1 runner.
"""

from ascend_patch.overlay.declarations import Setting, admits
from ascend_patch.patches import graphs, runner_v2, v0_29

RUNNER = "v2"

_V1_RUNNER = ("vllm.v1.worker.gpu_model_runner:", "vllm.v1.worker.gpu_input_batch:",
              "vllm.v1.worker.block_table:", "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler",
              "vllm.v1.sample.rejection_sampler:", "vllm.v1.spec_decode.")


def _serves_mrv2(declaration) -> bool:
    """Whether a v0_29 declaration holds on MRV2: not limited to releases before 0.34, not one of
    the V1 runner's modules, and not the setting that pinned the V1 runner (0.34 refuses
    VLLM_USE_V2_MODEL_RUNNER other than 1)."""
    if not admits(declaration, "0.34"):
        return False
    if isinstance(declaration, Setting):
        return declaration.variable != "VLLM_USE_V2_MODEL_RUNNER"
    return not declaration.target.startswith(_V1_RUNNER)


PATCHES = [*filter(_serves_mrv2, v0_29.PATCHES), *runner_v2.RUNNER]

MANIFEST = [*filter(_serves_mrv2, v0_29.MANIFEST), *runner_v2.RUNNER, *runner_v2.GRAPH_DEVICE_API,
            *graphs.SEAMS]
"""Everything the overlay changes or relies on for these releases: the loader verifies all of
it before applying any, and ``doctor``, ``probe`` and ``docs/patches.md`` list it."""
