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
import importlib.util
import re
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ascend_patch.overlay import matrix
from ascend_patch.overlay.decision import load_patch_set
from ascend_patch.overlay.declarations import Contract, Patch, Seam, Setting
from tests.helpers.process import ROOT

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
    assert all(isinstance(p, (Patch, Contract)) and p.module.startswith("vllm") for p in module.PATCHES)


def _resolve(path: str):
    module, _, qualname = path.partition(":")
    owner = importlib.import_module(module)
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return owner


def _with_its_runner(name: str):
    """A set's name; a V1 runner's set marked to run where vLLM still has that runner, whose
    modules its implementations import (gone from 0.34)."""
    from ascend_patch.overlay.decision import patch_set_runner

    return pytest.param(name, marks=[pytest.mark.v1_runner] if patch_set_runner(name) == "v1" else [])


@pytest.mark.parametrize("name", [_with_its_runner(name) for name in SETS])
def test_every_implementation_path_resolves(name):
    """The implementation each declaration names (the wrapper or replacement, the overriding
    class, the seam's user) exists, and so does a wrapper or replacement named by path
    (imports vLLM, as the engine does)."""
    for d in _declarations(name):
        if isinstance(d, Setting):
            continue
        _resolve(d.implementation)
        if isinstance(d, Patch) and isinstance(d.wrapper or d.replacement, str):
            _resolve(d.wrapper or d.replacement)


def test_every_model_runner_v2_kernel_implementation_is_declared_with_its_parameters():
    """The torch implementations registered for MRV2's Triton kernels and the manifest's kernel
    contracts name the same kernels with the same parameters (launch options aside): verification
    at import vllm then fails on a release whose kernel changed, before any launch could feed an
    implementation the wrong tensor."""
    import inspect

    from ascend_patch.npu.runner.v2 import kernels
    from ascend_patch.patches import runner_v2

    def names(signature: str) -> tuple[str, ...]:
        return tuple(part.partition("=")[0] for part in signature.strip("()").split(", "))

    declared = {c.target.replace(":", "."): names(c.signature[0]) for c in runner_v2.KERNELS}
    implemented = {name: tuple(p for p in inspect.signature(fn).parameters if p not in kernels.LAUNCH_OPTIONS)
                   for name, fn in kernels.implementations().items()}
    assert declared == implemented


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


