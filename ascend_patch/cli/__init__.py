"""The ``ascend-patch`` command (also ``python -m ascend_patch``): ``doctor``, ``probe`` and
``verify``.

Docs: README.md, "Installing for real use", "Probing a release" and "Hardware acceptance kit".
"""

from __future__ import annotations

import argparse
import json
import sys


def _doctor(args: argparse.Namespace) -> int:
    from ascend_patch.cli import doctor

    data = doctor.report(apply=args.apply)
    print(json.dumps(data, indent=2) if args.json else doctor.render(data))
    return 0 if data["ok"] else 1


def _matrix(args: argparse.Namespace) -> int:
    from ascend_patch.overlay import matrix

    try:
        table = matrix.load(args.file)
    except matrix.MatrixError as exc:
        print(f"ascend-patch matrix: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(matrix.to_jsonable(table), indent=2))
    else:
        print(matrix.render_markdown(table))
    return 0


def _probe(args: argparse.Namespace) -> int:
    from ascend_patch.cli import probe, releases

    return probe.run(
        args.target,
        version=args.version,
        index_url=args.index_url or releases.DEFAULT_INDEX,
        as_json=args.json,
    )


def _verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ascend_patch.cli import verify

    return verify.run(args.emulate, Path(args.output), Path(args.models) if args.models else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascend-patch", description="Stock vLLM on Huawei Ascend NPUs, as an overlay."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser(
        "doctor", help="report versions, mode, patch set and every target's status"
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--apply",
        action="store_true",
        help="import vLLM and every target module so each patch is applied, not only verified",
    )
    doctor.set_defaults(func=_doctor)

    table = commands.add_parser("matrix", help="print compat_matrix.yaml")
    table.add_argument("--json", action="store_true", help="machine-readable output")
    table.add_argument("--file", default=None, help="a matrix file other than the installed one")
    table.set_defaults(func=_matrix)

    probe = commands.add_parser(
        "probe",
        help="check a vLLM release or source statically: which patch set, does every target verify",
        description="Check a vLLM release without installing or importing it. Exit status: "
        "0 would activate, 1 would not, 2 the probe failed (bad input, download failure).",
    )
    probe.add_argument(
        "target",
        metavar="VERSION|PATH",
        help="a release on the index (0.33.0; its sdist is fetched into the cache), or a wheel, "
        "sdist, source tree, vllm package directory or installed site-packages",
    )
    probe.add_argument(
        "--version",
        default=None,
        help="the vLLM version of PATH, for a checkout that records none",
    )
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.add_argument(
        "--index-url",
        default=None,
        help="simple-API package index to fetch releases from (default: PyPI, https://pypi.org/simple)",
    )
    probe.set_defaults(func=_probe)

    verify = commands.add_parser(
        "verify",
        help="run the hardware acceptance checks on this NPU and write a JSON evidence record",
        description="Build tiny models locally, run each NPU path (attention, prefix cache, chunked "
        "prefill, graphs, sampler, MLA, MoE, W8A8, TP) against HF transformers on the CPU, and write "
        "one JSON evidence record. Exit status: 0 every check passed, 1 one did not, 2 no NPU.",
    )
    verify.add_argument("--emulate", action="store_true",
                        help="run the same checks on the emulated NPU (CPU tensors), as CI does")
    verify.add_argument("--output", "-o", default="ascend-patch-verify.json",
                        help="where to write the record (default: ./ascend-patch-verify.json)")
    verify.add_argument("--models", default=None,
                        help="where to build the tiny models (default: ASCEND_PATCH_CACHE_DIR/models)")
    verify.set_defaults(func=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
