"""What this machine offers the NPU path, asked before anything else is decided.

The loader calls :func:`check` at every ``import vllm`` (and ``ascend-patch doctor`` through
it) by the path it names, so the overlay wing imports nothing of this one. It is torch-free:
a process that stays stock, and doctor, never load torch. torch_npu is imported only when it
is installed, through the kernel seam, the one module that talks to it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import importlib_metadata

from ascend_patch import env


@dataclass(frozen=True)
class Device:
    """The answer to one requested mode."""

    mode: str | None
    """``"npu"`` or ``"emulate"``: where the NPU path can run; None: nowhere, or not looked
    for (vllm-ascend owns the platform in auto mode)."""
    detail: str
    """What was found: the NPUs torch_npu sees, why none is usable, a bad HBM setting."""
    vllm_ascend: str | None
    """The installed vllm-ascend version ("unknown" for a bare source tree), or None."""
    torch_npu_unusable: bool = False
    """torch_npu is installed but fails to import or sees no NPU."""


def vllm_ascend_present() -> str | None:
    """The installed vllm-ascend version ("unknown" for a bare source tree), or None.
    A directory without ``__init__.py`` (a namespace package) is not an installation."""
    try:
        return importlib_metadata.version("vllm-ascend")
    except importlib_metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("vllm_ascend")
        return "unknown" if spec is not None and spec.origin not in (None, "namespace") else None


def check(requested: str) -> Device:
    """What ``ASCEND_PATCH=requested`` (``auto``, ``npu`` or ``emulate``) finds here, looking
    no further than the answer needs."""
    ascend = vllm_ascend_present()
    if ascend is not None and requested == "auto":
        return Device(None, f"vllm-ascend {ascend} is installed", ascend)
    if requested == "emulate":
        try:
            hbm = env.emulated_hbm_bytes()
        except env.SettingError as exc:
            return Device(None, str(exc), ascend)
        return Device("emulate", f"emulated NPU with {hbm / (1 << 30):g} GiB HBM", ascend)
    if importlib.util.find_spec("torch_npu") is None:
        return Device(None, "torch_npu is not installed", ascend)
    from ascend_patch.npu.kernels import npu  # torch_npu imports torch anyway

    usable, detail = npu.probe()
    return Device("npu" if usable else None, detail, ascend, torch_npu_unusable=not usable)
