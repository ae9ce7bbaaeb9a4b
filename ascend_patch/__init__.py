"""ascend-patch: run stock vLLM on Huawei Ascend NPUs through a monkey-patch overlay.

This package is imported by the ``.pth`` bootstrap in every Python process of the
environment, so it must stay empty of imports: everything heavy lives in submodules
that are loaded only once ``vllm`` itself is imported.
"""

__version__ = "0.1.0"
