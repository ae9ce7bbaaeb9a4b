"""The emulated NPU graph (``ASCEND_PATCH=emulate``): a capture records the device work, a replay
re-executes exactly that work on the captured tensors.

It offers the part of ``torch_npu.npu`` the graph path calls (``NPUGraph``, ``graph``,
``graph_pool_handle``, ``ExternalEvent``, ``graph_task_group_begin/end``,
``graph_task_update_begin/end``), so :mod:`ascend_patch.npu.compilation.acl_graph` and the attention backend make the same
calls on the emulated NPU as on a real one, where these names are torch_npu's.

**What a capture records.** Every kernel-seam call (:mod:`ascend_patch.npu.kernels`) as one launch,
with its tensors by reference and its host arguments by value: Python lists and numbers, and the
tensors an op reads on the host at launch (:data:`HOST_TENSORS`). Every other tensor op (seen at
torch dispatch; a Python custom op such as ``vllm::unified_attention_with_output`` is descended
into, so the launches inside it are what is recorded), tensors by reference. Waits on an
``ExternalEvent``. Views and bare allocations record nothing: they do no device work, and what they
return keeps its storage. The capture runs the work once (the NPU only records it; vLLM discards a
capture's output), because the emulation needs real tensors to record.

**What a replay does.** It re-runs each recorded launch on the recorded tensors with the recorded
host values, writing every result into the tensor the capture produced: its fixed address in the
graph pool. The inputs a caller hands a replay are not looked at, as on the device: a caller that
did not copy a step's inputs into the captured buffers gets the capture's inputs again, and a launch
whose host arguments were not updated (``graph_task_update_*``) runs with the capture's values.

**What raises during a capture** (:class:`GraphCaptureError`), where the NPU would fail or would bake
a value into the graph:

- a host sync: the host reading tensor values (``.item()``, ``.tolist()``, ``.numpy()``,
  ``.cpu()``, ``bool(t)``), or an op whose output shape depends on them (``nonzero``,
  ``masked_select``, ``unique``...). On the emulated NPU every tensor is a CPU tensor, so inside a
  capture *every* tensor counts as device memory, except the arguments of a kernel-seam call (the
  seam kernels read their own host arguments, as the real ops do at launch);
- an allocation outside the graph pool: pinned host memory, or host data turned into a tensor
  (``torch.tensor(list)``), which a replay would repeat with the capture's values;
- a shape change: ``resize_`` or ``set_`` of a tensor (a graph's shapes and addresses are fixed);
- an op PyTorch tags ``cudagraph_unsafe``.

A replay raises (:class:`GraphReplayError`) at a captured ``ExternalEvent.wait`` on an event
nothing recorded (the NPU would wait there forever), or one recorded again before a ``reset``
cleared the earlier record (the NPU's wait may pass on the stale one: see :class:`ExternalEvent`).

**What it does not model.** Streams: one in-order queue stands for all of them, so the race an
``ExternalEvent`` guards against (a replay overtaking the host-parameter update on its own stream)
cannot happen here; what is checked is that each wait has one record of its own to pass on. Pool sharing: each emulated graph
keeps its own intermediates, while graphs captured into one device pool overlay theirs (the HBM
books charge a pool its largest graph, as the device would use), so one graph overwriting a tensor
another still reads is not reproduced. ``.to(device)`` of a host tensor: host and device are both
the CPU here, so that copy is invisible. Timing, and memory read without the dispatcher (an
extension reading ``data_ptr()``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ascend_patch.npu import kernels

# The tensor arguments each seam op reads on the host when launched; the others are device memory.
# (_npu_paged_attention: AtbCommon hands CPU inputs to ATB as host data, which PagedAttention reads
# at launch: paged_attention_operation.cpp, inTensor[4].hostData.)
HOST_TENSORS = {
    "paged_attention": frozenset({"context_lens"}),
    "paged_attention_workspace": frozenset({"context_lens"}),
}
# Seam ops that size and allocate a workspace on the host (``*_get_workspace``,
# ``*_get_max_workspace``) and launch nothing: inside a capture their buffer is an allocation of
# the graph pool, and a replay does not run them again.
WORKSPACE_OPS = frozenset({"paged_attention_workspace", "fused_infer_attention_score_decode_workspace",
                           "fused_infer_attention_score_verify_workspace",
                           "fused_infer_attention_score_mla_decode_workspace"})


class GraphCaptureError(RuntimeError):
    """The captured code did something an NPU graph cannot hold."""


class GraphReplayError(RuntimeError):
    """A replay or a task update would fail (or hang) on the NPU."""


_aten = torch.ops.aten
_ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default,
                          _aten.empty_like.default, _aten.new_empty.default,
                          _aten.new_empty_strided.default})
_HOST_DATA = frozenset({_aten.lift_fresh.default, _aten.lift_fresh_copy.default,
                        _aten._pin_memory.default})
_RESIZES = frozenset({_aten.resize_.default, _aten.set_.source_Storage,
                      _aten.set_.source_Storage_storage_offset, _aten.set_.source_Tensor,
                      _aten.set_.default})
_HOST_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item,
                         torch.Tensor.cpu, torch.Tensor.__array__})
# Recorded as one launch; any other namespace is a Python custom op, whose launches are recorded.
_DEVICE_NAMESPACES = frozenset({"aten", "prims", "c10d", "_c10d_functional"})

_BELOW_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # the emulated NPU's kernels

_capture: _Capture | None = None
_update: _Update | None = None


# -- the graph ------------------------------------------------------------------------------------


# The HBM books graph pools are charged to: those of the emulated runtime that handed out this
# graph API (EmulatedRuntime.graphs), so the graph never reaches back for a runtime.
_books = None


def charge_pools_to(books) -> None:
    """Charge the pools' memory to ``books`` (anything with ``charge(what, nbytes, lifetime)``)."""
    global _books
    _books = books


