"""The pinned releases' runs of tests/test_matrix_evidence.py, in the background from the start of
the session.

Each run is ``scripts/record_matrix_run.py --check VERSION``: it builds the release's environment
and runs the emulated e2e suite (and a v0_20 release's feature tests) in it, keeping about one
core busy for many minutes. Started when the session's tests are collected, one release after
another, they use the core the rest of the suite leaves idle; the tests that check them run last
(tests/conftest.py) and, once one is waiting, the releases not yet started start at once, side
by side, since nothing else runs any more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.helpers.process import ROOT


def build_checkpoints() -> None:
    """Every tiny checkpoint family the runs' suites read, built here first: the runs then only
    read them, and so do the session's own tests (each family skips what its stamp says is built)."""
    from ascend_patch.kit import tiny_adapters, tiny_drafts, tiny_encoders, tiny_models, tiny_vl
    from tests.helpers.engine import MODELS_DIR

    for family in (tiny_models, tiny_adapters, tiny_drafts, tiny_encoders, tiny_vl):
        family.build(MODELS_DIR)


class PinnedRuns:
    def __init__(self, versions: list[str], logs: Path):
        self.logs = logs
        self._procs: dict[str, subprocess.Popen] = {}
        self._started = {version: threading.Event() for version in versions}
        self._waiting = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._chain, args=(versions,), daemon=True)
        self._thread.start()

    def _start(self, version: str) -> subprocess.Popen | None:
        with self._lock:
            if self._closed:
                return None
            with open(self.logs / f"{version}.log", "w") as log:
                proc = subprocess.Popen(
                    [sys.executable, str(ROOT / "scripts" / "record_matrix_run.py"), "--check", version],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True,  # its pytest and engines are stopped with it
                )
            self._procs[version] = proc
        self._started[version].set()
        return proc

    def _chain(self, versions: list[str]) -> None:
        for version in versions:
            proc = self._start(version)
            # The next release starts when this one ends, or at once when a test waits.
            while proc is not None and proc.poll() is None and not self._waiting.wait(5):
                pass

    def wait(self, version: str, timeout: float) -> tuple[int, str]:
        """The run's exit status and the tail of its log."""
        self._waiting.set()
        self._started[version].wait(timeout=60)
        code = self._procs[version].wait(timeout=timeout)
        return code, (self.logs / f"{version}.log").read_text()[-6000:]

    def close(self) -> None:
        """Stop the runs still going (the session ended before their tests), each with the
        processes it started."""
        with self._lock:
            self._closed = True
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
