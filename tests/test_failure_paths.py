"""Every way the environment can be wrong gives a short answer and never a traceback.

Each case runs a fresh interpreter through the installed ``.pth`` (as ``vllm serve`` would),
and ``ascend-patch doctor`` must report the problem instead of crashing. Where the overlay was
asked for (``ASCEND_PATCH=npu`` or ``emulate``) and cannot activate, ``import vllm`` fails in
three lines (cause, fix, details); in ``auto`` mode vLLM stays stock with one line at most; a
malformed ``ASCEND_PATCH*`` value is one line naming the variable, the value and the
accepted forms, in every mode.
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


def _refused(env: dict[str, str], *expected: str) -> list[str]:
    proc = run_python(PLATFORM, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = ascend_patch_lines(proc.stderr)
    assert [line.split(":")[1].split()[0] for line in lines] == ["cannot", "fix", "details"], lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines


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
def test_a_bad_matrix_is_refused(tmp_path, content, expected):
    if "v0_99" in str(content):
        # Rename the installed release's set everywhere the matrix names it, so only the
        # missing module is wrong.
        content = content.replace(f"patch_set: {INSTALLED_SET}", "patch_set: v0_99")
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_MATRIX=str(_matrix(tmp_path, content)))
    _refused(env, expected)
    code, data = _doctor(env)
    assert code == 1 and data["would_activate"] is False and expected in data["reason"]


# The one rule for malformed values, for every ASCEND_PATCH* variable with a format: one line
# naming the variable, the value and the accepted forms; in auto mode too (never a silent
# fallback to stock vLLM); doctor says the same. ASCEND_PATCH_MATRIX and ASCEND_PATCH_CACHE_DIR
# take any path: a matrix that cannot be read is refused (test_a_bad_matrix_is_refused), a cache
# that cannot be written costs a re-parse.
MALFORMED = [
    ("ASCEND_PATCH", "sometimes", "ASCEND_PATCH='sometimes' is not a mode; expected one of auto, npu, emulate, off"),
    ("ASCEND_PATCH_STRICT", "2", "ASCEND_PATCH_STRICT='2' is not a flag; expected 1 (on) or 0 (off)"),
    ("ASCEND_PATCH_DEBUG", "2", "ASCEND_PATCH_DEBUG='2' is not a flag; expected 1 (on) or 0 (off)"),
    ("ASCEND_PATCH_EMULATED_HBM", "4", "ASCEND_PATCH_EMULATED_HBM='4' is not a size; write it with a unit like "
                                       "8GiB or 512MiB (B, KiB, MiB, GiB, TiB)"),
    ("ASCEND_PATCH_EMULATED_HBM", "lots", "ASCEND_PATCH_EMULATED_HBM='lots' is not a size"),
    ("ASCEND_PATCH_EMULATED_HBM", "9" * 400, "is not a size"),
    ("ASCEND_PATCH_EMULATED_HBM", "0B", "ASCEND_PATCH_EMULATED_HBM='0B' is not a usable device size; give one "
                                        "between 1B and 1EiB"),
    ("ASCEND_PATCH_VLLM_VERSION", "nonsense", "ASCEND_PATCH_VLLM_VERSION='nonsense' is not a version; expected a "
                                              "PEP 440 version such as 0.33.0 or 0.33.1.dev12+gabc"),
]


def test_every_variable_with_a_format_has_a_malformed_case():
    from ascend_patch import env

    paths = {"ASCEND_PATCH_MATRIX", "ASCEND_PATCH_CACHE_DIR"}
    assert {name for name, _, _ in MALFORMED} | paths == {v.name for v in env.VARIABLES}


@pytest.mark.parametrize("mode", ["emulate", "auto"])
@pytest.mark.parametrize(("variable", "value", "expected"), MALFORMED,
                         ids=[f"{name}={value[:8]}" for name, value, _ in MALFORMED])
def test_a_malformed_setting_is_one_line_in_every_mode(mode, variable, value, expected):
    env = clean_env(**{"ASCEND_PATCH": mode, variable: value})
    proc = run_python(PLATFORM, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = ascend_patch_lines(proc.stderr)
    assert line.startswith(f"ascend-patch: {variable}=") and expected in line
    code, data = _doctor(env)
    assert code == 1 and expected in data["error"]


def test_an_unknown_setting_is_warned_about_once_with_the_nearest_name():
    env = clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HMB="4GiB", ASCEND_PATCH_WHEEL_CACHE="/tmp")
    proc = run_python(PLATFORM, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout) == "EmulatedNPUPlatform"
    assert ascend_patch_lines(proc.stderr) == [
        "ascend-patch: unknown setting ASCEND_PATCH_EMULATED_HMB ignored; did you mean ASCEND_PATCH_EMULATED_HBM?"]


def test_every_ascend_patch_name_the_repository_uses_is_known():
    """The package's settings and the names the repository's own scripts read: the warning
    about unknown names must never fire on them."""
    import re

    from ascend_patch import env

    used = set()
    for path in [*ROOT.glob("scripts/*.*"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("ascend_patch/**/*.py"),
                 ROOT / ".ci" / "run"]:
        used |= set(re.findall(r"\bASCEND_PATCH_[A-Z_]*[A-Z]\b", path.read_text()))
    used.discard("ASCEND_PATCH_EMULATED_HMB")  # the misspelling the test above sets
    assert used <= {v.name for v in env.VARIABLES} | set(env.SCRIPT_VARIABLES), used


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
        from ascend_patch import DeliberateError
        from ascend_patch.overlay import post_import

        class Refusal(DeliberateError):
            pass

        def deliberate(module):
            raise Refusal("asked for and cannot be given")

        def fault(module):
            raise KeyError("a bug")

        try:
            post_import.run_loader(deliberate, None)
        except Refusal:
            print("raised")
        post_import.run_loader(fault, None)
        print("disabled" if post_import.loader_failed else "not disabled")
    """, env=clean_env(ASCEND_PATCH="auto"))
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


