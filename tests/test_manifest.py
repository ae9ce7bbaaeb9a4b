"""The patch sets are the one manifest of every change, and it is complete and consistent.

Every declaration says why, where our side lives, what upstream makes it necessary and when it
can go; every path it names resolves; the releases a declaration narrows itself to lie inside
its set's range, which only compat_matrix.yaml states; every run-time version probe in the NPU
wing is a declared seam; the two wings do not reach into each other; and docs/patches.md is
generated from all of it.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ascend_patch.overlay import matrix
from ascend_patch.overlay.decision import load_patch_set
from ascend_patch.overlay.patching import Patch, Seam, Setting
from tests.conftest import ROOT

TABLE = matrix.load()
SETS = [spec.name for spec in TABLE.patch_sets]


def _declarations(name):
    return load_patch_set(TABLE, name)


@pytest.mark.parametrize("name", SETS)
def test_every_declaration_carries_its_provenance(name):
    for d in _declarations(name):
        assert d.reason and d.upstream and d.remove_when and d.implementation, d.target


@pytest.mark.parametrize("name", SETS)
def test_manifest_holds_the_vllm_patches_and_no_target_twice(name):
    module = importlib.import_module(f"ascend_patch.patches.{name}")
    targets = [d.target for d in module.MANIFEST]
    assert len(targets) == len(set(targets))
    assert set(p.target for p in module.PATCHES) <= set(targets)
    assert all(isinstance(p, Patch) and p.module.startswith("vllm") for p in module.PATCHES)


def _resolve(path: str):
    module, _, qualname = path.partition(":")
    owner = importlib.import_module(module)
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return owner


@pytest.mark.parametrize("name", SETS)
def test_every_implementation_path_resolves(name):
    """The wrapper, replacement, overriding class or seam user each declaration names exists
    (imports vLLM, as the engine does)."""
    for d in _declarations(name):
        if isinstance(d, Setting):
            continue
        if isinstance(d, Patch) and isinstance(d.wrapper or d.replacement, str) and not d.by:
            _resolve(d.wrapper or d.replacement)
        else:
            _resolve(d.implementation)


@pytest.mark.parametrize("name", SETS)
def test_sub_ranges_and_seams_lie_inside_the_sets_releases(name):
    spec = TABLE.patch_set(name)
    for d in _declarations(name):
        if d.vllm is not None:
            narrowed = SpecifierSet(d.vllm)
            inside = [v for v in TABLE.versions if spec.contains(Version(v)) and narrowed.contains(v)]
            assert inside, f"{d.target}: {d.vllm} admits no listed release of {name} ({spec.range})"
        if isinstance(d, Seam):
            for bound in (d.since, d.until):
                assert bound is None or Version(bound) <= spec.upper, d.target


def test_every_version_probe_in_the_npu_wing_is_a_declared_seam():
    """A ``hasattr`` on vLLM in the NPU wing is a version seam: it must say so, and the
    declared seams must cover what it probes."""
    declared = {d.qualname.rsplit(".", 1)[-1] for name in SETS for d in _declarations(name)
                if isinstance(d, Seam)}
    for path in (ROOT / "ascend_patch" / "npu").rglob("*.py"):
        if "kernels" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            probe = re.search(r"hasattr\(\w[\w.]*, \"(\w+)\"\)", line)
            if probe:
                where = f"{path.relative_to(ROOT)}:{number}"
                assert "# seam" in line, f"{where}: a version probe without a seam comment"
                seam = re.search(r"# seam (\w+)", line)
                assert (seam.group(1) if seam else probe.group(1)) in declared, where


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / "ascend_patch" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return found


def test_the_wings_do_not_reach_into_each_other():
    npu = _imports("npu")
    assert not any(m.startswith("ascend_patch.overlay") or m.startswith("ascend_patch.cli") for m in npu)
    overlay = _imports("overlay")
    # The overlay asks the device seam one question (is an NPU usable?) to decide the mode.
    assert {m for m in overlay if m.startswith("ascend_patch.npu")} <= {"ascend_patch.npu.kernels"}
    manifest = {m for path in (ROOT / "patches").glob("*.py")
                for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.ImportFrom) and (m := node.module)}
    assert not any(m.startswith("ascend_patch.npu") for m in manifest), (
        "the manifest names its implementations by path, imported only when applied")


def test_patch_docs_are_generated_from_the_manifest():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_patch_docs.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = (ROOT / "docs" / "patches.md").read_text()
    for name in SETS:
        for d in _declarations(name):
            assert f"`{d.target}`" in doc
