"""The CI run's policies (tests/helpers/ci.py), each in a pytest run of its own on a sample file:
under ``CI=true`` a skip the run did not choose fails, a chosen one stays a skip; outside CI
every skip stays one; and Hypothesis draws the same examples on every CI run."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.helpers.process import ROOT, clean_env

SAMPLE = '''
import pytest
from hypothesis import given, settings, strategies as st


def test_unreachable_index():
    pytest.skip("PyPI is unreachable (timed out): probing a real release needs it")


@pytest.mark.skipif(True, reason="no GPU here")
def test_unchosen_mark():
    pass


@pytest.mark.skipif(True, reason="recurrent layers are served on vLLM 0.33 and later")
def test_chosen_mark():
    pass


def test_chosen_in_the_body():
    pytest.skip("0.25.0 is recorded as untested")


@pytest.mark.xfail(reason="a known failure is not a skip")
def test_expected_failure():
    assert False


def test_runs():
    pass


@settings(max_examples=5)
@given(st.integers())
def test_draws(value):
    print("drawn", value)
'''


def _run(tmp_path, ci: str) -> tuple[dict[str, str], str]:
    """Each sample test's outcome (passed, skipped, failure, error), and the run's output."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / f"report-{ci or 'none'}.xml"
    env = clean_env(CI=ci, PYTHONPATH=str(ROOT))
    env.pop("HYPOTHESIS_PROFILE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.helpers.ci", "-p", "no:cacheprovider", "-s",
         f"--junitxml={report}", "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"),
         "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return outcomes, proc.stdout


OUTSIDE_CI = {"test_unreachable_index": "skipped", "test_unchosen_mark": "skipped",
              "test_chosen_mark": "skipped", "test_chosen_in_the_body": "skipped",
              "test_expected_failure": "skipped", "test_runs": "passed", "test_draws": "passed"}


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_skip_the_run_did_not_choose_fails(tmp_path, ci):
    outcomes, output = _run(tmp_path, ci)
    # a skip in the test fails it, one from a mark (setup) errs it; chosen skips and xfail stay
    assert outcomes == {**OUTSIDE_CI, "test_unreachable_index": "failure", "test_unchosen_mark": "error"}
    assert "skipped under CI for a reason the run did not choose: PyPI is unreachable" in output


@pytest.mark.parametrize("ci", ["", "false"])
def test_outside_ci_every_skip_stays_a_skip(tmp_path, ci):
    assert _run(tmp_path, ci)[0] == OUTSIDE_CI


def test_hypothesis_draws_the_same_examples_on_every_ci_run(tmp_path):
    def drawn(ci):
        return [line for line in _run(tmp_path, ci)[1].splitlines() if line.startswith("drawn")]

    first = drawn("true")
    assert len(first) > 1 and drawn("true") == first
