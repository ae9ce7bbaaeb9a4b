"""What the overlay costs every Python process, side by side in one run.

1. Interpreter start-up, ``python -c pass``: the installed ``.pth`` doing its work
   (``ASCEND_PATCH`` unset: the bootstrap installs its import watcher) against
   ``ASCEND_PATCH=off`` (the ``.pth`` line stops after one environment lookup).
   Also the exact cost of running the ``.pth`` line once in a fresh interpreter,
   and the modules it adds to a bare interpreter (goal: none but its own two).
2. ``from vllm import LLM`` with ``ASCEND_PATCH=emulate`` (mode decision, matrix,
   static verification of every target, platform switch) against ``ASCEND_PATCH=off``.

Runs alternate between the two configurations so drift on a busy machine hits both.
This is a measurement script, not a test: it prints figures and asserts nothing.

    .venv/bin/python scripts/bench_startup.py [--runs 30] [--vllm-runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
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


def _alternate(argv: list[str], a: dict, b: dict, runs: int) -> tuple[list[float], list[float]]:
    times_a, times_b = [], []
    for _ in range(runs):
        times_a.append(_wall(argv, a))
        times_b.append(_wall(argv, b))
    return times_a, times_b


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="python -c pass runs per configuration")
    parser.add_argument("--vllm-runs", type=int, default=3, help="vLLM import runs per configuration")
    args = parser.parse_args()
    if not PTH.is_file():
        print(f"{PTH} is not installed; run scripts/setup_env.sh first", file=sys.stderr)
        return 1
    py = sys.executable
    on, off = _env(), _env(ASCEND_PATCH="off")

    with_pth, without = _alternate([py, "-c", "pass"], on, off, args.runs)
    line_runs = []
    for _ in range(args.runs):
        out = subprocess.run(
            [py, "-c", LINE_COST, str(PTH)], env=off, check=True, capture_output=True, text=True
        ).stdout.split()
        line_runs.append((float(out[0]), out[1:]))
    added = sorted({m for _, mods in line_runs for m in mods})

    emulate, stock = _alternate(
        [py, "-c", "from vllm import LLM"], _env(ASCEND_PATCH="emulate"), off, args.vllm_runs
    )

    med = statistics.median
    rows = [
        ("python -c pass (median of %d)" % args.runs, med(with_pth), med(without)),
        ("from vllm import LLM (median of %d)" % args.vllm_runs, med(emulate), med(stock)),
    ]
    print(f"{'measurement':40} {'overlay':>10} {'baseline':>10} {'ratio':>7} {'delta':>10}")
    for name, a, b in rows:
        print(f"{name:40} {a * 1e3:8.1f}ms {b * 1e3:8.1f}ms {a / b:7.3f} {(a - b) * 1e3:+8.2f}ms")
    print(
        f"{'  overlay = .pth active / ASCEND_PATCH=emulate; baseline = ASCEND_PATCH=off':40}"
    )
    line = med(t for t, _ in line_runs)
    print(f"\n.pth line executed once in a fresh interpreter: median {line * 1e3:.3f} ms")
    print(f"modules it adds to a bare interpreter: {', '.join(added) or 'none'}")
    print(
        json.dumps(
            {
                "pass_ms": {"pth": med(with_pth) * 1e3, "off": med(without) * 1e3},
                "pth_line_ms": line * 1e3,
                "pth_added_modules": added,
                "vllm_import_s": {"emulate": med(emulate), "off": med(stock)},
                "vllm_import_ratio": med(emulate) / med(stock),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
