"""The patch engine: declare, verify all, then apply; one registry of originals.

A patch set is a list of :class:`Patch` declarations. :func:`verify` checks
every target against the installed vLLM *source* (see :mod:`ascend_patch.source`)
before anything is touched; the loader applies nothing unless every target
verifies. Application is lazy: a target is patched right after its module is
imported (or at once, if it already was), so verifying the model-runner patches
never imports the model runner in the API-server process.

Every original lives in :data:`REGISTRY`. Applying is idempotent and
:meth:`Registry.revert_all` restores each original by identity, including the
copies that other modules took with ``from module import name``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ascend_patch import _bootstrap
from ascend_patch import source
from ascend_patch.source import SourceTree, render_signature


_MISSING = object()  # an attribute the overlay added rather than replaced


class PatchError(RuntimeError):
    """A target could not be patched as declared."""


@dataclass(frozen=True)
class Patch:
    """One change to vLLM.

    Exactly one of ``wrapper`` / ``replacement`` is set, or neither: then the
    patch is a *contract*, a hook our own classes override (a platform method,
    a base-class method), verified like any target but never touched.
    """

    target: str
    """``"package.module:Qualified.name"``."""
    reason: str
    """One line: why the overlay needs this."""
    vllm: str
    """The vLLM releases this patch is for, as a PEP 440 specifier."""
    signature: tuple[str, ...] | None = None
    """Accepted signatures (``source.render_arguments`` form); None for classes and values."""
    wrapper: Callable | str | None = None
    """``wrapper(wrapped, instance, args, kwargs)``, installed with ``wrapt.FunctionWrapper``;
    or its ``"module:function"`` path, imported only when the patch is applied, which keeps
    patch sets cheap to import (doctor, verification at ``import vllm``)."""
    replacement: Callable[[object], object] | str | None = None
    """``replacement(original) -> new object``, installed as-is (or its path, like ``wrapper``)."""

    def __post_init__(self):
        if ":" not in self.target:
            raise ValueError(f"patch target {self.target!r} must be 'module:qualname'")
        if self.wrapper is not None and self.replacement is not None:
            raise ValueError(f"patch {self.target}: give a wrapper or a replacement, not both")

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]

    @property
    def kind(self) -> str:
        if self.wrapper is not None:
            return "wrap"
        if self.replacement is not None:
            return "replace"
        return "contract"

    def expected(self) -> str:
        if self.signature is None:
            return "defined"
        return " or ".join(self.signature)


@dataclass
class TargetStatus:
    patch: Patch
    state: str  # "verified", "missing" or "mismatch"; later "applied" or "reverted"
    found: str

    @property
    def ok(self) -> bool:
        return self.state in ("verified", "applied")

    def describe(self) -> str:
        return f"{self.patch.target}: expected {self.patch.expected()}, found {self.found}"


def verify(
    patches: list[Patch], tree: SourceTree, cache_dir: Path | None = None
) -> list[TargetStatus]:
    """Check every target in the source tree. Touches nothing.

    With ``cache_dir``, a result is reused when the same declarations meet
    byte-identical target modules: parsing the targets' files costs ~0.3 s,
    reading and hashing them ~2 ms, and this runs in every process that imports
    vLLM. Any edit to a target's file, or to the verifier itself, is a new key.
    """
    if cache_dir is None:
        return _verify_sources(patches, tree)
    entry = cache_dir / f"{_verification_key(patches, tree)}.json"
    try:
        recorded = json.loads(entry.read_text())
        if len(recorded) == len(patches):
            return [TargetStatus(p, state, found) for p, (state, found) in zip(patches, recorded)]
    except (OSError, ValueError, TypeError):
        pass  # no entry yet, or an unreadable one: verify from source
    statuses = _verify_sources(patches, tree)
    _write_atomically(entry, json.dumps([[s.state, s.found] for s in statuses]))
    return statuses


def _verification_key(patches: list[Patch], tree: SourceTree) -> str:
    key = hashlib.blake2b(digest_size=16)
    for verifier in (source.__file__, __file__):
        key.update(Path(verifier).read_bytes())
    digests: dict[str, str] = {}
    for patch in patches:
        if patch.module not in digests:
            path = tree.module_path(patch.module)
            digests[patch.module] = (
                hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest() if path else "-"
            )
        key.update(repr((patch.target, patch.signature, digests[patch.module])).encode())
    return key.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """Best effort: a read-only or full cache only costs the next process a re-parse."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)  # readers see a whole entry or none
    except OSError:
        Path(temporary).unlink(missing_ok=True)


