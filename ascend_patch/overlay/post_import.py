"""What runs once a module the start-up hook (:mod:`ascend_patch`) watches has executed: its
callbacks, in order, and around the loader's trigger the guard that keeps a failing loader from
taking vLLM down. Standard library only; imported when the first watched module is found, never
at interpreter start (the hook names it by path).

Once ``vllm`` is imported, a loader that fails for any reason other than the ones the user asked
to be told about (a :class:`~ascend_patch.DeliberateError`: a refusal in an asked-for mode,
strict mode, a malformed setting) leaves vLLM stock with one line on stderr, unless a mode was
asked for (``npu``, ``emulate``) or strict mode is on: then ``import vllm`` fails. A deliberate
error that nobody catches prints its message, not a traceback through vLLM's imports
(:func:`_quiet_deliberate_errors`).
"""

import os
import sys

from ascend_patch import DeliberateError, _callbacks, _lock, read_flag, read_mode, resolve

loader_failed = False
"""Set once a loader trigger failed in this process: the overlay stays off in it."""


class NotifyingLoader:
    """Wraps a module's real loader for one import, then steps aside."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def exec_module(self, module):
        # Give the module its real loader back before it runs, so inspect,
        # reload and pkgutil never see this wrapper.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _notify(module)


def _notify(module):
    with _lock:
        pending = _callbacks.pop(module.__name__, [])
    for index, callback in enumerate(pending):
        try:
            run(callback, module)
        except BaseException:
            # The import of `module` now fails. Keep the failed callback and
            # the ones after it, so a retried import cannot come back unpatched.
            with _lock:
                _callbacks.setdefault(module.__name__, [])[:0] = pending[index:]
            raise


def run(callback, module):
    """Run one callback on ``module``: a ``"module:function"`` path is a loader trigger, run
    under :func:`run_loader`'s guard; a callable is the registry's, run as it is."""
    if isinstance(callback, str):
        run_loader(callback, module)
    else:
        callback(module)


def _wants_errors():
    """Whether the user asked for certainty: a mode asked for (npu, emulate), or strict mode
    (a value that is not a flag counts: the loader refuses it)."""
    return (read_mode(os.environ.get("ASCEND_PATCH", "")) in ("npu", "emulate")
            or read_flag(os.environ.get("ASCEND_PATCH_STRICT", "")) is not False)


def _quiet_deliberate_errors():
    """Make an uncaught :class:`DeliberateError` print its message alone: it already says
    what is wrong and what to do, and a traceback through vLLM's imports hides that."""
    previous = sys.excepthook
    if getattr(previous, "ascend_patch", False):
        return

    def hook(kind, value, traceback):
        if not isinstance(value, DeliberateError):
            return previous(kind, value, traceback)
        text = str(value)
        sys.stderr.write(text if text.startswith("ascend-patch:") else f"ascend-patch: {text}")
        sys.stderr.write("\n")

    hook.ascend_patch = True
    sys.excepthook = hook


def run_loader(callback, module):
    """Run a loader trigger; an unexpected failure disables the overlay in this process."""
    global loader_failed
    if loader_failed:
        return
    try:
        resolve(callback)(module)
    except Exception as exc:
        if isinstance(exc, DeliberateError):
            _quiet_deliberate_errors()
            raise
        if _wants_errors():
            _quiet_deliberate_errors()
            raise DeliberateError(
                f"ascend-patch: cannot activate: the loader failed ({type(exc).__name__}: {exc})\n"
                "ascend-patch: fix: reinstall ascend-patch, or set ASCEND_PATCH=off for stock vLLM\n"
                "ascend-patch: details: ascend-patch doctor"
            ) from exc
        loader_failed = True
        sys.stderr.write(
            f"ascend-patch: disabled in this process, vLLM stays stock: the loader failed "
            f"({type(exc).__name__}: {exc}). Run `ascend-patch doctor`, or reinstall ascend-patch\n"
        )
