"""The ascend-patch command: doctor and matrix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ascend_patch.patches import v0_29
from tests.conftest import ROOT, clean_env, for_installed_vllm, run_json


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ascend_patch", *args],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        cwd=ROOT,
        timeout=300,
    )


def test_doctor_json_reports_the_033_set_with_every_target_verified():
    proc = _cli("doctor", "--json", ASCEND_PATCH="emulate")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["versions"]["vllm"] == "0.33.0"
    assert data["versions"]["vllm_distribution"] == "vllm"
    assert data["versions"]["torch"].startswith("2.13.0")
    assert data["versions"]["torch_npu"] is None
    assert (data["requested_mode"], data["mode"]) == ("emulate", "emulate")
    assert data["patch_set"] == "v0_29"
    assert "inside patch set v0_29" in data["patch_set_reason"]
    assert data["would_activate"] is True
    # The whole manifest: vLLM patches and contracts, torch device-API overrides, forced
    # settings and version seams, each with where it is implemented, why, and when it goes.
    assert [t["target"] for t in data["targets"]] == [p.target for p in for_installed_vllm(v0_29.MANIFEST)]
    assert {t["state"] for t in data["targets"]} == {"verified"}
    kinds = {t["kind"] for t in data["targets"]}
    assert kinds == {"wrap", "replace", "contract", "setting", "seam"}
    assert any(t["target"] == "torch.cuda:Stream" for t in data["targets"])
    assert any(t["target"] == "vllm.envs:VLLM_USE_V2_MODEL_RUNNER" for t in data["targets"])
    for t in data["targets"]:
        assert t["implementation"] and t["upstream"] and t["remove_when"], t["target"]
    assert data["settings"] == {"ASCEND_PATCH": "emulate"}
    assert any(path.endswith("a1_ascend_patch.pth") for path in data["pth"])


def test_doctor_apply_reports_applied_targets():
    proc = _cli("doctor", "--json", "--apply", ASCEND_PATCH="emulate")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    states = {t["target"]: t["state"] for t in data["targets"]}
    for patch in for_installed_vllm(v0_29.MANIFEST):
        if "emulate" in getattr(patch, "modes", ("emulate",)):
            assert states[patch.target] == ("verified" if patch.kind in ("contract", "seam") else "applied")
    assert data["import_failures"] == []
    # Quantisation: the `ascend` method registered with vLLM and the NPU int8 kernel in vLLM's
    # ScaledMM table for out-of-tree platforms.
    assert data["quantization"]["registered"] == {
        "methods": ["ascend", "compressed-tensors"],
        "int8_kernels": ["AscendInt8ScaledMMLinearKernel"]}


def test_doctor_table_and_exit_status():
    ok = _cli("doctor", ASCEND_PATCH="emulate")
    assert ok.returncode == 0
    assert "verdict: would activate" in ok.stdout
    assert "vllm.platforms:resolve_current_platform_cls_qualname" in ok.stdout
    assert "quantization (" in ok.stdout and "  ascend: msModelSlim AscendV1" in ok.stdout

    auto = _cli("doctor")
    assert auto.returncode == 0, "auto on a machine without an NPU is not a failure"
    assert "would NOT activate" in auto.stdout and "no NPU" in auto.stdout

    forced = _cli("doctor", ASCEND_PATCH="npu")
    assert forced.returncode == 1, "npu was asked for and cannot activate"
    assert "ASCEND_PATCH=npu but no NPU is usable" in forced.stdout

    old = _cli("doctor", ASCEND_PATCH="emulate", ASCEND_PATCH_VLLM_VERSION="0.11.0")
    assert old.returncode == 1
    assert "older than every patch set" in old.stdout

    bad = _cli("doctor", ASCEND_PATCH="sometimes")
    assert bad.returncode == 1 and "is not a mode" in bad.stdout


@pytest.mark.parametrize("mode", ["auto", "emulate"])
def test_doctor_never_imports_torch(mode):
    """The overlay decides the mode without torch (the NPU wing's torch-free detect module
    answers it); only torch_npu, where installed, would bring torch in."""
    code = """
        import json, sys
        from ascend_patch.cli import doctor
        data = doctor.report()
        print(json.dumps([data["state"], sorted({m.split(".")[0] for m in sys.modules} & {"torch", "vllm"})]))
    """
    state, heavy = run_json(code, env=clean_env(ASCEND_PATCH=mode))
    assert state == ("inert" if mode == "auto" else "verified")
    assert heavy == []


def test_matrix_command():
    proc = _cli("matrix")
    assert proc.returncode == 0
    assert "| 0.33.0 | v0_29 |" in proc.stdout
    data = json.loads(_cli("matrix", "--json").stdout)
    assert {v["vllm"] for v in data["versions"]} >= {"0.33.0", "0.29.0"}
    bad = _cli("matrix", "--file", "/nonexistent/matrix.yaml")
    assert bad.returncode == 2 and "cannot read" in bad.stderr
