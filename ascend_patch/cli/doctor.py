"""``ascend-patch doctor``: the first thing a user runs.

It answers "would the overlay activate here, and if not, why?" from the same
:func:`ascend_patch.overlay.loader.plan` the loader runs at ``import vllm``, so the
answer cannot drift from the behaviour. By default nothing is imported or
patched; ``--apply`` imports vLLM and every target module so each patch is
reported as actually applied.
"""

from __future__ import annotations

import importlib
import platform as host
import site
import sys
from pathlib import Path

from ascend_patch import __version__, env
from ascend_patch.cli import toolchain
from ascend_patch.npu import detect
from ascend_patch.overlay import matrix
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.declarations import State

PTH_NAME = "a1_ascend_patch.pth"


def pth_files() -> list[str]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [str(Path(d) / PTH_NAME) for d in dirs if (Path(d) / PTH_NAME).is_file()]


def _import_targets(act) -> list[str]:
    failures = []
    for module in sorted({p.module for p in act.patches}):
        try:
            importlib.import_module(module)
        except Exception as exc:  # report, don't crash the doctor
            failures.append(f"{module}: {exc!r}")
    return failures


def _quantization(act, apply: bool) -> dict:
    """The quantised formats the NPU path runs, whether their declarations verified here, and
    (with ``--apply``, once the overlay is active) what vLLM's registries then hold."""
    from ascend_patch.npu import quantization

    declared = [s for s in act.statuses
                if s.patch.implementation.startswith("ascend_patch.npu.quantization")]
    found = {"supported": quantization.SUPPORTED,
             "declarations": f"{sum(s.ok for s in declared)}/{len(declared)} verified"}
    if apply and act.state == "active":
        quantization.register_config()
        quantization.register_kernels()
        found["registered"] = quantization.registered()
    return found


def ascend_stack() -> dict:
    """NNAL (ATB), the SoC and which of the NPU paths need what (the files and npu-smi only)."""
    return {
        "nnal": toolchain.nnal(),
        "soc": toolchain.soc(),
        "needs_nnal": dict(toolchain.ATB_OPS),
        "needs_cann": "every other NPU op (attention prefill and cache writes, norms, rotary, "
                      "sampler, MoE, W8A8): aclnn ops of the CANN toolkit and its ops package",
    }


def _limitations(act) -> list[dict]:
    """The matrix's known limitations for this release: what a user must not expect to run here
    (the same entries ``probe`` and the README's matrix section show)."""
    release = act.decision.release if act.decision else None
    if release is None:
        return []
    return [{"id": lim.id, "summary": lim.summary} for lim in matrix.load().limitations_for(release)]


def report(apply: bool = False) -> dict:
    try:
        requested = env.mode()
    except ValueError as exc:
        return {"ok": False, "error": str(exc), "settings": env.settings()}
    import_failures: list[str] = []
    try:
        # Imported here: a damaged loader is a finding to report, not a crash.
        from ascend_patch.overlay import loader
    except Exception as exc:
        return {"ok": False, "requested_mode": requested, "settings": env.settings(),
                "error": f"the loader failed ({type(exc).__name__}: {exc}); reinstall ascend-patch"}
    try:
        if apply and requested != "off":
            import vllm  # noqa: F401  (the .pth, if installed, activates here)

            act = loader.activate("ascend-patch doctor --apply")
            import_failures = _import_targets(act)
        else:
            act = loader.plan("ascend-patch doctor")
    except (loader.AscendPatchError, ValueError) as exc:
        return {"ok": False, "requested_mode": requested, "error": str(exc), "settings": env.settings()}
    except Exception as exc:  # a damaged install or a bug: report it, the doctor's job
        return {"ok": False, "requested_mode": requested, "settings": env.settings(),
                "error": f"the loader failed ({type(exc).__name__}: {exc}); reinstall ascend-patch"}

    quantization = _quantization(act, apply)
    stack = ascend_stack()
    vllm = act.vllm
    selection = act.selection
    applied = set(loader.REGISTRY.applied_targets())
    targets = []
    for status in act.statuses:
        state = State.APPLIED if status.patch.target in applied else status.state
        targets.append(
            {
                "target": status.patch.target,
                "kind": status.patch.kind,
                "state": state,
                "expected": status.patch.expected(),
                "found": status.found,
                "reason": status.patch.reason,
                "implementation": status.patch.implementation,
                "upstream": status.patch.upstream,
                "remove_when": status.patch.remove_when,
            }
        )
    would_activate = act.state in ("verified", "active")
    entry = selection.entry if selection else None
    return {
        "ok": would_activate or requested in ("auto", "off"),
        "ascend_patch": __version__,
        "python": host.python_version(),
        "versions": {
            "vllm": vllm.version if vllm else None,
            "vllm_detected": vllm.detected if vllm else None,
            "vllm_distribution": vllm.distribution if vllm else None,
            "vllm_version_source": vllm.source if vllm else None,
            "vllm_location": vllm.location if vllm else None,
            "torch": versions.installed_version("torch"),
            "torch_npu": versions.installed_version("torch-npu"),
            "cann": toolchain.cann_version(),
            "nnal": stack["nnal"]["version"],
            "driver": toolchain.driver_version(),
            "vllm_ascend": detect.vllm_ascend_present(),
        },
        "requested_mode": requested,
        "mode": act.mode,
        "mode_reason": act.mode_reason or act.reason,
        "state": act.state,
        "would_activate": would_activate,
        "reason": act.reason,
        "warnings": act.warnings,
        "patch_set": selection.patch_set.name if selection and selection.patch_set else None,
        "patch_set_reason": selection.reason if selection else None,
        "matrix_status": entry.status if entry else None,
        "targets": targets,
        "quantization": quantization,
        "limitations": _limitations(act),
        "ascend": stack,
        "import_failures": import_failures,
        "settings": env.settings(),
        "pth": pth_files(),
        "interpreter": sys.executable,
    }


