"""Shared fixtures: fresh interpreters with a controlled ASCEND_PATCH* environment.

Most loader tests run in a subprocess, because what they test is what happens
when a *fresh* interpreter imports vLLM through the installed ``.pth`` file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def vllm_package_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM must be installed"
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any ASCEND_PATCH* setting, plus overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(overrides)
    return env


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


@pytest.fixture(scope="session")
def vllm_dir() -> Path:
    return vllm_package_dir()
