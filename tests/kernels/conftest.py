import pytest

from ascend_patch.npu import kernels
from ascend_patch.npu.kernels import reference


@pytest.fixture(autouse=True)
def fresh_seam():
    """Each test starts on the reference backend with no remembered rotary cache."""
    kernels.use("reference")
    reference.reset_rotary_embedding_state()
    yield
    kernels.use("reference")
    reference.reset_rotary_embedding_state()
