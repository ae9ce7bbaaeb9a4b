"""Every ``ASCEND_PATCH*`` environment variable, in one place.

Nothing else in the package reads ``os.environ`` for these names, except the ``.pth``
bootstrap (:mod:`ascend_patch` itself), which must not import this module at interpreter
start: it reads ``ASCEND_PATCH``, ``ASCEND_PATCH_STRICT`` and ``ASCEND_PATCH_DEBUG`` with
the same parsers (:func:`~ascend_patch.read_mode`, :func:`~ascend_patch.read_flag`), which
this module imports from there (standard library only). The table of
variables in docs/reference.md is checked against :data:`VARIABLES` by the test suite.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass

from ascend_patch import MODES, DeliberateError, read_flag, read_mode


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "ASCEND_PATCH",
        "auto",
        "Device mode: `auto` (activate only when torch_npu imports and an NPU is "
        "visible), `npu` (force; fail when no NPU), `emulate` (the NPU code path on "
        "CPU tensors), `off` (the .pth does nothing).",
    ),
    Variable(
        "ASCEND_PATCH_VLLM_VERSION",
        "",
        "Use this vLLM version instead of the detected one, for builds whose "
        "version string says nothing useful (forks, vendored copies).",
    ),
    Variable(
        "ASCEND_PATCH_STRICT",
        "0",
        "`1` turns every deviation (unknown or newer vLLM, bad matrix, failed "
        "verification, vllm-ascend present) into an error instead of a warning.",
    ),
    Variable(
        "ASCEND_PATCH_MATRIX",
        "",
        "Path of a compat matrix to use instead of the installed `compat_matrix.yaml` "
        "(for CI that pins its own list of vLLM releases).",
    ),
    Variable(
        "ASCEND_PATCH_EMULATED_HBM",
        "4GiB",
        "Device memory of the emulated NPU, with a unit: `8GiB`, `512MiB`; vLLM sizes the KV cache "
        "from it, and the KV cache is real host memory. Only used with `ASCEND_PATCH=emulate`.",
    ),
    Variable(
        "ASCEND_PATCH_DEBUG",
        "0",
        "`1` prints loader diagnostics to stderr, including from the .pth bootstrap "
        "before any logging is configured.",
    ),
    Variable(
        "ASCEND_PATCH_CACHE_DIR",
        "",
        "Where `ascend-patch probe` keeps downloaded vLLM releases and the loader keeps "
        "verification results. Default: "
        "`$XDG_CACHE_HOME/ascend-patch` (or `~/.cache/ascend-patch`).",
    ),
)

_BY_NAME = {v.name: v for v in VARIABLES}

SCRIPT_VARIABLES = (
    "ASCEND_PATCH_BASE_VENV",
    "ASCEND_PATCH_MODELINFO_CACHE",
    "ASCEND_PATCH_RELEASE_CACHE",
    "ASCEND_PATCH_REQUIREMENTS",
    "ASCEND_PATCH_WHEEL_CACHE",
)
"""Names the repository's own scripts (scripts/setup_env.sh, scripts/test.sh, the test
suite) read; the package never does, and does not warn about them (docs/contributing.md)."""


class SettingError(DeliberateError, ValueError):
    """An ``ASCEND_PATCH*`` variable holds a value it cannot mean anything by."""


def raw(name: str) -> str:
    """The variable's value as set, or its default."""
    var = _BY_NAME[name]
    return os.environ.get(name, var.default).strip()


def mode() -> str:
    value = read_mode(raw("ASCEND_PATCH"))
    if value is None:
        raise SettingError(
            f"ASCEND_PATCH={raw('ASCEND_PATCH').lower()!r} is not a mode; expected one of "
            f"{', '.join(MODES)}"
        )
    return value


def validate() -> None:
    """The one rule for malformed values: every ``ASCEND_PATCH*`` variable with a format is
    read now, and a value it cannot mean anything by is a :class:`SettingError` naming the
    variable, the value and the accepted forms (never a silent fallback)."""
    mode(), strict(), debug(), emulated_hbm_bytes()
    override = vllm_version_override()
    if override is not None and not _is_version(override):
        raise SettingError(
            f"ASCEND_PATCH_VLLM_VERSION={override!r} is not a version; expected a PEP 440 "
            "version such as 0.33.0 or 0.33.1.dev12+gabc"
        )


def _is_version(text: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def unknown_names() -> list[str]:
    """One warning per ``ASCEND_PATCH*`` name in the environment that nothing reads (a typo
    would otherwise be ignored in silence), with the nearest known name."""
    known = [v.name for v in VARIABLES]
    warnings = []
    for name in sorted(os.environ):
        if name.startswith("ASCEND_PATCH") and name not in _BY_NAME and name not in SCRIPT_VARIABLES:
            near = difflib.get_close_matches(name, known, n=1)
            warnings.append(f"unknown setting {name} ignored" + (f"; did you mean {near[0]}?" if near else
                            f"; known: {', '.join(known)}"))
    return warnings


def _flag(name: str) -> bool:
    value = read_flag(raw(name))
    if value is None:
        raise SettingError(f"{name}={raw(name)!r} is not a flag; expected 1 (on) or 0 (off)")
    return value


def strict() -> bool:
    return _flag("ASCEND_PATCH_STRICT")


def debug() -> bool:
    return _flag("ASCEND_PATCH_DEBUG")


def vllm_version_override() -> str | None:
    return raw("ASCEND_PATCH_VLLM_VERSION") or None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


_MAX_SIZE = 1 << 60  # 1 EiB: far beyond any device, small enough for every size computation


def parse_size(text: str) -> int:
    """``8GiB`` → bytes. Binary units; ``G``, ``GB`` and ``GiB`` all mean 2**30. The unit is
    required: a bare ``4`` could mean bytes or GiB."""
    match = _SIZE.match(text) if len(text) < 64 else None
    if not match:
        raise SettingError(f"{text[:64]!r} is not a size; write it with a unit like 8GiB or 512MiB "
                           "(B, KiB, MiB, GiB, TiB)")
    number, unit = match.groups()
    size = float(number) * _UNITS[unit[:1].upper()]
    if not 1 <= size <= _MAX_SIZE:
        raise SettingError(f"{text!r} is not a usable device size; give one between 1B and 1EiB")
    return int(size)


def emulated_hbm_bytes() -> int:
    try:
        return parse_size(raw("ASCEND_PATCH_EMULATED_HBM"))
    except SettingError as exc:
        raise SettingError(f"ASCEND_PATCH_EMULATED_HBM={exc}") from None


def matrix_path() -> str | None:
    return raw("ASCEND_PATCH_MATRIX") or None


def cache_dir() -> str:
    configured = raw("ASCEND_PATCH_CACHE_DIR")
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "ascend-patch")


def settings() -> dict[str, str]:
    """The variables that are set in this process, for doctor."""
    return {v.name: os.environ[v.name] for v in VARIABLES if v.name in os.environ}
