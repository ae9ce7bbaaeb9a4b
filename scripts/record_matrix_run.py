"""Keep compat_matrix.yaml true: run a vLLM release and record what was run.

For each VERSION:

1. static: ``ascend-patch probe VERSION`` checks every target of the set the loader
   would pick against that release's source (nothing installed);
2. dynamic (when ``requirements/test-vllm-VERSION.txt`` pins an environment for it):
   builds ``.venvs/vllm-VERSION`` with that exact vLLM on the CPU torch, and runs the
   emulated end-to-end suite (tests/test_engine.py: greedy equal to HF, prefix caching,
   chunked prefill, bf16 fused kernels, sampling, emulated HBM, LoRA) inside it, and, on a release
   in FEATURES, the feature tests carrying its marker (on 0.28.0, the v0_20 set's: speculative
   decoding, disaggregated prefill, data parallelism, encoder-only pooling, sleep mode, a
   vision-language model; on 0.33.0, what only a release with the V1 model runner can check);
3. writes the outcome into the matrix: ``emulated-e2e`` when the suites passed,
   ``static-probe`` when only the probe ran and every target verified,
   ``unsupported`` when the probe found mismatches — with the date and the evidence.

``--evidence FILE`` instead turns the record of an ``ascend-patch verify`` run on Ascend hardware
into the ``npu-verified`` status of the vLLM release it ran, with its provenance in
``evidence.npu`` (the row's other evidence is kept). It refuses, in one line, a record that did
not pass, one made in emulation, and one whose vLLM version or patch set differs from the row's
(or from this checkout's declarations of that set).

    python scripts/record_matrix_run.py 0.32.0 0.29.0          # run and record
    python scripts/record_matrix_run.py --static-only 0.20.0   # probe only
    python scripts/record_matrix_run.py --check 0.32.0         # run, fail if the matrix disagrees
    python scripts/record_matrix_run.py --refresh-probe 0.31.0 # re-probe only, keep status and e2e record
    python scripts/record_matrix_run.py --evidence ascend-patch-verify.json   # a user's NPU record

Downstream CI can pin a version the same way: ``--check`` exits 1 when the recorded
status is not what the run shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "compat_matrix.yaml"
E2E_SUITE = "tests/test_engine.py"
FEATURES = {"0.28.0": "v0_20_features", "0.33.0": "v1_runner or each_runner"}
"""Pinned release -> the pytest markers (a ``-m`` expression) of the feature tests its run adds to
the e2e suite."""
FEATURE_SUITES = {
    "v0_20_features": ["tests/test_spec_decode.py", "tests/test_kv_transfer.py", "tests/test_kv_offload.py",
                       "tests/test_data_parallel.py", "tests/test_pooling.py", "tests/test_graph.py",
                       "tests/test_vl.py", "tests/test_moe.py"],
    # What only a release with vLLM's V1 model runner can check (the main environment's, 0.34+,
    # has Model Runner V2 only): V1's rejection sampler, the V1 sets' implementations and the V1
    # drafter's PIECEWISE graphs; and what each runner generation serves through its own code
    # (each_runner: recurrent layers' state books, the Mooncake connector's registration), which
    # the main line checks on MRV2.
    "v1_runner or each_runner": ["tests/kernels/test_spec_decode.py", "tests/test_graph_spec.py",
                                 "tests/test_manifest.py", "tests/test_mooncake.py",
                                 "tests/test_recurrent.py"],
}
"""Marker expression -> the test files that carry one of its markers."""


def requirements_for(version: str) -> Path:
    return ROOT / "requirements" / f"test-vllm-{version}.txt"


def static_probe(version: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_patch", "probe", version, "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    if proc.returncode == 2:
        raise SystemExit(f"probe of {version} failed:\n{proc.stderr}")
    data = json.loads(proc.stdout)
    targets = data["targets"]
    return {
        "run": "static-probe",
        "command": f"ascend-patch probe {version}",
        "patch_set": data["selection"]["probed_set"],
        "targets": len(targets),
        "verified": sum(1 for t in targets if t["state"] == "verified"),
        # torch's device-API targets: not in a vLLM release, verified at import vllm
        "unchecked": sum(1 for t in targets if t["state"] == "unchecked"),
        "mismatches": [f"{t['target']}: {t['found']}" for t in targets
                       if t["state"] not in ("verified", "unchecked")],
        "would_activate": proc.returncode == 0,
    }


def main_requirements() -> Path:
    """The main line's requirements file: the one ``scripts/setup_env.sh`` builds ``.venv`` from
    by default (decided there, once)."""
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    found = re.search(r'^REQUIREMENTS="\$\{ASCEND_PATCH_REQUIREMENTS:-\$ROOT/(requirements/[^}]+)\}"$', script,
                      re.MULTILINE)
    if found is None:
        raise SystemExit("scripts/setup_env.sh names no default requirements file")
    return ROOT / found.group(1)


def main_line() -> str:
    """The vLLM release of the main environment: the one :func:`main_requirements` pins."""
    return re.fullmatch(r"test-vllm-(.+)\.txt", main_requirements().name).group(1)


def _environment(version: str) -> Path:
    """The release's pinned environment: the main .venv for the one setup_env.sh builds
    by default, .venvs/vllm-VERSION for the others (built from the main one's packages where
    it exists, installing only the pins that differ)."""
    main = main_requirements()
    venv = ROOT / ".venv" if requirements_for(version) == main else ROOT / ".venvs" / f"vllm-{version}"
    env = {**os.environ, "ASCEND_PATCH_REQUIREMENTS": str(requirements_for(version)),
           "ASCEND_PATCH_BASE_VENV": str(ROOT / ".venv")}
    subprocess.run([str(ROOT / "scripts" / "setup_env.sh"), str(venv)], check=True, env=env)
    return venv


def _pytest(python: Path, args: list[str]) -> dict:
    """Run pytest on ``args`` in the release's environment: its counts and exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_PATCH")}
        proc = subprocess.run(
            [str(python), "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
            cwd=ROOT, env=env, timeout=3600,
        )
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = int(suite.get("tests"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    skipped = int(suite.get("skipped", 0))
    return {"passed": tests - failed - skipped, "failed": failed, "skipped": skipped,
            "exit_status": proc.returncode}


def dynamic_e2e(version: str) -> dict:
    """The e2e suite's record, and the feature tests' (``features``) on a release in FEATURES."""
    venv = _environment(version)
    python = venv / "bin" / "python"
    e2e = _pytest(python, [E2E_SUITE])
    versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, json, platform; print(json.dumps({"
         "'vllm': m.version('vllm'), 'torch': m.version('torch'), "
         "'transformers': m.version('transformers'), 'python': platform.python_version()}))"],
        capture_output=True, text=True, check=True,
    )
    command = f"scripts/record_matrix_run.py {version}"
    record = {"run": "emulated-e2e", "command": command, "suite": E2E_SUITE, **e2e,
              "environment": json.loads(versions.stdout)}
    if version in FEATURES:
        marker = FEATURES[version]
        suites = FEATURE_SUITES[marker]
        record["features"] = {"run": "emulated-features", "command": command, "suites": suites,
                              "marker": marker, **_pytest(python, [*suites, "-m", marker])}
    return record


def passed(run: dict) -> bool:
    """Every test ran and passed, and pytest agrees: a skip or a crash is not evidence."""
    return run["failed"] == 0 and run["skipped"] == 0 and run["passed"] > 0 and run["exit_status"] == 0


def outcome(version: str, static_only: bool) -> tuple[str, dict]:
    evidence = {"static_probe": static_probe(version)}
    if not evidence["static_probe"]["would_activate"]:
        return "unsupported", evidence
    if static_only or not requirements_for(version).is_file():
        return "static-probe", evidence
    evidence["e2e"] = run = dynamic_e2e(version)
    ok = passed(run) and ("features" not in run or passed(run["features"]))
    return ("emulated-e2e" if ok else "unsupported"), evidence


def refresh_probe(version: str) -> None:
    """Re-record only the static evidence of a listed release, keeping its status and any
    end-to-end record (after the manifest gained or lost declarations)."""
    data = yaml.safe_load(MATRIX.read_text())
    entry = data["versions"][version]
    evidence = {**entry.get("evidence", {}), "static_probe": static_probe(version)}
    if not evidence["static_probe"]["would_activate"]:
        raise SystemExit(f"{version} no longer verifies; record it with a full run instead")
    write(version, entry["status"], evidence, date=str(entry.get("date")))


def npu_verified(path: Path, version: str | None) -> str:
    """Record a passing hardware record of ``ascend-patch verify`` as the npu-verified status of
    its vLLM release (``version``, when given, must be that release); returns the release."""
    from ascend_patch.kit import record
    from ascend_patch.overlay import decision, matrix
    from ascend_patch.overlay.declarations import applies_to

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: refused: not a readable JSON record ({exc})") from None
    found = data.get("versions", {}).get("vllm") if isinstance(data, dict) else None
    version = version or found
    table = matrix.load(MATRIX)
    entry = table.versions.get(str(version))
    if entry is None:
        raise SystemExit(f"{path}: refused: {MATRIX} has no row for vLLM {version}")
    declarations = [d for d in decision.load_patch_set(table, entry.patch_set)
                    if applies_to(d, Version(version))]
    try:
        problem = record.conversion_problem(data, version, entry.patch_set, record.patch_set_digest(declarations))
        npu = None if problem else record.npu_evidence(data, record.file_sha256(path))
    except (KeyError, TypeError, AttributeError) as exc:
        problem = f"a malformed record ({type(exc).__name__}: {exc})"
    if problem:
        raise SystemExit(f"{path}: refused: {problem}")
    evidence = {**entry.evidence, "npu": npu}
    write(version, "npu-verified", evidence, date=evidence["npu"]["date"])
    matrix.load(MATRIX)  # what was written validates as npu-verified evidence
    return version


def write(version: str, status: str, evidence: dict, date: str | None = None) -> None:
    """Update one version's status, date and evidence, keeping the file's comments."""
    text = MATRIX.read_text()
    head, body = text.split("\nschema:", 1)
    data = yaml.safe_load("schema:" + body)
    entry = data["versions"].get(version)
    if entry is None:
        raise SystemExit(f"{MATRIX}: no row for {version}; add it (patch set, torch, torch_npu, cann) first")
    entry.update(status=status, date=date or datetime.date.today().isoformat(), evidence=evidence)
    data["versions"] = dict(sorted(data["versions"].items(), key=lambda kv: Version(kv[0]), reverse=True))
    MATRIX.write_text(head + "\n" + yaml.safe_dump(data, sort_keys=False, width=100))


def main() -> int:
    global MATRIX
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--static-only", action="store_true", help="probe only, build no environment")
    parser.add_argument("--check", action="store_true", help="compare with the matrix instead of writing it")
    parser.add_argument("--refresh-probe", action="store_true",
                        help="re-record only the static evidence, keeping status and e2e record")
    parser.add_argument("--evidence", type=Path, metavar="FILE",
                        help="an `ascend-patch verify` record from Ascend hardware: record npu-verified")
    parser.add_argument("--matrix", type=Path, default=MATRIX,
                        help="the matrix to update (default: the repository's; the README is re-rendered "
                             "only for that one)")
    args = parser.parse_args()
    MATRIX = args.matrix.resolve()
    render = MATRIX == ROOT / "compat_matrix.yaml"
    if args.evidence:
        if len(args.versions) > 1:
            parser.error("--evidence records one release")
        version = npu_verified(args.evidence, args.versions[0] if args.versions else None)
        print(f"   {version}: npu-verified from {args.evidence}", file=sys.stderr)
        if render:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "render_readme_matrix.py")], check=True)
        return 0
    if not args.versions:
        parser.error("name the vLLM versions to run, or give --evidence")
    if args.refresh_probe:
        for version in args.versions:
            refresh_probe(version)
        if render:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "render_readme_matrix.py")], check=True)
        return 0
    disagreements = []
    for version in args.versions:
        print(f"== vLLM {version}", file=sys.stderr)
        status, evidence = outcome(version, args.static_only)
        print(f"   {status}: {json.dumps(evidence)}", file=sys.stderr)
        if args.check:
            recorded = yaml.safe_load(MATRIX.read_text())["versions"].get(version, {}).get("status")
            if recorded != status:
                disagreements.append(f"{version}: matrix says {recorded}, the run shows {status}")
        else:
            write(version, status, evidence)
    if disagreements:
        print("compat_matrix.yaml disagrees with what ran:\n  " + "\n  ".join(disagreements), file=sys.stderr)
        return 1
    if not args.check and render:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "render_readme_matrix.py")], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
