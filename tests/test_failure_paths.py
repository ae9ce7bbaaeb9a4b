"""Every way the environment can be wrong gives one line and leaves vLLM stock.

Each case runs a fresh interpreter through the installed ``.pth`` (as ``vllm serve`` would):
``import vllm`` must succeed with the stock platform and exactly one ascend-patch line on
stderr, and ``ascend-patch doctor`` must report the problem instead of crashing. Only what
the user asked to be certain about — ``ASCEND_PATCH=npu`` without an NPU, strict mode, a
malformed mode or flag — stops ``import vllm``, with one clear error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ascend_patch.overlay import verification
from ascend_patch.overlay.declarations import Contract
from ascend_patch.overlay.verification import verify
from ascend_patch.overlay.source import SourceTree
from tests.helpers.process import ROOT, ascend_patch_lines, clean_env, mirror, run_python

PLATFORM = """
import json
from vllm.platforms import current_platform
print(json.dumps(type(current_platform).__name__))
"""


def _stock_with_one_line(env: dict[str, str], *expected: str, cwd: Path | None = None) -> str:
    proc = run_python(PLATFORM, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == "UnspecifiedPlatform"
    lines = ascend_patch_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]  # one message (a mismatch list follows it)
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def _doctor(env: dict[str, str], cwd: Path | None = None) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "ascend_patch", "doctor", "--json"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=cwd or ROOT)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _matrix(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


SHIPPED = (ROOT / "compat_matrix.yaml").read_text()


def _installed_patch_set() -> str:
    """The patch set the shipped matrix picks for the installed vLLM."""
    from importlib.metadata import version

    from ascend_patch.overlay import matrix

    return matrix.load(ROOT / "compat_matrix.yaml").select(version("vllm")).patch_set.name


INSTALLED_SET = _installed_patch_set()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary", "not a text file"),
        # the shipped list replaced (YAML keeps the last of two equal keys)
        (SHIPPED[: SHIPPED.index("\nlimitations:\n")] + "\nlimitations: 5\n", "limitations: expected a list"),
        (SHIPPED.replace(f"  {INSTALLED_SET}:\n    vllm:", "  v0_99:\n    vllm:", 1), "no patch set module"),
    ],
    ids=["binary", "limitations-not-a-list", "unknown-patch-set"],
)
def test_a_bad_matrix_leaves_vllm_stock(tmp_path, content, expected):
    if "v0_99" in str(content):
        # Rename the installed release's set everywhere the matrix names it, so only the
        # missing module is wrong.
        content = content.replace(f"patch_set: {INSTALLED_SET}", "patch_set: v0_99")
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_MATRIX=str(_matrix(tmp_path, content)))
    _stock_with_one_line(env, expected)
    code, data = _doctor(env)
    assert code == 1 and data["would_activate"] is False and expected in data["reason"]


@pytest.mark.parametrize(
    ("size", "expected"),
    [("9" * 400, "is not a size"), ("0", "is not a usable device size"), ("lots", "is not a size")],
)
def test_a_bad_emulated_hbm_leaves_vllm_stock(size, expected):
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM=size)
    _stock_with_one_line(env, "ASCEND_PATCH_EMULATED_HBM", expected)
    code, data = _doctor(env)
    assert code == 1 and expected in data["reason"]


def test_a_malformed_version_override_names_the_variable_set():
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_VLLM_VERSION="nonsense")
    line = _stock_with_one_line(env, "cannot read vLLM version 'nonsense' from ASCEND_PATCH_VLLM_VERSION")
    assert "set ASCEND_PATCH_VLLM_VERSION" not in line, "do not tell users to set what they set"


@pytest.mark.parametrize("variable", ["ASCEND_PATCH_STRICT", "ASCEND_PATCH_DEBUG"])
def test_a_flag_that_is_not_a_flag_is_an_error_not_silently_off(variable):
    env = clean_env(ASCEND_PATCH="emulate", **{variable: "2"})
    proc = run_python(PLATFORM, env=env)
    assert proc.returncode != 0
    assert f"SettingError: {variable}='2' is not a flag; expected 1 (on) or 0 (off)" in proc.stderr.splitlines()[-1]
    code, data = _doctor(env)
    assert code == 1 and f"{variable}='2' is not a flag" in data["error"]


def test_an_empty_vllm_ascend_directory_is_not_an_installation(tmp_path):
    (tmp_path / "vllm_ascend").mkdir()  # e.g. a stray checkout directory in the working dir
    proc = run_python(PLATFORM, env=clean_env(ASCEND_PATCH="auto"), cwd=tmp_path)
    assert proc.returncode == 0 and ascend_patch_lines(proc.stderr) == []
    code, data = _doctor(clean_env(ASCEND_PATCH="auto"), cwd=tmp_path)
    assert data["versions"]["vllm_ascend"] is None


def test_the_bootstrap_knows_a_deliberate_error_by_its_class():
    """Any DeliberateError stops ``import vllm`` whatever its name; any other failure of the
    loader disables the overlay with one line."""
    proc = run_python("""
        import ascend_patch.overlay.bootstrap as bootstrap

        class Refusal(bootstrap.DeliberateError):
            pass

        def deliberate(module):
            raise Refusal("asked for and cannot be given")

        def fault(module):
            raise KeyError("a bug")

        try:
            bootstrap._run_loader(deliberate, None)
        except Refusal:
            print("raised")
        bootstrap._run_loader(fault, None)
        print("disabled" if bootstrap._loader_failed else "not disabled")
    """, env=clean_env(ASCEND_PATCH="emulate"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["raised", "disabled"]
    assert ascend_patch_lines(proc.stderr) == [
        "ascend-patch: disabled in this process, vLLM stays stock: the loader failed (KeyError: "
        "'a bug'). Run `ascend-patch doctor`, or reinstall ascend-patch"]


def _fake_torch_npu(tmp_path: Path, body: str) -> Path:
    package = tmp_path / "fake" / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(body)
    return package.parent


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("raise ImportError('libascendcl.so: cannot open shared object file')", "import torch_npu failed"),
        ("__version__ = '2.13.0'\nclass npu:\n    is_available = staticmethod(lambda: False)\n"
         "    device_count = staticmethod(lambda: 0)\n", "sees no NPU"),
    ],
    ids=["cann-mismatch", "no-device"],
)
def test_auto_mode_warns_when_torch_npu_is_present_but_unusable(tmp_path, body, expected):
    env = clean_env(ASCEND_PATCH="auto", PYTHONPATH=str(_fake_torch_npu(tmp_path, body)))
    _stock_with_one_line(env, "ASCEND_PATCH=auto and no NPU", expected, "ascend-patch doctor")


def _copy_of_the_package(tmp_path: Path) -> Path:
    """An importable copy of ascend_patch, laid out as the wheel installs it, first on
    PYTHONPATH: the .pth then runs the copy's bootstrap and loader."""
    root = tmp_path / "site"
    shutil.copytree(ROOT / "ascend_patch", root / "ascend_patch",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pth"))
    shutil.copytree(ROOT / "patches", root / "ascend_patch" / "patches",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "compat_matrix.yaml", root / "ascend_patch" / "compat_matrix.yaml")
    return root


@pytest.mark.parametrize("mode", ["emulate", "auto"])
def test_a_damaged_loader_leaves_vllm_stock(tmp_path, mode):
    site = _copy_of_the_package(tmp_path)
    (site / "ascend_patch" / "overlay" / "loader.py").write_text("def broken(:\n")
    env = clean_env(ASCEND_PATCH=mode, PYTHONPATH=str(site))
    assert run_python("import ascend_patch.overlay.bootstrap as b; print(b.__file__)", env=env).stdout.startswith(
        str(site)), "the damaged copy is the one in use"
    _stock_with_one_line(env, "disabled in this process, vLLM stays stock", "SyntaxError")
    code, data = _doctor(env)
    assert code == 1 and "the loader failed (SyntaxError" in data["error"]


def test_a_damaged_loader_is_an_error_where_the_user_asked_for_certainty(tmp_path):
    site = _copy_of_the_package(tmp_path)
    (site / "ascend_patch" / "overlay" / "loader.py").write_text("def broken(:\n")
    proc = run_python(PLATFORM, env=clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_STRICT="1",
                                              PYTHONPATH=str(site)))
    assert proc.returncode != 0 and "SyntaxError" in proc.stderr


