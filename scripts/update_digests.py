#!/usr/bin/env python3
"""Write ``patches/<set>_digests.json``: each target's body digest in its set's reference release.

``ascend-patch probe`` compares a release's target bodies with these digests to
say, per target, whether the body changed since the release the patch set was
written against. The reference of a set is the newest release the matrix lists
in the set's range (0.33.0 for v0_29); its sdist comes from the index through
the probe's cache unless a local copy is given. Rerun this after adding a
target or moving a set's reference; the test suite fails when a set's digests
do not cover every target.

    scripts/update_digests.py                      # every set in compat_matrix.yaml
    scripts/update_digests.py v0_29                # one set
    scripts/update_digests.py v0_29=path/to/vllm-0.33.0.tar.gz   # from a local copy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ascend_patch.cli import probe, releases
from ascend_patch.overlay import matrix
from ascend_patch.overlay import version as versions
from ascend_patch.overlay.source import SourceTree


def update(table: matrix.Matrix, set_name: str, local: str | None, index_url: str) -> Path:
    reference = probe.reference_release(table, set_name)
    patches = probe.patches_of(set_name)
    with releases.open_source(local or reference, index_url=index_url) as source:
        if versions.parse_or_none(source.version) != versions.parse(reference):
            raise releases.ProbeError(
                f"{local} is vLLM {source.version or 'of unknown version'}, but the reference "
                f"release of {set_name} is {reference} (the newest the matrix lists in its range)"
            )
        digests = probe.compute_digests(patches, SourceTree(source.package_dir))
    absent = [target for target, digest in digests.items() if digest is None]
    path = probe.digests_path(set_name)
    data = {
        "patch_set": set_name,
        "reference": reference,
        "generated_by": "scripts/update_digests.py; do not edit",
        "digests": digests,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(
        f"{path}: {len(digests)} targets from vLLM {reference}"
        + (f" ({len(absent)} without a body digest: classes, values or absent)" if absent else "")
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "sets", nargs="*", metavar="SET[=PATH]",
        help="patch sets to update (default: all); PATH is a local sdist, wheel or tree of the reference",
    )
    parser.add_argument("--index-url", default=releases.DEFAULT_INDEX)
    args = parser.parse_args(argv)
    table = matrix.load()
    requested = [item.partition("=") for item in args.sets] or [
        (spec.name, "", "") for spec in table.patch_sets
    ]
    try:
        for name, _, local in requested:
            table.patch_set(name)  # KeyError for a set the matrix does not list
            update(table, name, local or None, args.index_url)
    except KeyError as exc:
        print(f"update_digests: no patch set {exc} in {table.path}", file=sys.stderr)
        return 2
    except releases.ProbeError as exc:
        print(f"update_digests: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
