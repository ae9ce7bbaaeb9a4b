"""Graph mode on the NPU: ACL graph capture and replay behind vLLM's static-graph hooks.

- :mod:`.graph_mode`: the graph-mode policy (which mode and capture sizes a configuration gets);
- :mod:`.acl_graph`: the static graph wrapper vLLM asks the platform for (and the FULL-graph
  wrapper the NPU runner substitutes for vLLM's ``CUDAGraphWrapper``), the host-parameter
  updates replayed graphs receive, and the capture sizes the NPU's stream budget allows.

The emulated NPU graph (``ASCEND_PATCH=emulate``), which records the device work of a capture and
replays exactly that work so graph-mode bugs fail off-hardware, is
:mod:`ascend_patch.npu.emulation.graph`.

Docs: docs/graph-mode.md, "Graph mode (ACL graphs)".
"""
