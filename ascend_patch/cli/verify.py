"""``ascend-patch verify``: the hardware acceptance kit.

On a machine with an Ascend NPU it builds its tiny models locally, runs every check of
:mod:`ascend_patch.kit.checks` on the NPU against HF transformers on the CPU, prints one line
per check and writes one JSON evidence record (schema in :mod:`ascend_patch.kit.record` and
docs/hardware-kit.md), which ``scripts/record_matrix_run.py --evidence`` turns into an ``npu-verified`` matrix
status. ``--emulate`` runs the same checks, in the same code, on the emulated NPU: how CI tests
the kit. Exit status: 0 every check passed, 1 one did not (the record says which), 2 no NPU or
bad input (no record).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform as host
import sys
import tempfile
import time
from pathlib import Path

from ascend_patch import __version__, env
from ascend_patch.cli import toolchain
from ascend_patch.overlay import version as versions

EMULATED_DEVICES = 2  # the emulated machine shows two devices, so the tp check runs in CI too
EMULATED_HBM = "1GiB"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write(path: Path, data: dict) -> None:
    """Atomically, after every check: a run that dies midway still leaves its evidence."""
    staging = path.with_name(path.name + ".partial")
    staging.write_text(json.dumps(data, indent=2) + "\n")
    staging.replace(path)


def _device(emulated: bool) -> tuple[dict, dict]:
    """``(device, what torch_npu says of the stack)`` for the record."""
    if emulated:
        from ascend_patch.npu.device import runtime

        return {"name": runtime(emulated=True).device_name(0), "soc": None, "soc_version": None, "family": None,
                "count": EMULATED_DEVICES, "emulated": True}, {}
    from ascend_patch.npu.kernels import npu

    stack = npu.stack()
    return {"name": stack["soc"], "soc": stack["soc"], "soc_version": stack["soc_version"],
            "family": toolchain.family(soc_version=stack["soc_version"]),
            "count": npu.device_count(), "emulated": False}, stack


def _versions(act, stack: dict) -> dict:
    return {
        "python": host.python_version(),
        "vllm": act.vllm.version,
        "torch": versions.installed_version("torch"),
        "torch_npu": versions.installed_version("torch-npu"),
        "transformers": versions.installed_version("transformers"),
        "cann": stack.get("cann") or toolchain.cann_version(),
        "nnal": toolchain.nnal()["version"],
        "driver": stack.get("driver") or toolchain.driver_version(),
    }


def _line(index: int, total: int, result) -> str:
    where = f"{result.family}: {result.model} {result.dtype}"
    return (f"[{index:2d}/{total}] {result.name:<20} {result.verdict.upper():<7} {where:<38} "
            f"{result.detail[:160]} ({result.seconds:.1f} s)")


def run(emulate: bool, output: Path, models_dir: Path | None) -> int:
    mode = "emulate" if emulate else "npu"
    if importlib.util.find_spec("vllm") is None:
        print("ascend-patch verify: vLLM is not installed in this environment", file=sys.stderr)
        return 2
    if "vllm" in sys.modules:
        print("ascend-patch verify: vLLM is already imported in this process; run verify on its own",
              file=sys.stderr)
        return 2
    if not emulate:
        from ascend_patch.npu.kernels import npu

        usable, detail = npu.probe()
        if not usable:
            print(f"ascend-patch verify: no NPU is usable here ({detail}); run it on an Ascend machine "
                  "with torch-npu and CANN, or `ascend-patch verify --emulate` for the same checks on CPU",
                  file=sys.stderr)
            return 2
        nnal = toolchain.nnal()
        if not nnal["on_library_path"]:
            print(f"ascend-patch verify: warning: NNAL's libatb.so is not on LD_LIBRARY_PATH; every "
                  f"family decodes on ATB ops and will fail: `source {nnal['set_env']}`", flush=True)
    os.environ["ASCEND_PATCH"] = mode
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engines, one per family
    if emulate:
        os.environ.setdefault("ASCEND_PATCH_EMULATED_HBM", EMULATED_HBM)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the progress lines are the output
    started = time.perf_counter()

    from ascend_patch.kit import checks, record, tiny_models

    models = tiny_models.build(models_dir or Path(env.cache_dir()) / "models", list(checks.TINY_MODELS))
    import vllm  # noqa: F401  (the .pth activates the overlay here, in the mode set above)

    from ascend_patch.overlay import loader

    act = loader.activate("ascend-patch verify")
    if act.state != loader.ActivationState.ACTIVE or act.mode != mode:
        print(f"ascend-patch verify: the overlay is not active in {mode} mode: {act.reason}; "
              "`ascend-patch doctor` shows why", file=sys.stderr)
        return 1
    device, stack = _device(emulate)
    entry = act.selection.entry
    data = {
        "schema": record.SCHEMA,
        "kind": record.KIND,
        "mode": mode,
        "note": "emulated: CPU tensors, no NPU; tests the kit, is no hardware evidence" if emulate
                else "a run on Ascend hardware",
        "command": "ascend-patch verify" + (" --emulate" if emulate else ""),
        "started": _now(),
        "finished": None,
        "complete": False,
        "ascend_patch": __version__,
        "patch_set": {"name": act.selection.patch_set.name, "declarations": len(act.patches),
                      "digest": record.patch_set_digest(act.patches)},
        "matrix_status": entry.status if entry else None,
        "versions": _versions(act, stack),
        "device": device,
        "nnal": toolchain.nnal(),
        "settings": env.settings(),
        "checks": [],
        "families": {},
        "summary": None,
        "seconds": None,
    }
    where = f"{'emulated NPU' if emulate else device['soc']} x{device['count']}"
    total = len(record.CHECKS)
    print(f"ascend-patch verify: vLLM {act.vllm.version}, patch set {data['patch_set']['name']}, "
          f"{where}; {total} checks; record: {output}", flush=True)
    _write(output, data)
    with tempfile.TemporaryDirectory(prefix="ascend-patch-verify-") as workdir:
        models = {**models, "tiny-qwen2-w8a8": checks.w8a8_checkpoint(models, Path(workdir))}
        for family in checks.families(models):
            print(f"ascend-patch verify: starting the {family.name} engine ({family.model})...", flush=True)
            facts = data["families"].setdefault(family.name, {})
            for result in checks.run(family, models[family.model], device["count"], facts):
                data["checks"].append(result.as_dict())
                print(_line(len(data["checks"]), total, result), flush=True)
                _write(output, data)
    data.update(finished=_now(), complete=True, summary=record.summary(data["checks"]),
                seconds=round(time.perf_counter() - started, 1))
    _write(output, data)
    outcome = data["summary"]
    print(f"ascend-patch verify: {outcome['verdict'].upper()}: {outcome['pass']} passed, {outcome['fail']} "
          f"failed, {outcome['error']} errors, {outcome['skipped']} skipped in {data['seconds']:.0f} s"
          f"{' (emulated)' if emulate else ''}; record: {output}", flush=True)
    return 0 if outcome["verdict"] == "pass" else 1
