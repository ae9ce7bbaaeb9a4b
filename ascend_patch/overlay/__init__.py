"""The overlay wing: how ascend-patch finds, verifies and patches a vLLM release.

Bootstrap glue (:mod:`.bootstrap`, run by the ``.pth`` in every interpreter), version
discovery (:mod:`.version`), the compat matrix (:mod:`.matrix`), static source
verification (:mod:`.source`), the patch engine and its registry of originals
(:mod:`.patching`), the one decision path (:mod:`.decision`) and the loader that acts on
it at ``import vllm`` (:mod:`.loader`). It knows vLLM releases and patching, and nothing
about NPUs: what gets patched in, and why, is declared in ``ascend_patch.patches``.

Kept free of imports: the ``.pth`` imports :mod:`.bootstrap` in every Python process.
"""