def test_the_pth_survives_a_bootstrap_that_raises_baseexception(tmp_path):
    site = _copy_of_the_package(tmp_path)
    bootstrap = site / "ascend_patch" / "overlay" / "bootstrap.py"
    bootstrap.write_text(bootstrap.read_text() + "\ndef install():\n    raise SystemExit(3)\n")
    env = clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(site))
    proc = run_python("print('still here')", env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here"
    # One message (some Pythons process a site directory's .pth files twice, e.g. through a
    # lib64 -> lib symlink, which is why the bootstrap is idempotent).
    assert set(ascend_patch_lines(proc.stderr)) == {"ascend-patch: bootstrap failed: SystemExit(3)"}


def test_a_target_file_this_python_cannot_parse_leaves_vllm_stock(tmp_path, vllm_dir):
    """A release whose target module uses syntax newer than the running Python."""
    tree = SourceTree(vllm_dir)
    target = tree.module_path("vllm.model_executor.warmup.kernel_warmup")
    copy = mirror(vllm_dir, tmp_path / "vllm", target)
    copy.write_text(copy.read_text() + "\ntype Alias[T] = list[T] | None  # 3.12 syntax\n")
    env = clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(tmp_path))
    _stock_with_one_line(env, "does not match patch set", "kernel_warmup.py",
                         "cannot be read by this Python")


