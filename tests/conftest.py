"""Shared fixtures. The helpers the test modules share live in :mod:`tests.helpers`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.engine import MODELS_DIR
from tests.helpers.process import vllm_package_dir


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


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """The tiny checkpoints, built locally (there is no model hub)."""
    from ascend_patch.kit import tiny_models

    return tiny_models.build(MODELS_DIR)
