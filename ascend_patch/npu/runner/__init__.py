"""The runner room: what belongs to one vLLM runner generation, and nothing else does.

vLLM 0.20-0.33 run the V1 model runner (``vllm/v1/worker/gpu_model_runner.py``); 0.34 removed it
and runs only Model Runner V2 (``vllm/v1/worker/gpu/``). Each generation has its own subpackage
(:mod:`.v1`, :mod:`.v2`); the worker (:mod:`.worker`), its sleep mode (:mod:`.sleep_mode`, over the
runner interface both generations have) and the KV-cache allocation wrapper (:mod:`.kv_allocation`)
are shared. Which generation runs is not derived here: the active patch set declares it
(``RUNNER`` in ``patches/v0_*.py``) and the loader records it with the release facts
(:data:`ascend_patch.release.runner`). Outside this room no module imports
``vllm.v1.worker`` (``scripts/import_graph.py`` checks it).

Docs: docs/contributing.md, "Repository layout".
"""

from __future__ import annotations

import importlib

from ascend_patch import release

GENERATIONS = ("v1", "v2")
"""The runner generations, by their subpackage's name."""

WORKER = "ascend_patch.npu.runner.worker.NPUWorker"
"""The worker class of every generation (``parallel_config.worker_cls``)."""

_MODEL_RUNNERS = {
    "v1": "ascend_patch.npu.runner.v1.model_runner:NPUModelRunner",
    "v2": "ascend_patch.npu.runner.v2.model_runner:NPUModelRunnerV2",
}
_KERNEL_OVERRIDES = {
    "v1": "ascend_patch.npu.runner.v1.spec_decode.install:register",
    "v2": "ascend_patch.npu.runner.v2.kernels:register",
}


def active() -> str:
    """The runner generation of the active patch set."""
    if release.runner not in GENERATIONS:
        raise RuntimeError(f"ascend-patch: the active patch set declares runner {release.runner!r}, "
                           f"not one of {', '.join(GENERATIONS)}")
    return release.runner


def _resolve(paths: dict[str, str]):
    module, _, name = paths[active()].partition(":")
    return getattr(importlib.import_module(module), name)


def model_runner_cls() -> type:
    """The NPU model runner class of the active generation (imported on first use)."""
    return _resolve(_MODEL_RUNNERS)


def register_triton_kernel_overrides() -> None:
    """Register the active generation's NPU implementations of vLLM's Triton kernels."""
    _resolve(_KERNEL_OVERRIDES)()


def check_config(vllm_config) -> None:
    """The worker class: every generation's is :data:`WORKER`, which builds the generation's
    runner."""
    parallel = vllm_config.parallel_config
    if parallel.worker_cls == "auto":
        parallel.worker_cls = WORKER
