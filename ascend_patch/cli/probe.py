"""``ascend-patch probe VERSION | PATH``: would the overlay activate on this vLLM?

Engineers trying a brand-new upstream release, and CI pinning versions against
the matrix, need that answer before building a 340 MB environment around the
release. So the probe never installs or imports vLLM: it reads the release's
``vllm/**/*.py`` files and gives the same answer the loader would at
``import vllm`` — the patch set :meth:`ascend_patch.overlay.matrix.Matrix.select`
picks, then :func:`ascend_patch.overlay.verification.verify` over every target, against
:class:`ascend_patch.overlay.source.SourceTree`.

Getting at that source (a release fetched from an index into the cache, an
archive, a tree) is :mod:`ascend_patch.cli.releases`.

Beyond "does it verify", each target reports whether its *body* changed since
the release its patch set was written against (digests committed in
``patches/<set>_digests.json`` by ``scripts/update_digests.py``). That is
informational: a wrapper survives a body change, but it is where to look
first when a new release misbehaves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from packaging.version import Version

from ascend_patch.cli import output
from ascend_patch.cli.doctor import counts, target_lines
from ascend_patch.cli.releases import ProbeError, Source, open_source
from ascend_patch.overlay import matrix
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.decision import decide, load_patch_set
from ascend_patch.overlay.declarations import Contract, Declaration, Patch, State
from ascend_patch.overlay.source import SourceTree

SCHEMA_VERSION = output.SCHEMA


# -- the report ---------------------------------------------------------------


def digests_path(set_name: str) -> Path:
    import ascend_patch.patches

    return Path(ascend_patch.patches.__file__).resolve().parent / f"{set_name}_digests.json"


def load_digests(set_name: str) -> dict | None:
    path = digests_path(set_name)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def digest_targets(declarations: list[Declaration]) -> list[Patch | Contract]:
    """The declarations whose vLLM function bodies the digests track."""
    return [d for d in declarations
            if isinstance(d, (Patch, Contract)) and d.module.split(".")[0] == "vllm"]


def compute_digests(patches: list[Patch | Contract], tree: SourceTree) -> dict[str, str | None]:
    """Each target's body digest in ``tree`` (None for classes, values and absent targets)."""
    digests = {}
    for patch in patches:
        found = tree.lookup(patch.module, patch.qualname) if tree.has_module(patch.module) else None
        digests[patch.target] = found.body_digest if found else None
    return digests


def reference_release(table: matrix.Matrix, set_name: str) -> str:
    """The release a set's digests come from: the newest one the matrix lists in its range."""
    listed = [Version(v) for v, e in table.versions.items() if e.patch_set == set_name]
    if not listed:
        raise ProbeError(
            f"the matrix lists no vLLM release for patch set {set_name}; add one to "
            f"versions: in {table.path}"
        )
    return str(max(listed))


def patches_of(set_name: str, table: matrix.Matrix | None = None) -> list[Patch | Contract]:
    """The set's patches on vLLM functions (the ones with body digests)."""
    return digest_targets(load_patch_set(table or matrix.load(), set_name))


def probe(source: Source, table: matrix.Matrix) -> dict:
    """Everything the loader would decide for ``source``, as a JSON-able report."""
    warnings: list[str] = []
    decision = decide(source.version if versions.parse_or_none(source.version) else None,
                      SourceTree(source.package_dir), table)
    selection, checked = decision.selection, decision.checked
    if decision.version is None:
        warnings.append(f"{source.version_source}. Pass --version X to select as for release X")
    elif selection.kind == "newer":
        warnings.append(selection.reason)
    unreadable = [s for s in decision.statuses if s.state is State.UNREADABLE]
    if unreadable:
        raise ProbeError(f"{unreadable[0].found}; run the probe with a Python the release supports")
    digests = load_digests(checked.name)
    reference = digests["reference"] if digests else None
    tracked = digest_targets(decision.declarations)
    if digests is None:
        warnings.append(
            f"no body digests for patch set {checked.name}; run scripts/update_digests.py"
        )
    elif any(p.target not in digests["digests"] for p in tracked):
        warnings.append(
            f"the body digests of {checked.name} predate some of its targets; "
            "run scripts/update_digests.py"
        )
    recorded = digests["digests"] if digests else {}
    current = compute_digests(tracked, SourceTree(source.package_dir)) if digests else {}
    targets = []
    for status in decision.statuses:
        patch = status.patch
        body = None
        known, now = recorded.get(patch.target), current.get(patch.target)
        if known is not None and now is not None:
            body = "same" if known == now else "changed"
        targets.append(
            {
                "target": patch.target,
                "kind": patch.kind,
                "state": status.state,
                "present": status.state not in (State.MISSING, State.UNCHECKED),
                "signature_match": (None if getattr(patch, "signature", None) is None
                                    else status.state is State.VERIFIED),
                "expected": patch.expected(),
                "found": status.found,
                "body": body,
                "reason": patch.reason,
                "implementation": patch.implementation,
                "upstream": patch.upstream,
                "remove_when": patch.remove_when,
            }
        )
    verdict = decision.verdict()
    if decision.would_activate and selection.kind == "unknown":
        verdict += ", if the version is newer than every patch set, as assumed"
    release = decision.release
    summary = {
        "targets": len(targets),
        **{state: sum(t["state"] == state for t in targets)
           for state in (State.VERIFIED, State.MISSING, State.MISMATCH, State.UNCHECKED)},
        "body_changed": sum(t["body"] == "changed" for t in targets),
    }
    return output.document("probe", {
        "input": {
            "argument": source.argument,
            "kind": source.kind,
            "package_dir": str(source.package_dir),
            **source.details,
        },
        "vllm": {
            "version": source.version,
            "version_source": source.version_source,
            "release": str(release) if release else None,
        },
        "selection": {
            "kind": selection.kind,
            "patch_set": selection.patch_set.name if selection.patch_set else None,
            "probed_set": checked.name,
            "range": checked.range,
            "reason": selection.reason,
        },
        "matrix_status": selection.entry.status if selection.entry else None,
        "limitations": [
            {"id": lim.id, "summary": lim.summary}
            for lim in table.limitations_for(release or checked.upper)
        ],
        "body_reference": reference,
        "targets": targets,
        "summary": summary,
        "would_activate": decision.would_activate,
        "verdict": verdict,
        "problems": [f"{t['target']}: expected {t['expected']}, found {t['found']}"
                     for t in targets if t["state"] in (State.MISSING, State.MISMATCH)],
        "next_step": None if decision.would_activate else _next_step(table, selection, source.version),
        "warnings": warnings,
    })


