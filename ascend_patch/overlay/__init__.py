"""The overlay wing: how ascend-patch finds, verifies and patches a vLLM release.

Version discovery (:mod:`.version`), the compat matrix (:mod:`.matrix`), static source
verification (:mod:`.source`), what a patch set declares (:mod:`.declarations`), its
verification with a cache of results (:mod:`.verification`), the registry of originals that
applies and reverts (:mod:`.registry`), the one decision path (:mod:`.decision`) and the
loader that acts on it at ``import vllm`` (:mod:`.loader`), run under the guard of
:mod:`.post_import`. It knows vLLM releases and patching, and nothing about NPUs: what gets
patched in, and why, is declared in ``ascend_patch.patches``, and the one thing it asks of the
NPU wing (which device mode?) it asks by path. It imports neither ``ascend_patch.npu`` nor torch (``scripts/import_graph.py``).
The interpreter-start hook that triggers the loader is :mod:`ascend_patch` itself, the one
module the ``.pth`` imports.

Docs: docs/design.md, "What happens at `import vllm`"; docs/compatibility.md, "Version selection".
"""