class _Pool:
    """A graph memory pool (``graph_pool_handle()``). Graphs captured into one pool are never
    replayed together, so the device overlays their memory: the pool holds its largest graph."""

    def __init__(self) -> None:
        self.nbytes = 0

    def hold(self, nbytes: int) -> None:
        if nbytes > self.nbytes:
            if _books is not None:
                _books.charge("graph pool", nbytes - self.nbytes, self)
            self.nbytes = nbytes


def graph_pool_handle() -> _Pool:
    return _Pool()


class NPUGraph:
    """A captured sequence of device work (``torch_npu.npu.NPUGraph``)."""

    replays = 0  # across all graphs: how many replays this process ran

    def __init__(self) -> None:
        # (fn, args, kwargs, fresh outputs as [(index or None, captured tensor)], seam op name)
        self._launches: list[tuple] = []
        self._storages: dict[int, int] = {}  # storage address -> bytes the graph's outputs hold
        self._pool: _Pool | None = None

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def capture_begin(self, pool: _Pool | None = None) -> None:
        global _capture
        if _capture is not None:
            raise GraphCaptureError("a graph capture is already in progress")
        self.reset()
        self._pool = pool if pool is not None else _Pool()
        _capture = _Capture(self)
        _capture.start()

    def capture_end(self) -> None:
        global _capture
        capture, _capture = _capture, None
        capture.stop()
        if capture.group_start is not None:
            raise GraphCaptureError("graph_task_group_begin without graph_task_group_end")
        self._pool.hold(self.nbytes)

    def _abandon_capture(self) -> None:
        global _capture
        capture, _capture = _capture, None
        capture.stop()
        self.reset()

    def replay(self) -> None:
        NPUGraph.replays += 1
        for fn, args, kwargs, fresh, _ in self._launches:
            result = fn(*args, **kwargs)
            for index, captured in fresh:
                captured.copy_(result if index is None else result[index])

    def reset(self) -> None:
        self._launches.clear()
        self._storages.clear()

    def pool(self) -> _Pool | None:
        return self._pool

    def _record(self, fn, args, kwargs, result, inputs, name=None, alias_only=False) -> None:
        """One launch; its outputs that share no storage with an input are the graph's own.
        An op that may return a view (``alias_only``) and did is no launch at all."""
        taken = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
        fresh = []
        outputs = [(None, result)] if isinstance(result, torch.Tensor) else (
            list(enumerate(result)) if isinstance(result, (tuple, list)) else [])
        for index, output in outputs:
            if isinstance(output, torch.Tensor) and output.untyped_storage().data_ptr() not in taken:
                fresh.append((index, output))
                self._hold(output)
        if fresh or not alias_only:
            self._launches.append((fn, args, kwargs, fresh, name))

    def _hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self._storages[storage.data_ptr()] = storage.nbytes()