def test_a_damaged_loader_leaves_vllm_stock_in_auto_mode(tmp_path):
    site = _copy_of_the_package(tmp_path)
    (site / "ascend_patch" / "overlay" / "loader.py").write_text("def broken(:\n")
    env = clean_env(ASCEND_PATCH="auto", PYTHONPATH=str(site))
    assert run_python("import ascend_patch.overlay as o; print(o.__file__)", env=env).stdout.startswith(
        str(site)), "the damaged copy is the one in use"
    _stock_with_one_line(env, "disabled in this process, vLLM stays stock", "SyntaxError")
    code, data = _doctor(env)
    assert code == 1 and "the loader failed (SyntaxError" in data["error"]


@pytest.mark.parametrize("settings", [{"ASCEND_PATCH": "emulate"}, {"ASCEND_PATCH": "auto", "ASCEND_PATCH_STRICT": "1"}],
                         ids=["emulate", "strict"])
def test_a_damaged_loader_is_an_error_where_the_user_asked_for_certainty(tmp_path, settings):
    site = _copy_of_the_package(tmp_path)
    (site / "ascend_patch" / "overlay" / "loader.py").write_text("def broken(:\n")
    lines = _refused(clean_env(**settings, PYTHONPATH=str(site)), "the loader failed (SyntaxError")
    assert lines[1] == "ascend-patch: fix: reinstall ascend-patch, or set ASCEND_PATCH=off for stock vLLM"


def test_the_pth_survives_a_bootstrap_that_raises_baseexception(tmp_path):
    site = _copy_of_the_package(tmp_path)
    bootstrap = site / "ascend_patch" / "__init__.py"
    bootstrap.write_text(bootstrap.read_text() + "\ndef install():\n    raise SystemExit(3)\n")
    env = clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(site))
    proc = run_python("print('still here')", env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here"
    # One message (some Pythons process a site directory's .pth files twice, e.g. through a
    # lib64 -> lib symlink, which is why the bootstrap is idempotent).
    assert set(ascend_patch_lines(proc.stderr)) == {"ascend-patch: bootstrap failed: SystemExit(3)"}


def test_a_target_file_this_python_cannot_parse_is_refused_and_doctor_names_it(tmp_path, vllm_dir):
    """A release whose target module uses syntax newer than the running Python."""
    tree = SourceTree(vllm_dir)
    target = tree.module_path("vllm.model_executor.warmup.kernel_warmup")
    copy = mirror(vllm_dir, tmp_path / "vllm", target)
    copy.write_text(copy.read_text() + "\ntype Alias[T] = list[T] | None  # 3.12 syntax\n")
    env = clean_env(ASCEND_PATCH="emulate", PYTHONPATH=str(tmp_path))
    _refused(env, "does not match patch set")
    code, data = _doctor(env)
    assert code == 1 and [p for p in data["problems"] if "kernel_warmup.py" in p and "cannot be read by this Python" in p]


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
