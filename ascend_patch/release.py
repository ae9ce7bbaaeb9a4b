"""What the loader learned about the running vLLM release, for the NPU wing.

The overlay decides and the NPU wing acts, and neither imports the other: the loader writes
here when it activates, the platform reads. Each process that imports vLLM runs the loader,
so each has its own, correct value.
"""

from __future__ import annotations

import logging

proven_end_to_end = False
"""Whether compat_matrix.yaml records an end-to-end run of this release (emulated-e2e or
npu-verified): the suite that proves graph mode, which is on by default only then."""

patched: frozenset[str] = frozenset()
"""The implementations (``module:object``) of the patches the active patch set installs on this
release (those whose own range admits it): a feature served through one of them is refused where
the set does not declare it for the release."""

mode: str | None = None
"""The device mode the loader decided (``"npu"`` or ``"emulate"``) while the overlay is active."""

runner: str | None = None
"""The runner generation (``"v1"``, ``"v2"``) the active patch set declares (its ``RUNNER``)."""

activation_line = ""
"""The INFO line announcing the overlay (version, vLLM, patch set, mode, runner) where it is
active in this process; empty elsewhere."""

_announced = False


def announce() -> None:
    """Log :data:`activation_line` through vLLM's logger, once per process: called once vLLM's
    logging is configured (by the loader, or by the platform's ``log_warnings`` hook)."""
    global _announced
    if activation_line and not _announced:
        _announced = True
        logging.getLogger("vllm.ascend_patch").info(activation_line)