def _tensors(tree):
    for item in tree:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors(item)
        elif isinstance(item, dict):
            yield from _tensors(item.values())


class graph:
    """``with graph(g, pool=None, stream=None):`` captures the enclosed work into ``g``
    (``torch_npu.npu.graph``; one in-order stream, so ``stream`` changes nothing)."""

    def __init__(self, npu_graph: NPUGraph, pool: _Pool | None = None, stream=None, **_) -> None:
        self.npu_graph, self.pool = npu_graph, pool

    def __enter__(self) -> NPUGraph:
        self.npu_graph.capture_begin(pool=self.pool)
        return self.npu_graph

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is None:
            self.npu_graph.capture_end()
        else:
            self.npu_graph._abandon_capture()


def is_capturing() -> bool:
    return _capture is not None


class Stream:
    """A stream of the emulated NPU: all of them are one in-order queue."""

    def __init__(self, *args, **kwargs) -> None: ...
    def wait_stream(self, stream) -> None: ...
    def wait_event(self, event) -> None: ...
    def synchronize(self) -> None: ...


_STREAM = Stream()


def current_stream(device=None) -> Stream:
    return _STREAM


def stream(stream: Stream | None):
    return contextlib.nullcontext(stream)


# -- capture: what is recorded and what raises --------------------------------------------------


class _Capture:
    def __init__(self, graph: NPUGraph) -> None:
        self.graph = graph
        self.seam_depth = 0  # inside a kernel-seam call: its own work, not recorded separately
        self.group_start: int | None = None
        self._stack = contextlib.ExitStack()

    def start(self) -> None:
        self._stack.enter_context(_swap_seam(self._launch))
        self._stack.enter_context(_HostReads(self))
        self._stack.enter_context(_DeviceWork(self))

    def stop(self) -> None:
        self._stack.close()

    def _launch(self, name, fn, signature, args, kwargs):
        self.seam_depth += 1
        try:
            result = fn(*args, **kwargs)
            args, kwargs = _by_value(name, signature, args, kwargs)
        finally:
            self.seam_depth -= 1
        if name in WORKSPACE_OPS:
            self.graph._hold(result)
            return result
        self.graph._record(fn, args, kwargs, result, (args, kwargs), name)
        return result

    def check(self, func, args, kwargs) -> None:
        tags = func.tags
        if ((torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags)
                and not _integer_indexing(func, args)):
            raise GraphCaptureError(
                f"host sync inside a captured region: {func} reads tensor values on the host "
                "(.item(), bool(), or an output shape that depends on the values); an NPU graph "
                "cannot contain it. Compute it before the captured region, or keep the op outside it")
        if func in _HOST_DATA or kwargs.get("pin_memory"):
            raise GraphCaptureError(
                f"allocation outside the graph pool inside a captured region: {func} places host "
                "data or pinned memory, which the graph would replay with the capture's values; "
                "copy host values into a persistent device buffer before the replay instead")
        if func in _RESIZES:
            raise GraphCaptureError(
                f"shape change inside a captured region: {func} resizes or re-points a tensor, but "
                "a graph's shapes and addresses are fixed at capture")
        if torch.Tag.cudagraph_unsafe in tags:
            raise GraphCaptureError(f"{func} is tagged cudagraph_unsafe and cannot be captured")


