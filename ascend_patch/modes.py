"""How the ``ASCEND_PATCH`` mode and the ``ASCEND_PATCH_*`` flags read: standard library only,
nothing imported, so the ``.pth`` bootstrap (:mod:`ascend_patch.overlay.bootstrap`) and the
settings registry (:mod:`ascend_patch.env`) parse them the same way without either importing
the other.
"""

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
