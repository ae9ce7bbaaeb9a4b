"""Model Runner V2's FULL graphs as ACL graphs.

MRV2 captures FULL graphs itself (``CudaGraphManager.capture``): ``torch.cuda.CUDAGraph()`` and
``with torch.cuda.graph(graph, pool, stream=...)`` around a forward, then ``graph.replay()`` in
``run_fullgraph``, **outside** ``set_forward_context``. On the NPU:

- ``torch.cuda.CUDAGraph`` is the device runtime's ``NPUGraph`` and ``torch.cuda.graph`` its
  ``graph`` context, which also collects the capture's host-parameter launches
  (:func:`ascend_patch.npu.compilation.acl_graph.launch`: kernels such as
  ``_npu_paged_attention`` whose host arguments change every step) and files them under the graph;
- the graph manager renews those launches with the step's attention metadata before each
  replay (:func:`~ascend_patch.npu.compilation.acl_graph.renew_host_params`), the metadata the
  runner recorded when it prepared the step (:attr:`NPUModelGraphManagerMixin.step_metadata`).

Attention chooses its capturable forms from ``acl_graph.capturing()``, never from the forward
context's runtime mode: MRV2 captures FULL graphs with ``cudagraph_runtime_mode=NONE``.
"""

from __future__ import annotations

import contextlib
import weakref

from vllm.platforms import current_platform

from ascend_patch.npu.compilation import acl_graph
from ascend_patch.npu.compilation.acl_graph import NPUGraphWrapper  # the process's graph counters

managers: weakref.WeakSet = weakref.WeakSet()
"""The process's graph managers, whose ``graphs`` hold its FULL graphs by batch descriptor (what
the engine tests inspect, as ``NPUGraphWrapper._all_instances`` for V1's)."""


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


class NPUModelGraphManagerMixin:
    """In front of MRV2's ``ModelCudaGraphManager`` (:func:`npu_graph_manager`)."""

    step_metadata: dict | None = None
    """The attention metadata of the step about to replay, by layer name (set by the runner)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        managers.add(self)

    def run_fullgraph(self, desc):
        graph = self.graphs.get(desc)
        launches = getattr(graph, "host_param_launches", ())  # not a seam: set at capture
        if launches:
            graphs = _graph_api()
            if getattr(self, "_update_stream", None) is None:  # not a seam: ours
                self._update_stream = graphs.Stream()  # not the capture's stream
            # Kept alive until the next replay's update: the replay reads them.
            self._workspaces = acl_graph.renew_host_params(graphs, self._update_stream, launches,
                                                           self.step_metadata)
            NPUGraphWrapper.task_updates += len(launches)
        NPUGraphWrapper.replays[desc.num_tokens] += 1
        NPUGraphWrapper.replays_by_model["backbone"] += 1
        return super().run_fullgraph(desc)


def npu_graph_manager(original: type) -> type:
    """Replacement of ``vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager`` (and of the
    name the runner builds it by)."""
    return type("ModelCudaGraphManager", (NPUModelGraphManagerMixin, original),
                {"__module__": __name__, "__qualname__": "NPUModelGraphManager"})