def _integer_indexing(func, args) -> bool:
    """``aten.index.Tensor`` with integer indices only (a gather, as in ``cache[positions]``): its
    output shape is the indices' shape, so it is device work. Only boolean masks make the shape
    depend on the values, which is why the op carries the dynamic-shape tag."""
    return func is _aten.index.Tensor and all(
        index is None or not (index.dtype == torch.bool or index.dtype == torch.uint8)
        for index in args[1])


class _DeviceWork(TorchDispatchMode):
    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        capture = self.capture
        if capture.seam_depth:
            return func(*args, **kwargs)
        if func.namespace not in _DEVICE_NAMESPACES:
            # A Python custom op: run its kernel (below this dispatch key) and record its launches.
            with _DeviceWork(capture):
                return func.redispatch(_BELOW_PYTHON, *args, **kwargs)
        capture.check(func, args, kwargs)
        result = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            capture.graph._hold(result)  # no device work; the storage it names is fixed
            return result
        launch = _waiting(func) if func.namespace == "c10d" else func
        capture.graph._record(launch, list(args), dict(kwargs), result, (args, kwargs),
                              alias_only=func.is_view)
        return result


def _waiting(collective):
    """A c10d collective as a graph launch: its caller waited on the work at capture, and a replay
    completes it in the same place (a captured collective is one task on the NPU's stream)."""

    def launch(*args, **kwargs):
        result = collective(*args, **kwargs)
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.ScriptObject):
                item.wait()
        return result

    return launch


class _HostReads(TorchFunctionMode):
    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and not self.capture.seam_depth:
            raise GraphCaptureError(
                f"host sync inside a captured region: Tensor.{func.__name__}() copies device values "
                "to the host, which an NPU graph cannot do mid-replay (and the host would keep the "
                "capture's values). Read it before the captured region")
        return func(*args, **(kwargs or {}))


@functools.cache
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def _by_value(name, signature, args, kwargs):
    """A launch's arguments as the graph keeps them: host values copied, device tensors referenced."""
    host = HOST_TENSORS.get(name, ())
    bound = signature.bind(*args, **kwargs)
    for arg, value in bound.arguments.items():
        if arg in host and isinstance(value, torch.Tensor):
            bound.arguments[arg] = value.clone()
        elif isinstance(value, (list, tuple)):
            bound.arguments[arg] = list(value) if isinstance(value, list) else value
    return bound.args, bound.kwargs


def _swap_seam(launch):
    """Route every kernel-seam op through ``launch(name, fn, signature, args, kwargs)``."""

    def routed(name, fn):
        signature = _signature(fn)

        def call(*args, **kwargs):
            return launch(name, fn, signature, args, kwargs)

        return call

    return kernels.swapped(routed)


# -- task groups: host-parameter updates of captured launches -------------------------------------


class _TaskGroup:
    def __init__(self, graph: NPUGraph, indices: list[int]) -> None:
        self.graph, self.indices = graph, indices


def graph_task_group_begin(stream=None) -> None:
    capture = _capturing("graph_task_group_begin")
    if capture.group_start is not None:
        raise GraphCaptureError("graph_task_group_begin inside an open task group")
    capture.group_start = len(capture.graph._launches)


def graph_task_group_end(stream=None) -> _TaskGroup:
    capture = _capturing("graph_task_group_end")
    if capture.group_start is None:
        raise GraphCaptureError("graph_task_group_end without graph_task_group_begin")
    indices = list(range(capture.group_start, len(capture.graph._launches)))
    capture.group_start = None
    plain = [capture.graph._launches[i][0] for i in indices if capture.graph._launches[i][4] is None]
    if plain or not indices:
        raise GraphCaptureError(
            f"a task group must hold kernel launches only, got {plain or 'nothing'}: only those "
            "can be re-issued with new host arguments")
    return _TaskGroup(capture.graph, indices)


