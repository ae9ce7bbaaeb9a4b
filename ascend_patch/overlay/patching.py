"""The patch engine: declare, verify all, then apply; one registry of originals.

A patch set (``ascend_patch.patches.<name>``) is the manifest of every change the
overlay makes for one vLLM release line. It lists three kinds of declaration:

- :class:`Patch`: an attribute of vLLM (or torch) that is wrapped, replaced, or only
  relied on (a *contract*: a hook our own classes override, verified, never touched);
- :class:`Setting`: an environment variable vLLM reads that the overlay forces;
- :class:`Seam`: a name that appears or disappears inside the set's range, which the
  NPU wing probes for at run time; declared so the probe can check it statically.

:func:`verify` checks every declaration against the installed *source* (see
:mod:`ascend_patch.overlay.source`) before anything is touched; the loader applies
nothing unless every one verifies. Application is lazy: a target is patched right
after its module is imported (or at once, if it already was), so verifying the
model-runner patches never imports the model runner in the API-server process.

Every original lives in :data:`REGISTRY`. Applying is idempotent and
:meth:`Registry.revert_all` restores each original by identity, including the
copies that other modules took with ``from module import name``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ascend_patch.overlay import bootstrap, source
from ascend_patch.overlay.source import SourceTree, render_signature

MODES = ("npu", "emulate")
"""The device modes a declaration can apply in (``ASCEND_PATCH`` once decided)."""

_MISSING = object()  # an attribute or variable the overlay added rather than replaced


class PatchError(RuntimeError):
    """A target could not be patched as declared."""


class _Target:
    """``target`` is ``"package.module:Qualified.name"``."""

    target: str

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


@dataclass(frozen=True)
class Patch(_Target):
    """One change to vLLM or torch.

    Exactly one of ``wrapper`` / ``replacement`` is set, or neither: then the
    patch is a *contract*, a hook our own classes override (a platform method,
    a base-class method), verified like any target but never touched.
    """

    target: str
    """``"package.module:Qualified.name"``."""
    reason: str
    """One line: why the overlay needs this."""
    vllm: str | None = None
    """A PEP 440 specifier narrowing the patch to part of its set's releases; None for all
    of them. The set's range itself lives only in ``compat_matrix.yaml``."""
    signature: tuple[str, ...] | None = None
    """Accepted signatures (``source.render_arguments`` form); None for classes and values."""
    wrapper: Callable | str | None = None
    """``wrapper(wrapped, instance, args, kwargs)``, installed with ``wrapt.FunctionWrapper``;
    or its ``"module:function"`` path, imported only when the patch is applied, which keeps
    patch sets cheap to import (doctor, verification at ``import vllm``)."""
    replacement: Callable[[object], object] | str | None = None
    """``replacement(original) -> new object``, installed as-is (or its path, like ``wrapper``)."""
    upstream: str = ""
    """What in vLLM (file, PR) or torch makes the patch necessary, or "NPU-only: ..."."""
    remove_when: str = ""
    """The condition under which the patch can be deleted."""
    by: str = ""
    """Where our side lives: for a contract, the ``module:Class`` that overrides or calls it;
    for a wrapper or replacement, only when its path does not say (a factory object)."""
    modes: tuple[str, ...] = MODES
    """The device modes the patch applies in (verified in every mode)."""
    rebind: bool = True
    """Also replace copies other modules bound with ``from module import name``."""

    def __post_init__(self):
        if ":" not in self.target:
            raise ValueError(f"patch target {self.target!r} must be 'module:qualname'")
        if self.wrapper is not None and self.replacement is not None:
            raise ValueError(f"patch {self.target}: give a wrapper or a replacement, not both")

    @property
    def kind(self) -> str:
        if self.wrapper is not None:
            return "wrap"
        if self.replacement is not None:
            return "replace"
        return "contract"

    @property
    def implementation(self) -> str:
        """Where the change is implemented, for docs and diagnostics."""
        done_by = self.wrapper if self.wrapper is not None else self.replacement
        if self.by or done_by is None:
            return self.by
        if isinstance(done_by, str):
            return done_by
        return f"{getattr(done_by, '__module__', '?')}:{getattr(done_by, '__qualname__', done_by)}"

    def expected(self) -> str:
        if self.signature is None:
            return "defined"
        return " or ".join(self.signature)

    def check(self, tree: SourceTree, release: Version | None) -> tuple[str, str]:
        if not tree.has_root(self.module):
            root = self.module.partition(".")[0]
            return "unchecked", f"{root} is not part of this source (checked at import vllm)"
        if not tree.has_module(self.module):
            return "missing", f"no module {self.module}"
        if tree.parse_error(self.module):
            return "unreadable", tree.parse_error(self.module)
        found = tree.lookup(self.module, self.qualname)
        if found is None:
            return "missing", f"no {self.qualname} in {self.module}"
        if self.signature is None:
            return "verified", f"{found.kind} at line {found.lineno}"
        if found.signature not in self.signature:
            return "mismatch", found.signature if found.kind == "function" else f"a {found.kind}"
        return "verified", found.signature


