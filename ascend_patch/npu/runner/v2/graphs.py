"""Model Runner V2's FULL graphs as ACL graphs, the target's and the drafter's.

MRV2 captures FULL graphs itself (``CudaGraphManager.capture``): ``torch.cuda.CUDAGraph()`` and
``with torch.cuda.graph(graph, pool, stream=...)`` around a forward, then ``graph.replay()`` in
``run_fullgraph``, **outside** ``set_forward_context``. The target model's graphs belong to a
``ModelCudaGraphManager``; a speculator's (the EAGLE/MTP/draft-model drafter's prefill over the
verified tokens, and each draft step after the first) to ``SpeculatorCudaGraphManager``s. On the
NPU:

- ``torch.cuda.CUDAGraph`` is the device runtime's ``NPUGraph`` and ``torch.cuda.graph`` its
  ``graph`` context, which also collects the capture's host-parameter launches
  (:func:`ascend_patch.npu.compilation.acl_graph.launch`: kernels such as
  ``_npu_paged_attention`` whose host arguments change every step) and files them under the graph;
- every manager renews those launches before each replay
  (:func:`~ascend_patch.npu.compilation.acl_graph.renew_host_params`) with the attention metadata
  last built for each layer: the runner's for the step (which the drafter's prefill reuses) and the
  speculator's for each draft step (:data:`step_metadata`). A CUDA graph needs none of this: its
  kernels read the lengths from device buffers the metadata builders refill.

Attention chooses its capturable forms from ``acl_graph.capturing()``, never from the forward
context's runtime mode: MRV2 captures FULL graphs with ``cudagraph_runtime_mode=NONE``.
"""

from __future__ import annotations

import contextlib
import weakref

from vllm.platforms import current_platform

from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper  # the process's graph counters

managers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The process's graph managers, whose ``graphs`` hold its FULL graphs by batch descriptor (what
the engine tests inspect, as ``NPUGraphWrapper._all_instances`` for V1's), each with the model
tag its replays count under: "backbone" the target's, "drafter" a speculator's."""
step_metadata: dict = {}
"""The attention metadata last built for each layer, by layer name: what each replay renews its
launches with. Layers are named apart (the drafter's from the target's), and every build precedes
the replay that reads it in MRV2's step; a new runner starts it afresh (:func:`forget_steps`)."""


def forget_steps() -> None:
    """A new runner's graphs read none of an earlier engine's metadata (nor keep it alive)."""
    step_metadata.clear()


def _graph_api():
    return current_platform.runtime().graphs()


def npu_graph_class(original):
    """Replacement factory of ``torch.cuda.CUDAGraph``: the device runtime's graph."""

    def CUDAGraph(*args, **kwargs):  # noqa: N802 - torch's name
        return _graph_api().NPUGraph()

    return CUDAGraph


def npu_graph_capture(original):
    """Replacement factory of ``torch.cuda.graph``: capture on the device runtime, collecting
    the host-parameter launches each replay must renew."""

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        graphs = _graph_api()
        with acl_graph._collect_host_param_launches() as launches, \
                graphs.graph(cuda_graph, pool=pool, stream=stream):
            yield cuda_graph
        # On the graph itself: each launch's task group refers back to it, so a table keyed by
        # graphs (even weakly) would keep every graph, and the KV cache its launches read, alive.
        cuda_graph.host_param_launches = launches
        NPUGraphWrapper.captures += 1

    return graph


def record_step_metadata(metadata: dict | None) -> None:
    """File attention metadata just built (by layer name) for the replays that follow."""
    if metadata:
        step_metadata.update(metadata)


def register_manager(wrapped, instance, args, kwargs):
    """Wrapper of ``CudaGraphManager.capture``: the process's managers and their model tags, for
    the engine tests."""
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    managers[instance] = "backbone" if isinstance(instance, ModelCudaGraphManager) else "drafter"
    return wrapped(*args, **kwargs)


def renew_before_replay(wrapped, instance, args, kwargs):
    """Wrapper of ``CudaGraphManager.run_fullgraph(desc)``: renew the graph's host-parameter
    launches with the metadata last built for their layers, then replay."""
    (desc,) = args
    graph = instance.graphs.get(desc)
    launches = getattr(graph, "host_param_launches", ())  # not a seam: set at capture
    if launches:
        graphs = _graph_api()
        if getattr(instance, "_update_stream", None) is None:  # not a seam: ours
            instance._update_stream = graphs.Stream()  # not the capture's stream
        # Kept alive until the next replay's update: the replay reads them.
        instance._workspaces = acl_graph.renew_host_params(graphs, instance._update_stream,
                                                           launches, step_metadata)
        NPUGraphWrapper.task_updates += len(launches)
    NPUGraphWrapper.replays[managers[instance], desc.num_tokens] += 1  # captured, so registered
    return wrapped(*args, **kwargs)


def record_drafter_metadata(wrapped, instance, args, kwargs):
    """Wrapper of ``DraftModelSpeculator._build_attn_metadata``: a draft step's metadata, which
    only its forward context sees, filed for the drafter graph replayed next."""
    metadata = wrapped(*args, **kwargs)
    record_step_metadata(metadata)
    return metadata
