"""Application: one registry of the originals of everything the overlay changed.

Application is lazy: a target is patched right after its module is imported (or at once,
if it already was), so verifying the model-runner patches never imports the model runner
in the API-server process. Applying is idempotent, and :meth:`Registry.revert_all`
restores each original by identity, including the copies that other modules took with
``from module import name``. The loader schedules a set only once every declaration of it
verified (:mod:`.verification`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from ascend_patch import resolve, unwatch, watch
from ascend_patch.overlay.declarations import Contract, Declaration, Patch, Seam, Setting
from ascend_patch.overlay.source import render_signature

_UNSET = object()  # an environment variable the overlay set rather than replaced


class PatchError(RuntimeError):
    """A target could not be patched as declared."""


@dataclass
class _Applied:
    patch: Patch | Setting
    owner: object
    attr: str
    original: object
    installed: object
    rebinds: list[tuple[ModuleType, str]] = field(default_factory=list)


def _owner_and_attr(module: ModuleType, qualname: str) -> tuple[object, str]:
    *path, attr = qualname.split(".")
    owner: object = module
    for name in path:
        owner = getattr(owner, name)
    return owner, attr


def _raw_attribute(owner: object, attr: str) -> object:
    """The attribute as stored on its owner: a classmethod object, not a bound method."""
    try:
        return vars(owner)[attr]
    except KeyError:
        raise PatchError(f"{getattr(owner, '__name__', owner)} defines no {attr!r}") from None


_CONTEXT_MANAGER = contextlib.contextmanager(lambda: iter(())).__code__


def _live_signature(raw: object) -> str | None:
    func = getattr(raw, "__func__", raw)  # unwrap classmethod / staticmethod
    if getattr(func, "__code__", None) is _CONTEXT_MANAGER:
        func = func.__wrapped__  # @contextmanager in the source: its function's signature counts
    if getattr(func, "_torchdynamo_disable", False):
        func = func.__wrapped__  # @torch.compiler.disable in the source: the same
    try:
        return render_signature(func)
    except (TypeError, ValueError):
        return None


def _modules() -> list[ModuleType]:
    return [m for m in list(sys.modules.values()) if isinstance(m, ModuleType)]


class Registry:
    """The originals of everything the overlay changed, in application order."""

    def __init__(self) -> None:
        self._applied: dict[str, _Applied] = {}
        self._scheduled: set[str] = set()
        self._watchers: list[tuple[str, Callable]] = []

    def get_original(self, target: str) -> object:
        return self._applied[target].original

    def applied_targets(self) -> list[str]:
        return list(self._applied)

    def entries(self) -> list[tuple[str, object, str, object]]:
        """``(target, owner, attribute, original)`` for every attribute currently changed."""
        return [(t, r.owner, r.attr, r.original) for t, r in self._applied.items()
                if r.owner is not os.environ]

    def environment(self) -> dict[str, str | None]:
        """Each environment variable currently forced, with its value before (None: unset)."""
        return {r.attr: None if r.original is _UNSET else r.original
                for r in self._applied.values() if r.owner is os.environ}

    def schedule(self, declarations: Sequence[Declaration]) -> None:
        """Set each setting now; apply each patch when its module has been imported (now,
        if it has). Contracts and seams are only verified, never applied."""
        by_module: dict[str, list[Patch]] = {}
        for declaration in declarations:
            if declaration.target in self._scheduled or isinstance(declaration, (Contract, Seam)):
                continue
            self._scheduled.add(declaration.target)
            if isinstance(declaration, Setting):
                self._set(declaration)
            else:
                by_module.setdefault(declaration.module, []).append(declaration)
        for module_name, module_patches in by_module.items():
            def apply(module: ModuleType, ps: list[Patch] = module_patches) -> None:
                self._apply_all(module, ps)

            self._watchers.append((module_name, apply))
            watch(module_name, apply)

    def _set(self, setting: Setting) -> None:
        original = os.environ.get(setting.variable, _UNSET)
        os.environ[setting.variable] = setting.value
        self._applied[setting.target] = _Applied(setting, os.environ, setting.variable, original,
                                                 setting.value)

    def _apply_all(self, module: ModuleType, patches: list[Patch]) -> None:
        for patch in patches:
            if patch.target not in self._applied:
                self._apply(module, patch)

    def _apply(self, module: ModuleType, patch: Patch) -> None:
        owner, attr = _owner_and_attr(module, patch.qualname)
        original = _raw_attribute(owner, attr)
        if patch.signature is not None:
            live = _live_signature(original)
            if live not in patch.signature:
                # The source verified but the live object differs: someone else
                # replaced it at runtime. Refuse rather than wrap the wrong thing.
                raise PatchError(
                    f"{patch.target}: expected {patch.expected()}, found {live} at runtime "
                    "(replaced by another package?)"
                )
        if patch.wrapper is not None:
            import wrapt

            installed = wrapt.FunctionWrapper(original, resolve(patch.wrapper))
        else:
            installed = resolve(patch.replacement)(original)
        setattr(owner, attr, installed)
        record = _Applied(patch, owner, attr, original, installed)
        if isinstance(owner, ModuleType) and patch.rebind:
            # Reach the copies bound earlier with `from module import name`.
            for other in _modules():
                if other is not owner and vars(other).get(attr) is original:
                    setattr(other, attr, installed)
                    record.rebinds.append((other, attr))
        self._applied[patch.target] = record

    def revert_all(self) -> list[str]:
        """Restore every original; returns the targets restored."""
        restored = []
        for target, record in reversed(list(self._applied.items())):
            if record.owner is os.environ:
                if record.original is _UNSET:
                    os.environ.pop(record.attr, None)
                else:
                    os.environ[record.attr] = record.original
                restored.append(target)
                continue
            setattr(record.owner, record.attr, record.original)
            for module, attr in record.rebinds:
                setattr(module, attr, record.original)
            if isinstance(record.owner, ModuleType) and record.patch.rebind:
                # Modules imported after the patch bound the installed object.
                for other in _modules():
                    if vars(other).get(record.attr) is record.installed:
                        setattr(other, record.attr, record.original)
            restored.append(target)
        for module_name, callback in self._watchers:
            unwatch(module_name, callback)
        self._applied.clear()
        self._scheduled.clear()
        self._watchers.clear()
        return restored


REGISTRY = Registry()