@dataclass(frozen=True)
class Setting:
    """An environment variable vLLM reads that the overlay sets, in this process and so in
    every process vLLM spawns from it. Verified by the variable's presence in the module
    that reads it (``vllm/envs.py``)."""

    variable: str
    value: str
    reason: str
    upstream: str = ""
    remove_when: str = ""
    module: str = "vllm.envs"
    by: str = "ascend_patch.overlay.patching:Registry"
    modes: tuple[str, ...] = MODES
    vllm: str | None = None
    kind = "setting"

    @property
    def target(self) -> str:
        return f"{self.module}:{self.variable}"

    @property
    def implementation(self) -> str:
        return f"os.environ[{self.variable!r}] = {self.value!r}"

    def expected(self) -> str:
        return f"read by {self.module}"

    def check(self, tree: SourceTree, release: Version | None) -> tuple[str, str]:
        if not tree.has_module(self.module):
            return "missing", f"no module {self.module}"
        if tree.parse_error(self.module):
            return "unreadable", tree.parse_error(self.module)
        if not tree.mentions(self.module, self.variable):
            return "missing", f"{self.module} no longer reads {self.variable}"
        return "verified", f"read by {self.module}"


@dataclass(frozen=True)
class Seam(_Target):
    """A name that appears (``since``) or disappears (``until``) inside a set's releases.

    The NPU wing probes for it at run time (``hasattr``); the declaration makes that
    probe visible, and verification checks that the release agrees: present from
    ``since`` on, absent before it (and from ``until`` on).
    """

    target: str
    reason: str
    since: str | None = None
    until: str | None = None
    used_by: str = ""
    signature: tuple[str, ...] | None = None
    vllm: str | None = None
    kind = "seam"

    @property
    def implementation(self) -> str:
        return self.used_by

    @property
    def upstream(self) -> str:
        bounds = [f"added in vLLM {self.since}" if self.since else "",
                  f"removed in vLLM {self.until}" if self.until else ""]
        return "; ".join(b for b in bounds if b)

    @property
    def remove_when(self) -> str:
        bounds = [f"every supported release is {self.since} or newer" if self.since else "",
                  f"every supported release is older than {self.until}" if self.until else ""]
        return "; ".join(b for b in bounds if b)

    def present_in(self, release: Version) -> bool:
        return (self.since is None or release >= Version(self.since)) and (
            self.until is None or release < Version(self.until)
        )

    def expected(self) -> str:
        return " and ".join(
            b for b in (f"present from {self.since}" if self.since else "",
                        f"gone from {self.until}" if self.until else "") if b
        )

    def check(self, tree: SourceTree, release: Version | None) -> tuple[str, str]:
        if tree.parse_error(self.module):
            return "unreadable", tree.parse_error(self.module)
        found = tree.lookup(self.module, self.qualname) if tree.has_module(self.module) else None
        if found is not None and self.signature is not None and found.signature not in self.signature:
            return "mismatch", found.signature if found.kind == "function" else f"a {found.kind}"
        where = f"{found.kind} at line {found.lineno}" if found else "absent"
        if release is None:
            return "verified", where  # a tree of unknown version: nothing to compare with
        if (found is not None) != self.present_in(release):
            return "mismatch", f"{where} in vLLM {release}"
        return "verified", where


Declaration = Patch | Setting | Seam


@dataclass
class TargetStatus:
    patch: Declaration
    state: str  # "verified", "missing", "mismatch", "unreadable" or "unchecked"; later "applied"
    found: str

    @property
    def ok(self) -> bool:
        # "unchecked": a torch target when only a vLLM release is at hand (the probe).
        return self.state in ("verified", "applied", "unchecked")

    def describe(self) -> str:
        return f"{self.patch.target}: expected {self.patch.expected()}, found {self.found}"


def applies_to(declaration: Declaration, release: Version | None) -> bool:
    """Whether a declaration's own sub-range (if any) admits ``release``."""
    if declaration.vllm is None or release is None:
        return True
    return SpecifierSet(declaration.vllm).contains(release, prereleases=True)


# -- verification ----------------------------------------------------------------------------

_CACHE_ENTRY_LIMIT = 1 << 20  # a real entry is a few KiB; anything bigger is not ours


def verify(
    patches: Sequence[Declaration],
    tree: SourceTree,
    cache_dir: Path | None = None,
    release: Version | None = None,
) -> list[TargetStatus]:
    """Check every declaration in the source tree. Touches nothing.

    With ``cache_dir``, a result is reused when the same declarations meet
    byte-identical target modules: parsing the targets' files costs ~0.3 s,
    reading and hashing them ~2 ms, and this runs in every process that imports
    vLLM. Any edit to a target's file, or to the verifier itself, is a new key; an
    entry that is not a small regular file, or does not carry the key it was
    computed for, is ignored.
    """
    if cache_dir is None:
        return _verify_sources(patches, tree, release)
    key, declared = _verification_key(patches, tree, release)
    entry = cache_dir / f"{key}.json"
    recorded = _read_cache_entry(entry, key, patches)
    if recorded is not None:
        return [TargetStatus(p, state, found) for p, (state, found) in zip(patches, recorded)]
    statuses = _verify_sources(patches, tree, release)
    rows = [[s.state, s.found] for s in statuses]
    # Files reached through re-exports are not part of the key; record their digests so a
    # change to them invalidates the entry too.
    others = {str(path): _digest(path) for path in sorted(tree.read_paths - declared)}
    _write_atomically(entry, json.dumps({"key": key, "targets": [p.target for p in patches],
                                         "statuses": rows, "others": others,
                                         "check": _entry_check(key, rows, others)}))
    return statuses


