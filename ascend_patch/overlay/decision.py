"""The one decision path: which patch set a vLLM release gets, and does every declaration
of that set hold in its source?

:func:`decide` is pure: a version, a source tree and the matrix in, a :class:`Decision`
out, nothing imported from vLLM and nothing patched. The loader calls it at
``import vllm`` for the installed vLLM (then adds what only a live process knows: the
device mode, strict mode, whether vLLM already chose a platform); ``ascend-patch
probe`` calls it for a release it has only the source of (then adds body digests).
So the probe's verdict is the loader's, by construction.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ascend_patch.overlay import matrix
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.declarations import DECLARATION_TYPES, Declaration, TargetStatus, applies_to
from ascend_patch.overlay.verification import verify
from ascend_patch.overlay.source import SourceTree


@dataclass
class Decision:
    version: str | None
    """The version decided for; None for a tree that records none."""
    release: Version | None
    selection: matrix.Selection
    checked: matrix.PatchSetSpec
    """The set whose declarations were verified: the selected one, or for information the
    one the release would have to join when none is selected."""
    declarations: list[Declaration]
    statuses: list[TargetStatus]

    @property
    def failed(self) -> list[TargetStatus]:
        return [s for s in self.statuses if not s.ok]

    @property
    def would_activate(self) -> bool:
        return self.selection.patch_set is not None and not self.failed

    def verdict(self) -> str:
        name, total = self.checked.name, len(self.statuses)
        if self.selection.patch_set is None:
            return (f"{self.selection.reason}: the loader would stay inert (targets shown "
                    f"against {name}, the nearest set, for information)")
        if self.failed:
            return f"{len(self.failed)} of {total} targets of {name} differ: the loader would patch nothing"
        return f"all {total} targets of {name} verify"


def load_patch_set(table: matrix.Matrix, name: str) -> list[Declaration]:
    """The declarations of patch set ``name``; a set the matrix names but this install does
    not ship, or a malformed one, is a matrix problem."""
    try:
        module = importlib.import_module(f"ascend_patch.patches.{name}")
    except ImportError as exc:
        raise matrix.MatrixError(
            f"{table.path}: patch_sets.{name}: no patch set module ascend_patch.patches.{name} "
            f"in this ascend-patch ({exc.msg})"
        ) from None
    declarations = getattr(module, "MANIFEST", None)
    if not isinstance(declarations, (list, tuple)) or not all(
        isinstance(d, DECLARATION_TYPES) for d in declarations
    ):
        raise matrix.MatrixError(
            f"{table.path}: patch_sets.{name}: ascend_patch.patches.{name}.MANIFEST is not a "
            "list of Patch, Contract, Setting and Seam declarations"
        )
    if not isinstance(getattr(module, "RUNNER", None), str):
        raise matrix.MatrixError(
            f"{table.path}: patch_sets.{name}: ascend_patch.patches.{name} declares no RUNNER "
            "(the runner generation its declarations are written for, e.g. \"v1\")"
        )
    return list(declarations)


def patch_set_runner(name: str) -> str:
    """The runner generation patch set ``name`` declares (its ``RUNNER``: "v1" for vLLM's V1
    model runner, "v2" for Model Runner V2), once :func:`load_patch_set` has checked it."""
    return importlib.import_module(f"ascend_patch.patches.{name}").RUNNER


def _nearest_set(table: matrix.Matrix, release: Version) -> matrix.PatchSetSpec:
    """For a release no set covers: the oldest set above it (the one it would have to
    join), else the newest."""
    return next((s for s in table.patch_sets if s.lower > release), table.patch_sets[-1])


def decide(
    version: str | None,
    tree: SourceTree,
    table: matrix.Matrix,
    cache_dir: Path | None = None,
) -> Decision:
    """Select a patch set for ``version`` and verify every declaration that applies to it.

    ``version`` None means a tree that records no version, treated as newer than every
    set (as a checkout of vLLM main is). Raises :class:`matrix.MatrixError` for a set
    that cannot be loaded and :class:`versions.VersionError` for an unreadable version.
    """
    if version is None:
        newest = table.patch_sets[-1]
        selection = matrix.Selection(
            newest, "unknown",
            f"the version is unknown; assumed newer than every patch set (as a checkout of "
            f"vLLM main is), so the newest, {newest.name} ({newest.range}), is checked",
            None,
        )
        release = None
    else:
        selection = table.select(version)
        release = versions.release(versions.parse(version))
    checked = selection.patch_set or _nearest_set(table, release)
    # An unknown version is assumed newer than every set: the sub-ranges that reach its end.
    admitted = checked.upper if release is None else release
    declarations = [d for d in load_patch_set(table, checked.name) if applies_to(d, admitted)]
    statuses = verify(declarations, tree, cache_dir=cache_dir, release=release)
    return Decision(version, release, selection, checked, declarations, statuses)
