"""What the overlay costs every Python process, side by side in one run.

1. Interpreter start-up, ``python -c pass``: the installed ``.pth`` doing its work
   (``ASCEND_PATCH`` unset: the bootstrap installs its import watcher) against
   ``ASCEND_PATCH=off`` (the ``.pth`` line stops after one environment lookup).
   Best of the runs as well as the median: on a shared machine the best run is the one the
   other load disturbed least. Also the exact cost of running the ``.pth`` line once in a
   fresh interpreter, and the modules it adds to a bare interpreter (goal: its own one).
   Run it with the interpreter of a regular install (a wheel installed into a venv, as
   ``tests/test_packaging.py`` makes) for the figure users pay: an editable install adds
   setuptools' import finder in front of the package.
2. ``from vllm import LLM`` with ``ASCEND_PATCH=emulate`` (mode decision, matrix,
   verification of every target, platform switch) against ``ASCEND_PATCH=off``, both
   with the verification result cached (every process after the first on an install)
   and with an empty cache (the first process: every target file parsed).

Runs alternate between the two configurations so drift on a busy machine hits both.
This is a measurement script, not a test: it prints figures and asserts nothing.

    .venv/bin/python scripts/bench_startup.py [--runs 30] [--vllm-runs 3]   (0: skip part 2)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PTH = Path(sysconfig.get_paths()["purelib"]) / "a1_ascend_patch.pth"


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
    env.update(overrides)
    return env


def _wall(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _interleave(argv: list[str], envs: dict[str, Callable[[], dict]], runs: int) -> dict:
    """Wall times per configuration; ``envs`` builds each run's environment."""
    times: dict[str, list[float]] = {name: [] for name in envs}
    for _ in range(runs):
        for name, make_env in envs.items():
            times[name].append(_wall(argv, make_env()))
    return times


def _vllm_imports(py: str, off: dict[str, str], runs: int) -> tuple[list, list, list]:
    """``from vllm import LLM`` wall times: emulate with the verification cache warm, emulate
    with an empty cache, and off."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        warm = _env(ASCEND_PATCH="emulate")
        _wall([py, "-c", "from vllm import LLM"], warm)  # fills the default cache if empty
        imports = _interleave(
            [py, "-c", "from vllm import LLM"],
            {
                "emulate": lambda: warm,
                "cold": lambda: _env(
                    ASCEND_PATCH="emulate", ASCEND_PATCH_CACHE_DIR=tempfile.mkdtemp(dir=scratch)
                ),
                "off": lambda: off,
            },
            runs,
        )
    return imports["emulate"], imports["cold"], imports["off"]


LINE_COST = """
import os, sys, time
line = open(sys.argv[1]).read()
os.environ.pop("ASCEND_PATCH", None)
before = set(sys.modules)
start = time.perf_counter()
exec(line)
elapsed = time.perf_counter() - start
print(elapsed, *sorted(set(sys.modules) - before))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=30, help="python -c pass runs per configuration")
    parser.add_argument("--vllm-runs", type=int, default=3, help="vLLM import runs per configuration (0: none)")
    args = parser.parse_args()
    if not PTH.is_file():
        print(f"{PTH} is not installed; run scripts/setup_env.sh first", file=sys.stderr)
        return 1
    py = sys.executable
    on, off = _env(), _env(ASCEND_PATCH="off")

    passes = _interleave([py, "-c", "pass"], {"pth": lambda: on, "off": lambda: off}, args.runs)
    with_pth, without = passes["pth"], passes["off"]
    line_runs = []
    # From a directory of its own: `-c` puts the working directory first on sys.path, where a
    # checkout's ascend_patch/ would stand in for the installed one.
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as elsewhere:
        for _ in range(args.runs):
            out = subprocess.run(
                [py, "-c", LINE_COST, str(PTH)], env=off, check=True, capture_output=True,
                text=True, cwd=elsewhere,
            ).stdout.split()
            line_runs.append((float(out[0]), out[1:]))
    added = sorted({m for _, mods in line_runs for m in mods})

    med = statistics.median
    rows = [
        ("python -c pass (median of %d)" % args.runs, med(with_pth), med(without)),
        ("python -c pass (best of %d)" % args.runs, min(with_pth), min(without)),
    ]
    figures = {
        "pass_ms": {"pth": med(with_pth) * 1e3, "off": med(without) * 1e3},
        "pass_best_ms": {"pth": min(with_pth) * 1e3, "off": min(without) * 1e3},
    }
    if args.vllm_runs:
        emulate, cold, stock = _vllm_imports(py, off, args.vllm_runs)
        rows += [
            ("from vllm import LLM (median of %d)" % args.vllm_runs, med(emulate), med(stock)),
            ("  same, empty verification cache", med(cold), med(stock)),
        ]
        figures["vllm_import_s"] = {"emulate": med(emulate), "cold": med(cold), "off": med(stock)}
        figures["vllm_import_ratio"] = med(emulate) / med(stock)
    print(f"{'measurement':40} {'overlay':>10} {'baseline':>10} {'ratio':>7} {'delta':>10}")
    for name, a, b in rows:
        print(f"{name:40} {a * 1e3:8.1f}ms {b * 1e3:8.1f}ms {a / b:7.3f} {(a - b) * 1e3:+8.2f}ms")
    print(
        f"{'  overlay = .pth active / ASCEND_PATCH=emulate; baseline = ASCEND_PATCH=off':40}"
    )
    line = med(t for t, _ in line_runs)
    print(f"\n.pth line executed once in a fresh interpreter: median {line * 1e3:.3f} ms")
    print(f"modules it adds to a bare interpreter: {', '.join(added) or 'none'}")
    print(json.dumps({**figures, "pth_line_ms": line * 1e3, "pth_added_modules": added}))
    return 0

if __name__ == "__main__":
    sys.exit(main())
