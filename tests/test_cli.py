"""The ascend-patch command: doctor and matrix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
from packaging.version import Version

from ascend_patch.overlay import matrix
from ascend_patch.patches import v0_29
from tests.helpers.engine import for_installed_vllm
from tests.helpers.process import ROOT, clean_env, run_json


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
    # What the matrix says does not run on this release, as probe says it.
    expected = [lim.id for lim in matrix.load().limitations_for(Version("0.33.0"))]
    assert [lim["id"] for lim in data["limitations"]] == expected and expected


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
    assert "known limitations of this release (compat_matrix.yaml):\n  model-runner-v2: " in ok.stdout

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


# What `npu-smi info` prints on an Atlas 800I A2 (the fields vllm-ascend's setup.py reads): a
# stand-in for the driver's tool, which this machine does not have.
NPU_SMI = """#!/bin/sh
case "$*" in
  "info -l") printf '\\tTotal Count                    : 1\\n\\n\\tNPU ID                         : 0\\n' ;;
  "info -t board -i 0") printf '\\tNPU ID                         : 0\\n\\tProduct Name                   : \\n' ;;
  "info -t board -i 0 -c 0") printf '\\tNPU ID                         : 0\\n\\tChip Type                      : Ascend\\n\\tChip Name                      : 910B3\\n' ;;
  *) exit 1 ;;
esac
"""


def _ascend_stack(tmp_path):
    """An NNAL install laid out as its installer lays it out, and npu-smi on PATH."""
    home = tmp_path / "nnal" / "atb" / "latest" / "atb" / "cxx_abi_1"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "libatb.so").write_bytes(b"")
    (tmp_path / "nnal" / "atb" / "latest" / "version.info").write_text("Ascend-cann-atb : 8.5.0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npu-smi").write_text(NPU_SMI)
    (bin_dir / "npu-smi").chmod(0o755)
    return {"ATB_HOME_PATH": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}, home / "lib"


def test_doctor_reports_nnal_the_soc_and_the_paths_that_need_nnal(tmp_path):
    stack, lib = _ascend_stack(tmp_path)
    data = json.loads(_cli("doctor", "--json", ASCEND_PATCH="emulate", LD_LIBRARY_PATH=str(lib), **stack).stdout)
    nnal = data["ascend"]["nnal"]
    assert (nnal["found"], nnal["version"], nnal["on_library_path"]) == (True, "8.5.0", True)
    assert nnal["libatb"] == str(lib / "libatb.so") and data["versions"]["nnal"] == "8.5.0"
    assert data["ascend"]["soc"] == {"soc": "Ascend910B3", "family": "A2", "source": "npu-smi"}
    assert set(data["ascend"]["needs_nnal"]) == {"_npu_paged_attention", "_npu_paged_attention_get_workspace",
                                                 "atb.npu_multi_head_latent_attention"}
    table = _cli("doctor", ASCEND_PATCH="emulate", LD_LIBRARY_PATH=str(lib), **stack).stdout
    assert re.search(r"^NNAL \(ATB\)\s+8\.5\.0 \(.*libatb\.so\)$", table, re.MULTILINE)
    assert re.search(r"^SoC\s+Ascend910B3 \(A2\) \[npu-smi\]$", table, re.MULTILINE)
    assert "  atb.npu_multi_head_latent_attention: MLA decode (DeepSeek-V2/V3)" in table

    unsourced = _cli("doctor", ASCEND_PATCH="emulate", LD_LIBRARY_PATH="", **stack).stdout
    assert "libatb.so is not on LD_LIBRARY_PATH: `source /usr/local/Ascend/nnal/atb/set_env.sh`" in unsourced
    missing = _cli("doctor", ASCEND_PATCH="emulate").stdout
    assert re.search(r"^NNAL \(ATB\)\s+not found: paged decode and MLA decode fail at their first call",
                     missing, re.MULTILINE)
    assert re.search(r"^SoC\s+unknown \(no npu-smi\)$", missing, re.MULTILINE)


def test_the_nnal_table_names_every_atb_call_of_the_kernel_seam():
    """torch_npu exposes its ATB ops as torch_npu.<API_LIST name> and torch_npu.atb.<ATB_API_LIST
    name> (op_plugin/atb/_atb_ops.py of each wheel the matrix pins); every such call of the seam
    must be in doctor's table (an _npu_* name alone does not make an op ATB: FIA's workspace query
    is an aclnn op)."""
    from ascend_patch.cli import toolchain
    from tests import npu_wheels

    atb = set()
    for version in npu_wheels.matrix_versions():
        with zipfile.ZipFile(npu_wheels.fetch(version)) as wheel:
            source = wheel.read(npu_wheels._ATB_OPS).decode()
        atb |= set(npu_wheels._string_list(source, "API_LIST"))
        atb |= {f"atb.{name}" for name in npu_wheels._string_list(source, "ATB_API_LIST")}
    seam = (ROOT / "ascend_patch" / "npu" / "kernels" / "npu.py").read_text()
    called = set(re.findall(r"_torch_npu\(\)\.((?:atb\.)?\w+)\(", seam))
    assert "_npu_paged_attention" in atb and "atb.npu_multi_head_latent_attention" in atb
    assert called & atb == set(toolchain.ATB_OPS)
