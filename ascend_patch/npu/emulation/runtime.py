"""The emulated NPU's runtime (``ASCEND_PATCH=emulate``): a CPU-backed device with
``ASCEND_PATCH_EMULATED_HBM`` bytes of memory and its own books.

It implements :class:`ascend_patch.npu.device.Runtime` on CPU tensors. The emulated NPU executes
in order on one stream, so its streams and events are exact no-ops. Weights and KV cache are
charged to the books when placed, as their storages at their current sizes (sleep mode frees them
by resizing the storages), and activations are measured during vLLM's profiling run;
vLLM's own ``determine_available_memory`` then sizes the KV cache from those numbers exactly as
it would on a device.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ascend_patch.npu.storage import unique_storages
from ascend_patch.npu.emulation import graph


class _EmulatedStream(torch.Stream):
    """One in-order stream: waiting and synchronising are already satisfied. A ``torch.Stream``
    (of the CPU), so that ``Tensor.record_stream`` takes it (Model Runner V2's pipeline-parallel
    broadcast marks its tensors for a side stream); :func:`_cpu_record_stream` gives that op the
    CPU kernel torch lacks."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, device="cpu")

    def wait_stream(self, stream) -> None: ...
    def wait_event(self, event) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        return event if event is not None else _EmulatedEvent()


_RECORD_STREAM: list = []


def _cpu_record_stream() -> None:
    """Register a no-op CPU kernel for ``aten::record_stream``, once per process: on one
    in-order stream no allocation can be reused early, so there is nothing to record. torch has
    none (the op exists for device allocators), and a tensor of the emulated NPU is a CPU tensor."""
    if not _RECORD_STREAM:
        library = torch.library.Library("aten", "IMPL")
        library.impl("record_stream", lambda tensor, stream: None, "CPU")
        _RECORD_STREAM.append(library)  # the registration lasts as long as its Library object