def _nnal_line(found: dict) -> str:
    if not found["found"]:
        return (f"not found: paged decode and MLA decode fail at their first call; install NNAL and "
                f"`source {found['set_env']}`")
    line = f"{found['version'] or 'version unknown'} ({found['libatb']})"
    if not found["on_library_path"]:
        line += f"; libatb.so is not on LD_LIBRARY_PATH: `source {found['set_env']}`"
    return line


def _soc_line(found: dict | None) -> str:
    if found is None:
        return "unknown (no npu-smi)"
    family = f" ({found['family']})" if found["family"] else ""
    return f"{found['soc'] or 'unknown'}{family} [{found['source']}]"


def render(data: dict) -> str:
    if "error" in data:
        return f"ascend-patch doctor: {data['error']}"
    v = data["versions"]
    rows = [
        ("ascend-patch", data["ascend_patch"]),
        ("python", f"{data['python']} ({data['interpreter']})"),
        ("vllm", f"{v['vllm'] or 'not installed'}"
         + (f" [{v['vllm_distribution'] or 'source tree'}; from {v['vllm_version_source']}]" if v["vllm"] else "")),
        ("torch", v["torch"] or "not installed"),
        ("torch-npu", v["torch_npu"] or "not installed"),
        ("CANN", v["cann"] or "not found"),
        ("NNAL (ATB)", _nnal_line(data["ascend"]["nnal"])),
        ("driver", v["driver"] or "not found"),
        ("SoC", _soc_line(data["ascend"]["soc"])),
        ("vllm-ascend", v["vllm_ascend"] or "not installed"),
        ("mode", f"{data['requested_mode']} -> {data['mode'] or 'none'}: {data['mode_reason']}"),
        ("patch set", f"{data['patch_set'] or 'none'}" + (f": {data['patch_set_reason']}" if data["patch_set_reason"] else "")),
        ("matrix status", data["matrix_status"] or "not listed"),
        ("state", f"{data['state']}: {data['reason']}" if data["reason"] else data["state"]),
        (".pth loader", ", ".join(data["pth"]) or "not installed in this interpreter"),
        ("settings", ", ".join(f"{k}={val}" for k, val in data["settings"].items()) or "(defaults)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {val}" for k, val in rows]
    for warning in data["warnings"]:
        lines.append(f"{'warning'.ljust(width)}  {warning}")
    if data["targets"]:
        lines.append("")
        tw = max(len(t["target"]) for t in data["targets"])
        lines.append(f"{'target'.ljust(tw)}  {'kind':8}  {'state':9}  found")
        for t in data["targets"]:
            lines.append(f"{t['target'].ljust(tw)}  {t['kind']:8}  {t['state']:9}  {t['found']}")
    lines.append("")
    lines.append("NNAL (ATB) is needed by:")
    for op, path in data["ascend"]["needs_nnal"].items():
        lines.append(f"  {op}: {path}")
    lines.append(f"  (CANN alone: {data['ascend']['needs_cann']})")
    quantization = data["quantization"]
    lines.append("")
    lines.append(f"quantization ({quantization['declarations']}):")
    for method, schemes in quantization["supported"].items():
        lines.append(f"  {method}: {schemes}")
    if "registered" in quantization:
        found = quantization["registered"]
        lines.append(f"  registered: methods {', '.join(found['methods']) or 'none'}; int8 kernels "
                     f"for PlatformEnum.OOT: {', '.join(found['int8_kernels']) or 'none'}")
    if data["limitations"]:
        lines.append("")
        lines.append("known limitations of this release (compat_matrix.yaml):")
        lines.extend(f"  {lim['id']}: {lim['summary']}" for lim in data["limitations"])
    for failure in data["import_failures"]:
        lines.append(f"import failed: {failure}")
    lines.append("")
    lines.append("verdict: " + ("would activate" if data["would_activate"] else "would NOT activate"))
    return "\n".join(lines)
