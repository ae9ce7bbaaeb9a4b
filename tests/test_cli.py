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
from tests.helpers.patch_sets import installed
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


INSTALLED = installed()


def test_doctor_json_reports_the_installed_releases_set_with_every_target_verified():
    import importlib.metadata

    proc = _cli("doctor", "--json", ASCEND_PATCH="emulate")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["versions"]["vllm"] == INSTALLED.vllm
    assert data["versions"]["vllm_distribution"] == "vllm"
    assert data["versions"]["torch"] == importlib.metadata.version("torch")
    assert data["versions"]["torch_npu"] is None
    assert (data["requested_mode"], data["mode"]) == ("emulate", "emulate")
    assert data["patch_set"] == INSTALLED.patch_set
    assert f"inside patch set {INSTALLED.patch_set}" in data["patch_set_reason"]
    assert data["would_activate"] is True
    # The whole manifest: vLLM patches and contracts, torch device-API overrides, forced
    # settings and version seams, each with where it is implemented, why, and when it goes.
    assert [t["target"] for t in data["targets"]] == [p.target for p in INSTALLED.manifest]
    assert {t["state"] for t in data["targets"]} == {"verified"}
    kinds = {t["kind"] for t in data["targets"]}
    assert kinds == {str(d.kind) for d in INSTALLED.manifest} >= {"wrap", "replace", "contract", "seam"}
    assert any(t["target"] == "torch.cuda:Stream" for t in data["targets"])
    # The V1 runner's releases force it off; from 0.34 Model Runner V2 is the only runner.
    assert any(t["target"] == "vllm.envs:VLLM_USE_V2_MODEL_RUNNER"
               for t in data["targets"]) == (INSTALLED.runner == "V1")
    for t in data["targets"]:
        assert t["implementation"] and t["upstream"] and t["remove_when"], t["target"]
    assert data["settings"] == {"ASCEND_PATCH": "emulate"}
    assert any(path.endswith("a1_ascend_patch.pth") for path in data["pth"])
    # What the matrix says does not run on this release, as probe says it.
    expected = [lim.id for lim in matrix.load().limitations_for(Version(INSTALLED.vllm))]
    assert [lim["id"] for lim in data["limitations"]] == expected and expected


def test_doctor_apply_reports_applied_targets():
    proc = _cli("doctor", "--json", "--apply", ASCEND_PATCH="emulate")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    states = {t["target"]: t["state"] for t in data["targets"]}
    for patch in INSTALLED.manifest:
        if "emulate" in getattr(patch, "modes", ("emulate",)):
            assert states[patch.target] == ("verified" if patch.kind in ("contract", "seam") else "applied")
    assert data["import_failures"] == []
    # Quantisation: the `ascend` method registered with vLLM and the NPU int8 kernel in vLLM's
    # ScaledMM table for out-of-tree platforms.
    assert data["quantization"]["registered"] == {
        "methods": ["ascend", "compressed-tensors"],
        "int8_kernels": ["AscendInt8ScaledMMLinearKernel"]}


