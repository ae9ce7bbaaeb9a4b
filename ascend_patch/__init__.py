"""ascend-patch: run stock vLLM on Huawei Ascend NPUs through a monkey-patch overlay.

This module is the interpreter-start hook: ``a1_ascend_patch.pth`` imports it, and only it,
in every Python process of the environment, so it must cost nothing: standard library only,
no module that plain Python does not already import at start-up (``os``, ``sys`` and
``_thread`` are), and no submodule of this package. All it does is put one finder at the
front of ``sys.meta_path`` that notices when ``vllm`` (or, if first, ``vllm.platforms``) has
been imported and hands over to :mod:`ascend_patch.overlay.loader`. The patch registry reuses
the same finder to patch vLLM submodules right after they execute. Everything else lives in
submodules, loaded only once a watched module is found: what runs after it executes (its
callbacks, and the guard around the loader) is :mod:`ascend_patch.overlay.post_import`.

It also holds how the ``ASCEND_PATCH`` mode and the ``ASCEND_PATCH_*`` flags read
(:func:`read_mode`, :func:`read_flag`) and the base of deliberate errors, which the settings
registry (:mod:`ascend_patch.env`) imports from here, so the two parse them the same way
without the hook importing the registry; and :func:`resolve` for the ``"module:attribute"``
paths that name code to import only when it runs.

No exception may escape :func:`install`; the ``.pth`` line also guards the
import of this module, so a ``.pth`` left behind by ``pip uninstall`` is inert.

Docs: docs/design.md, "What happens at `import vllm`"; docs/contributing.md, "Benchmarks" (its
cost at start-up).
"""

import _thread
import os
import sys

__version__ = "0.1.0"

MODES = ("auto", "npu", "emulate", "off")
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def read_mode(text):
    """An ``ASCEND_PATCH`` value as a mode (empty: ``auto``); None if it is not one."""
    value = text.strip().lower() or "auto"
    return value if value in MODES else None


def read_flag(text):
    """An ``ASCEND_PATCH_*`` flag value as True or False; None if it is not a flag."""
    value = text.strip().lower()
    return True if value in _ON else False if value in _OFF else None


class DeliberateError(Exception):
    """An error ascend-patch raises on purpose, with a message meant for the user: it stops
    ``import vllm``. Anything else the loader raises is a fault of ascend-patch (a damaged
    install, a bug), which must not take the user's vLLM down with it."""


# module name -> callbacks to run, in order, right after that module executes.
# A callback is a callable taking the module, or a "pkg.mod:function" string
# that is imported only when it fires (so start-up never imports the loader).
# Guarded by _lock: imports may race on several threads.
_callbacks = {}
_lock = _thread.RLock()
# What runs once a watched module has executed, imported only then (never at start-up).
_AFTER_IMPORT = "ascend_patch.overlay.post_import"


def resolve(target):
    """``target`` itself, or for a ``"module:attribute"`` path the attribute, imported now."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    __import__(module_name)
    return getattr(sys.modules[module_name], attr)


def _debug(message):
    if read_flag(os.environ.get("ASCEND_PATCH_DEBUG", "")):
        sys.stderr.write(f"ascend-patch: {message}\n")


class PostImportFinder:
    """A ``sys.meta_path`` entry that only answers for watched module names."""

    def __init__(self):
        self._resolving = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _callbacks or fullname in self._resolving:  # a dict read: no lock
            return None
        self._resolving.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._resolving.discard(fullname)
        if spec is not None and getattr(spec.loader, "exec_module", None) is not None:
            try:
                spec.loader = resolve(f"{_AFTER_IMPORT}:NotifyingLoader")(spec.loader)
            except Exception as exc:  # a damaged install: vLLM stays stock, as without the .pth
                sys.stderr.write(f"ascend-patch: bootstrap failed: {exc!r}\n")
        return spec


def _ensure_finder():
    if not any(isinstance(entry, PostImportFinder) for entry in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())


def watch(module_name, callback):
    """Run ``callback(module)`` right after ``module_name`` is imported.

    If the module is already imported, the callback runs now.
    """
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _ensure_finder()
            _callbacks.setdefault(module_name, []).append(callback)
            return
    resolve(f"{_AFTER_IMPORT}:run")(callback, module)


def unwatch(module_name, callback):
    """Forget a callback that has not fired yet."""
    with _lock:
        pending = _callbacks.get(module_name, [])
        if callback in pending:
            pending.remove(callback)
            if not pending:
                del _callbacks[module_name]


def install():
    """Entry point of the ``.pth`` file (and of the ``.start`` file on Python 3.15+)."""
    try:
        if read_mode(os.environ.get("ASCEND_PATCH", "")) == "off":
            return
        if "vllm" in _callbacks or "vllm" in sys.modules:
            return
        watch("vllm", "ascend_patch.overlay.loader:on_vllm_imported")
        # vLLM 0.24-0.31 resolve current_platform while vllm/__init__.py still runs
        # (vllm.utils.torch_utils computes PIN_MEMORY on import): the platform
        # module's import is the last moment the overlay can still choose it.
        watch("vllm.platforms", "ascend_patch.overlay.loader:on_vllm_imported")
        _debug("watching for `import vllm`")
    except BaseException as exc:  # never break interpreter start-up
        sys.stderr.write(f"ascend-patch: bootstrap disabled: {exc!r}\n")
