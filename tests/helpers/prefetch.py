"""Engine drivers started ahead of their modules, in the background, one at a time.

The suite runs its tests one after another, and an engine module's fixture waits a minute or two
for its driver (tests/engine_driver.py): a long, mostly single-threaded stretch that leaves the
second core to the pinned releases' runs, which end long before the suite does. A module that
names its drivers' specs before its tests run (``engine_specs(tiny_models, items)``, items: the
module's tests this session runs) has them started here, in session order, while the suite runs
the tests before it, in the default emulated environment as it was when the tests were collected.
:func:`tests.helpers.engine.run_engine`, asked for that environment, takes the finished (or
running) driver of exactly its spec and interpreter, and runs anything else itself: a test reads
the same driver output either way, only sooner.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_TIMEOUT = 2400  # the longest a module gives its driver


def key(spec: dict, python: str) -> str:
    return json.dumps([spec, python], sort_keys=True)


class _Driver:
    def __init__(self, spec: dict, env: dict[str, str], python: str):
        self.spec, self.env, self.python = spec, env, python
        self.state = "pending"  # -> "running" -> "done", or "claimed" by the test that needs it
        self.done = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.result: subprocess.CompletedProcess | BaseException | None = None


class Prefetch:
    def __init__(self, specs: list[tuple[dict, dict[str, str], str]], root: Path, drive):
        self._drivers = {key(spec, python): _Driver(spec, env, python) for spec, env, python in specs}
        self._all = list(self._drivers.values())
        self._root = root
        self._drive = drive
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._chain, daemon=True)
        self._thread.start()

    def _chain(self) -> None:
        for driver in self._all:
            with self._lock:
                if self._closed:
                    return
                if driver.state != "pending":
                    continue
                driver.state = "running"
            try:
                driver.result = self._drive(driver.spec, Path(tempfile.mkdtemp(dir=self._root)), driver.env,
                                            _TIMEOUT, driver.python, started=lambda proc: setattr(driver, "proc", proc))
            except BaseException as error:  # handed to the test that waits for it
                driver.result = error
            driver.state = "done"
            driver.done.set()

    def take(self, spec: dict, python: str) -> subprocess.CompletedProcess | None:
        """The driver run of exactly this spec and interpreter, waited for; None when there is
        none, or it has not started (the caller runs it: nothing waits twice)."""
        with self._lock:
            driver = self._drivers.pop(key(spec, python), None)
            if driver is None or driver.state == "pending":
                if driver is not None:
                    driver.state = "claimed"
                return None
        driver.done.wait()
        if isinstance(driver.result, BaseException):
            raise driver.result
        return driver.result

    def close(self) -> None:
        """Stop the driver still running (the session ended first), with its workers."""
        with self._lock:
            self._closed = True
            running = [d.proc for d in self._all if d.state == "running" and d.proc]
            unused = [d for d in self._drivers.values() if d.state != "pending"]
        if unused:  # a module built another spec than it named, or another environment: wasted runs
            print(f"prefetch: {len(unused)} driver run(s) started ahead were not taken", file=sys.stderr)
        for proc in running:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


_current: Prefetch | None = None


def start(specs: list[tuple[dict, dict[str, str], str]], root: Path, drive) -> None:
    global _current
    _current = Prefetch(specs, root, drive)


def take(spec: dict, python: str) -> subprocess.CompletedProcess | None:
    return _current.take(spec, python) if _current is not None else None


def close() -> None:
    if _current is not None:
        _current.close()
