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


def matrix_up_to_installed(tmp_path) -> tuple[str, matrix.PatchSetSpec]:
    """A copy of the shipped matrix without the patch sets newer than the installed vLLM's (and
    their releases), and its newest set: the tests of what happens to a release newer than every
    set read it, since the shipped matrix's newest set (Model Runner V2, 0.34+) does not match the
    main environment's vLLM (0.33, V1)."""
    import importlib.metadata

    import yaml

    installed = Version(Version(importlib.metadata.version("vllm")).base_version)
    data = yaml.safe_load(matrix.default_path().read_text())
    table = matrix.load()
    newer = {spec.name for spec in table.patch_sets if spec.lower > installed}
    data["patch_sets"] = {name: spec for name, spec in data["patch_sets"].items() if name not in newer}
    data["versions"] = {v: row for v, row in data["versions"].items() if row["patch_set"] not in newer}
    path = tmp_path / "compat_matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path), matrix.load(path).patch_sets[-1]
