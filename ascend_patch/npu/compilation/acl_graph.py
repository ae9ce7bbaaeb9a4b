"""ACL graphs behind vLLM's static-graph hooks.

:class:`NPUGraphWrapper` is what vLLM runs a graph through: the platform names it as the static
graph wrapper (``get_static_graph_wrapper_cls``, used for the pieces of a PIECEWISE-compiled
model) and the NPU runner puts it where vLLM's V1 runner builds ``CUDAGraphWrapper`` for FULL
graphs. It keeps vLLM's contract (run eagerly unless the forward context's runtime mode is the
wrapper's; one graph per ``BatchDescriptor``; capture on first sight, replay after) and does it
with the device runtime's graph API: ``torch_npu.npu.NPUGraph`` on the NPU, the emulated graph of
:mod:`ascend_patch.npu.emulation.graph` otherwise.

Host-parameter updates. Some NPU kernels take host arguments that change every step
(``_npu_paged_attention``'s ``context_lens``); a graph would replay the capture's values. A kernel
launched through :func:`launch` inside a capture is captured as its own task group, behind an
``ExternalEvent`` wait and reset; before each replay the wrapper re-issues it with the step's host
values (``graph_task_update_begin``/``_end`` on an update stream) and records the event, which
releases the replay's wait (the protocol vllm-ascend uses, ``compilation/acl_graph.py``). The
reset is what makes the next replay wait again: torch_npu's ``ExternalEvent`` keeps its flag
through a wait until ``reset()`` (``npu/streams.py``), and vllm-ascend captures ``wait`` then
``reset`` for the same reason.

Stream budget. An ACL graph holds device streams, and the NPU has 2048;
:func:`capture_size_budget` is vllm-ascend's formula (``update_aclgraph_sizes``) for how many
capture sizes fit, which the platform applies when it settles the graph configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable
from unittest.mock import patch

import torch
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
from vllm.compilation import monitor
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.platforms import current_platform

# -- host-parameter updates -----------------------------------------------------------------------


@dataclasses.dataclass
class _HostParamLaunch:
    """One captured launch whose host arguments each replay renews."""

    key: str  # the forward context's attention-metadata key (the layer name)
    issue: Callable  # issue(params, workspace): the kernel call
    workspace: Callable | None  # workspace(params): the buffer the call is given, or None
    handle: object  # the task group (graph_task_group_end)
    event: object  # the ExternalEvent the captured launch waits for


_capturing: list[_HostParamLaunch] | None = None  # the launches of the capture in progress


def launch(key: str, params, issue: Callable, workspace: Callable | None = None) -> None:
    """Issue a kernel whose host arguments change every step: ``issue(params, workspace(params))``.

    ``params`` is this step's attention metadata of layer ``key``. Outside a capture the kernel
    just runs (with no workspace: the op allocates its own). Inside one it is captured as a task
    group that every replay re-issues with that replay's metadata for ``key``.
    """
    if _capturing is None:
        issue(params, None)
        return
    graphs = current_platform.runtime().graphs()
    stream = graphs.current_stream()
    buffer = workspace(params) if workspace is not None else None
    event = graphs.ExternalEvent()
    event.wait(stream)
    event.reset(stream)  # the flag outlives the wait: clear it for the next replay's record
    graphs.graph_task_group_begin(stream)
    issue(params, buffer)
    handle = graphs.graph_task_group_end(stream)
    _capturing.append(_HostParamLaunch(key, issue, workspace, handle, event))


def capturing() -> bool:
    """Whether a graph capture is in progress (its launches must not bake host values)."""
    return _capturing is not None


@contextlib.contextmanager
def _collect_host_param_launches():
    global _capturing
    outer, _capturing = _capturing, []
    try:
        yield _capturing
    finally:
        _capturing = outer


def full_graphs_configured() -> bool:
    """Whether the engine whose model is being built captures FULL graphs: its attention layers
    then launch the decode kernels' capturable forms. False outside an engine's config."""
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
    except AssertionError:  # vLLM 0.33 outside set_current_vllm_config (an impl built alone)
        return False
    mode = config.compilation_config.cudagraph_mode
    return mode is not None and mode.has_full_cudagraphs()


# -- the wrapper ---------------------------------------------------------------------------------


class NPUGraphWrapper(CUDAGraphWrapper):
    """vLLM's ``CUDAGraphWrapper`` contract on the NPU's graphs (see the module docstring).

    A subclass, so vLLM's bookkeeping over ``CUDAGraphWrapper._all_instances`` (clearing graphs,
    counting them) covers it; the capture and replay are its own, as ``CUDAGraphWrapper.__call__``
    hard-codes ``torch.cuda.graph``.
    """

    captures = 0  # process-wide counts, for tests and benchmarks
    # by (model tag, the replayed batch's padded token count): the wrapper's tag (see __init__),
    # or an MRV2 graph manager's
    replays: Counter[tuple[str, int]] = Counter()
    task_updates = 0  # captured launches re-issued with a replay's host parameters

    def __init__(self, runnable, vllm_config, runtime_mode, cudagraph_options=None) -> None:
        super().__init__(runnable, vllm_config, runtime_mode, cudagraph_options)
        self._graphs = current_platform.runtime().graphs()
        self._update_stream = None
        self._host_params: dict[object, list[_HostParamLaunch]] = {}
        self._workspaces: list = []  # the buffers of the latest update, alive while it replays
        # A piece's model, by vLLM's tag of the compiled model ("eagle_head", "draft_model": a
        # drafter's pieces): the drafter's replays are told from the target's.
        backend = getattr(runnable, "vllm_backend", None)  # not a seam: FULL graphs wrap a model
        self.model_tag = backend.prefix if backend is not None else "backbone"

    def clear_graphs(self) -> None:
        super().clear_graphs()
        self._host_params.clear()

    def __call__(self, *args, **kwargs):
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        context = get_forward_context()
        mode = context.cudagraph_runtime_mode
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        descriptor = context.batch_descriptor
        entry = self.concrete_cudagraph_entries.get(descriptor)
        if entry is None or entry.cudagraph is None:
            return self._capture(descriptor, args, kwargs)
        if self.is_debugging_mode:
            addresses = [x.data_ptr() for x in args if isinstance(x, torch.Tensor)]
            assert addresses == entry.input_addresses, (
                f"graph inputs moved since capture: {entry.input_addresses} -> {addresses}")
        updates = self._host_params[descriptor]
        if updates:
            if self._update_stream is None:
                self._update_stream = self._graphs.Stream()  # not the capture's stream
            self._workspaces = renew_host_params(self._graphs, self._update_stream, updates,
                                                 context.attn_metadata)
            NPUGraphWrapper.task_updates += len(updates)
        entry.cudagraph.replay()
        NPUGraphWrapper.replays[self.model_tag, descriptor.num_tokens] += 1
        return entry.output

    def _capture(self, descriptor, args, kwargs):
        if hasattr(monitor, "validate_cudagraph_capturing_enabled"):  # seam: vLLM < 0.34
            monitor.validate_cudagraph_capturing_enabled()
        entry = CUDAGraphEntry(batch_descriptor=descriptor)
        entry.input_addresses = [x.data_ptr() for x in args if isinstance(x, torch.Tensor)]
        graph = self._graphs.NPUGraph()
        with contextlib.ExitStack() as stack:
            if self.cudagraph_options.gc_disable:
                # Piecewise capture takes one graph per layer: collect once, not per piece.
                stack.enter_context(patch("gc.collect", lambda *a, **k: None))
                stack.enter_context(patch("torch.accelerator.empty_cache", lambda *a, **k: None))
            host_params = stack.enter_context(_collect_host_param_launches())
            with self._graphs.graph(graph, pool=self.graph_pool):
                output = self.runnable(*args, **kwargs)
        # The output stays referenced: replays write into it (the pool keeps its address).
        entry.output, entry.cudagraph = output, graph
        self.concrete_cudagraph_entries[descriptor] = entry
        self._host_params[descriptor] = host_params
        compilation_counter.num_cudagraph_captured += 1
        NPUGraphWrapper.captures += 1
        return output



def renew_host_params(graphs, stream, updates: list[_HostParamLaunch], metadata) -> list:
    """Before a replay: re-issue each captured launch of ``updates`` with this step's ``metadata``
    on the update ``stream``, then record its event, which the replay's captured wait passes on.
    Returns the workspaces handed to the launches (to keep alive while the replay runs)."""
    # The update stream first waits for what the current stream has queued, the previous replay
    # among it: an update landing while that replay runs would rewrite a task in flight, or
    # record the event before that replay's captured reset, which would clear it (a hang).
    stream.wait_stream(graphs.current_stream())
    workspaces = []
    with graphs.stream(stream):
        for update in updates:
            params = metadata[update.key]
            buffer = update.workspace(params) if update.workspace is not None else None
            workspaces.append(buffer)
            _reissue(graphs, stream, update, params, buffer)
            update.event.record(stream)
    return workspaces


def _reissue(graphs, stream, update: _HostParamLaunch, params, buffer) -> None:
    graphs.graph_task_update_begin(stream, update.handle)
    update.issue(params, buffer)
    graphs.graph_task_update_end(stream)


# -- how many capture sizes the NPU's streams allow ----------------------------------------------

STREAM_BUDGET = 1800
"""Streams ACL graphs may take: the NPU has 2048, vllm-ascend keeps 248 in reserve."""
CONTEXT_PARALLEL_STREAMS = 100
"""Streams prefill or decode context parallelism takes for its communication (each)."""


@dataclasses.dataclass(frozen=True)
class CaptureBudget:
    max_sizes: int
    graphs_per_size: int
    reason: str


def capture_size_budget(vllm_config, piecewise: bool, full: bool) -> CaptureBudget:
    """How many capture sizes fit in the NPU's stream budget (vllm-ascend ``update_aclgraph_sizes``,
    releases/v0.20.2rc): each size takes one graph per piece (``num_hidden_layers + 1`` pieces in a
    PIECEWISE split) plus one FULL graph; communication groups (TP > 1, DP > 1) take streams too,
    more so in HCCL's default FFTS+/AICPU expansion than with ``HCCL_OP_EXPANSION_MODE=AIV``.
    With LoRA vLLM captures every size once per LoRA case (:func:`lora_cases`)."""
    hf = vllm_config.model_config.hf_text_config
    layers = getattr(hf, "num_hidden_layers", 0)  # not a seam: an HF config field
    graphs_per_size = ((layers + 1 if piecewise else 0) + (1 if full else 0)) * lora_cases(vllm_config)
    parallel = vllm_config.parallel_config
    comm_groups = sum(size > 1 for size in (parallel.data_parallel_size, parallel.tensor_parallel_size))
    budget = STREAM_BUDGET
    if os.environ.get("HCCL_OP_EXPANSION_MODE") == "AIV":
        factor = 1 + comm_groups + int(parallel.enable_expert_parallel)
        if vllm_config.model_config.is_moe:
            factor += int(parallel.data_parallel_size > 1)
        else:  # the dense layers' AIV all-reduce holds streams of its own
            budget -= factor * graphs_per_size
        max_sizes = math.floor(budget / graphs_per_size / factor)
        how = f"HCCL AIV expansion, {factor} stream(s) per graph"
    else:
        for size in (parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size):
            budget -= CONTEXT_PARALLEL_STREAMS * (size > 1)
        max_sizes = math.floor((budget - 40 * comm_groups) / graphs_per_size / (1 + 2 * comm_groups))
        how = (f"{comm_groups} communication group(s) in HCCL's FFTS+/AICPU expansion"
               if comm_groups else "no communication groups")
    reason = (f"ACL graphs may hold {STREAM_BUDGET} of the NPU's 2048 streams and each size takes "
              f"{graphs_per_size} graph(s) ({layers} layers, "
              f"{'PIECEWISE' if piecewise else ''}{' + ' if piecewise and full else ''}"
              f"{'FULL' if full else ''}"
              f"{f', × {lora_cases(vllm_config)} LoRA cases' if vllm_config.lora_config else ''}"
              f"), {how}")
    return CaptureBudget(max(max_sizes, 1), graphs_per_size, reason)


def lora_cases(vllm_config) -> int:
    """How many graphs vLLM captures per size and mode for LoRA's sake: with
    ``cudagraph_specialize_lora`` one without adapters plus one per captured active-adapter count
    (V1's ``CudagraphDispatcher._get_lora_cases``, the same 0.20-0.33, and Model Runner V2's
    ``get_lora_capture_cases``); without it one on V1, and on Model Runner V2 two: without
    adapters and with ``max_loras + 1`` active."""
    from ascend_patch import release

    lora = vllm_config.lora_config
    if lora is None:
        return 1
    if not vllm_config.compilation_config.cudagraph_specialize_lora:
        return 2 if release.runner == "v2" else 1
    from vllm.lora.utils import get_captured_lora_counts

    return 1 + len(get_captured_lora_counts(lora.max_loras, lora.specialize_active_lora))


def sample_sizes(sizes: list[int], keep: int) -> list[int]:
    """``keep`` of the ascending ``sizes``, spread evenly, the smallest and largest always kept."""
    if keep >= len(sizes):
        return list(sizes)
    if keep == 1:
        return [sizes[-1]]
    step = (len(sizes) - 1) / (keep - 1)
    indices = sorted({round(i * step) for i in range(keep)} | {0, len(sizes) - 1})
    return [sizes[i] for i in indices]
