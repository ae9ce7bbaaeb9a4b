"""The torch device-API overrides: what the manifest's device-API patches install.

vLLM's GPU worker and V1 model runner call ``torch.cuda`` streams and events and the
``torch.accelerator`` memory API directly (``patches/device_api.py`` lists the names). Each
patch replaces its name with the active device runtime's stand-in
(:meth:`ascend_patch.npu.device.Runtime.device_api`), chosen when the patch is applied:
``torch.npu``'s on an NPU, the emulated NPU's otherwise.
"""

from __future__ import annotations

import importlib

from ascend_patch.npu import device


def stand_in(original):
    """Replacement factory of every device-API patch: the active runtime's stand-in for the
    torch name whose current object is ``original`` (each name the runtime covers is looked up,
    so a name the runtime lacks fails here, at apply time)."""
    runtime = device.active_runtime()
    for target, replacement in runtime.device_api().items():
        module, _, name = target.partition(":")
        if getattr(importlib.import_module(module), name) is original:
            return replacement
    raise LookupError(f"{type(runtime).__name__} has no stand-in for {original!r}")
