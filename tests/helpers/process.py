"""Fresh interpreters with a controlled ASCEND_PATCH* environment, and the files they run on.

Most loader tests run in a subprocess, because what they test is what happens when a *fresh*
interpreter imports vLLM through the installed ``.pth`` file.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def vllm_package_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM must be installed"
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any ASCEND_PATCH* setting, plus overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(overrides)
    return env


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_python(
    code: str,
    *,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    timeout: float = 300,
    python: str = sys.executable,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    argv = [python, *(args or []), "-c", textwrap.dedent(code)]
    return subprocess.run(
        argv,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
    )


def run_json(code: str, **kwargs) -> dict:
    """Run ``code``, which must print one JSON document last; fail with its stderr."""
    proc = run_python(code, **kwargs)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ascend_patch_lines(stderr: str) -> list[str]:
    """The lines of stderr that come from ascend-patch."""
    return [line for line in stderr.splitlines() if "ascend-patch" in line or "ascend_patch" in line]


@functools.cache
def _pypi_problem() -> str | None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=10).close()
    except OSError as exc:
        return f"PyPI is unreachable ({getattr(exc, 'reason', exc)})"
    return None


def under_ci() -> bool:
    """Whether this is a CI run (``CI=true``, as .ci/run and most CI services set it)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_pypi(what: str) -> None:
    """Skip when PyPI cannot be reached, except in CI (``CI=true``), where the network is
    part of the contract and a silent skip would hide that a claim went unchecked."""
    problem = _pypi_problem()
    if problem is None:
        return
    if under_ci():
        pytest.fail(f"{problem}: {what} needs it, and CI must not skip it")
    pytest.skip(f"{problem}: {what} needs it")


def mirror(src: Path, dst: Path, keep_real: Path) -> Path:
    """Mirror the package ``src`` at ``dst`` with symlinks, except along the path to
    ``keep_real``, which is copied so that it can be edited. Returns the copy."""
    dst.mkdir(parents=True)
    rel = keep_real.relative_to(src)
    for entry in src.iterdir():
        if entry.name == rel.parts[0]:
            if len(rel.parts) == 1:
                (dst / entry.name).write_bytes(entry.read_bytes())
            else:
                mirror(entry, dst / entry.name, keep_real)
        else:
            (dst / entry.name).symlink_to(entry)
    return dst / rel
