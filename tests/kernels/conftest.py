import pytest

from ascend_patch.npu import kernels


@pytest.fixture(autouse=True)
def reference_seam():
    """Each test starts on the reference backend and leaves it there."""
    kernels.use("reference")
    yield
    kernels.use("reference")
