"""compat_matrix.yaml: schema validation and patch-set selection."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ascend_patch.overlay import matrix
from tests.helpers.process import ROOT

MATRIX = ROOT / "compat_matrix.yaml"


def _valid() -> dict:
    return {
        "schema": 1,
        "patch_sets": {
            "old": {"vllm": ">=0.20,<0.29", "summary": "before"},
            "new": {"vllm": ">=0.29,<0.34", "summary": "after"},
        },
        "versions": {
            "0.33.0": {
                "patch_set": "new",
                "torch": "2.14.0",
                "torch_npu": "2.14.0",
                "cann": "unknown",
                "status": "emulated-e2e",
                "date": "2026-11-29",
                "evidence": {"e2e": {"command": "scripts/x", "passed": 3, "environment": {"torch": "2.13.0+cpu"}}},
            },
            "0.27.0": {
                "patch_set": "old",
                "torch": "2.13.0",
                "torch_npu": "2.13.0",
                "cann": "unknown",
                "status": "untested",
            },
        },
        "limitations": [{"id": "x", "vllm": ">=0.29", "summary": "y"}],
    }


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_the_shipped_matrix_is_valid():
    table = matrix.load(MATRIX)
    assert [s.name for s in table.patch_sets][-1] == "v0_34"
    assert {"0.33.0", "0.34.0"} <= set(table.versions)
    assert all(e.status != "npu-verified" for e in table.versions.values())


def test_default_path_is_the_shipped_matrix():
    assert matrix.default_path() == MATRIX


@pytest.mark.parametrize(
    ("version", "kind", "chosen"),
    [
        ("0.33.0", "in-range", "new"),
        ("0.29.0", "in-range", "new"),
        ("0.29.0rc1", "in-range", "new"),
        ("0.33.1.dev12+gabc123", "in-range", "new"),
        ("0.33.0+empty", "in-range", "new"),
        ("0.28.0", "in-range", "old"),
        ("0.20.0", "in-range", "old"),
        ("0.34.0", "newer", "new"),
        ("0.34.0.dev5+gdeadbee", "newer", "new"),
        ("1.2.0", "newer", "new"),
        ("0.19.1", "older", None),
        ("0.11.0", "older", None),
    ],
)
def test_selection_rules(tmp_path, version, kind, chosen):
    table = matrix.load(_write(tmp_path, _valid()))
    selection = table.select(version)
    assert selection.kind == kind
    assert (selection.patch_set.name if selection.patch_set else None) == chosen
    assert version in selection.reason


def test_a_gap_between_ranges_selects_nothing(tmp_path):
    data = _valid()
    data["patch_sets"]["old"]["vllm"] = ">=0.20,<0.27"
    data["versions"].pop("0.27.0")
    selection = matrix.load(_write(tmp_path, data)).select("0.28.0")
    assert selection.kind == "gap" and selection.patch_set is None


def test_exact_entry_is_attached(tmp_path):
    table = matrix.load(_write(tmp_path, _valid()))
    assert table.select("0.33.0+empty").entry.status == "emulated-e2e"
    assert table.select("0.31.0").entry is None


def _mutations():
    def drop(*keys):
        def mutate(d):
            target = d
            for key in keys[:-1]:
                target = target[key]
            del target[keys[-1]]
        return mutate

    def put(value, *keys):
        def mutate(d):
            target = d
            for key in keys[:-1]:
                target = target[key]
            target[keys[-1]] = value
        return mutate

    return [
        (put(2, "schema"), "schema", "expected 1"),
        (drop("patch_sets"), "<top>.patch_sets", "missing"),
        (put({}, "patch_sets"), "patch_sets", "at least one"),
        (put(">=0.29", "patch_sets", "new", "vllm"), "patch_sets.new.vllm", ">=LOW,<HIGH"),
        (put("=>0.29", "patch_sets", "new", "vllm"), "patch_sets.new.vllm", "not a PEP 440"),
        (put(">=0.25,<0.34", "patch_sets", "new", "vllm"), "patch_sets.new.vllm", "overlaps"),
        (put(">=0.34,<0.29", "patch_sets", "new", "vllm"), "patch_sets.new.vllm", "empty range"),
        (drop("patch_sets", "new", "summary"), "patch_sets.new.summary", "missing"),
        (put("old", "versions", "0.33.0", "patch_set"), "versions.0.33.0.patch_set", "ranges put"),
        (put("great", "versions", "0.33.0", "status"), "versions.0.33.0.status", "not one of"),
        (drop("versions", "0.33.0", "date"), "versions.0.33.0.date", "required"),
        (drop("versions", "0.33.0", "evidence"), "versions.0.33.0.evidence", "required"),
        (put("npu-verified", "versions", "0.33.0", "status"), "versions.0.33.0.evidence.npu", "hardware"),
        (put(2.14, "versions", "0.33.0", "torch"), "versions.0.33.0.torch", "expected str"),
        (drop("versions", "0.27.0", "cann"), "versions.0.27.0.cann", "missing"),
        (put([{"id": "x", "vllm": "???", "summary": "s"}], "limitations"), "limitations[0].vllm", "not a PEP 440"),
    ]


@pytest.mark.parametrize(("mutate", "key", "problem"), _mutations())
def test_malformed_matrix_names_file_key_and_problem(tmp_path, mutate, key, problem):
    data = _valid()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(matrix.MatrixError) as err:
        matrix.load(path)
    message = str(err.value)
    assert str(path) in message
    assert f": {key}: " in message
    assert problem in message


def test_bad_version_keys(tmp_path):
    data = _valid()
    data["versions"]["0.33"] = data["versions"].pop("0.33.0")
    with pytest.raises(matrix.MatrixError, match=r"versions\.0\.33: key must be a plain release"):
        matrix.load(_write(tmp_path, data))


def test_not_yaml_and_unreadable(tmp_path):
    with pytest.raises(matrix.MatrixError, match=r"line \d+: not valid YAML"):
        matrix.load(_write(tmp_path, "schema: 1\npatch_sets: [unclosed\n"))
    with pytest.raises(matrix.MatrixError, match="cannot read"):
        matrix.load(tmp_path / "missing.yaml")


def test_env_override_path(tmp_path, monkeypatch):
    path = _write(tmp_path, _valid())
    monkeypatch.setenv("ASCEND_PATCH_MATRIX", str(path))
    assert matrix.load().path == path


def test_markdown_lists_every_version_newest_first(tmp_path):
    text = matrix.render_markdown(matrix.load(_write(tmp_path, _valid())))
    rows = [line for line in text.splitlines() if line.startswith("| 0.")]
    assert rows[0].startswith("| 0.33.0 | new | 2.14.0 | 2.13.0+cpu | 2.14.0 | unknown | emulated-e2e | 2026-11-29 |")
    assert rows[1].startswith("| 0.27.0 | old | 2.13.0 | - |")


def test_an_emulated_row_names_the_torch_its_run_used(tmp_path):
    """The pinned torch is vLLM's; the run's is what CI could install (a CPU build): both shown."""
    table = matrix.load(_write(tmp_path, _valid()))
    assert (table.versions["0.33.0"].torch, table.versions["0.33.0"].torch_run) == ("2.14.0", "2.13.0+cpu")
    assert table.versions["0.27.0"].torch_run is None
    rows = {row["vllm"]: row for row in matrix.to_jsonable(table)["versions"]}
    assert (rows["0.33.0"]["torch_run"], rows["0.27.0"]["torch_run"]) == ("2.13.0+cpu", None)
    data = _valid()
    del data["versions"]["0.33.0"]["evidence"]["e2e"]["environment"]
    with pytest.raises(matrix.MatrixError, match=r"versions\.0\.33\.0\.evidence\.e2e\.environment\.torch: "
                                                 r"required for status emulated-e2e"):
        matrix.load(_write(tmp_path, data))
    shipped = matrix.load()
    assert all(e.torch_run for e in shipped.versions.values() if e.status == "emulated-e2e")


def _npu_verified(evidence_edit=None) -> dict:
    """A matrix whose 0.33.0 row is npu-verified by the evidence record_matrix_run.py writes, from
    a synthetic record (a fixture of the validation: no run made it)."""
    from ascend_patch.kit import record

    synthetic = {
        "schema": 1, "command": "ascend-patch verify", "finished": "2026-12-01T10:00:00+00:00",
        "ascend_patch": "0.1.0", "patch_set": {"name": "new", "digest": "d" * 64},
        "device": {"soc": "synthetic", "family": None, "count": 1},
        "versions": {"vllm": "0.33.0", "torch": "2.14.0", "torch_npu": "synthetic", "cann": "synthetic",
                     "nnal": "synthetic", "driver": None},
        "checks": [{"name": name, "verdict": "skipped" if name == "tp" else "pass"} for name in record.CHECKS],
    }
    evidence = record.npu_evidence(synthetic, "a" * 64)
    if evidence_edit:
        evidence_edit(evidence)
    data = _valid()
    data["versions"]["0.33.0"].update(status="npu-verified", evidence={"npu": evidence})
    return data


def test_npu_verified_with_its_record_is_valid(tmp_path):
    entry = matrix.load(_write(tmp_path, _npu_verified())).versions["0.33.0"]
    assert entry.status == "npu-verified" and entry.evidence["npu"]["checks"]["tp"] == "skipped"


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda e: e.update(record_sha256="not-a-digest"), "record_sha256 must be the sha256"),
    (lambda e: e.update(run="emulated-e2e"), "not written from an ascend-patch verify record"),
    (lambda e: e.update(patch_set="old"), "the run used patch set 'old', the row says 'new'"),
    (lambda e: e["versions"].update(vllm="0.32.0"), "the run's vLLM is not 0.33.0"),
    (lambda e: e["versions"].update(cann=None), "versions.cann is missing"),
    (lambda e: e["checks"].update(mla="fail"), "checks that did not pass: mla"),
    (lambda e: e["checks"].update(graphs="skipped"), "checks that did not pass: graphs"),
    (lambda e: e["checks"].pop("moe"), "checks must list exactly"),
    (lambda e: e.update(date="yesterday"), "date must be the run's date"),
])
def test_npu_verified_needs_exactly_the_record_of_a_passing_hardware_run(tmp_path, edit, problem):
    with pytest.raises(matrix.MatrixError, match=r"versions\.0\.33\.0\.evidence\.npu: ") as err:
        matrix.load(_write(tmp_path, _npu_verified(edit)))
    assert problem in str(err.value)


def test_the_feature_page_says_which_suites_passed_on_which_line(tmp_path):
    data = _valid()
    data["versions"]["0.33.0"]["evidence"]["e2e"].update(
        suite="tests/test_engine.py", features={"suites": ["tests/test_moe.py"]})
    text = matrix.render_features(matrix.load(_write(tmp_path, data)))
    assert "| | new (`>=0.29,<0.34`) | old (`>=0.20,<0.29`) |" in text
    assert "| releases by status | emulated-e2e x1 | untested x1 |" in text
    assert "| `tests/test_engine.py` passed, emulated | 0.33.0 | - |" in text
    assert "| `tests/test_moe.py` passed, emulated | 0.33.0 | - |" in text
    assert "| [x](compatibility.md#known-limitations) | limited | - |" in text
