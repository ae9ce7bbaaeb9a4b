"""A release's patch set as the loader records it (:data:`ascend_patch.release.patched`), for the
unit tests of the platform's gates that read it, without an engine or that release installed."""

from __future__ import annotations

import contextlib

from packaging.version import Version

from ascend_patch import release
from ascend_patch.overlay import loader, matrix
from ascend_patch.overlay.decision import load_patch_set
from ascend_patch.overlay.declarations import applies_to


@contextlib.contextmanager
def patched_as_on(version: str):
    """``release.patched`` as activation on vLLM ``version`` sets it, restored on exit."""
    table = matrix.load()
    declarations = [d for d in load_patch_set(table, table.select(version).patch_set.name)
                    if applies_to(d, Version(version))]
    saved, release.patched = release.patched, loader.patched(declarations)
    try:
        yield
    finally:
        release.patched = saved
