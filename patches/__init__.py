"""Versioned patch sets: only the glue that differs between vLLM release lines.

Installed as ``ascend_patch.patches``. ``compat_matrix.yaml`` (beside this
package) maps vLLM releases to a set by name; set ``<name>`` is the module
``ascend_patch.patches.<name>`` and exports ``PATCHES``, the complete list of
:class:`ascend_patch.patching.Patch` declarations the loader verifies (all of
them, against the installed source) before applying any. Declarations shared
by every set live in :mod:`.common`; a set adds only its own glue, using
feature probes for the few seams that move inside its range.
"""