def _digest(path: Path) -> str:
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return "-"


def _entry_check(key: str, rows: list, others: dict) -> str:
    return hashlib.blake2b(json.dumps([key, rows, others]).encode(), digest_size=16).hexdigest()


def _read_cache_entry(entry: Path, key: str, patches: Sequence[Declaration]) -> list | None:
    """The recorded statuses, or None for no entry or one that cannot be trusted: not a
    regular file (a FIFO would block, /dev/zero never ends), too big, malformed, recorded
    for other declarations or another key (a copied or hand-edited entry), or computed
    from re-exporting files that have changed since."""
    try:
        fd = os.open(entry, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _CACHE_ENTRY_LIMIT:
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = json.loads(handle.read(_CACHE_ENTRY_LIMIT + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    try:
        rows, others = data["statuses"], data["others"]
        valid = (
            data["key"] == key
            and data["targets"] == [p.target for p in patches]
            and data["check"] == _entry_check(key, rows, others)
            and len(rows) == len(patches)
            and all(isinstance(s, str) and isinstance(f, str) for s, f in rows)
            and all(_digest(Path(path)) == digest for path, digest in others.items())
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return rows if valid else None


def _verification_key(
    patches: Sequence[Declaration], tree: SourceTree, release: Version | None
) -> tuple[str, set[Path]]:
    """The cache key (verifier sources, release, declarations, the declared modules' bytes)
    and the files it covers."""
    key = hashlib.blake2b(digest_size=16)
    for verifier in (source.__file__, __file__):
        key.update(Path(verifier).read_bytes())
    key.update(str(release).encode())
    digests: dict[str, str] = {}
    covered: set[Path] = set()
    for patch in patches:
        module = patch.module
        if module not in digests:
            path = tree.module_path(module)
            digests[module] = _digest(path) if path else "-"
            if path:
                covered.add(path)
        key.update(repr((type(patch).__name__, patch.target, getattr(patch, "signature", None),
                         getattr(patch, "since", None), getattr(patch, "until", None),
                         digests[module])).encode())
    return key.hexdigest(), covered


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


def _verify_sources(
    patches: Sequence[Declaration], tree: SourceTree, release: Version | None
) -> list[TargetStatus]:
    return [TargetStatus(p, *p.check(tree, release)) for p in patches]


# -- application -------------------------------------------------------------------------------


@dataclass
class _Applied:
    patch: Declaration
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


_CONTEXT_MANAGER = contextlib.contextmanager(lambda: iter(())).__code__


def _live_signature(raw: object) -> str | None:
    func = getattr(raw, "__func__", raw)  # unwrap classmethod / staticmethod
    if getattr(func, "__code__", None) is _CONTEXT_MANAGER:
        func = func.__wrapped__  # @contextmanager in the source: its function's signature counts
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
        return {r.attr: None if r.original is _MISSING else r.original
                for r in self._applied.values() if r.owner is os.environ}

    def schedule(self, patches: Sequence[Declaration]) -> None:
        """Set each setting now; apply each patch when its module has been imported (now,
        if it has). Contracts and seams are only verified, never applied."""
        by_module: dict[str, list[Patch]] = {}
        for patch in patches:
            if patch.target in self._scheduled or patch.kind in ("contract", "seam"):
                continue
            self._scheduled.add(patch.target)
            if isinstance(patch, Setting):
                self._set(patch)
            else:
                by_module.setdefault(patch.module, []).append(patch)
        for module_name, module_patches in by_module.items():
            def apply(module: ModuleType, ps: list[Patch] = module_patches) -> None:
                self._apply_all(module, ps)

            self._watchers.append((module_name, apply))
            bootstrap.watch(module_name, apply)

    def _set(self, setting: Setting) -> None:
        original = os.environ.get(setting.variable, _MISSING)
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

            installed = wrapt.FunctionWrapper(original, _resolve(patch.wrapper))
        else:
            installed = _resolve(patch.replacement)(original)
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
                if record.original is _MISSING:
                    os.environ.pop(record.attr, None)
                else:
                    os.environ[record.attr] = record.original
                restored.append(target)
                continue
            if record.original is _MISSING:
                delattr(record.owner, record.attr)
            else:
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
            bootstrap.unwatch(module_name, callback)
        self._applied.clear()
        self._scheduled.clear()
        self._watchers.clear()
        return restored


REGISTRY = Registry()
