"""The engine on the emulated NPU in a fresh interpreter, and its output against the HF oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ascend_patch.kit import oracle
from ascend_patch.kit.oracle import hf_greedy
from tests.helpers import prefetch
from tests.helpers.process import ROOT, clean_env


def installed_vllm_is_mrv2_only() -> bool:
    """Whether the installed vLLM has only Model Runner V2 (0.34+: the V1 runner is gone)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(Version(version("vllm")).base_version) >= Version("0.34")


MODELS_DIR = ROOT / ".cache" / "models"
V0_20_FEATURES = "v0_20_features"
"""The marker of the feature tests a v0_20-set release runs in CI (scripts/record_matrix_run.py)."""


def only_marked_tests(request, marker: str = V0_20_FEATURES) -> bool:
    """Whether every test this session runs from the requesting module carries ``marker`` (a
    pinned release's ``-m v0_20_features`` run): the module's shared engines then start only the
    ones those tests read. A marked test that reads another engine fails on its missing key."""
    return only_marked(module_items(request), marker)


def module_items(request) -> list:
    """The tests this session runs from the requesting module."""
    return [item for item in request.session.items if item.module is request.module]


def only_marked(items: list, marker: str = V0_20_FEATURES) -> bool:
    """Whether every one of a module's selected ``items`` carries ``marker``."""
    return bool(items) and all(item.get_closest_marker(marker) for item in items)


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
    """Reduced-precision greedy output tracks the fp32 HF oracle within the measured bf16 drift
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
    environment, or take its run started ahead of the module in the default one
    (:mod:`tests.helpers.prefetch`)."""
    environment = env or default_env()
    ahead = prefetch.take(spec, python) if environment == default_env() else None
    proc = ahead or drive(spec, tmp_path, environment, timeout, python)
    assert proc.returncode == 0, f"engine driver failed:\n{proc.stderr[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"engine driver printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def default_env() -> dict[str, str]:
    return clean_env(ASCEND_PATCH="emulate", ASCEND_PATCH_EMULATED_HBM="512MiB")


def drive(spec: dict, tmp_path: Path, env: dict[str, str], timeout: float, python: str,
          started=None) -> subprocess.CompletedProcess:
    """The driver's run; ``started`` (a background run's) is handed the process, which leads a
    session of its own so that it can be stopped with its workers."""
    spec_file = tmp_path / f"engine-spec-{len(list(tmp_path.glob('engine-spec-*')))}.json"
    spec_file.write_text(json.dumps(spec))
    argv = [python, str(ROOT / "tests" / "engine_driver.py"), str(spec_file)]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path, start_new_session=started is not None) as proc:
        if started is not None:
            started(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