def test_doctor_table_and_exit_status():
    ok = _cli("doctor", ASCEND_PATCH="emulate", COLUMNS="200")
    assert ok.returncode == 0
    first = ok.stdout.splitlines()[:3]
    assert first[0].startswith("verdict") and first[0].endswith("would activate (emulate mode)")
    name = INSTALLED.patch_set
    assert re.match(rf"patch set\s+{name} \(runner {INSTALLED.runner}\): all \d+ targets of {name} verify$",
                    first[1])
    assert re.match(r"targets\s+(\d+) targets: \1 verified$", first[2])
    assert "vllm.platforms:resolve_current_platform_cls_qualname" not in ok.stdout, "behind --targets"
    first_limitation = matrix.load().limitations_for(Version(INSTALLED.vllm))[0].id
    assert re.search(rf"^limitations\s+{first_limitation}, ", ok.stdout, re.MULTILINE)
    assert re.search(r"^quantization\s+ascend, compressed-tensors \(\d+/\d+ verified declarations\)$",
                     ok.stdout, re.MULTILINE)
    listed = _cli("doctor", "--targets", "--verbose", ASCEND_PATCH="emulate", COLUMNS="200").stdout
    assert re.search(r"^verified\s+wrap\s+vllm.platforms:resolve_current_platform_cls_qualname$", listed,
                     re.MULTILINE)
    assert f"known limitations of this release (compat_matrix.yaml):\n  {first_limitation}  " in listed
    assert "  ascend  " in listed.split("\nquantization:\n", 1)[1]

    auto = _cli("doctor")
    assert auto.returncode == 0, "auto on a machine without an NPU is not a failure"
    assert "stock vLLM here (no NPU); the patch set verifies" in auto.stdout, "vetted in every mode"
    assert re.search(r"^next step\s+ASCEND_PATCH=emulate runs the same NPU code path", auto.stdout, re.MULTILINE)
    off = json.loads(_cli("doctor", "--json", ASCEND_PATCH="off").stdout)
    assert off["state"] == "off" and off["patch_set"] == INSTALLED.patch_set and off["summary"]["verified"] > 0
    assert off["problems"] == [] and "unset ASCEND_PATCH" in off["next_step"]

    forced = _cli("doctor", ASCEND_PATCH="npu")
    assert forced.returncode == 1, "npu was asked for and cannot activate"
    assert "ASCEND_PATCH=npu but no NPU is usable" in forced.stdout

    old = _cli("doctor", ASCEND_PATCH="emulate", ASCEND_PATCH_VLLM_VERSION="0.11.0", COLUMNS="200")
    assert old.returncode == 1
    assert re.search(r"^problem\s+vLLM 0.11.0 is older than every patch set", old.stdout, re.MULTILINE)
    served = re.escape(matrix.load().served_range())
    assert re.search(r"^next step\s+Install a vLLM release this ascend-patch serves \(pip install "
                     rf"'vllm{served}'\).*details: `ascend-patch probe 0.11.0`$", old.stdout, re.MULTILINE)

    bad = _cli("doctor", ASCEND_PATCH="sometimes")
    assert bad.returncode == 1 and "is not a mode" in bad.stdout


@pytest.mark.parametrize("command", [("doctor",), ("doctor", "--targets", "--verbose"), ("probe", "--help")])
def test_text_output_fits_an_80_column_terminal(command):
    """Every line fits, except one that holds a single unbreakable word (a long path)."""
    proc = _cli(*command, ASCEND_PATCH="emulate", COLUMNS="80")
    assert proc.stdout
    for line in proc.stdout.splitlines():
        assert len(line) <= 80 or len(line.split()) == 1, line


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
    wide = {"COLUMNS": "1000"}
    table = _cli("doctor", "--verbose", ASCEND_PATCH="emulate", LD_LIBRARY_PATH=str(lib), **stack, **wide).stdout
    assert re.search(r"^NNAL \(ATB\)\s+8\.5\.0 \(.*libatb\.so\)$", table, re.MULTILINE)
    assert re.search(r"^SoC\s+Ascend910B3 \(A2\) \[npu-smi\]$", table, re.MULTILINE)
    assert re.search(r"^  atb.npu_multi_head_latent_attention\s+MLA decode \(DeepSeek-V2/V3\)$", table, re.MULTILINE)

    unsourced = _cli("doctor", ASCEND_PATCH="emulate", LD_LIBRARY_PATH="", **stack, **wide).stdout
    assert "libatb.so is not on LD_LIBRARY_PATH: `source /usr/local/Ascend/nnal/atb/set_env.sh`" in unsourced
    missing = _cli("doctor", ASCEND_PATCH="emulate", **wide).stdout
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


