"""Sleep mode (levels 1 and 2) without a device memory pool: offload and free.

vLLM's CUDA sleep mode unmaps the physical pages behind its CuMem pool and maps new ones at the
same virtual addresses on wake, so every tensor and CUDA graph stays valid. That needs a compiled
allocator (vllm-ascend builds one over ``aclrtMallocPhysical``/``aclrtMapMem``); the overlay frees
the storages themselves instead:

- ``sleep(1)`` copies every weight storage to host memory, then resizes the device storage to 0
  bytes; the KV cache's storages are resized to 0 (their contents are forgotten, as in vLLM,
  whose engine resets the prefix cache before it sleeps).
- ``sleep(2)`` frees the parameters without a copy (the buffers, e.g. rotary tables, go to host
  memory as vLLM's worker keeps them) and the KV cache; ``wake_up`` reloads the parameters from
  the model's checkpoint with vLLM's ``reload_weights``.
- ``wake_up`` regrows each storage in place, copies the host copies back and zeroes the KV cache.
  Tensors, parameters and views keep their identity (only their storage was resized), so the model,
  the attention layers' cache views and vLLM's KV-cache tensors stay bound; their device addresses
  change, so the captured graphs are dropped at sleep and captured again once everything is awake.

Docs: docs/distributed.md, "Sleep mode".
"""

from __future__ import annotations

import torch
from vllm.compilation.cuda_graph import CUDAGraphWrapper

from ascend_patch.npu.storage import unique_storages

TAGS = ("weights", "kv_cache")


class _Freed:
    """Storages resized to 0 bytes, their sizes, and the host copies to restore (None: reload)."""

    def __init__(self) -> None:
        self.storages: list[tuple[torch.UntypedStorage, int, torch.UntypedStorage | None]] = []

    def free(self, storages: list[torch.UntypedStorage], keep: bool) -> None:
        for storage in storages:
            nbytes = storage.nbytes()
            if not nbytes:
                continue
            host = torch.UntypedStorage(nbytes, device="cpu").copy_(storage) if keep else None
            storage.resize_(0)
            self.storages.append((storage, nbytes, host))

    def restore(self) -> bool:
        """Regrow every storage, from its host copy or zeroed; True if some had no host copy."""
        reload = False
        for storage, nbytes, host in self.storages:
            storage.resize_(nbytes)
            if host is None:
                storage.fill_(0)
                reload = True
            else:
                storage.copy_(host)
        self.storages.clear()
        return reload


class OffloadAndFree:
    """One worker's sleep state: what is asleep, by vLLM's tags."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._asleep: dict[str, _Freed] = {}
        self._recapture = False

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is not supported on Ascend by ascend-patch (levels: 1, 2)")
        if self._asleep:
            return  # vLLM's executor ignores a second sleep too
        model = self._runner.get_model()
        parameters = unique_storages(model.parameters())
        shared = {s.data_ptr() for s in parameters}
        buffers = [s for s in unique_storages(model.buffers()) if s.data_ptr() not in shared]
        self._recapture = _drop_graphs(self._runner)
        weights, kv_cache = _Freed(), _Freed()
        weights.free(buffers, keep=True)
        weights.free(parameters, keep=level == 1)
        kv_cache.free(unique_storages(_flat(self._runner.kv_caches)), keep=False)
        self._asleep = {"weights": weights, "kv_cache": kv_cache}
        torch.accelerator.empty_cache()  # the device allocator's cached blocks count as used

    def wake_up(self, tags: list[str] | None) -> None:
        unknown = set(tags or ()) - set(TAGS)
        if unknown:
            raise ValueError(f"sleep mode on Ascend wakes {', '.join(TAGS)}; unknown tags: {sorted(unknown)}")
        for tag in tags or TAGS:
            freed = self._asleep.pop(tag, None)
            if freed is None:
                continue
            if freed.restore() and tag == "weights":
                self._runner.reload_weights()
        if not self._asleep and self._recapture:
            self._recapture = False
            self._runner.capture_model()


def _flat(caches) -> list[torch.Tensor]:
    """vLLM's ``kv_caches``: per-layer tensors, or lists of them (one per attention kind)."""
    if isinstance(caches, torch.Tensor):
        return [caches]
    return [t for item in caches for t in _flat(item)]


def _drop_graphs(runner) -> bool:
    """Drop every captured graph (their addresses are about to change): the graph wrappers' and
    Model Runner V2's FULL graphs, which its graph manager holds (``release_graphs`` keeps what
    to capture again); True if there were any."""
    captured = any(entry.cudagraph is not None for wrapper in CUDAGraphWrapper._all_instances
                   for entry in wrapper.concrete_cudagraph_entries.values())
    CUDAGraphWrapper.clear_all_graphs()
    manager = getattr(runner, "cudagraph_manager", None)  # not a seam: Model Runner V2's only
    if manager is not None and manager.graphs:
        captured = True
        manager.release_graphs()
    return captured
