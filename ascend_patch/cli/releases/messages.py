"""How the release code speaks to the user: :class:`ProbeError` for a failure, :func:`note`
for a progress line on stderr, :func:`amount` for a size."""

from __future__ import annotations

import sys


class ProbeError(RuntimeError):
    """The probe could not get at the source (bad input, no network, bad download): exit 2."""


def note(message: str) -> None:
    sys.stderr.write(f"ascend-patch probe: {message}\n")
    sys.stderr.flush()


def amount(count: int) -> str:
    """``4 << 20`` → ``4 MiB``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} bytes"
