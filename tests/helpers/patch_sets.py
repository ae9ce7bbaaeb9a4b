"""A release's patch set as the loader records it (:data:`ascend_patch.release.patched`), for the
unit tests of the platform's gates that read it, without an engine or that release installed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from packaging.version import Version

from ascend_patch import release
from ascend_patch.overlay import loader, matrix
from ascend_patch.overlay.decision import load_patch_set
from ascend_patch.overlay.declarations import applies_to


def _selected(version: str) -> tuple[str, list]:
    """The patch set the shipped matrix picks for vLLM ``version``, and its declarations that
    apply to that release, as the loader selects them."""
    table = matrix.load()
    name = table.select(version).patch_set.name
    return name, [d for d in load_patch_set(table, name) if applies_to(d, Version(version))]


@contextlib.contextmanager
def patched_as_on(version: str):
    """``release.patched`` as activation on vLLM ``version`` sets it, restored on exit."""
    saved, release.patched = release.patched, loader.patched(_selected(version)[1])
    try:
        yield
    finally:
        release.patched = saved


def matrix_up_to_installed(tmp_path, release: str | None = None) -> tuple[str, matrix.PatchSetSpec]:
    """A copy of the shipped matrix without the patch sets newer than ``release``'s (by default
    the installed vLLM's) and their releases, and its newest set: the tests of what happens to a
    release newer than every set read it, on a tree the newest set of that copy serves."""
    import importlib.metadata

    import yaml

    installed = Version(Version(release or importlib.metadata.version("vllm")).base_version)
    data = yaml.safe_load(matrix.default_path().read_text())
    table = matrix.load()
    newer = {spec.name for spec in table.patch_sets if spec.lower > installed}
    data["patch_sets"] = {name: spec for name, spec in data["patch_sets"].items() if name not in newer}
    data["versions"] = {v: row for v, row in data["versions"].items() if row["patch_set"] not in newer}
    path = tmp_path / "compat_matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path), matrix.load(path).patch_sets[-1]


@dataclass(frozen=True)
class Installed:
    """The installed vLLM release and what the shipped matrix serves it with."""

    vllm: str
    patch_set: str
    runner: str
    """The runner generation the patch set declares: "V1" or "V2", as ``doctor`` prints it."""
    manifest: list
    """The patch set's declarations that apply to the release, as the loader selects them."""
    patches: list
    """Those of them the loader applies or checks at import (the set's ``PATCHES``)."""


def installed() -> Installed:
    """The main test environment's release facts, for the tests that read what ``doctor`` and
    the loader report about it (the main line moves to each new release)."""
    import importlib
    import importlib.metadata

    from ascend_patch.overlay.decision import patch_set_runner

    version = Version(importlib.metadata.version("vllm")).base_version
    name, manifest = _selected(version)
    patches = [d for d in importlib.import_module(f"ascend_patch.patches.{name}").PATCHES
               if applies_to(d, Version(version))]
    return Installed(version, name, patch_set_runner(name).upper(), manifest, patches)
