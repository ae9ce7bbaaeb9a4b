"""Verification: every declaration of a set checked against a release's source, touching
nothing; and the cache that lets a process skip the parsing.

Parsing the targets' files costs ~0.3 s, reading and hashing them ~2 ms, and this runs in
every process that imports vLLM. So a result is kept under ``ASCEND_PATCH_CACHE_DIR/verified``
and reused when the same declarations meet byte-identical target modules. Any edit to a
target's file, or to the verifier itself, is a new key; an entry that is not a small regular
file, or does not carry the key it was computed for, is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.version import Version

from ascend_patch.overlay import declarations, source
from ascend_patch.overlay.declarations import Declaration, State, TargetStatus
from ascend_patch.overlay.source import SourceTree

_CACHE_ENTRY_LIMIT = 1 << 20  # a real entry is a few KiB; anything bigger is not ours


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path``; OSError for what is not a regular file (a FIFO would block,
    /dev/zero never ends) or holds more than ``limit`` bytes (the message names the limit in
    MiB)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"larger than {limit / (1 << 20):g} MiB")
    return data


def verify(
    patches: Sequence[Declaration],
    tree: SourceTree,
    cache_dir: Path | None = None,
    release: Version | None = None,
) -> list[TargetStatus]:
    """Check every declaration in the source tree; with ``cache_dir``, through the cache."""
    if cache_dir is None:
        return _verify_sources(patches, tree, release)
    key, declared = _verification_key(patches, tree, release)
    entry = cache_dir / f"{key}.json"
    recorded = _read_cache_entry(entry, key, patches)
    if recorded is not None:
        return [TargetStatus(p, state, found) for p, (state, found) in zip(patches, recorded)]
    statuses = _verify_sources(patches, tree, release)
    rows = [[s.state, s.found] for s in statuses]
    # Files reached through re-exports are not part of the key; record their digests so a
    # change to them invalidates the entry too.
    others = {str(path): _digest(path) for path in sorted(tree.read_paths - declared)}
    _write_atomically(entry, json.dumps({"key": key, "targets": [p.target for p in patches],
                                         "statuses": rows, "others": others,
                                         "check": _entry_check(key, rows, others)}))
    return statuses


def _verify_sources(
    patches: Sequence[Declaration], tree: SourceTree, release: Version | None
) -> list[TargetStatus]:
    return [TargetStatus(p, *p.check(tree, release)) for p in patches]


def _digest(path: Path) -> str:
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return "-"


def _entry_check(key: str, rows: list, others: dict) -> str:
    return hashlib.blake2b(json.dumps([key, rows, others]).encode(), digest_size=16).hexdigest()


def _read_cache_entry(
    entry: Path, key: str, patches: Sequence[Declaration]
) -> list[tuple[State, str]] | None:
    """The recorded statuses, or None for no entry or one that cannot be trusted: not a
    small regular file, malformed, recorded for other declarations or another key (a copied
    or hand-edited entry), or computed from re-exporting files that have changed since."""
    try:
        data = json.loads(read_regular_file(entry, _CACHE_ENTRY_LIMIT))
    except (OSError, ValueError):
        return None
    try:
        rows, others = data["statuses"], data["others"]
        valid = (
            data["key"] == key
            and data["targets"] == [p.target for p in patches]
            and data["check"] == _entry_check(key, rows, others)
            and len(rows) == len(patches)
            and all(isinstance(found, str) for _, found in rows)
            and all(_digest(Path(path)) == digest for path, digest in others.items())
        )
        return [(State(state), found) for state, found in rows] if valid else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _verification_key(
    patches: Sequence[Declaration], tree: SourceTree, release: Version | None
) -> tuple[str, set[Path]]:
    """The cache key (verifier sources, release, declarations, the declared modules' bytes)
    and the files it covers."""
    key = hashlib.blake2b(digest_size=16)
    for verifier in (source.__file__, declarations.__file__, __file__):
        key.update(Path(verifier).read_bytes())
    key.update(str(release).encode())
    digests: dict[str, str] = {}
    covered: set[Path] = set()
    for patch in patches:
        module = patch.module
        if module not in digests:
            path = tree.module_path(module)
            digests[module] = _digest(path) if path else "-"
            if path:
                covered.add(path)
        key.update(repr((type(patch).__name__, patch.target, getattr(patch, "signature", None),
                         getattr(patch, "since", None), getattr(patch, "until", None),
                         digests[module])).encode())
    return key.hexdigest(), covered


def _write_atomically(path: Path, text: str) -> None:
    """Best effort: a read-only or full cache only costs the next process a re-parse."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)  # readers see a whole entry or none
    except OSError:
        Path(temporary).unlink(missing_ok=True)