class _EmulatedEvent:
    def __init__(self, *args, **kwargs) -> None: ...
    def record(self, stream=None) -> None: ...
    def wait(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


class _ActivationTracker(TorchDispatchMode):
    """Peak bytes of the storages that ops allocate while active.

    A storage counts from the op that creates it until it is freed (tracked with
    storage weak references, so views keep it alive as they should); outputs that
    alias an input (views, in-place ops) allocate nothing.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile (PIECEWISE graphs) compiles in vLLM's profiling run: dynamo refuses to
        # trace under a dispatch mode that does not step aside while it compiles.
        return True

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # data_ptr -> (weak ref handle, bytes)
        self._current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, nbytes) in list(self._live.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._live[key]
                self._current -= nbytes
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in inputs and key not in self._live:
                    self._live[key] = (storage._weak_ref(), storage.nbytes())
                    self._current += storage.nbytes()
        self.peak = max(self.peak, self._current)
        return out

    def __exit__(self, *exc_info):
        for ref, _ in self._live.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._live.clear()
        return super().__exit__(*exc_info)


class EmulatedRuntime:
    """A CPU-backed NPU with ``ASCEND_PATCH_EMULATED_HBM`` bytes of device memory."""

    def __init__(self, hbm_bytes: int):
        self.hbm_bytes = hbm_bytes
        self._charged: dict[int, tuple[str, Callable[[], int]]] = {}  # handle -> (what, its bytes now)
        self._handles = itertools.count()
        self._peak = 0
        self._lock = threading.Lock()

    # -- the books --------------------------------------------------------------------------

    def charge(self, what: str, nbytes: int, lifetime: object) -> None:
        """Place ``nbytes`` of ``what`` on the device until ``lifetime`` is garbage-collected,
        as a real device frees memory when the tensors holding it die."""
        self._book(what, lambda: nbytes, lifetime)

    def charge_storages(self, what: str, storages: list[torch.UntypedStorage], lifetime: object) -> None:
        """Place ``storages`` on the device until ``lifetime`` is garbage-collected, at their
        current sizes: a storage resized in place (sleep mode frees weights and KV cache that way)
        changes what the books hold."""
        self._book(what, lambda: sum(s.nbytes() for s in storages), lifetime)

    def _book(self, what: str, size: Callable[[], int], lifetime: object) -> None:
        nbytes = size()
        with self._lock:
            in_use = self._in_use()
            if in_use + nbytes > self.hbm_bytes:
                raise torch.OutOfMemoryError(
                    f"emulated NPU out of memory: {what} needs {nbytes / 2**30:.3f} GiB but only "
                    f"{(self.hbm_bytes - in_use) / 2**30:.3f} GiB of "
                    f"{self.hbm_bytes / 2**30:.3f} GiB are free (raise ASCEND_PATCH_EMULATED_HBM)"
                )
            handle = next(self._handles)
            self._charged[handle] = (what, size)
            self._peak = max(self._peak, in_use + nbytes)
        weakref.finalize(lifetime, self._release, handle)

    def _in_use(self) -> int:
        return sum(size() for _, size in self._charged.values())

    def in_use_by_kind(self) -> dict[str, int]:
        """Bytes on the books by what holds them ("weights", "KV cache", "graph pool")."""
        by_kind: dict[str, int] = {}
        with self._lock:
            for what, size in self._charged.values():
                by_kind[what] = by_kind.get(what, 0) + size()
        return by_kind

    def _release(self, handle: int) -> None:
        with self._lock:
            self._charged.pop(handle, None)

    def memory_allocated(self, device: object = None) -> int:
        with self._lock:
            return self._in_use()

    @contextlib.contextmanager
    def track_activations(self):
        """Measure the transient memory of the enclosed forward passes into the peak."""
        tracker = _ActivationTracker()
        with tracker:
            yield
        base = self.memory_allocated()
        if base + tracker.peak > self.hbm_bytes:
            raise torch.OutOfMemoryError(
                f"emulated NPU out of memory: activations need {tracker.peak / 2**30:.3f} GiB on "
                f"top of {base / 2**30:.3f} GiB in use, HBM is {self.hbm_bytes / 2**30:.3f} GiB"
            )
        with self._lock:
            self._peak = max(self._peak, base + tracker.peak)

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return self.hbm_bytes - self.memory_allocated(), self.hbm_bytes

    def _memory_stats(self, device=None) -> dict[str, int]:
        current = self.memory_allocated()
        with self._lock:
            return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": max(self._peak, current)}

    def _reset_peak(self, device=None) -> None:
        self._peak = self.memory_allocated()

    def _max_memory_allocated(self, device=None) -> int:
        return self._memory_stats()["allocated_bytes.all.peak"]

    # -- identity -----------------------------------------------------------------------------

    def device_name(self, index: int) -> str:
        return f"Ascend NPU (emulated on CPU, {self.hbm_bytes / 2**30:.1f} GiB HBM)"

    def device_uuid(self, index: int) -> str:
        return f"emulated-npu-{index}"

    def set_device(self, device: torch.device) -> None:
        return None  # one CPU; nothing to select

    def manual_seed_all(self, seed: int) -> None:
        return None  # torch.manual_seed, called just before, seeds the CPU

    def pin_memory_available(self) -> bool:
        return False  # pinning needs an accelerator runtime

    def num_compute_units(self, index: int) -> int:
        return os.cpu_count() or 1

    def device_api(self) -> dict[str, object]:
        """The emulated NPU's stand-ins for torch's device API, by patch target.

        One in-order stream on one device: waiting, synchronising and selecting are already
        satisfied, and memory comes from the books. Every entry is its own function object:
        torch.compile's dynamo registers a handler per torch API it knows, keyed by function,
        so two APIs sharing one object collide.
        """
        _cpu_record_stream()
        return {
            "torch.cuda:Stream": _EmulatedStream,
            "torch.cuda:Event": _EmulatedEvent,
            "torch.cuda:current_stream": lambda *a, **k: _EmulatedStream(),
            "torch.cuda:default_stream": lambda *a, **k: _EmulatedStream(),
            "torch.cuda:stream": lambda stream=None: contextlib.nullcontext(),
            "torch.cuda:set_stream": lambda *a, **k: None,
            "torch.cuda:synchronize": lambda *a, **k: None,
            "torch.accelerator:get_memory_info": lambda device=None: self.mem_get_info(),
            "torch.accelerator:synchronize": lambda *a, **k: None,
            "torch.accelerator:empty_cache": lambda *a, **k: None,
            "torch.accelerator:empty_host_cache": lambda *a, **k: None,
            "torch.accelerator:current_device_index": lambda: 0,
            "torch.accelerator:set_device_index": lambda *a, **k: None,
            "torch.accelerator:device_index": lambda index: contextlib.nullcontext(),
            "torch.accelerator:current_stream": lambda *a, **k: _EmulatedStream(),
            "torch.accelerator:set_stream": lambda *a, **k: None,
            "torch.accelerator:memory_stats": self._memory_stats,
            "torch.accelerator:memory_reserved": lambda device=None: self.memory_allocated(),
            "torch.accelerator:memory_allocated": lambda device=None: self.memory_allocated(),
            "torch.accelerator:max_memory_allocated": self._max_memory_allocated,
            "torch.accelerator:reset_peak_memory_stats": self._reset_peak,
            "torch:Event": _EmulatedEvent,
        }

    def graphs(self):
        """The graph API (torch_npu.npu's names): the emulated NPU graph, its pools charged to
        these books."""
        graph.charge_pools_to(self)
        return graph

    def worker_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")  # the CPU behind the emulated NPU

    def charge_weights(self, model: torch.nn.Module) -> int:
        """CPU tensors are not device memory: the weights are what loading placed on the
        emulated NPU, so charge exactly those storages; returns their bytes (the runner's figure)."""
        storages = unique_storages((*model.parameters(), *model.buffers()))
        self.charge_storages("weights", storages, model)
        return sum(s.nbytes() for s in storages)

