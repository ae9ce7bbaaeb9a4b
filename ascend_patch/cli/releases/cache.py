"""The cache of extracted releases, shared by concurrent probes (``ascend_patch.env.cache_dir()``
``/releases``).

``releases/vllm-X/`` holds ``release.json`` (with the sha256 of every file) and ``vllm/``; an
entry is reused only while every file matches, and is replaced once a fresh copy is ready. A
probe extracts into ``releases/.vllm-X-*/`` and holds a lock on its ``.live`` file while it
does; a staging directory nobody holds is left by a killed probe, and removed.
``releases/.lock`` serialises the short steps that look at or change entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from packaging.version import Version

from ascend_patch.cli.releases.archive import package_files, sha256_of
from ascend_patch.cli.releases.messages import ProbeError, note
from ascend_patch.overlay import version as versions

_LIVE = ".live"


@contextlib.contextmanager
def _hold(lock: Path) -> Iterator[None]:
    """An exclusive lock on ``lock`` (created if need be), released when the process ends
    however it ends."""
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _is_held(lock: Path) -> bool:
    descriptor = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


def _entry_problem(entry: Path, requested: Version) -> tuple[dict | None, str | None]:
    """An entry's release.json if its files are exactly those it records, else what is wrong."""
    try:
        info = json.loads((entry / "release.json").read_text())
        manifest, version = info.get("manifest"), info.get("version")
    except FileNotFoundError:
        return None, "it has no release.json"
    except (OSError, ValueError, AttributeError):
        return None, "its release.json is unreadable"
    if not isinstance(manifest, dict) or "__init__.py" not in manifest:
        return None, "its release.json records no files (an older ascend-patch wrote it)"
    if not isinstance(version, str) or versions.parse_or_none(version) != requested:
        return None, f"its release.json records vLLM {version!r}"
    package = str(entry / "vllm")
    found = package_files(package)
    for name in sorted(manifest.keys() - found):
        return None, f"vllm/{name} is missing"
    for name in sorted(found - manifest.keys()):
        return None, f"vllm/{name} is not part of the release"
    for name, recorded in sorted(manifest.items()):
        try:
            digest = sha256_of(os.path.join(package, name))
        except OSError as exc:
            return None, f"vllm/{name} is unreadable ({exc.strerror})"
        if digest != recorded:
            return None, f"vllm/{name} changed since it was extracted"
    return info, None


class ReleaseCache:
    """The entries below ``root`` (``.../releases``)."""

    def __init__(self, root: Path):
        self.root = root

    def _entries(self, requested: Version) -> list[Path]:
        """The entries of ``requested``, however the index spelled it (0.33, 0.33.0)."""
        return sorted(
            path for path in self.root.glob("vllm-*")
            if path.is_dir() and versions.parse_or_none(path.name[len("vllm-") :]) == requested
        )

    def _intact(self, requested: Version, report: bool) -> tuple[Path, dict] | None:
        for entry in self._entries(requested):
            info, problem = _entry_problem(entry, requested)
            if info is not None:
                return entry, info
            if report:
                note(f"the cached {entry} is damaged ({problem}); fetching the release again")
        return None

    def lookup(self, requested: Version) -> tuple[Path, dict] | None:
        """An intact entry of ``requested`` (entry, its release.json), after removing the
        staging directories of probes that are gone."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with _hold(self.root / ".lock"):
                for path in self.root.glob(".vllm-*"):
                    if not path.is_dir() or (path / _LIVE).exists() and _is_held(path / _LIVE):
                        continue
                    shutil.rmtree(path, ignore_errors=True)
                    note(f"removed {path}, left by an interrupted probe")
                return self._intact(requested, report=True)
        except OSError as exc:
            raise ProbeError(
                f"cannot use the cache in {self.root}: {exc.strerror}; set ASCEND_PATCH_CACHE_DIR "
                "to a writable directory"
            ) from None

    @contextlib.contextmanager
    def staging(self, version_text: str) -> Iterator[Path]:
        """A new staging directory, held as live while the context runs and removed if it
        fails; :meth:`install` moves it in."""
        with contextlib.ExitStack() as stack:
            try:
                with _hold(self.root / ".lock"):  # so a cleaner never sees it unlocked
                    staging = Path(tempfile.mkdtemp(prefix=f".vllm-{version_text}-", dir=self.root))
                    stack.enter_context(_hold(staging / _LIVE))
            except OSError as exc:
                raise ProbeError(
                    f"cannot create a staging directory in {self.root}: {exc.strerror}"
                ) from None
            try:
                yield staging
            except OSError as exc:
                shutil.rmtree(staging, ignore_errors=True)
                raise ProbeError(
                    f"cannot write the release into {self.root} ({exc.strerror}); "
                    "run the probe again"
                ) from None
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)  # while it is still locked as ours
                raise

    def install(self, staging: Path, requested: Version, info: dict) -> tuple[Path, dict]:
        """Move ``staging`` in as the entry of ``requested``, replacing damaged entries; a
        concurrent probe's intact entry wins instead."""
        (staging / "release.json").write_text(json.dumps(info, indent=1) + "\n")
        with _hold(self.root / ".lock"):
            winner = self._intact(requested, report=False)
            if winner is not None:
                shutil.rmtree(staging, ignore_errors=True)
                return winner
            trash = Path(tempfile.mkdtemp(prefix=".vllm-replaced-", dir=self.root))
            for damaged in self._entries(requested):
                damaged.rename(trash / damaged.name)
            final = self.root / f"vllm-{info['version']}"
            (staging / _LIVE).unlink()
            staging.rename(final)
            shutil.rmtree(trash, ignore_errors=True)
            return final, info