def _capturing(what: str) -> _Capture:
    if _capture is None:
        raise GraphCaptureError(f"{what} outside a graph capture")
    return _capture


class _Update:
    """Between graph_task_update_begin and _end: each seam call re-issues the group's next launch
    with new arguments instead of running."""

    def __init__(self, group: _TaskGroup) -> None:
        self.group, self.cursor = group, 0
        self._swap = _swap_seam(self._reissue)
        self._swap.__enter__()

    def _reissue(self, name, fn, signature, args, kwargs):
        launches = self.group.graph._launches
        if self.cursor >= len(self.group.indices):
            raise GraphReplayError(f"task update re-issued {name} beyond its task group's "
                                   f"{len(self.group.indices)} launch(es)")
        index = self.group.indices[self.cursor]
        captured_fn, _, _, fresh, captured = launches[index]
        if name != captured:
            raise GraphReplayError(f"task update re-issued {name}, but the task group captured {captured}")
        args, kwargs = _by_value(name, signature, args, kwargs)
        launches[index] = (captured_fn, args, kwargs, fresh, name)
        self.cursor += 1

    def close(self) -> None:
        self._swap.__exit__(None, None, None)
        if self.cursor != len(self.group.indices):
            raise GraphReplayError(f"task update re-issued {self.cursor} of its task group's "
                                   f"{len(self.group.indices)} launch(es)")


def graph_task_update_begin(stream, handle: _TaskGroup) -> None:
    global _update
    if _capture is not None or _update is not None:
        raise GraphReplayError("graph_task_update_begin inside a capture or another update")
    _update = _Update(handle)


def graph_task_update_end(stream=None) -> None:
    global _update
    update, _update = _update, None
    if update is None:
        raise GraphReplayError("graph_task_update_end without graph_task_update_begin")
    update.close()


class ExternalEvent:
    """``torch_npu.npu.ExternalEvent``: a captured ``wait`` holds the replay until the event is
    recorded (vllm-ascend records it once a step's task updates are issued). As torch_npu
    documents it (``npu/streams.py``: "you can call wait() before record(). Before reusing
    ExternalEvent, you need to call reset() to clear the flag"), a wait does not clear the flag:
    only ``reset`` does, so a graph captures ``wait`` then ``reset``.

    One in-order queue cannot show the race a missing reset opens, so it is caught where it
    starts: a record landing on an event still set from an earlier record. On the NPU the wait
    it was meant for may already have passed on the earlier one, and the replay may run before
    the update that record follows.
    """

    def __init__(self) -> None:
        self._recorded = False
        self._overrun = False  # recorded again while still set: the wait cannot tell them apart

    def record(self, stream=None) -> None:
        if _capture is not None:
            _capture.graph._launches.append((self._set, (), {}, [], None))
        else:
            self._set()

    def wait(self, stream=None) -> None:
        if _capture is not None:
            _capture.graph._launches.append((self._wait, (), {}, [], None))
        else:
            self._wait()

    def reset(self, stream=None) -> None:
        if _capture is not None:
            _capture.graph._launches.append((self._clear, (), {}, [], None))
        else:
            self._clear()

    def _set(self) -> None:
        self._overrun = self._recorded
        self._recorded = True

    def _clear(self) -> None:
        self._recorded = self._overrun = False

    def _wait(self) -> None:
        if not self._recorded:
            raise GraphReplayError(
                "the replay reached an ExternalEvent wait that nothing recorded: on the NPU the "
                "graph would wait here forever (the step's host-parameter update was not issued)")
        if self._overrun:
            raise GraphReplayError(
                "the replay reached an ExternalEvent wait on an event recorded twice without a "
                "reset() between: on the NPU it may pass on the earlier record and run before "
                "this step's host-parameter update lands (capture reset() after wait())")
