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

Any failure leaves vLLM exactly stock with one log line saying why, except
where the user asked for certainty: ``ASCEND_PATCH=npu`` without a usable NPU,
and any deviation under ``ASCEND_PATCH_STRICT=1``, raise :class:`AscendPatchError`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ascend_patch import env, release
from ascend_patch.modes import DeliberateError
from ascend_patch.overlay import bootstrap, matrix
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


def _deviation(act: Activation, message: str) -> Activation:
    """An unusual situation: stay stock and say so, or raise under strict mode."""
    if env.strict():
        raise AscendPatchError(f"{message} (ASCEND_PATCH_STRICT=1)")
    act.state, act.reason, act.deviation = ActivationState.INERT, message, True
    return act


def _decide_mode(act: Activation) -> Activation | None:
    """Set ``act.mode``; return ``act`` early if the overlay stays out of the way."""
    device = bootstrap.resolve(DEVICE_CHECK)(act.requested)
    if device.vllm_ascend is not None:
        if act.requested == "auto":
            return _deviation(
                act,
                f"vllm-ascend {device.vllm_ascend} is installed and owns this NPU platform; "
                "ascend-patch stays inert. Uninstall one of them, or set ASCEND_PATCH=npu to let "
                "ascend-patch take over",
            )
        act.warnings.append(
            f"vllm-ascend {device.vllm_ascend} is installed too; ascend-patch takes over because "
            f"ASCEND_PATCH={act.requested}"
        )
    if act.requested == "emulate":
        if device.mode is None:  # a malformed HBM size is reported now, not mid-engine
            return _deviation(act, f"{device.detail}; ascend-patch stays inert")
        act.mode, act.mode_reason = "emulate", "ASCEND_PATCH=emulate"
        return None
    if device.mode == "npu":
        act.mode = "npu"
        act.mode_reason = f"ASCEND_PATCH={act.requested} and {device.detail}"
        return None
    if act.requested == "npu":
        raise AscendPatchError(
            f"ASCEND_PATCH=npu but no NPU is usable: {device.detail}. Install the CANN toolkit and "
            "the torch-npu release matching your torch (`ascend-patch doctor` shows both), "
            "or use ASCEND_PATCH=emulate to run the NPU code path on CPU"
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
    env.strict(), env.debug()  # a malformed flag is an error now, like a malformed mode
    if act.requested == "off":
        act.state, act.reason = ActivationState.OFF, "ASCEND_PATCH=off"
        return act
    try:
        act.vllm = vllm_install or versions.find_vllm()
    except versions.VersionError as exc:
        return _deviation(act, str(exc))
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
        return _deviation(act, str(exc))
    selection = act.decision.selection
    if selection.patch_set is None:
        return _deviation(act, f"{selection.reason}; ascend-patch stays inert")
    if selection.kind == "newer":
        if env.strict():
            raise AscendPatchError(f"{selection.reason} (ASCEND_PATCH_STRICT=1)")
        act.warnings.append(selection.reason)
    failed = act.decision.failed
    if failed:
        details = "".join(f"\n  - {s.describe()}" for s in failed)
        return _deviation(
            act,
            f"vLLM {act.vllm.version} does not match patch set {selection.patch_set.name}: "
            f"{len(failed)} of {len(act.statuses)} targets differ; nothing was patched"
            f"{details}",
        )
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


def activate(trigger: str, vllm_install: versions.VllmInstall | None = None) -> Activation:
    """Run :func:`plan` and apply its patches. Once per process; later calls return
    the first decision."""
    global _activation
    with _lock:
        if _activation is not None:
            return _activation
        act = plan(trigger, vllm_install)
        if act.state is ActivationState.VERIFIED:
            resolved = _platform_already_resolved()
            if resolved is not None:
                act = _deviation(
                    act,
                    f"vLLM already resolved its platform to {type(resolved).__name__} before "
                    f"ascend-patch loaded (trigger: {trigger}); install ascend-patch with pip "
                    "so its .pth runs at interpreter start",
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
        _activation = act
    for message in act.warnings:
        _logger().warning("ascend-patch: %s", message)
    if act.deviation:
        _logger().warning("ascend-patch: %s", act.reason)
    else:
        _debug(act.reason)
    return act


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
