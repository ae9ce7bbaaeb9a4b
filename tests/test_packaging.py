"""What ships: the sdist, the wheel built from it, regular (non-editable) installs of each that
start an emulated engine, the editable install, and a fresh environment that has no vLLM.

The editable install the rest of the suite runs from imports the package from the checkout, so
it cannot notice a module the wheel leaves out; these tests install the built artefacts into
environments of their own and run them from outside the checkout.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from ascend_patch.kit.oracle import hf_greedy, prompt_token_ids
from tests.helpers.engine import run_engine
from tests.helpers.process import ROOT, clean_env, run_python

PTH = "a1_ascend_patch.pth"
RUNTIME_DEPENDENCIES = ("wrapt", "importlib-metadata", "zipp", "lazy-importer", "packaging", "pyyaml")


def _pins() -> dict[str, str]:
    text = (ROOT / "requirements" / "test-vllm-0.33.0.txt").read_text()
    return {
        m.group(1).lower().replace("_", "-"): m.group(2)
        for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.MULTILINE)
    }


def source_modules() -> set[str]:
    """Every module of the checkout as the installed package names it: ``ascend_patch/**`` and
    the manifest, ``patches/`` (shipped as ``ascend_patch.patches``)."""
    def dotted(path: Path, root: Path, prefix: tuple[str, ...]) -> str:
        parts = (*prefix, *path.relative_to(root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    package = ROOT / "ascend_patch"
    modules = {dotted(p, package, ("ascend_patch",)) for p in package.rglob("*.py")}
    modules |= {dotted(p, ROOT / "patches", ("ascend_patch", "patches")) for p in (ROOT / "patches").glob("*.py")}
    return modules


def _archive_modules(names: list[str], root: str = "") -> set[str]:
    """The modules an archive holds under ``root`` (the wheel's root, an sdist's top folder),
    with the sdist's ``patches/`` named as it installs."""
    modules = set()
    for name in names:
        relative = name.removeprefix(root)
        if not relative.endswith(".py") or not relative.startswith(("ascend_patch/", "patches/")):
            continue
        if relative.startswith("patches/"):
            relative = "ascend_patch/" + relative
        parts = relative.removesuffix(".py").split("/")
        modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, each built straight from a clean copy of the checkout (what
    ``pip install .`` does), so no earlier build's ``build/`` or ``*.egg-info`` (the editable
    install writes one) can put back a file the package list would drop."""
    tree = tmp_path_factory.mktemp("tree") / "ascend-patch"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venvs", ".cache", ".tmp", "build", "dist", "*.egg-info", "__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("ascend_patch-*.whl")
    (sdist,) = out.glob("ascend_patch-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def wheel(dist) -> Path:
    return dist["wheel"]


def test_wheel_holds_every_module_the_pth_and_the_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"ascend_patch", PTH, next(t for t in top if t.endswith(".dist-info"))}
    assert _archive_modules(names) == source_modules(), "the wheel holds exactly the checkout's modules"
    for data in ("ascend_patch/compat_matrix.yaml", "ascend_patch/patches/v0_20_digests.json",
                 "ascend_patch/patches/v0_29_digests.json"):
        assert data in names, data
    assert not any(n.endswith(".pth") and "/" in n for n in names), "the .pth belongs at the root only"
    assert zipfile.ZipFile(wheel).read(PTH) == (ROOT / "ascend_patch" / PTH).read_bytes()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "ascend-patch = ascend_patch.cli:main" in text
    assert "[vllm.general_plugins]" in text and "ascend_patch = ascend_patch.overlay.loader:general_plugin" in text


def test_sdist_holds_what_builds_the_wheel_and_no_tests(dist):
    sdist = dist["sdist"]
    root = sdist.name.removesuffix(".tar.gz") + "/"
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert _archive_modules(names, root) == source_modules()
    for required in ("pyproject.toml", "setup.py", "README.md", "compat_matrix.yaml",
                     f"ascend_patch/{PTH}", "patches/v0_29_digests.json"):
        assert root + required in names, required
    assert not any(n.startswith(root + "tests/") for n in names), "tests need the checkout"


def test_editable_wheel_carries_the_pth(tmp_path):
    code = (
        "import sys; from setuptools import build_meta; "
        f"print(build_meta.build_editable({str(tmp_path)!r}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(tmp_path / name).namelist()
    assert PTH in names
    assert any(n.startswith("__editable__") and n.endswith(".pth") for n in names)
    assert sorted([PTH, next(n for n in names if n.startswith("__editable__") and n.endswith(".pth"))])[-1] == PTH, (
        "our .pth must sort after setuptools' editable finder, so the package is importable when it runs"
    )


def test_this_environment_runs_the_installed_pth():
    site = Path(sysconfig.get_paths()["purelib"])
    assert (site / PTH).read_bytes() == (ROOT / "ascend_patch" / PTH).read_bytes()
    proc = run_python("import sys; print(sorted(m for m in sys.modules if m.startswith('ascend_patch')))")
    assert proc.stdout.strip() == "['ascend_patch']" and proc.stderr == "", "the .pth imports its one module"


def _site(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


# --- regular installs beside the pinned vLLM -------------------------------------------------------


@pytest.fixture(scope="module", params=["wheel", "sdist"])
def regular_install(request, dist, tmp_path_factory) -> tuple[str, Path]:
    """A new venv with ascend-patch installed (not editable) from the wheel or the sdist, beside
    the pinned vLLM: the test environment's site-packages is one more path entry of the venv
    (``_pinned_vllm.pth``, read only; path entries run no .pth of theirs, so the checkout's
    editable install stays invisible), and its own site-packages holds nothing but the artefact's
    install. pip comes from that path too; ``--no-index``: nothing is fetched."""
    venv = tmp_path_factory.mktemp(request.param) / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (_site(venv) / "_pinned_vllm.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", str(dist[request.param])],
        capture_output=True, text=True, timeout=600, cwd=venv.parent, env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return request.param, venv


def test_regular_install_imports_every_module_from_itself(regular_install):
    """Every module of the checkout imports in the new venv, each from the venv's own copy."""
    _, venv = regular_install
    python = str(venv / "bin" / "python")
    site = _site(venv).resolve()
    code = """
        import importlib, importlib.metadata, importlib.util, json, pkgutil
        import ascend_patch
        v1_runner_gone = tuple(map(int, importlib.metadata.version("vllm").split(".")[:2])) >= (0, 34)
        found = {"ascend_patch": ascend_patch.__file__}
        for info in pkgutil.walk_packages(ascend_patch.__path__, "ascend_patch."):
            # Found, not run: the CLI; the V1 runner's room where vLLM no longer has that runner.
            if info.name.endswith(".__main__") or (
                    v1_runner_gone and info.name.startswith("ascend_patch.npu.runner.v1")):
                found[info.name] = importlib.util.find_spec(info.name).origin
            else:
                found[info.name] = importlib.import_module(info.name).__file__
        print(json.dumps(found))
    """
    proc = run_python(code, python=python, cwd=venv.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(found) == source_modules()
    outside = {name: path for name, path in found.items() if not Path(path).resolve().is_relative_to(site)}
    assert outside == {}, "imported from outside the venv's own install"
    assert (_site(venv) / PTH).is_file()
    assert (venv / "bin" / "ascend-patch").is_file()


def test_regular_install_runs_an_emulated_engine(regular_install, tiny_models, tmp_path):
    """Stock vLLM on the emulated NPU from the regular install, tokens equal to HF. From the wheel,
    the engine core is a spawned process (vLLM's default), so the installed .pth must reach it;
    from the sdist it runs in-process, which also reports the kernel seam's launches."""
    kind, venv = regular_install
    model = tiny_models["tiny-llama"]
    prompts = prompt_token_ids(model, [5, 130])
    spawned = kind == "wheel"
    spec = {"engines": [{
        "model": str(model),
        "kwargs": {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 2, "enforce_eager": True},
        "runs": [{"prompts": prompts, "sampling": [{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}]}],
    }]}
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="512MiB",
                    VLLM_ENABLE_V1_MULTIPROCESSING="1" if spawned else "0")
    result = run_engine(spec, tmp_path, env=env, python=str(venv / "bin" / "python"))
    (engine,) = result["engines"]
    (run,) = engine["runs"]
    assert run["tokens"] == hf_greedy(model, prompts, 8)
    if not spawned:  # fp32: the cache write and the custom ops on the seam, attention composed
        assert {"scatter_pa_kv_cache", "rms_norm", "add_rms_norm", "swiglu", "mrope"} <= set(run["launches"])


# --- a fresh environment without vLLM -------------------------------------------------------------


def _venv_with(wheel: Path, where: Path, deps: list[str]) -> Path:
    """A new environment at ``where`` with ascend-patch from the wheel and ``deps``: no vLLM, no torch."""
    venv = where / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel), *deps],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return venv


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory, wheel) -> Path:
    """ascend-patch from the wheel with its own dependencies, shared by the tests that leave it as is."""
    pins = _pins()
    deps = [f"{name}=={pins[name]}" for name in RUNTIME_DEPENDENCIES]
    return _venv_with(wheel, tmp_path_factory.mktemp("bare"), deps)


def test_regular_install_runs_the_pth(bare_venv):
    python = str(bare_venv / "bin" / "python")
    assert (_site(bare_venv) / PTH).is_file()
    proc = run_python("import sys; print(sorted(m for m in sys.modules if m.startswith('ascend_patch')))", python=python)
    assert proc.stdout.strip() == "['ascend_patch']" and proc.stderr == "", "the .pth imports its one module"


def test_no_vllm_installed(bare_venv):
    python = str(bare_venv / "bin" / "python")
    assert run_python("pass", python=python).stderr == ""
    pip = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, env=clean_env())
    assert pip.returncode == 0 and pip.stderr == ""
    imported = run_python("import vllm", python=python)
    assert "No module named 'vllm'" in imported.stderr.splitlines()[-1]
    assert [line for line in imported.stderr.splitlines() if "ascend" in line.lower()] == []

    doctor = [str(bare_venv / "bin" / "ascend-patch"), "doctor"]
    auto = subprocess.run(doctor, capture_output=True, text=True, env=clean_env())
    assert auto.returncode == 0, "auto without vLLM is not a failure"
    assert re.search(r"^vllm\s+not installed$", auto.stdout, re.MULTILINE)
    emulate = subprocess.run(doctor, capture_output=True, text=True, env=clean_env(ASCEND_PATCH="emulate"))
    assert emulate.returncode == 1, "emulate was asked for and cannot activate"
    assert "vLLM is not installed" in emulate.stdout


def test_uninstall_removes_the_pth_and_a_stale_copy_is_harmless(wheel, tmp_path):
    """In an environment of its own (uninstalling from the shared one would break the tests after
    it); the .pth needs no dependency to be found and removed."""
    venv = _venv_with(wheel, tmp_path, [])
    python = str(venv / "bin" / "python")
    site = _site(venv)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "ascend-patch"], check=True, capture_output=True)
    assert not (site / PTH).exists()
    (site / PTH).write_bytes((ROOT / "ascend_patch" / PTH).read_bytes())
    proc = run_python("print('ok')", python=python)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "ok", "")
