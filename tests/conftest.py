"""Shared fixtures: fresh interpreters with a controlled ASCEND_PATCH* environment.

Most loader tests run in a subprocess, because what they test is what happens
when a *fresh* interpreter imports vLLM through the installed ``.pth`` file.
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

from ascend_patch.kit import oracle
from ascend_patch.kit.oracle import hf_greedy, hf_logits, hf_model, prompt_token_ids  # noqa: F401

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


def require_pypi(what: str) -> None:
    """Skip when PyPI cannot be reached, except in CI (``CI=true``), where the network is
    part of the contract and a silent skip would hide that a claim went unchecked."""
    problem = _pypi_problem()
    if problem is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{problem}: {what} needs it, and CI must not skip it")
    pytest.skip(f"{problem}: {what} needs it")


@pytest.fixture
def reference_kernels():
    """The kernel seam bound to the reference kernels, as the emulated NPU platform binds it, for
    tests that run NPU-path pieces in this process (the seam fails closed until a backend is
    chosen)."""
    from ascend_patch.npu import kernels

    kernels.use("reference")


@pytest.fixture(scope="session")
def vllm_dir() -> Path:
    return vllm_package_dir()


# --- engine tests: tiny local models, the HF oracle, and the engine driver --------------------

def for_installed_vllm(declarations) -> list:
    """The declarations of a patch set that apply to the installed vLLM (their own sub-range
    admits it), as the loader selects them."""
    from importlib.metadata import version

    from packaging.version import Version

    from ascend_patch.overlay.declarations import applies_to

    release = Version(Version(version("vllm")).base_version)
    return [d for d in declarations if applies_to(d, release)]


MODELS_DIR = ROOT / ".cache" / "models"


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """The tiny checkpoints, built locally (there is no model hub)."""
    from ascend_patch.kit import tiny_models

    return tiny_models.build(MODELS_DIR)


def assert_greedy_equals_hf(engine: dict, model_dir: Path, prompts: list[list[int]], max_tokens: int) -> None:
    """An fp32 engine's two greedy runs of ``prompts`` (the second served from the prefix cache)
    equal HF transformers token for token."""
    assert "error" not in engine, engine.get("error")
    oracle = hf_greedy(model_dir, prompts, max_tokens)
    first, cached = engine["runs"]
    assert first["tokens"] == oracle
    assert cached["tokens"] == oracle, "served from the prefix cache"
    assert sum(cached["cached"]) > 0


def assert_tracks_hf_logits(model_dir: Path, prompts: list[list[int]], generated: list[list[int]],
                            min_exact: float = 0.9, routed: bool = False,
                            bf16_oracle: bool = False) -> None:
    """Reduced-precision greedy output tracks the fp32 HF oracle within bf16 rounding
    (:func:`ascend_patch.kit.oracle.hf_logit_tracking`, which says why ``routed`` and
    ``bf16_oracle`` admit HF bf16 as a second oracle). The expert path's own bf16 numerics,
    routing held fixed, are checked tightly in tests/kernels/test_moe_ops.py."""
    tracking = oracle.hf_logit_tracking(model_dir, prompts, generated, min_exact, routed, bf16_oracle)
    assert tracking.ok, tracking.message


def assert_tracks_logits(oracles: list[list], prompts: list[list[int]], generated: list[list[int]],
                         min_exact: float = 0.9, routed: bool = False) -> None:
    """The check of :func:`assert_tracks_hf_logits` against given oracles: per oracle, the
    next-token logits at every position of each prompt + generated sequence."""
    tracking = oracle.logit_tracking(oracles, prompts, generated, min_exact, routed)
    assert tracking.ok, tracking.message


def run_engine(spec: dict, tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 600,
               python: str = sys.executable) -> dict:
    """Run tests/engine_driver.py on ``spec`` in a fresh interpreter (emulated NPU) of ``python``'s
    environment."""
    spec_file = tmp_path / f"engine-spec-{len(list(tmp_path.glob('engine-spec-*')))}.json"
    spec_file.write_text(json.dumps(spec))
    environment = env or clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="512MiB")
    proc = subprocess.run(
        [python, str(ROOT / "tests" / "engine_driver.py"), str(spec_file)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"engine driver failed:\n{proc.stderr[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"engine driver printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])
