"""``ascend-patch doctor``: the first thing a user runs.

It answers "would the overlay activate here, and if not, why?" from the same
:func:`ascend_patch.overlay.loader.plan` the loader runs at ``import vllm``, so the
answer cannot drift from the behaviour. By default nothing is imported or
patched; ``--apply`` imports vLLM and every target module so each patch is
reported as actually applied.

Whatever the mode, the installed vLLM is checked against its patch set too (a CPU build
host can vet an image meant for Ascend). The text starts with the verdict, the counts and
the problems; ``--targets`` adds every target, ``--verbose`` the long explanations.
"""

from __future__ import annotations

import importlib
import platform as host
import site
import sys
from pathlib import Path

from ascend_patch import __version__, env
from ascend_patch.cli import output, toolchain
from ascend_patch.npu import detect
from ascend_patch.overlay import matrix
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.decision import decide, patch_set_runner
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


def _quantization(act, decision, apply: bool) -> dict:
    """The quantised formats the NPU path runs, whether their declarations verified here, and
    (with ``--apply``, once the overlay is active) what vLLM's registries then hold."""
    from ascend_patch.npu import quantization

    declared = [s for s in (decision.statuses if decision else [])
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


def _limitations(decision) -> list[dict]:
    """The matrix's known limitations for this release: what a user must not expect to run here
    (the same entries ``probe`` and docs/compatibility.md lists)."""
    release = decision.release if decision else None
    if release is None:
        return []
    return [{"id": lim.id, "summary": lim.summary} for lim in matrix.load().limitations_for(release)]


def _failure(message: str, **known) -> dict:
    return output.document("doctor", {"ok": False, **known, "error": message, "settings": env.settings()})


def _evaluate(act, loader):
    """The decision for the installed vLLM where the loader stopped before making one (off,
    auto without an NPU, vllm-ascend present): the patch set is vetted in every mode."""
    if act.decision is not None:
        return act.decision, act.vllm, None
    try:
        vllm = act.vllm or versions.find_vllm()
        if vllm is None:
            return None, None, None
        return decide(vllm.version, loader.source_tree(vllm.location), matrix.load()), vllm, None
    except (matrix.MatrixError, versions.VersionError) as exc:
        return None, act.vllm, str(exc)


def report(apply: bool = False) -> dict:
    try:
        requested = env.mode()
    except ValueError as exc:
        return _failure(str(exc))
    import_failures: list[str] = []
    try:
        # Imported here: a damaged loader is a finding to report, not a crash.
        from ascend_patch.overlay import loader
    except Exception as exc:
        return _failure(f"the loader failed ({type(exc).__name__}: {exc}); reinstall ascend-patch",
                        requested_mode=requested)
    try:
        if apply and requested != "off":
            import vllm  # noqa: F401  (the .pth, if installed, activates here)

            act = loader.activate("ascend-patch doctor --apply")
            import_failures = _import_targets(act)
        else:
            act = loader.plan("ascend-patch doctor")
    except (loader.AscendPatchError, ValueError) as exc:
        return _failure(str(exc), requested_mode=requested)
    except Exception as exc:  # a damaged install or a bug: report it, the doctor's job
        return _failure(f"the loader failed ({type(exc).__name__}: {exc}); reinstall ascend-patch",
                        requested_mode=requested)

    decision, vllm, evaluation_error = _evaluate(act, loader)
    quantization = _quantization(act, decision, apply)
    stack = ascend_stack()
    selection = decision.selection if decision else None
    applied = set(loader.REGISTRY.applied_targets())
    targets = []
    for status in decision.statuses if decision else []:
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
    problems = ([evaluation_error] if evaluation_error else
                [selection.reason] if selection is not None and selection.patch_set is None else [])
    cause = act.reason.splitlines()[0].removesuffix("; ascend-patch stays inert") if act.deviation else None
    if cause and cause not in problems:
        problems.insert(0, cause)  # what stops the loader here: no NPU in npu mode, targets that differ, ...
    problems += [f"{t['target']}: expected {t['expected']}, found {t['found']}"
                 for t in targets if t["state"] in (State.MISSING, State.MISMATCH, State.UNREADABLE)]
    problems += [f"import failed: {failure}" for failure in import_failures]
    return output.document("doctor", {
        "ok": would_activate or requested in ("auto", "off"),
        "would_activate": would_activate,
        "verdict": _verdict(act, would_activate, decision),
        "summary": {"targets": len(targets), **{state: sum(t["state"] == state for t in targets)
                    for state in (State.VERIFIED, State.APPLIED, State.MISSING, State.MISMATCH,
                                  State.UNCHECKED)}},
        "problems": problems,
        "next_step": _next_step(act, requested, would_activate, decision, problems) if vllm or evaluation_error
                     else "install vLLM in this environment (`ascend-patch matrix --constraints` lists the "
                          "releases this ascend-patch serves)",
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
        "reason": act.reason,
        "warnings": act.warnings,
        "patch_set": selection.patch_set.name if selection and selection.patch_set else None,
        "patch_set_reason": selection.reason if selection else None,
        "patch_set_verdict": decision.verdict() if decision else evaluation_error,
        "runner": patch_set_runner(selection.patch_set.name).upper() if selection and selection.patch_set else None,
        "matrix_status": entry.status if entry else None,
        "targets": targets,
        "quantization": quantization,
        "limitations": _limitations(decision),
        "ascend": stack,
        "import_failures": import_failures,
        "settings": env.settings(),
        "pth": pth_files(),
        "interpreter": sys.executable,
    })


def _verdict(act, would_activate: bool, decision) -> str:
    if would_activate:
        return f"would activate ({act.mode} mode)" if act.state == "verified" else f"active ({act.mode} mode)"
    if act.state == "off":
        return "stock vLLM: ASCEND_PATCH=off"
    if decision is not None and decision.would_activate and not act.deviation:
        return "stock vLLM here (no NPU); the patch set verifies, so on an Ascend host it would activate"
    return "would NOT activate"


def _next_step(act, requested: str, would_activate: bool, decision, problems: list[str]) -> str | None:
    """One thing to do when the answer is no."""
    if would_activate:
        return None
    if act.deviation and act.fix:
        details = "" if act.details == "ascend-patch doctor" else f"; details: `{act.details}`"
        return act.fix[0].upper() + act.fix[1:] + details
    if problems and decision is not None and decision.failed:
        return "this vLLM does not match its patch set: `ascend-patch matrix --constraints` gives the releases that work"
    if requested == "off":
        return "unset ASCEND_PATCH (or set it to auto, npu or emulate) to let the overlay activate"
    return ("ASCEND_PATCH=emulate runs the same NPU code path on CPU here; on an Ascend host, install "
            "CANN and the torch-npu release matching torch")


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


def counts(summary: dict) -> str:
    """``180 targets: 158 verified, 22 unchecked`` (the states that occur)."""
    shown = [f"{summary[state]} {state}" for state in ("verified", "applied", "unchecked", "missing", "mismatch")
             if summary.get(state)]
    return f"{summary['targets']} targets" + (f": {', '.join(shown)}" if shown else "")


def target_lines(targets: list[dict], columns: int) -> list[str]:
    """The full target table: one line per target, with what was found where it differs."""
    lines = []
    for t in targets:
        body = " (body changed)" if t.get("body") == "changed" else ""  # probe's rows say
        lines += output.field(f"{t['state']:9} {t['kind']:8}", t["target"] + body, 18, columns)
        if t["state"] in (State.MISSING, State.MISMATCH, State.UNREADABLE):
            lines += output.field("", f"expected {t['expected']}, found {t['found']}", 18, columns)
    return lines


def render(data: dict, targets: bool = False, verbose: bool = False) -> str:
    """Verdict, counts and problems first, then the versions; ``targets`` adds every target,
    ``verbose`` the explanations (NNAL, quantisation, limitations in full)."""
    columns = output.width()
    if "error" in data:
        return "\n".join(output.fields([("verdict", "doctor could not decide: " + data["error"])], columns))
    v = data["versions"]
    head = [("verdict", data["verdict"])]
    if data["patch_set"]:
        head.append(("patch set", f"{data['patch_set']} (runner {data['runner']}): {data['patch_set_verdict']}"))
    elif data["patch_set_verdict"]:
        head.append(("patch set", data["patch_set_verdict"]))
    if data["summary"]["targets"]:
        head.append(("targets", counts(data["summary"])))
    head += [("problem", problem) for problem in data["problems"][:5]]
    if len(data["problems"]) > 5:
        head.append(("problem", f"... and {len(data['problems']) - 5} more (--targets lists them)"))
    head += [("warning", warning) for warning in data["warnings"]]
    if data["next_step"]:
        head.append(("next step", data["next_step"]))
    rows = [
        ("mode", f"{data['requested_mode']} -> {data['mode'] or 'none'}: {data['mode_reason']}"),
        ("ascend-patch", data["ascend_patch"]),
        ("vllm", f"{v['vllm'] or 'not installed'}"
         + (f" [{v['vllm_distribution'] or 'source tree'}; from {v['vllm_version_source']}]" if v["vllm"] else "")),
        ("torch", v["torch"] or "not installed"),
        ("torch-npu", v["torch_npu"] or "not installed"),
        ("CANN", v["cann"] or "not found"),
        ("NNAL (ATB)", _nnal_line(data["ascend"]["nnal"])),
        ("driver", v["driver"] or "not found"),
        ("SoC", _soc_line(data["ascend"]["soc"])),
        ("vllm-ascend", v["vllm_ascend"] or "not installed"),
        ("matrix status", data["matrix_status"] or "not listed"),
        ("python", f"{data['python']} ({data['interpreter']})"),
        (".pth loader", ", ".join(data["pth"]) or "not installed in this interpreter"),
        ("settings", ", ".join(f"{k}={val}" for k, val in data["settings"].items()) or "(defaults)"),
    ]
    if data["limitations"] and not verbose:
        rows.append(("limitations", ", ".join(lim["id"] for lim in data["limitations"])
                     + " (--verbose explains them)"))
    quantization = data["quantization"]
    rows.append(("quantization", f"{', '.join(quantization['supported'])} "
                                 f"({quantization['declarations']} declarations)"))
    lines = output.fields(head + [("", "")] + rows, columns)
    if "registered" in quantization:
        found = quantization["registered"]
        lines += output.fields([("", f"registered: methods {', '.join(found['methods']) or 'none'}; int8 "
                                     f"kernels for PlatformEnum.OOT: {', '.join(found['int8_kernels']) or 'none'}")],
                               columns)
    if verbose:
        lines += ["", "NNAL (ATB) is needed by:"]
        lines += output.fields([(f"  {op}", path) for op, path in data["ascend"]["needs_nnal"].items()], columns)
        lines += output.fields([("  (CANN alone", data["ascend"]["needs_cann"] + ")")], columns)
        lines += ["", "quantization:"]
        lines += output.fields([(f"  {method}", str(schemes)) for method, schemes in quantization["supported"].items()],
                               columns)
        if data["limitations"]:
            lines += ["", "known limitations of this release (compat_matrix.yaml):"]
            lines += output.fields([(f"  {lim['id']}", lim["summary"]) for lim in data["limitations"]], columns)
    if targets and data["targets"]:
        lines += ["", "targets (state, kind, target):"] + target_lines(data["targets"], columns)
    elif data["targets"]:
        lines += ["", "`ascend-patch doctor --targets` lists every target; --verbose explains the rest"]
    return "\n".join(line.rstrip() for line in lines)