def _probes(source: str):
    """Every ``hasattr(obj, name)`` and ``getattr(obj, name, default)`` in ``source``: its line,
    the name when it is a literal, and the text of the lines it spans (where its comment is)."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and (node.func.id == "hasattr" or node.func.id == "getattr" and len(node.args) == 3)):
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            yield node.lineno, name, " ".join(lines[node.lineno - 1:node.end_lineno])


def _unexplained_probes(source: str, declared: set[str]) -> list[str]:
    """A probe is a version seam (``# seam [name]``, declared in a patch set) or says why it is
    not one (``# not a seam: why``: a field some models, layers or spec kinds lack, our own
    attribute). Returns the lines that do neither."""
    problems = []
    for number, name, text in _probes(source):
        seam = re.search(r"# seam\b(?: (\w+))?", text)
        if seam:
            if (seam.group(1) or name) not in declared:
                problems.append(f"{number}: seam {seam.group(1) or name} is not declared")
        elif not re.search(r"# not a seam: \S", text):
            problems.append(f"{number}: a probe that is neither a declared seam nor says why it is not one")
    return problems


def test_every_version_probe_in_the_npu_wing_is_a_declared_seam():
    """``hasattr`` and ``getattr(..., default)`` on vLLM in the NPU wing are version probes: each
    is a declared seam or says why it is not one. (The kernels package probes torch_npu.)"""
    declared = {d.qualname.rsplit(".", 1)[-1] for name in SETS for d in _declarations(name)
                if isinstance(d, Seam)}
    problems = [f"{path.relative_to(ROOT)}:{problem}"
                for path in sorted((ROOT / "ascend_patch" / "npu").rglob("*.py"))
                if "kernels" not in path.parts
                for problem in _unexplained_probes(path.read_text(), declared)]
    assert problems == []


def test_the_probe_check_catches_getattr_defaults_and_hasattr():
    source = ("a = getattr(config, 'enable_eplb', False)\n"
              "b = hasattr(config, 'x')\n"
              "c = getattr(config, 'y')\n"  # no default: not a probe
              "d = getattr(layer, 'impl', None)  # not a seam: not every layer attends\n"
              "e = hasattr(ops, 'fused_add_rms_norm')  # seam: 0.21+\n"
              "f = hasattr(ops, 'undeclared')  # seam: 0.40+\n")
    assert _unexplained_probes(source, {"fused_add_rms_norm"}) == [
        "1: a probe that is neither a declared seam nor says why it is not one",
        "2: a probe that is neither a declared seam nor says why it is not one",
        "6: seam undeclared is not declared",
    ]


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IMPORT_GRAPH = _import_graph()


def test_the_wings_do_not_reach_into_each_other():
    """Every import statement counts, those inside functions too. The overlay asks the NPU
    wing its one question (which device mode?) through the path loader.DEVICE_CHECK names."""
    arrows, outside = IMPORT_GRAPH.graph()
    npu = {t for name, targets in arrows.items() if name.startswith("ascend_patch.npu") for t in targets}
    assert not any(t.startswith(("ascend_patch.overlay", "ascend_patch.cli")) for t in npu)
    assert IMPORT_GRAPH.wing_violations(arrows, outside) == []


def test_the_manifest_holds_declarations_only():
    """patches/ imports the declaration types and its own modules, nothing else (lazy imports
    included): our side is named by ``module:object`` path and imported only when applied. And
    it defines no class: code lives in the NPU wing."""
    arrows, outside = IMPORT_GRAPH.graph()
    manifest = {name for name in arrows if name.startswith("ascend_patch.patches")}
    # the overlay package's __init__ runs first, and imports nothing
    allowed = {"ascend_patch.overlay", "ascend_patch.overlay.declarations", *manifest}
    for name in sorted(manifest):
        assert arrows[name] <= allowed, f"{name} imports {sorted(arrows[name] - allowed)}"
        assert not outside[name], f"{name} imports {sorted(outside[name])}"
    classes = [f"{path.name}:{node.name}" for path in (ROOT / "patches").glob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]
    assert classes == []


def test_the_import_graph_has_no_cycle():
    arrows, _ = IMPORT_GRAPH.graph()
    assert IMPORT_GRAPH.cycles(arrows) == []


def test_the_import_graph_sees_lazy_imports_and_arrows_into_the_npu_wing(tmp_path):
    """The checks are not blind: an import inside a function of the overlay is an arrow."""
    (tmp_path / "ascend_patch" / "overlay").mkdir(parents=True)
    (tmp_path / "ascend_patch" / "npu").mkdir()
    (tmp_path / "patches").mkdir()
    for package in ("ascend_patch", "ascend_patch/overlay", "ascend_patch/npu"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ascend_patch" / "overlay" / "loader.py").write_text(
        "def mode():\n    from ascend_patch.npu import detect\n    import torch\n")
    (tmp_path / "ascend_patch" / "npu" / "detect.py").write_text("from ..overlay import loader\n")
    arrows, outside = IMPORT_GRAPH.graph(tmp_path)
    assert IMPORT_GRAPH.wing_violations(arrows, outside) == [
        "ascend_patch.overlay.loader -> ascend_patch.npu", "ascend_patch.overlay.loader -> ascend_patch.npu.detect",
        "ascend_patch.overlay.loader -> torch"]
    assert IMPORT_GRAPH.cycles(arrows) == [
        frozenset({"ascend_patch.overlay.loader", "ascend_patch.npu.detect"})]


def test_the_import_graph_counts_a_submodule_import_as_one_of_its_package(tmp_path):
    """A package whose __init__ imports a module that imports a sibling of the package's is a
    cycle (import order alone keeps it alive); a package's own modules importing each other are not."""
    for package in ("ascend_patch", "ascend_patch/kernels", "ascend_patch/kernels/inner", "ascend_patch/refs"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "patches").mkdir()
    (tmp_path / "ascend_patch" / "kernels" / "__init__.py").write_text(
        "from ascend_patch.refs import attention\nfrom ascend_patch.kernels.inner import ops\n")
    (tmp_path / "ascend_patch" / "kernels" / "limits.py").write_text("")
    (tmp_path / "ascend_patch" / "kernels" / "inner" / "ops.py").write_text("from ascend_patch.kernels import limits\n")
    (tmp_path / "ascend_patch" / "refs" / "attention.py").write_text("from ascend_patch.kernels import limits\n")
    arrows, _ = IMPORT_GRAPH.graph(tmp_path)
    assert IMPORT_GRAPH.cycles(arrows) == [frozenset({"ascend_patch.kernels", "ascend_patch.refs.attention"})]


def test_the_runner_walls_hold():
    arrows, outside = IMPORT_GRAPH.graph()
    assert IMPORT_GRAPH.runner_violations(arrows, outside) == []


def test_the_runner_walls_see_a_worker_import_and_a_set_without_its_runner(tmp_path):
    for package in ("ascend_patch", "ascend_patch/npu", "ascend_patch/npu/runner", "patches"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ascend_patch" / "npu" / "platform.py").write_text(
        "def f():\n    from vllm.v1.worker.gpu_worker import Worker\n")
    (tmp_path / "ascend_patch" / "npu" / "runner" / "worker.py").write_text(
        "from vllm.v1.worker.gpu_worker import Worker\n")
    for runner in ("v1", "v2"):
        (tmp_path / "patches" / f"runner_{runner}.py").write_text("")
    (tmp_path / "patches" / "v0_20.py").write_text('from ascend_patch.patches import runner_v1\nRUNNER = "v1"\n')
    (tmp_path / "patches" / "v0_29.py").write_text(
        'from ascend_patch.patches import runner_v1, runner_v2\nRUNNER = "v1"\n')
    (tmp_path / "patches" / "v0_34.py").write_text('from ascend_patch.patches import runner_v1\nRUNNER = "v2"\n')
    arrows, outside = IMPORT_GRAPH.graph(tmp_path)
    assert IMPORT_GRAPH.runner_violations(arrows, outside, tmp_path) == [
        "ascend_patch.npu.platform -> vllm.v1.worker.gpu_worker",
        "ascend_patch.patches.v0_29 declares RUNNER = 'v1' and composes "
        "ascend_patch.patches.runner_v1, ascend_patch.patches.runner_v2",
        "ascend_patch.patches.v0_34 declares RUNNER = 'v2' and composes ascend_patch.patches.runner_v1",
    ]


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
