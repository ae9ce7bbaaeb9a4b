"""Read, validate and query ``compat_matrix.yaml``.

The matrix is the one source of truth for which vLLM releases map to which
patch set, with which torch / torch-npu / CANN, and with what evidence. The
schema is documented at the top of the YAML file itself; this module enforces
it and every error names the file, the key and the problem.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from ascend_patch import env
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.verification import read_regular_file

SCHEMA_VERSION = 1
STATUSES = ("npu-verified", "emulated-e2e", "static-probe", "untested", "unsupported")
# Statuses that claim a run happened, so they must carry its date and evidence.
_RUN_STATUSES = ("npu-verified", "emulated-e2e", "static-probe")
RUN_END_TO_END = ("npu-verified", "emulated-e2e")
"""The statuses that record an end-to-end run (graph mode is on by default only there)."""


class MatrixError(ValueError):
    """``compat_matrix.yaml`` is malformed. The message names file, key and problem."""


def default_path() -> Path:
    """The matrix sits beside the ``patches`` package: inside ``ascend_patch/`` in
    an installed wheel, at the repository root in a source checkout."""
    import ascend_patch.patches

    return Path(ascend_patch.patches.__file__).resolve().parent.parent / "compat_matrix.yaml"


@dataclass(frozen=True)
class PatchSetSpec:
    name: str
    vllm: SpecifierSet
    lower: Version
    upper: Version
    summary: str

    def contains(self, release: Version) -> bool:
        return self.lower <= release < self.upper

    @property
    def range(self) -> str:
        return f">={self.lower},<{self.upper}"


@dataclass(frozen=True)
class VersionEntry:
    vllm: str
    patch_set: str
    torch: str
    torch_npu: str
    cann: str
    status: str
    date: str | None = None
    evidence: dict = field(default_factory=dict)

    @property
    def torch_run(self) -> str | None:
        """The torch the emulated end-to-end run used (its recorded environment), which is
        not the torch the release pins: CI runs the CPU build it can install."""
        return ((self.evidence.get("e2e") or {}).get("environment") or {}).get("torch")


@dataclass(frozen=True)
class Limitation:
    id: str
    summary: str
    vllm: SpecifierSet


@dataclass(frozen=True)
class Selection:
    """The outcome of choosing a patch set for one vLLM version."""

    patch_set: PatchSetSpec | None
    kind: str  # "in-range", "newer", "older" or "gap"
    reason: str
    entry: VersionEntry | None


@dataclass(frozen=True)
class Matrix:
    path: Path
    patch_sets: tuple[PatchSetSpec, ...]  # ordered oldest range first
    versions: dict[str, VersionEntry]
    limitations: tuple[Limitation, ...]

    def patch_set(self, name: str) -> PatchSetSpec:
        for spec in self.patch_sets:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def served_range(self) -> str:
        """The vLLM releases some patch set serves, as a pip specifier (``>=0.20,<0.34``)."""
        return f">={self.patch_sets[0].lower},<{self.patch_sets[-1].upper}"

    def set_for_release(self, release: Version) -> PatchSetSpec | None:
        return next((s for s in self.patch_sets if s.contains(release)), None)

    def select(self, version_text: str) -> Selection:
        parsed = versions.parse(version_text)
        rel = versions.release(parsed)
        entry = self.versions.get(str(rel))
        in_range = self.set_for_release(rel)
        if in_range is not None:
            return Selection(
                in_range,
                "in-range",
                f"vLLM {version_text} (release {rel}) is inside patch set "
                f"{in_range.name} ({in_range.range})",
                entry,
            )
        newest, oldest = self.patch_sets[-1], self.patch_sets[0]
        if rel >= newest.upper:
            return Selection(
                newest,
                "newer",
                f"vLLM {version_text} is newer than every patch set; trying the newest, "
                f"{newest.name} ({newest.range}), which activates only if every target "
                "verifies",
                entry,
            )
        if rel < oldest.lower:
            return Selection(
                None,
                "older",
                f"vLLM {version_text} is older than every patch set (oldest: "
                f"{oldest.name}, {oldest.range})",
                entry,
            )
        return Selection(
            None,
            "gap",
            f"vLLM {version_text} falls between the patch sets' ranges",
            entry,
        )

    def limitations_for(self, release: Version) -> list[Limitation]:
        return [lim for lim in self.limitations if lim.vllm.contains(release, prereleases=True)]


def _fail(path: Path, key: str, problem: str) -> MatrixError:
    return MatrixError(f"{path}: {key}: {problem}")


def _require(path: Path, mapping: dict, key: str, where: str, kind=str):
    if key not in mapping:
        raise _fail(path, f"{where}.{key}", "missing")
    value = mapping[key]
    if not isinstance(value, kind):
        raise _fail(
            path, f"{where}.{key}", f"expected {kind.__name__}, found {type(value).__name__}"
        )
    return value


def _bounds(path: Path, key: str, text: str) -> tuple[SpecifierSet, Version, Version]:
    try:
        spec = SpecifierSet(text)
    except InvalidSpecifier:
        raise _fail(path, key, f"{text!r} is not a PEP 440 specifier") from None
    lowers = [Version(s.version) for s in spec if s.operator == ">="]
    uppers = [Version(s.version) for s in spec if s.operator == "<"]
    if len(lowers) != 1 or len(uppers) != 1 or len(spec) != 2:
        raise _fail(path, key, f"{text!r} must be exactly '>=LOW,<HIGH'")
    if lowers[0] >= uppers[0]:
        raise _fail(path, key, f"{text!r} is an empty range")
    return spec, lowers[0], uppers[0]


def parse(data: object, path: Path) -> Matrix:
    if not isinstance(data, dict):
        raise _fail(path, "<top>", "expected a mapping")
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        raise _fail(path, "schema", f"expected {SCHEMA_VERSION}, found {schema!r}")

    sets: list[PatchSetSpec] = []
    for name, body in _require(path, data, "patch_sets", "<top>", dict).items():
        where = f"patch_sets.{name}"
        if not isinstance(body, dict):
            raise _fail(path, where, "expected a mapping")
        spec, lower, upper = _bounds(path, f"{where}.vllm", _require(path, body, "vllm", where))
        sets.append(PatchSetSpec(str(name), spec, lower, upper, _require(path, body, "summary", where)))
    if not sets:
        raise _fail(path, "patch_sets", "at least one patch set is required")
    sets.sort(key=lambda s: s.lower)
    for before, after in zip(sets, sets[1:]):
        if after.lower < before.upper:
            raise _fail(
                path, f"patch_sets.{after.name}.vllm", f"overlaps patch set {before.name}"
            )

    entries: dict[str, VersionEntry] = {}
    for text, body in _require(path, data, "versions", "<top>", dict).items():
        where = f"versions.{text}"
        release = versions.parse_or_none(str(text))
        if release is None:
            raise _fail(path, where, "key is not a version")
        if str(release) != str(text) or str(versions.release(release)) != str(text):
            raise _fail(path, where, "key must be a plain release like 0.33.0")
        if not isinstance(body, dict):
            raise _fail(path, where, "expected a mapping")
        entry = VersionEntry(
            vllm=str(text),
            patch_set=_require(path, body, "patch_set", where),
            torch=_require(path, body, "torch", where),
            torch_npu=_require(path, body, "torch_npu", where),
            cann=_require(path, body, "cann", where),
            status=_require(path, body, "status", where),
            date=body.get("date"),
            evidence=body.get("evidence") or {},
        )
        owner = next((s for s in sets if s.contains(release)), None)
        if owner is None or owner.name != entry.patch_set:
            raise _fail(
                path,
                f"{where}.patch_set",
                f"{entry.patch_set!r} but the ranges put {text} in "
                f"{owner.name if owner else 'no patch set'}",
            )
        if entry.status not in STATUSES:
            raise _fail(path, f"{where}.status", f"{entry.status!r} is not one of {STATUSES}")
        if entry.status in _RUN_STATUSES:
            if not isinstance(entry.date, (str, _dt.date)):
                raise _fail(path, f"{where}.date", f"required for status {entry.status}")
            if not isinstance(body.get("evidence"), dict) or not body["evidence"]:
                raise _fail(path, f"{where}.evidence", f"required for status {entry.status}")
        if entry.status == "emulated-e2e" and not isinstance(entry.torch_run, str):
            raise _fail(path, f"{where}.evidence.e2e.environment.torch",
                        "required for status emulated-e2e: the torch the run used")
        if entry.status == "npu-verified":
            # Only rows that claim hardware pay for this import (standard library only).
            from ascend_patch.kit import record

            problem = record.evidence_problem(entry.evidence.get("npu"), str(text), entry.patch_set)
            if problem:
                raise _fail(path, f"{where}.evidence.npu", problem)
        entries[str(text)] = entry

    limitations = []
    listed = data.get("limitations") or []
    if not isinstance(listed, list):
        raise _fail(path, "limitations", f"expected a list, found {type(listed).__name__}")
    for index, body in enumerate(listed):
        where = f"limitations[{index}]"
        if not isinstance(body, dict):
            raise _fail(path, where, "expected a mapping")
        text = _require(path, body, "vllm", where)
        try:
            spec = SpecifierSet(text)
        except InvalidSpecifier:
            raise _fail(path, f"{where}.vllm", f"{text!r} is not a PEP 440 specifier") from None
        limitations.append(
            Limitation(_require(path, body, "id", where), _require(path, body, "summary", where), spec)
        )
    return Matrix(path, tuple(sets), entries, tuple(limitations))


_MAX_BYTES = 4 << 20  # the shipped matrix is ~12 KB; a huge file is not a matrix


def load(path: Path | None = None) -> Matrix:
    """Load ``path``, else ``ASCEND_PATCH_MATRIX``, else the installed matrix. Only a regular
    file of sane size is read: a FIFO would block every ``import vllm``."""
    path = Path(path or env.matrix_path() or default_path())
    try:
        text = read_regular_file(path, _MAX_BYTES).decode("utf-8")
    except OSError as exc:
        raise MatrixError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise MatrixError(f"{path}: not a text file (expected UTF-8 YAML)") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "<parse>"
        raise _fail(path, where, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return parse(data, path)


def to_jsonable(table: Matrix) -> dict:
    return {
        "path": str(table.path),
        "patch_sets": [
            {"name": s.name, "vllm": s.range, "summary": s.summary} for s in table.patch_sets
        ],
        "versions": [
            {
                "vllm": e.vllm,
                "patch_set": e.patch_set,
                "torch": e.torch,
                "torch_npu": e.torch_npu,
                "torch_run": e.torch_run,
                "cann": e.cann,
                "status": e.status,
                "date": str(e.date) if e.date else None,
                "evidence": e.evidence,
            }
            for e in table.versions.values()
        ],
        "limitations": [
            {"id": lim.id, "vllm": str(lim.vllm), "summary": lim.summary}
            for lim in table.limitations
        ],
    }


def render_markdown(table: Matrix, compact: bool = False) -> str:
    """The compatibility table: in full for docs/compatibility.md and ``ascend-patch matrix``;
    ``compact`` (the README's) names each limitation and leaves its text to the docs. A test
    keeps both files identical to what this renders."""
    lines = [
        "| vLLM | patch set | torch (pinned) | torch (run) | torch-npu | CANN | status | date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(table.versions.values(), key=lambda e: Version(e.vllm), reverse=True)
    for e in ordered:
        lines.append(
            f"| {e.vllm} | {e.patch_set} | {e.torch} | {e.torch_run or '-'} | {e.torch_npu} | {e.cann} | "
            f"{e.status} | {e.date or ''} |"
        )
    lines.append("")
    lines.append("| patch set | vLLM | summary |")
    lines.append("|---|---|---|")
    for s in reversed(table.patch_sets):
        lines.append(f"| {s.name} | `{s.range}` | {s.summary} |")
    if table.limitations:
        lines.append("")
        if compact:
            lines.append("Known limitations ([what each means](docs/compatibility.md#known-limitations)): "
                         + ", ".join(f"`{lim.id}`" for lim in table.limitations) + ".")
        else:
            lines.append("### Known limitations")
            lines.append("")
            lines.extend(f"- **{lim.id}** (`{lim.vllm}`): {lim.summary}" for lim in table.limitations)
    return "\n".join(lines)


def _suites_of(entry: VersionEntry) -> list[str]:
    """The test suites an emulated-e2e row's evidence records as passed."""
    if entry.status != "emulated-e2e":
        return []
    e2e = entry.evidence.get("e2e") or {}
    return [e2e["suite"], *((e2e.get("features") or {}).get("suites") or [])] if "suite" in e2e else []


def _recorded_suites(table: Matrix) -> list[str]:
    return list(dict.fromkeys(suite for e in table.versions.values() for suite in _suites_of(e)))


STATUS_LEGEND = {
    "npu-verified": "`ascend-patch verify` passed on Ascend hardware with this exact vLLM (none yet)",
    "emulated-e2e": "the emulated end-to-end suite passed with this exact vLLM installed (CPU, no NPU)",
    "static-probe": "every target verified against the release's source; nothing was run",
    "untested": "nothing has been run against this release",
    "unsupported": "known not to work; the evidence says why",
}


def render_features(table: Matrix) -> str:
    """docs/features.md's table: per release line (patch set), the statuses its releases
    carry, the releases each recorded test suite passed on (emulated), and each known
    limitation: where it applies."""
    sets = list(reversed(table.patch_sets))
    head = "| | " + " | ".join(f"{s.name} (`{s.range}`)" for s in sets) + " |"
    lines = [head, "|---" * (len(sets) + 1) + "|"]

    def statuses(spec: PatchSetSpec) -> str:
        found = [e for e in table.versions.values() if e.patch_set == spec.name]
        return ", ".join(f"{status} x{n}" for status in STATUSES
                         if (n := sum(e.status == status for e in found))) or "none listed"

    lines.append("| releases by status | " + " | ".join(statuses(s) for s in sets) + " |")
    for suite in _recorded_suites(table):
        cells = [", ".join(e.vllm for e in table.versions.values()
                           if e.patch_set == s.name and suite in _suites_of(e)) or "-" for s in sets]
        lines.append(f"| `{suite}` passed, emulated | " + " | ".join(cells) + " |")
    for lim in table.limitations:
        cells = ["limited" if any(lim.vllm.contains(Version(e.vllm), prereleases=True)
                                  for e in table.versions.values() if e.patch_set == s.name) else "-"
                 for s in sets]
        lines.append(f"| [{lim.id}](compatibility.md#known-limitations) | " + " | ".join(cells) + " |")
    lines += ["", "Status legend:", ""]
    lines += [f"- `{status}`: {meaning}" for status, meaning in STATUS_LEGEND.items()]
    return "\n".join(lines)


def render_feature_table(table: Matrix, features: dict[str, list[str]], main_line: str) -> str:
    """The README's feature table: per release line (patch set), the releases on which every test
    suite of a feature is recorded as passing (emulated); ``main_line``, the release of the main
    environment, runs every suite in each CI run."""
    sets = list(reversed(table.patch_sets))
    lines = ["| feature (its suites) | " + " | ".join(f"{s.name} (`{s.range}`)" for s in sets) + " |",
             "|---" * (len(sets) + 1) + "|"]
    releases = [[(e.vllm, set(_suites_of(e))) for e in table.versions.values()
                 if e.patch_set == spec.name] for spec in sets]
    for feature, suites in features.items():
        cells = []
        for found in releases:
            ran = [f"{vllm} (main)" if vllm == main_line else vllm
                   for vllm, passed in found if vllm == main_line or set(suites) <= passed]
            cells.append(", ".join(ran) or "-")
        named = ", ".join(f"`{suite.removeprefix('tests/')}`" for suite in suites)
        lines.append(f"| {feature} ({named}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_constraints(table: Matrix) -> str:
    """A pip constraints file (``pip install -c FILE vllm``): the vLLM releases some patch set
    serves, so ``pip install -U vllm`` cannot move a working host past them; the torch and
    torch-npu each listed release pairs with, as comments (pip cannot express a pairing)."""
    from ascend_patch import __version__

    lines = [f"# ascend-patch {__version__}: the vLLM releases its patch sets serve ({table.path.name})",
             f"vllm{table.served_range()}",
             "# torch-npu must be the release built for the torch your vLLM pins:"]
    for e in sorted(table.versions.values(), key=lambda e: Version(e.vllm), reverse=True):
        lines.append(f"#   vllm=={e.vllm}: torch=={e.torch}, torch-npu=={e.torch_npu}, CANN {e.cann} ({e.status})")
    return "\n".join(lines)
