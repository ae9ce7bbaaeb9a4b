"""Device storages behind tensors: what the emulated HBM's books charge and sleep mode frees."""

from __future__ import annotations

import torch


def unique_storages(tensors) -> list[torch.UntypedStorage]:
    """The distinct storages behind ``tensors`` (views and tied weights share one)."""
    unique: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())