# -- the verification cache ---------------------------------------------------------------------


@pytest.fixture
def declared(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text("def f(a, b=1):\n    return a\n")
    tree = SourceTree(root)
    patches = [Contract("pkg.mod:f", "t", signature=("(a, b=...)",))]
    key, _ = verification._verification_key(patches, tree, None)
    return tree, patches, tmp_path / "verified", key


def _within(seconds: float, fn):
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"did not return within {seconds} s"
    return result[0]


def test_a_fifo_in_the_cache_does_not_hang_verification(declared):
    tree, patches, cache, key = declared
    cache.mkdir()
    os.mkfifo(cache / f"{key}.json")
    statuses = _within(10, lambda: verify(patches, tree, cache_dir=cache))
    assert [s.state for s in statuses] == ["verified"]


def test_a_link_to_an_endless_device_is_ignored(declared):
    tree, patches, cache, key = declared
    cache.mkdir()
    (cache / f"{key}.json").symlink_to("/dev/zero")
    statuses = _within(10, lambda: verify(patches, tree, cache_dir=cache))
    assert [s.state for s in statuses] == ["verified"]


def test_a_hand_edited_entry_is_ignored(declared):
    tree, patches, cache, key = declared
    mod = tree.package_dir / "mod.py"
    mod.write_text("def f(a, b=1, c=2):\n    return a\n")  # the signature no longer matches
    key, _ = verification._verification_key(patches, SourceTree(tree.package_dir), None)
    first = verify(patches, SourceTree(tree.package_dir), cache_dir=cache)
    assert [s.state for s in first] == ["mismatch"]
    entry = cache / f"{key}.json"
    data = json.loads(entry.read_text())
    data["statuses"] = [["verified", "(a, b=...)"]]  # forge a pass
    entry.write_text(json.dumps(data))
    again = verify(patches, SourceTree(tree.package_dir), cache_dir=cache)
    assert [s.state for s in again] == ["mismatch"], "a forged entry must not activate the overlay"


def test_an_entry_is_invalidated_by_a_change_to_a_re_exporting_file(tmp_path):
    """A name re-exported from another module is verified there; editing that module must
    invalidate the cached result even though the declared module is unchanged."""
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text("from .impl import f\n")
    (root / "impl.py").write_text("def f(a):\n    return a\n")
    patches = [Contract("pkg.mod:f", "t", signature=("(a)",))]
    cache = tmp_path / "verified"
    assert [s.state for s in verify(patches, SourceTree(root), cache_dir=cache)] == ["verified"]
    (root / "impl.py").write_text("def f(a, b):\n    return a\n")
    assert [s.state for s in verify(patches, SourceTree(root), cache_dir=cache)] == ["mismatch"]
