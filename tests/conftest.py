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


# The pinned releases' runs (tests/test_matrix_evidence.py) start in the background as soon as
# their tests are selected, and those tests run last: the runs overlap the rest of the suite.
PINNED_TEST = "test_pinned_release_runs_end_to_end"
PINNED_RUNS = pytest.StashKey()


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: getattr(item, "originalname", None) == PINNED_TEST)


def pytest_collection_finish(session):
    pinned = [item for item in session.items if getattr(item, "originalname", None) == PINNED_TEST]
    if not pinned or session.config.option.collectonly:
        return
    import tempfile

    from tests.helpers import pinned as runs
    from tests.test_matrix_evidence import CI_DYNAMIC

    runs.build_checkpoints()
    logs = Path(tempfile.mkdtemp(prefix="pinned-"))
    selected = [item.callspec.params["version"] for item in pinned]
    session.config.stash[PINNED_RUNS] = runs.PinnedRuns([v for v in CI_DYNAMIC if v in selected], logs)


def pytest_sessionfinish(session):
    runs = session.config.stash.get(PINNED_RUNS, None)
    if runs is not None:
        runs.close()


@pytest.fixture(scope="session")
def pinned_runs(request):
    return request.config.stash[PINNED_RUNS]
