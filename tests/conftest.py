"""Shared fixtures. The helpers the test modules share live in :mod:`tests.helpers`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.ci import pytest_runtest_makereport  # noqa: F401 (the CI run's skip policy)
from tests.helpers.engine import MODELS_DIR, installed_vllm_is_mrv2_only
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


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: getattr(item, "originalname", None) == PINNED_TEST)
    # Deselected, not skipped: a release without that runner generation has nothing for them to
    # check.
    other_generation = "v1_runner" if installed_vllm_is_mrv2_only() else "mrv2_only"
    elsewhere = [item for item in items if item.get_closest_marker(other_generation)]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if not item.get_closest_marker(other_generation)]


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    import tempfile

    from tests.helpers import pinned as runs

    pinned = [item for item in session.items if getattr(item, "originalname", None) == PINNED_TEST]
    if pinned:
        from tests.test_matrix_evidence import CI_DYNAMIC

        runs.build_checkpoints()
        logs = Path(tempfile.mkdtemp(prefix="pinned-"))
        selected = [item.callspec.params["version"] for item in pinned]
        session.config.stash[PINNED_RUNS] = runs.PinnedRuns([v for v in CI_DYNAMIC if v in selected], logs)
    # The modules whose engine drivers start ahead of them (tests/helpers/prefetch.py): worth it
    # once there is a module before them to overlap.
    modules = {item.module: None for item in session.items if hasattr(item.module, "engine_specs")}
    if len(modules) > 1:
        _start_prefetch(session, list(modules))


def _start_prefetch(session, modules) -> None:
    import sys
    import tempfile

    from ascend_patch.kit import tiny_models
    from tests.helpers import prefetch
    from tests.helpers.engine import default_env, drive

    models = tiny_models.build(MODELS_DIR)
    env = default_env()
    specs = [(spec, env, sys.executable) for module in modules
             for spec in module.engine_specs(models, [item for item in session.items if item.module is module])]
    prefetch.start(specs, Path(tempfile.mkdtemp(prefix="prefetch-")), drive)


def pytest_sessionfinish(session):
    from tests.helpers import prefetch

    prefetch.close()
    runs = session.config.stash.get(PINNED_RUNS, None)
    if runs is not None:
        runs.close()


@pytest.fixture(scope="session")
def pinned_runs(request):
    return request.config.stash[PINNED_RUNS]
