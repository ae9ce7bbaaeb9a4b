"""The manifest: every change ascend-patch makes to vLLM (and torch), per vLLM release line.

Installed as ``ascend_patch.patches``. ``compat_matrix.yaml`` (beside this
package) maps vLLM releases to a set by name; set ``<name>`` is the module
``ascend_patch.patches.<name>`` and exports:

- ``PATCHES``: the patches and contracts on vLLM's own functions;
- ``MANIFEST``: those plus the torch device-API overrides, the environment settings
  the overlay forces and the version seams the NPU wing probes for — everything the
  loader verifies (all of it, against the installed source) before applying any.

Declarations shared by every set live in one module per area, mirroring ``ascend_patch/npu/``:
:mod:`.platform`, :mod:`.engine`, :mod:`.attention`, :mod:`.moe`, :mod:`.quant`, :mod:`.graphs`,
:mod:`.lora`, :mod:`.recurrent`, :mod:`.spec_decode` and :mod:`.device_api` (declarations only: our
side is named by path), built with the helpers of :mod:`._declare`. What one runner generation
needs is its runner module (:mod:`.runner_v1`); a set declares its generation (``RUNNER = "v1"``),
composes exactly that runner module, and adds only its own glue.
``docs/patches.md`` is generated from these modules (``scripts/render_patch_docs.py``).
"""