def test_matrix_constraints_is_a_pip_constraints_file_of_the_served_releases():
    from packaging.requirements import Requirement

    proc = _cli("matrix", "--constraints")
    assert proc.returncode == 0, proc.stderr
    requirements = [Requirement(line) for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert [r.name for r in requirements] == ["vllm"]
    table = matrix.load()
    served = requirements[0].specifier
    assert all(served.contains(version) for version in table.versions), "every listed release is served"
    assert not served.contains(str(table.patch_sets[-1].upper)) and not served.contains("0.19.0")
    assert "#   vllm==0.33.0: torch==2.14.0, torch-npu==2.14.0, CANN unknown (emulated-e2e)" in proc.stdout


def _envelope(data: dict, command: str) -> None:
    assert (data["schema"], data["kind"]) == (1, f"ascend-patch-{command}")


def test_every_json_output_carries_the_schema_and_errors_are_json_too(tmp_path):
    """doctor, matrix, probe and collect-env: one envelope (schema, kind), and an error in
    --json mode is that envelope with an error string (the verify record: test_verify)."""
    _envelope(json.loads(_cli("doctor", "--json", ASCEND_PATCH="emulate").stdout), "doctor")
    _envelope(json.loads(_cli("matrix", "--json").stdout), "matrix")
    package = json.loads(_cli("probe", "--json", str(tmp_path)).stdout)
    _envelope(package, "probe")
    assert "is not a vLLM source" in package["error"]
    broken = _cli("matrix", "--json", "--file", str(tmp_path / "none.yaml"))
    assert broken.returncode == 2
    error = json.loads(broken.stdout)
    _envelope(error, "matrix")
    assert set(error) == {"schema", "kind", "error"} and "cannot read" in error["error"]
    bad_mode = json.loads(_cli("doctor", "--json", ASCEND_PATCH="sometimes").stdout)
    _envelope(bad_mode, "doctor")
    assert "ASCEND_PATCH='sometimes' is not a mode" in bad_mode["error"]
    from ascend_patch.cli import output
    from ascend_patch.kit import record

    assert output.SCHEMA == record.SCHEMA, "the verify record shares the schema version"


def test_collect_env_is_a_bug_report_bundle_without_private_values(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "ascend-patch-verify.json").write_text(json.dumps({"kind": "ascend-patch-verify", "where": str(home)}))
    proc = subprocess.run([sys.executable, "-m", "ascend_patch", "collect-env"], capture_output=True, text=True,
                          env=clean_env(ASCEND_PATCH="emulate", HOME=str(home), VLLM_API_KEY="secret-value",
                                        VLLM_LOGGING_LEVEL="INFO", ASCEND_PATCH_CACHE_DIR=str(home / "cache")),
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    _envelope(data, "collect-env")
    assert data["versions"]["vllm"] == INSTALLED.vllm and data["doctor"]["would_activate"] is True
    assert data["settings"].items() >= {"ASCEND_PATCH": "emulate", "ASCEND_PATCH_CACHE_DIR": "~/cache",
                                        "VLLM_LOGGING_LEVEL": "INFO"}.items()
    assert "VLLM_API_KEY" not in data["settings"]
    assert data["verify_record"]["record"] == {"kind": "ascend-patch-verify", "where": "~"}
    assert "secret-value" not in proc.stdout and str(home) not in proc.stdout


def test_version_and_no_abbreviations_with_a_suggestion():
    from ascend_patch import __version__
    from ascend_patch.cli import build_parser

    assert _cli("--version").stdout.strip() == f"ascend-patch {__version__}"
    parser = build_parser()
    subparsers = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0].choices
    assert not parser.allow_abbrev and not any(sub.allow_abbrev for sub in subparsers.values())
    typo = _cli("verify", "--emulat")
    assert typo.returncode == 2, "a prefix of --emulate is not --emulate"
    assert typo.stderr.strip().endswith("unrecognized arguments: --emulat; did you mean --emulate?")
    command = _cli("doctr")
    assert command.returncode == 2 and command.stderr.strip().endswith("did you mean doctor?")
    flag = _cli("doctor", "--target")
    assert flag.returncode == 2 and flag.stderr.strip().endswith("did you mean --targets?")


def test_no_argument_parser_in_the_repository_accepts_abbreviations():
    """``verify --emulat`` ran the whole kit once: every parser, the scripts' too, refuses prefixes."""
    for path in [*ROOT.glob("scripts/*.py"), *ROOT.glob("ascend_patch/**/*.py")]:
        for call in re.findall(r"ArgumentParser\((.*)", path.read_text()):
            assert "allow_abbrev=False" in call, (path, call)
