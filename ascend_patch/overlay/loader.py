"""What happens when ``vllm`` is imported: decide, verify, then apply — or stay stock.

Triggers: the ``.pth`` bootstrap calls :func:`on_vllm_imported` right after
``vllm/__init__.py`` runs; the ``vllm.general_plugins`` entry point calls
:func:`general_plugin` in every process vLLM starts. Both end in
:func:`activate`, which runs once per process:

1. the mode (``ASCEND_PATCH``): off, auto (NPU visible?), npu (forced) or emulate; what
   the machine offers is the NPU wing's answer (:data:`DEVICE_CHECK`), the one question
   the overlay asks it;
2. the vLLM version, the patch set ``compat_matrix.yaml`` maps it to, and every
   declaration of that set verified against the installed source — the one
   decision path, :func:`ascend_patch.overlay.decision.decide`, which the probe runs too;
3. only if all of that holds, the set is scheduled through the registry, the
   platform selection first.

The refusal rule: where the overlay was asked for (``ASCEND_PATCH=npu`` or ``emulate``) or
an NPU is present (``auto`` found one), and it cannot activate, ``import vllm`` fails with three
lines (the cause, the fix, the command that shows the details): stock vLLM on a machine meant
for the NPU path would only die later, further from the cause. ``auto`` on a machine without
an NPU stays stock and silent; ``ASCEND_PATCH_STRICT=1`` makes every deviation an error.

Where it activates, one INFO line through vLLM's logger says so (:func:`activation_line`): at
once where vLLM's logging is already configured, else when vLLM configures it (vLLM 0.33+
configures logging late, then calls the platform's ``log_warnings`` hook, which announces it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ascend_patch import DeliberateError, __version__, env, release, resolve
from ascend_patch.overlay import matrix
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.decision import Decision, decide, patch_set_runner
from ascend_patch.overlay.declarations import Declaration, Patch, Setting, TargetStatus, TextEnum
from ascend_patch.overlay.registry import REGISTRY
from ascend_patch.overlay.source import SourceTree

DEVICE_CHECK = "ascend_patch.npu.detect:check"
"""What this machine offers the NPU path, asked of the NPU wing by path (as the manifest
names every implementation), so the overlay imports nothing of that wing, nor torch:
``check(requested_mode)`` returns a ``Device`` (vllm-ascend installed? which device, why)."""


class AscendPatchError(DeliberateError, RuntimeError):
    """The overlay was asked for and cannot be given."""


class ActivationState(TextEnum):
    """Where the loader stands in this process."""

    OFF = "off"
    INERT = "inert"
    VERIFIED = "verified"
    """Decided and verified, not yet applied (``plan``, doctor)."""
    ACTIVE = "active"
    REVERTED = "reverted"


@dataclass
class Activation:
    """Everything the loader decided in this process, for logs and doctor."""

    requested: str
    trigger: str
    state: ActivationState = ActivationState.INERT
    reason: str = ""
    mode: str | None = None  # "npu" or "emulate" once decided
    mode_reason: str = ""
    vllm: versions.VllmInstall | None = None
    decision: Decision | None = None
    warnings: list[str] = field(default_factory=list)
    deviation: bool = False
    """Inert for an unusual reason (worth a warning), not by choice or for lack of an NPU."""
    fix: str = ""
    """For a deviation: what the user can do about it (the refusal's second line)."""
    details: str = "ascend-patch doctor"
    """For a deviation: the command that shows the details (the refusal's third line)."""

    @property
    def active(self) -> bool:
        return self.state is ActivationState.ACTIVE

    @property
    def selection(self) -> matrix.Selection | None:
        return self.decision.selection if self.decision else None

    @property
    def patches(self) -> list[Declaration]:
        return self.decision.declarations if self.decision else []

    @property
    def statuses(self) -> list[TargetStatus]:
        return self.decision.statuses if self.decision else []


_activation: Activation | None = None
_activating = False
_lock = threading.RLock()


def _logger() -> logging.Logger:
    # Under the "vllm" logger so our lines use vLLM's format once it is configured.
    return logging.getLogger("vllm.ascend_patch")


def _debug(message: str) -> None:
    _logger().debug(message)
    if env.debug():
        sys.stderr.write(f"ascend-patch: {message}\n")


def current() -> Activation | None:
    """The decision made in this process, if any."""
    return _activation


def _deviation(act: Activation, message: str, fix: str, details: str = "ascend-patch doctor") -> Activation:
    """An unusual situation: stay stock and say so, or raise under strict mode."""
    if env.strict():
        raise AscendPatchError(f"{message} (ASCEND_PATCH_STRICT=1)")
    act.state, act.reason, act.deviation = ActivationState.INERT, message, True
    act.fix, act.details = fix, details
    return act


def _releases_fix() -> str:
    """The refusal's fix for a vLLM this ascend-patch does not serve."""
    try:
        served = f"pip install 'vllm{matrix.load().served_range()}'"
    except matrix.MatrixError:
        served = "`ascend-patch matrix` lists them"
    return (f"install a vLLM release this ascend-patch serves ({served}), upgrade ascend-patch, "
            "or set ASCEND_PATCH=off for stock vLLM")


def asked_for(act: Activation) -> bool:
    """Whether staying stock would betray the user: a mode was asked for, or an NPU is here."""
    return act.requested in ("npu", "emulate") or act.mode == "npu"


def refusal(act: Activation) -> str:
    """The three lines ``import vllm`` fails with: cause, fix, details."""
    cause = act.reason.splitlines()[0].removesuffix("; ascend-patch stays inert")
    return (f"ascend-patch: cannot activate in {act.mode or act.requested} mode: {cause}\n"
            f"ascend-patch: fix: {act.fix}\n"
            f"ascend-patch: details: {act.details}")


def _decide_mode(act: Activation) -> Activation | None:
    """Set ``act.mode``; return ``act`` early if the overlay stays out of the way."""
    device = resolve(DEVICE_CHECK)(act.requested)
    if device.vllm_ascend is not None:
        if act.requested == "auto":
            return _deviation(
                act,
                f"vllm-ascend {device.vllm_ascend} is installed and owns this NPU platform; "
                "ascend-patch stays inert. Uninstall one of them, or set ASCEND_PATCH=npu to let "
                "ascend-patch take over",
                "uninstall vllm-ascend or ascend-patch, or set ASCEND_PATCH=npu",
            )
        act.warnings.append(
            f"vllm-ascend {device.vllm_ascend} is installed too; ascend-patch takes over because "
            f"ASCEND_PATCH={act.requested}"
        )
    if act.requested == "emulate":  # its one setting, the HBM size, was validated by plan()
        act.mode, act.mode_reason = "emulate", "ASCEND_PATCH=emulate"
        return None
    if device.mode == "npu":
        act.mode = "npu"
        act.mode_reason = f"ASCEND_PATCH={act.requested} and {device.detail}"
        return None
    if act.requested == "npu":
        return _deviation(
            act, f"ASCEND_PATCH=npu but no NPU is usable: {device.detail}",
            "install the CANN toolkit and the torch-npu release matching your torch, or use "
            "ASCEND_PATCH=emulate to run the NPU code path on CPU",
        )
    act.state, act.reason = ActivationState.INERT, f"ASCEND_PATCH=auto and no NPU: {device.detail}"
    if device.torch_npu_unusable:
        # torch_npu is there but unusable (CANN mismatch, no device visible): stock vLLM
        # would run on a machine meant for NPUs, which deserves one line.
        act.deviation = True
        act.reason += ("; vLLM stays stock. `ascend-patch doctor` shows the versions; "
                       "ASCEND_PATCH=npu turns this into an error")
    return act


def source_tree(vllm_dir: str | Path) -> SourceTree:
    """The installed vLLM, and torch beside it for the torch device-API declarations.
    Found without importing torch (``doctor`` never does)."""
    spec = importlib.util.find_spec("torch")
    roots = [Path(next(iter(spec.submodule_search_locations)))] if spec and spec.submodule_search_locations else []
    return SourceTree(Path(vllm_dir), *roots)


def plan(trigger: str, vllm_install: versions.VllmInstall | None = None) -> Activation:
    """Decide everything, verify every target, touch nothing."""
    act = Activation(requested=env.mode(), trigger=trigger)
    if act.requested == "off":
        act.state, act.reason = ActivationState.OFF, "ASCEND_PATCH=off"
        return act
    env.validate()  # a malformed value is an error now, in every mode, never a fallback
    act.warnings += env.unknown_names()
    try:
        act.vllm = vllm_install or versions.find_vllm()
    except versions.VersionError as exc:
        return _deviation(act, str(exc), "set ASCEND_PATCH_VLLM_VERSION to the release this vLLM was "
                          "built from, or ASCEND_PATCH=off for stock vLLM")
    if act.vllm is None:
        act.state, act.reason = ActivationState.INERT, "vLLM is not installed"
        return act
    if _decide_mode(act) is not None:
        return act
    try:
        act.decision = decide(
            act.vllm.version,
            source_tree(act.vllm.location),
            matrix.load(),
            cache_dir=Path(env.cache_dir()) / "verified",
        )
    except (matrix.MatrixError, versions.VersionError) as exc:
        return _deviation(act, str(exc), "correct the matrix (or unset ASCEND_PATCH_MATRIX), reinstall "
                          "ascend-patch, or set ASCEND_PATCH=off for stock vLLM")
    selection = act.decision.selection
    if selection.patch_set is None:
        return _deviation(act, f"{selection.reason}; ascend-patch stays inert", _releases_fix(),
                          f"ascend-patch probe {act.vllm.version}")
    failed = act.decision.failed
    if selection.kind == "newer":
        if env.strict():
            raise AscendPatchError(f"{selection.reason} (ASCEND_PATCH_STRICT=1)")
        if not failed:
            act.warnings.append(selection.reason)
    if failed:
        listing = "".join(f"\n  - {s.describe()}" for s in failed)
        lead = (f"vLLM {act.vllm.version} is newer than every patch set; {len(failed)} of "
                f"{len(act.statuses)} targets of the newest, {selection.patch_set.name}, differ"
                if selection.kind == "newer" else
                f"vLLM {act.vllm.version} does not match patch set {selection.patch_set.name}: "
                f"{len(failed)} of {len(act.statuses)} targets differ")
        return _deviation(act, f"{lead}; nothing was patched{listing}", _releases_fix(),
                          "ascend-patch doctor --targets")
    act.state = ActivationState.VERIFIED
    return act


def _platform_already_resolved() -> object | None:
    platforms = sys.modules.get("vllm.platforms")
    resolved = getattr(platforms, "_current_platform", None) if platforms else None
    if resolved is None or type(resolved).__module__.startswith("ascend_patch."):
        return None
    return resolved


def _overridden_settings(act: Activation) -> list[str]:
    """One warning per variable the user set that a forced setting overrides."""
    return [
        f"{s.variable}={os.environ[s.variable]} ignored: {s.reason}"
        for s in act.patches
        if isinstance(s, Setting) and act.mode in s.modes
        and os.environ.get(s.variable, s.value).strip().lower() != s.value
    ]


def activate(trigger: str, vllm_install: versions.VllmInstall | None = None) -> Activation | None:
    """Run :func:`plan` and apply its patches. Once per process; later calls return
    the first decision, and a trigger fired while it is being made returns None."""
    global _activation, _activating
    with _lock:
        if _activation is not None:
            return _activation
        if _activating:
            # An import the activation itself makes (a replacement module importing
            # vllm.platforms, the second trigger) while the first decision is applied.
            return None
        _activating = True
        try:
            act = _apply(trigger, vllm_install)
        finally:
            _activating = False
        _activation = act
    if act.active:
        _announce_if_logging_is_configured()
    for message in act.warnings:
        _logger().warning("ascend-patch: %s", message)
    if act.deviation:
        _logger().warning("ascend-patch: %s", act.reason)
    else:
        _debug(act.reason)
    return act


def _apply(trigger: str, vllm_install: versions.VllmInstall | None) -> Activation:
    """:func:`plan`, then schedule its patches where it verified; a deviation in an asked-for
    mode raises. Called by :func:`activate` under its lock."""
    act = plan(trigger, vllm_install)
    if act.state is ActivationState.VERIFIED:
        resolved = _platform_already_resolved()
        if resolved is not None:
            act = _deviation(
                act,
                f"vLLM already resolved its platform to {type(resolved).__name__} before "
                f"ascend-patch loaded (trigger: {trigger}); install ascend-patch with pip "
                "so its .pth runs at interpreter start",
                "install ascend-patch with pip into this environment (its .pth must run at "
                "interpreter start), or set ASCEND_PATCH=off",
            )
        else:
            act.warnings += _overridden_settings(act)
            scheduled = [d for d in act.patches if act.mode in getattr(d, "modes", (act.mode,))]
            # the release facts first: a patch applied at once (torch's device API) reads them
            entry = act.selection.entry
            release.proven_end_to_end = entry is not None and entry.status in matrix.RUN_END_TO_END
            release.patched = patched(scheduled)
            release.mode = act.mode
            release.runner = patch_set_runner(act.selection.patch_set.name)
            REGISTRY.schedule(scheduled)
            act.state = ActivationState.ACTIVE
            act.reason = (
                f"vLLM {act.vllm.version} on {'emulated ' if act.mode == 'emulate' else ''}"
                f"NPU, patch set {act.selection.patch_set.name}, "
                f"{len(act.statuses)} targets verified"
            )
            release.activation_line = activation_line(act)
    if act.deviation and asked_for(act):
        raise AscendPatchError(refusal(act))
    return act


def activation_line(act: Activation) -> str:
    """The one INFO line a process logs where the overlay activates."""
    return (f"ascend-patch {__version__} active: vLLM {act.vllm.version}, patch set "
            f"{act.selection.patch_set.name}, mode {act.mode}, runner "
            f"{patch_set_runner(act.selection.patch_set.name).upper()}")


def _announce_if_logging_is_configured() -> None:
    """Log the activation line now where vLLM's logging is set up: vLLM before 0.33 sets it
    up when ``vllm.logger`` is imported. From 0.33 vLLM configures it later in each process
    and then calls the platform's ``log_warnings`` hook, which announces instead."""
    importlib.import_module("vllm.logger")
    if logging.getLogger("vllm").handlers:
        release.announce()


def deactivate() -> list[str]:
    """Restore stock vLLM in this process (tests and diagnostics)."""
    global _activation
    with _lock:
        restored = REGISTRY.revert_all()
        if _activation is not None:
            _activation.state = ActivationState.REVERTED
        _activation = None
        release.proven_end_to_end = False
        release.patched = frozenset()
        release.mode = release.runner = None
        release.activation_line = ""
        return restored


def patched(declarations: list[Declaration]) -> frozenset[str]:
    """What :data:`ascend_patch.release.patched` holds once ``declarations`` are scheduled."""
    return frozenset(d.implementation for d in declarations if isinstance(d, Patch))


def on_vllm_imported(module) -> None:
    """Called by the ``.pth`` bootstrap right after ``vllm/__init__.py`` executed."""
    activate("import vllm")


def general_plugin() -> None:
    """``vllm.general_plugins`` entry point: a second, idempotent trigger (with
    ``ASCEND_PATCH=off`` it only records that decision)."""
    activate("vllm.general_plugins")