def _next_step(table: matrix.Matrix, selection: matrix.Selection, version: str | None) -> str:
    """What to do when the answer is no."""
    served = f"vllm{table.served_range()}"
    if selection.kind in ("newer", "unknown"):
        return (f"stay on a release the patch sets serve ({served}; `ascend-patch matrix --constraints` "
                f"pins it) until a patch set for {version or 'this vLLM'} ships: upgrade ascend-patch then")
    return f"use a release the patch sets serve ({served}), or an ascend-patch that serves {version}"


def _describe_input(data: dict) -> str:
    given = data["input"]
    if given["kind"] == "release":
        check = "sha256 verified" if given.get("sha256_verified") else "no sha256 on the index"
        if given.get("yanked"):
            check += "; yanked on the index"
        where = "cached" if given.get("cached") else "downloaded"
        return f"{given['archive']} from the index ({check}; {where} in {given['cache']})"
    if given["kind"] in ("sdist", "wheel"):
        return f"{given['kind']} {given['argument']}"
    return f"{given['kind']} {given['package_dir']}"


def render(data: dict, targets: bool = False, verbose: bool = False) -> str:
    """Verdict, counts and problems first; ``targets`` adds every target, ``verbose`` the
    limitations in full."""
    columns = output.width()
    v, sel, summary = data["vllm"], data["selection"], data["summary"]
    head = [
        ("verdict", ("would activate: " if data["would_activate"] else "would NOT activate: ") + data["verdict"]),
        ("targets", counts(summary)
         + (f"; {summary['body_changed']} bodies changed since {data['body_reference']}"
            if data["body_reference"] else "")),
    ]
    head += [("problem", problem) for problem in data["problems"][:5]]
    if len(data["problems"]) > 5:
        head.append(("problem", f"... and {len(data['problems']) - 5} more (--targets lists them)"))
    if data["next_step"]:
        head.append(("next step", data["next_step"]))
    rows = [
        ("probed", _describe_input(data)),
        ("vllm", f"{v['version']} (from {v['version_source']})" if v["version"] else "unknown"),
        ("patch set", f"{sel['patch_set'] or 'none'}: {sel['reason']}"),
        ("matrix", data["matrix_status"] or "not listed"),
        ("bodies", f"compared with vLLM {data['body_reference']}, the release "
                   f"{sel['probed_set']} was written against" if data["body_reference"] else "no reference"),
    ]
    if data["limitations"] and not verbose:
        rows.append(("limitations", ", ".join(lim["id"] for lim in data["limitations"])
                     + " (--verbose explains them)"))
    rows.extend(("warning", w) for w in data["warnings"])
    lines = output.fields(head + [("", "")] + rows, columns)
    if verbose and data["limitations"]:
        lines += ["", "known limitations of this release (compat_matrix.yaml):"]
        lines += output.fields([(f"  {lim['id']}", lim["summary"]) for lim in data["limitations"]], columns)
    if targets:
        lines += ["", "targets (state, kind, target):"] + target_lines(data["targets"], columns)
    else:
        lines += ["", "--targets lists every target"]
    return "\n".join(line.rstrip() for line in lines)


def run(argument: str, *, version: str | None, index_url: str, as_json: bool,
        targets: bool = False, verbose: bool = False) -> int:
    """The ``probe`` command: 0 would activate, 1 would not, 2 the probe itself failed."""
    try:
        table = matrix.load()
        with open_source(argument, version, index_url) as source:
            data = probe(source, table)
    except (ProbeError, matrix.MatrixError) as exc:
        return _failed(str(exc), as_json)
    except Exception as exc:  # a bug, yet still "the probe failed", never "would not activate"
        return _failed(f"internal error, please report it: {type(exc).__name__}: {exc}", as_json)
    print(output.dumps(data) if as_json else render(data, targets, verbose))
    return 0 if data["would_activate"] else 1


def _failed(message: str, as_json: bool) -> int:
    message = " ".join(message.split())  # one line, whatever an index put in it
    if as_json:
        print(output.dumps(output.error("probe", message)))
    print(f"ascend-patch probe: {message}", file=sys.stderr)
    return 2
