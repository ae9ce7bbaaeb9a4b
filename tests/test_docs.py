"""The README says what the code does."""

from __future__ import annotations

import re
import subprocess

import pytest

from ascend_patch import env
from ascend_patch.overlay import matrix
from tests.helpers.process import ROOT, clean_env

README = (ROOT / "README.md").read_text()


def test_every_environment_variable_is_documented_with_its_default():
    rows = dict(re.findall(r"^\| `(ASCEND_PATCH\w*)` \| ([^|]+) \|", README, re.MULTILINE))
    assert set(rows) == {v.name for v in env.VARIABLES}
    for var in env.VARIABLES:
        if var.default:
            assert var.default in rows[var.name], var.name


def test_compatibility_table_is_generated_from_the_matrix():
    table = matrix.render_markdown(matrix.load())
    assert table in README, "run: python scripts/render_readme_matrix.py"


def test_two_commands_exist_and_ci_runs_the_test_command():
    assert "scripts/demo.sh" in README and "scripts/test.sh" in README
    for script in ("scripts/demo.sh", "scripts/test.sh", "scripts/setup_env.sh"):
        assert (ROOT / script).stat().st_mode & 0o111, script
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_readme_main_command_generates_on_the_emulated_npu():
    """``scripts/demo.sh`` as a user runs it: it reuses the environment, builds the tiny
    model, prints doctor, and generates through an unchanged ``LLM(...)`` script (whose
    engine core is a spawned process). Numerics are the engine tests' job."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh")],
        env=clean_env(), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "verdict: would activate" in result.stdout
    assert "platform: EmulatedNPUPlatform (Ascend NPU (emulated on CPU, 1.0 GiB HBM))" in result.stdout
    generations = re.findall(r"^    token ids: \[([\d, ]+)\]$", result.stdout, re.MULTILINE)
    assert [len(ids.split(", ")) for ids in generations] == [24, 24, 24]


def test_the_acceptance_kit_section_lists_every_check_and_the_commands():
    from ascend_patch.kit import record

    section = README.split("## Hardware acceptance kit: `ascend-patch verify`", 1)[1].split("\n## ", 1)[0]
    table = section.split("| check | family", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9-]+)` \| ", table, re.MULTILINE)
    assert listed == list(record.CHECKS)
    for command in ("ascend-patch verify ", "source /usr/local/Ascend/nnal/atb/set_env.sh",
                    "python scripts/record_matrix_run.py --evidence ascend-patch-verify.json",
                    "ascend-patch verify --emulate"):
        assert command in section, command