def _verify_sources(patches: list[Patch], tree: SourceTree) -> list[TargetStatus]:
    statuses = []
    for patch in patches:
        if not tree.has_module(patch.module):
            statuses.append(TargetStatus(patch, "missing", f"no module {patch.module}"))
            continue
        found = tree.lookup(patch.module, patch.qualname)
        if found is None:
            statuses.append(TargetStatus(patch, "missing", f"no {patch.qualname} in {patch.module}"))
        elif patch.signature is None:
            statuses.append(TargetStatus(patch, "verified", f"{found.kind} at line {found.lineno}"))
        elif found.signature not in patch.signature:
            shape = found.signature if found.kind == "function" else f"a {found.kind}"
            statuses.append(TargetStatus(patch, "mismatch", shape))
        else:
            statuses.append(TargetStatus(patch, "verified", found.signature))
    return statuses


@dataclass
class _Applied:
    patch: Patch
    owner: object
    attr: str
    original: object
    installed: object
    rebinds: list[tuple[ModuleType, str]] = field(default_factory=list)


def _resolve(obj: Callable | str) -> Callable:
    if not isinstance(obj, str):
        return obj
    module, _, attr = obj.partition(":")
    return getattr(importlib.import_module(module), attr)


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


def _live_signature(raw: object) -> str | None:
    func = getattr(raw, "__func__", raw)  # unwrap classmethod / staticmethod
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

    def is_applied(self, target: str) -> bool:
        return target in self._applied

    def get_original(self, target: str) -> object:
        return self._applied[target].original

    def applied_targets(self) -> list[str]:
        return list(self._applied)

    def entries(self) -> list[tuple[str, object, str, object]]:
        """``(target, owner, attribute, original)`` for everything currently changed."""
        return [(t, r.owner, r.attr, r.original) for t, r in self._applied.items()]

    def schedule(self, patches: list[Patch]) -> None:
        """Apply each patch when its module has been imported (now, if it has)."""
        by_module: dict[str, list[Patch]] = {}
        for patch in patches:
            if patch.kind != "contract" and patch.target not in self._scheduled:
                self._scheduled.add(patch.target)
                by_module.setdefault(patch.module, []).append(patch)
        for module_name, module_patches in by_module.items():
            def apply(module: ModuleType, ps: list[Patch] = module_patches) -> None:
                self._apply_all(module, ps)

            self._watchers.append((module_name, apply))
            _bootstrap.watch(module_name, apply)

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

            installed = wrapt.FunctionWrapper(original, _resolve(patch.wrapper))
        else:
            installed = _resolve(patch.replacement)(original)
        setattr(owner, attr, installed)
        record = _Applied(patch, owner, attr, original, installed)
        if isinstance(owner, ModuleType):
            # Reach the copies bound earlier with `from module import name`.
            for other in _modules():
                if other is not owner and vars(other).get(attr) is original:
                    setattr(other, attr, installed)
                    record.rebinds.append((other, attr))
        self._applied[patch.target] = record

    def replace(self, owner: object, attr: str, value: object, reason: str) -> None:
        """Replace an attribute outside vLLM (torch device APIs the NPU runtime takes over),
        keeping the original here like any patch. Idempotent per target."""
        name = getattr(owner, "__name__", type(owner).__name__)
        target = f"{name}:{attr}"
        if target in self._applied:
            return
        original = vars(owner).get(attr, _MISSING)
        setattr(owner, attr, value)
        self._applied[target] = _Applied(
            Patch(target, reason, "*", replacement=lambda _: value), owner, attr, original, value
        )

    def revert_all(self) -> list[str]:
        """Restore every original; returns the targets restored."""
        restored = []
        for target, record in reversed(list(self._applied.items())):
            if record.original is _MISSING:
                delattr(record.owner, record.attr)
            else:
                setattr(record.owner, record.attr, record.original)
            for module, attr in record.rebinds:
                setattr(module, attr, record.original)
            if isinstance(record.owner, ModuleType):
                # Modules imported after the patch bound the installed object.
                for other in _modules():
                    if vars(other).get(record.attr) is record.installed:
                        setattr(other, record.attr, record.original)
            restored.append(target)
        for module_name, callback in self._watchers:
            _bootstrap.unwatch(module_name, callback)
        self._applied.clear()
        self._scheduled.clear()
        self._watchers.clear()
        return restored


REGISTRY = Registry()
