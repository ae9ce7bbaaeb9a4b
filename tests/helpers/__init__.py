"""Helpers the test modules share (fixtures stay in ``tests/conftest.py``).

- :mod:`.process`: fresh interpreters with a controlled ASCEND_PATCH* environment, the
  installed vLLM's source, PyPI reachability;
- :mod:`.engine`: running the engine driver on the emulated NPU and comparing its output with
  the HF oracle (:mod:`ascend_patch.kit.oracle`);
- :mod:`.pinned`: the pinned vLLM releases' runs of tests/test_matrix_evidence.py, in the
  background from the start of the session;
- :mod:`.attention`: the attention kernels' float32 oracle and the batches, paged caches and
  tolerances of the kernel tests.
"""
