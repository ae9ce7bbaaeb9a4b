"""vLLM's ``graph_capture`` context on the NPU.

``vllm.distributed.parallel_state.graph_capture`` enters each group's
``GroupCoordinator.graph_capture``, which asserts that a group with a device communicator has
CUDA's or XPU's (0.22+) and enters their custom all-reduce capture. The NPU needs neither: HCCL
collectives are captured as they are. This replacement keeps the rest of vLLM's behaviour: the
capture runs on a stream of its own (or the given context's, 0.26-0.30, or the given stream,
0.34+, whose graphs share the pool's free blocks), ordered after the current one.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def graph_capture(device: torch.device, stream=None, graph_capture_context=None):
    from vllm.distributed.parallel_state import GraphCaptureContext
    from vllm.platforms import current_platform

    graphs = current_platform.runtime().graphs()
    if isinstance(stream, GraphCaptureContext):  # 0.26-0.30 passed the context second
        graph_capture_context, stream = stream, None
    if graph_capture_context is None:
        graph_capture_context = GraphCaptureContext(stream or graphs.Stream())
    stream = graph_capture_context.stream
    stream.wait_stream(graphs.current_stream())
    with graphs.stream(stream):
        yield graph_capture_context


def npu_graph_capture(original):
    """Replacement factory for ``vllm.distributed.parallel_state.graph_capture``."""
    return graph_capture
