"""The wheel, the editable install, and a fresh environment that has no vLLM."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_env, run_python

PTH = "a1_ascend_patch.pth"
RUNTIME_DEPENDENCIES = ("wrapt", "importlib-metadata", "zipp", "lazy-importer", "packaging", "pyyaml")


def _pins() -> dict[str, str]:
    text = (ROOT / "requirements" / "test-vllm-0.33.0.txt").read_text()
    return {
        m.group(1).lower().replace("_", "-"): m.group(2)
        for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.MULTILINE)
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (built,) = out.glob("ascend_patch-*.whl")
    return built


def test_wheel_holds_one_package_the_pth_and_the_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"ascend_patch", PTH, next(t for t in top if t.endswith(".dist-info"))}
    for required in (
        "ascend_patch/compat_matrix.yaml",
        "ascend_patch/patches/__init__.py",
        "ascend_patch/patches/common.py",
        "ascend_patch/patches/v0_29.py",
        "ascend_patch/overlay/bootstrap.py",
        "ascend_patch/npu/kernels/npu.py",
    ):
        assert required in names, required
    assert not any(n.endswith(".pth") and "/" in n for n in names), "the .pth belongs at the root only"
    assert zipfile.ZipFile(wheel).read(PTH) == (ROOT / "ascend_patch" / PTH).read_bytes()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "ascend-patch = ascend_patch.cli:main" in text
    assert "[vllm.general_plugins]" in text and "ascend_patch = ascend_patch.overlay.loader:general_plugin" in text


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
    proc = run_python("import sys; print('ascend_patch.overlay.bootstrap' in sys.modules)")
    assert proc.stdout.strip() == "True" and proc.stderr == ""


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory, wheel) -> Path:
    """A new environment with ascend-patch from the wheel and its own dependencies: no vLLM, no torch."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pins = _pins()
    deps = [f"{name}=={pins[name]}" for name in RUNTIME_DEPENDENCIES]
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel), *deps],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return venv


def _site(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def test_regular_install_runs_the_pth(bare_venv):
    python = str(bare_venv / "bin" / "python")
    assert (_site(bare_venv) / PTH).is_file()
    proc = run_python("import sys; print('ascend_patch.overlay.bootstrap' in sys.modules)", python=python)
    assert proc.stdout.strip() == "True" and proc.stderr == ""


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


def test_uninstall_removes_the_pth_and_a_stale_copy_is_harmless(bare_venv):
    python = str(bare_venv / "bin" / "python")
    site = _site(bare_venv)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "ascend-patch"], check=True, capture_output=True)
    assert not (site / PTH).exists()
    (site / PTH).write_bytes((ROOT / "ascend_patch" / PTH).read_bytes())
    proc = run_python("print('ok')", python=python)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "ok", "")
