"""What a patch set declares: every change the overlay makes to vLLM or torch, and every
name it relies on without changing it.

A patch set (``ascend_patch.patches.<name>``) lists four kinds of declaration:

- :class:`Patch`: an attribute of vLLM (or torch) that is wrapped or replaced;
- :class:`Contract`: one that is only relied on, a hook our own classes override or a
  function they call, verified and never touched;
- :class:`Setting`: an environment variable vLLM reads that the overlay forces;
- :class:`Seam`: a name that appears or disappears inside the set's range, which the
  NPU wing probes for at run time; declared so the probe can check it statically.

Each says why (``reason``), where our side is implemented (``implementation``), what
upstream makes it necessary and when it can go, and checks itself against the source of
a release (:meth:`check`). :mod:`.verification` runs the checks, :mod:`.registry` applies
the patches and settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ascend_patch.overlay.source import SourceTree

MODES = ("npu", "emulate")
"""The device modes a declaration can apply in (``ASCEND_PATCH`` once decided)."""


class TextEnum(str, Enum):
    """Members that are their text: in JSON, in f-strings, and equal to it."""

    __str__ = str.__str__
    __format__ = str.__format__


class Kind(TextEnum):
    WRAP = "wrap"
    REPLACE = "replace"
    CONTRACT = "contract"
    SETTING = "setting"
    SEAM = "seam"


class State(TextEnum):
    """A declaration's state on a release: what verification found, or, once the overlay
    is active, ``applied``."""

    VERIFIED = "verified"
    MISSING = "missing"
    MISMATCH = "mismatch"
    UNREADABLE = "unreadable"
    UNCHECKED = "unchecked"
    """A torch target when only a vLLM release is at hand (the probe): checked at import."""
    APPLIED = "applied"


class _Target:
    """A declaration of ``target = "package.module:Qualified.name"``, optionally with the
    signatures it accepts."""

    target: str
    signature: tuple[str, ...] | None

    def _check_target(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"patch target {self.target!r} must be 'module:qualname'")

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]

    def expected(self) -> str:
        if self.signature is None:
            return "defined"
        return " or ".join(self.signature)

    def check(self, tree: SourceTree, release: Version | None) -> tuple[State, str]:
        if not tree.has_root(self.module):
            root = self.module.partition(".")[0]
            return State.UNCHECKED, f"{root} is not part of this source (checked at import vllm)"
        if not tree.has_module(self.module):
            return State.MISSING, f"no module {self.module}"
        if tree.parse_error(self.module):
            return State.UNREADABLE, tree.parse_error(self.module)
        found = tree.lookup(self.module, self.qualname)
        if found is None:
            return State.MISSING, f"no {self.qualname} in {self.module}"
        if self.signature is None:
            return State.VERIFIED, f"{found.kind} at line {found.lineno}"
        if found.signature not in self.signature:
            return State.MISMATCH, found.signature if found.kind == "function" else f"a {found.kind}"
        return State.VERIFIED, found.signature


@dataclass(frozen=True)
class Patch(_Target):
    """One change to vLLM or torch: exactly one of ``wrapper`` and ``replacement``."""

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
    implementation: str = ""
    """Where our side lives (``module:object``): the wrapper's or replacement's path unless
    that is a factory object, or says less than the class it builds."""
    modes: tuple[str, ...] = MODES
    """The device modes the patch applies in (verified in every mode)."""
    rebind: bool = True
    """Also replace copies other modules bound with ``from module import name``."""

    def __post_init__(self):
        self._check_target()
        if self.wrapper is not None and self.replacement is not None:
            raise ValueError(f"patch {self.target}: give a wrapper or a replacement, not both")
        if self.wrapper is None and self.replacement is None:
            raise ValueError(f"patch {self.target}: give a wrapper or a replacement; a target "
                             "that is only relied on is a Contract")
        if not self.implementation:
            done_by = self.wrapper if self.wrapper is not None else self.replacement
            if not isinstance(done_by, str):
                done_by = f"{getattr(done_by, '__module__', '?')}:{getattr(done_by, '__qualname__', done_by)}"
            object.__setattr__(self, "implementation", done_by)

    @property
    def kind(self) -> Kind:
        return Kind.WRAP if self.wrapper is not None else Kind.REPLACE


@dataclass(frozen=True)
class Contract(_Target):
    """A name of vLLM (or torch) that our side relies on without changing it: a hook our
    classes override, a base class they subclass, a function they call. Verified like a
    patch target, so a signature change in a new release fails loudly instead of leaving an
    override that vLLM no longer calls the same way."""

    target: str
    reason: str
    vllm: str | None = None
    signature: tuple[str, ...] | None = None
    upstream: str = ""
    remove_when: str = ""
    implementation: str = ""
    """The ``module:object`` that overrides, subclasses or calls the target."""
    kind = Kind.CONTRACT

    def __post_init__(self):
        self._check_target()


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
    modes: tuple[str, ...] = MODES
    vllm: str | None = None
    kind = Kind.SETTING

    @property
    def target(self) -> str:
        return f"{self.module}:{self.variable}"

    @property
    def implementation(self) -> str:
        return f"os.environ[{self.variable!r}] = {self.value!r}"

    def expected(self) -> str:
        return f"read by {self.module}"

    def check(self, tree: SourceTree, release: Version | None) -> tuple[State, str]:
        if not tree.has_module(self.module):
            return State.MISSING, f"no module {self.module}"
        if tree.parse_error(self.module):
            return State.UNREADABLE, tree.parse_error(self.module)
        if not tree.mentions(self.module, self.variable):
            return State.MISSING, f"{self.module} no longer reads {self.variable}"
        return State.VERIFIED, f"read by {self.module}"


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
    implementation: str = ""
    """The ``module:object`` that probes for the name."""
    signature: tuple[str, ...] | None = None
    vllm: str | None = None
    pr: str | None = None
    """The upstream PR that added or removed the name (``owner/repo#number``), where known."""
    kind = Kind.SEAM

    def __post_init__(self):
        self._check_target()

    @property
    def upstream(self) -> str:
        bounds = [f"added in vLLM {self.since}" if self.since else "",
                  f"removed in vLLM {self.until}" if self.until else "", self.pr or ""]
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

    def check(self, tree: SourceTree, release: Version | None) -> tuple[State, str]:
        if tree.parse_error(self.module):
            return State.UNREADABLE, tree.parse_error(self.module)
        found = tree.lookup(self.module, self.qualname) if tree.has_module(self.module) else None
        if found is not None and self.signature is not None and found.signature not in self.signature:
            return State.MISMATCH, found.signature if found.kind == "function" else f"a {found.kind}"
        where = f"{found.kind} at line {found.lineno}" if found else "absent"
        if release is None:
            return State.VERIFIED, where  # a tree of unknown version: nothing to compare with
        if (found is not None) != self.present_in(release):
            return State.MISMATCH, f"{where} in vLLM {release}"
        return State.VERIFIED, where


Declaration = Patch | Contract | Setting | Seam
DECLARATION_TYPES = (Patch, Contract, Setting, Seam)


@dataclass
class TargetStatus:
    patch: Declaration
    state: State
    found: str

    @property
    def ok(self) -> bool:
        return self.state in (State.VERIFIED, State.APPLIED, State.UNCHECKED)

    def describe(self) -> str:
        return f"{self.patch.target}: expected {self.patch.expected()}, found {self.found}"


def applies_to(declaration: Declaration, release: Version | None) -> bool:
    """Whether a declaration's own sub-range (if any) admits ``release``."""
    if declaration.vllm is None or release is None:
        return True
    return SpecifierSet(declaration.vllm).contains(release, prereleases=True)


def admits(declaration: Declaration, release: str) -> bool:
    """:func:`applies_to` for a release given as text (``"0.34"``), for patch-set modules, which
    import nothing but this module."""
    return applies_to(declaration, Version(release))
