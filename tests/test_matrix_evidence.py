"""compat_matrix.yaml claims only what was run, and CI re-runs it.

- Every status that claims a run carries the record scripts/record_matrix_run.py writes.
- Every listed release is probed statically (its sdist from PyPI, cached in the workspace)
  and must still verify as the matrix says.
- The releases CI pins (below) are installed in their own environment and run the emulated
  end-to-end suite (a v0_20 release also the feature tests marked ``v0_20_features``); the matrix
  must say ``emulated-e2e`` for each. The runs start in the background when the session's tests are
  collected (tests/helpers/pinned.py), and their tests run last.
"""

from __future__ import annotations

import re
import sys

import pytest
import yaml

from ascend_patch.overlay import matrix
from tests.helpers.process import ROOT, require_pypi

TABLE = matrix.load()
# The main line (scripts/setup_env.sh names it: vLLM 0.34.0, the newest release served) runs the
# whole suite; these releases keep pinned runs. The longest run first: the pinned runs start one
# after another (tests/helpers/pinned.py).
CI_DYNAMIC = ["0.28.0", "0.33.0", "0.29.0"]


def _record_script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import record_matrix_run
    finally:
        sys.path.pop(0)
    return record_matrix_run


@pytest.mark.parametrize("version", sorted(TABLE.versions), ids=str)
def test_every_claimed_status_has_a_recorded_run(version):
    entry = TABLE.versions[version]
    evidence = entry.evidence
    if entry.status == "untested":
        assert not evidence, "untested rows carry no evidence"
        return
    probe = evidence["static_probe"]
    assert probe["run"] == "static-probe" and probe["patch_set"] == entry.patch_set
    if entry.status == "unsupported":
        assert probe["mismatches"], "unsupported needs the failing targets"
        return
    # "unchecked": the torch device-API targets, which no vLLM release contains.
    assert probe["would_activate"] and probe["verified"] + probe["unchecked"] == probe["targets"] > 0
    if entry.status == "npu-verified":
        # record_matrix_run.py --evidence wrote it from a passing hardware record (the matrix
        # validation checks its shape); the row's emulated evidence stays beside it.
        assert evidence["npu"]["run"] == "npu-verify" and evidence["npu"]["patch_set"] == entry.patch_set
        return
    if entry.status == "emulated-e2e":
        run = evidence["e2e"]
        assert run["run"] == "emulated-e2e" and run["suite"] == "tests/test_engine.py"
        assert run["failed"] == 0 and run["passed"] > 0 and run["exit_status"] == 0
        assert run["skipped"] == 0, "a skipped test is an unchecked claim"
        assert run["environment"]["vllm"] == version, "the run used exactly this release"
        record = _record_script()
        marker = record.FEATURES.get(str(version))
        assert ("features" in run) == (marker is not None), "the feature tests of its pinned run"
        if marker:
            features = run["features"]
            assert features["run"] == "emulated-features" and features["marker"] == marker
            assert features["suites"] == record.FEATURE_SUITES[marker]
            assert features["failed"] == features["skipped"] == features["exit_status"] == 0
            assert features["passed"] > 0
    else:
        assert entry.status == "static-probe" and "e2e" not in evidence


def _main_line() -> str:
    return _record_script().main_line()


def test_ci_pins_the_versions_the_issue_asks_for():
    for version in [*CI_DYNAMIC, _main_line()]:
        assert (ROOT / "requirements" / f"test-vllm-{version}.txt").is_file(), version


def test_the_main_line_is_the_newest_release_served():
    """The README's commands set up and test the newest vLLM the matrix serves: new releases are
    what the overlay exists to serve first."""
    served = [version for version, entry in TABLE.versions.items()
              if entry.status in ("emulated-e2e", "npu-verified")]
    assert _main_line() == str(max(served))


def test_ci_reruns_every_release_the_matrix_claims_ran():
    claimed = {str(v) for v, entry in TABLE.versions.items() if entry.status == "emulated-e2e"}
    assert claimed == {*CI_DYNAMIC, _main_line()}


def test_every_release_with_feature_tests_is_pinned_and_its_marker_names_their_files():
    """A pinned release runs the tests carrying its marker (the v0_20 set's features on 0.28.0,
    what only a vLLM with the V1 model runner can check on 0.33.0), and those live in the suites
    its run names."""
    record = _record_script()
    for version, markers in record.FEATURES.items():
        assert version in CI_DYNAMIC, version
        names = "|".join(markers.split(" or "))
        marked = {path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "tests").rglob("test_*.py"))
                  if re.search(rf"mark\.({names})\b", path.read_text())}
        assert marked == set(record.FEATURE_SUITES[markers])


@pytest.mark.parametrize("version", sorted(TABLE.versions), ids=str)
def test_static_probe_still_matches_the_matrix(version):
    require_pypi("re-probing the release sdists")
    entry = TABLE.versions[version]
    if entry.status == "untested":
        pytest.skip(f"{version} is recorded as untested")
    probe = _record_script().static_probe(version)
    recorded = entry.evidence["static_probe"]
    assert probe["patch_set"] == entry.patch_set
    assert probe["would_activate"] == recorded["would_activate"]
    assert (probe["verified"], probe["unchecked"], probe["targets"]) == (
        recorded["verified"], recorded["unchecked"], recorded["targets"])


@pytest.mark.slow
@pytest.mark.parametrize("version", CI_DYNAMIC)
def test_pinned_release_runs_end_to_end(version, pinned_runs):
    """The release's own environment runs the emulated e2e suite (and its set's feature tests):
    ``record_matrix_run.py --check``, started with the session (the ``pinned_runs`` fixture,
    tests/conftest.py)."""
    assert TABLE.versions[version].status == "emulated-e2e"
    code, log = pinned_runs.wait(version, timeout=3000)
    assert code == 0, log


def test_record_script_keeps_the_schema_comment(tmp_path, monkeypatch):
    record = _record_script()
    copy = tmp_path / "compat_matrix.yaml"
    copy.write_text((ROOT / "compat_matrix.yaml").read_text())
    monkeypatch.setattr(record, "MATRIX", copy)
    version = max(TABLE.versions)
    evidence = {"static_probe": {"run": "static-probe", "patch_set": TABLE.versions[version].patch_set,
                                 "targets": 1, "verified": 1, "mismatches": [], "would_activate": True,
                                 "command": "test"}}
    record.write(version, "static-probe", evidence)
    text = copy.read_text()
    assert text.startswith("# compat_matrix.yaml")
    assert "# Schema (version 1)" in text
    reloaded = matrix.load(copy)
    assert reloaded.versions[version].status == "static-probe"
    assert yaml.safe_load(text)["versions"][version]["evidence"] == evidence
