"""The ``ascend-patch`` command (also ``python -m ascend_patch``): ``doctor``, ``probe`` and
``verify``.

Docs: docs/installation.md, "Installing for real use"; docs/compatibility.md, "Probing a release";
docs/hardware-kit.md, "Hardware acceptance kit: `ascend-patch verify`".
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from ascend_patch import __version__

ISSUES = "the issue tracker of the repository you installed ascend-patch from"
"""Where to report a problem; docs/faq.md says what to attach (``ascend-patch collect-env``)."""


def _doctor(args: argparse.Namespace) -> int:
    from ascend_patch.cli import doctor, output

    if args.apply and not args.json:
        print("ascend-patch doctor: importing vLLM and every target module, so each patch is applied "
              "(about 20 s)...", file=sys.stderr, flush=True)
    data = doctor.report(apply=args.apply)
    print(output.dumps(data) if args.json else doctor.render(data, targets=args.targets, verbose=args.verbose))
    return 0 if data["ok"] else 1


def _matrix(args: argparse.Namespace) -> int:
    from ascend_patch.cli import output
    from ascend_patch.overlay import matrix

    try:
        table = matrix.load(args.file)
    except matrix.MatrixError as exc:
        if args.json:
            print(output.dumps(output.error("matrix", str(exc))))
        print(f"ascend-patch matrix: {exc}", file=sys.stderr)
        return 2
    if args.constraints:
        print(matrix.render_constraints(table))
    elif args.json:
        print(output.dumps(output.document("matrix", matrix.to_jsonable(table))))
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
        targets=args.targets,
        verbose=args.verbose,
    )


def _verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ascend_patch.cli import verify

    return verify.run(args.emulate, Path(args.output), Path(args.models) if args.models else None)


def _collect_env(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ascend_patch.cli import collect_env, output

    print(output.dumps(collect_env.collect(Path(args.record))))
    return 0


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--emulat`` is a typo, not ``--emulate``), and a "did you mean" for a
    misspelt command or flag."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = _suggestion(self, message)
        super().error(message + (f"; did you mean {hint}?" if hint else ""))


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str | None:
    choice = re.search(r"invalid choice: '([^']*)'", message)
    if choice:
        commands = [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                    for name in action.choices]
        near = difflib.get_close_matches(choice.group(1), commands, n=1)
        return near[0] if near else None
    unknown = re.search(r"unrecognized arguments: (\S+)", message)
    if unknown and unknown.group(1).startswith("-"):
        flags = [flag for action in _all_actions(parser) for flag in action.option_strings]
        near = difflib.get_close_matches(unknown.group(1).split("=")[0], flags, n=1)
        return near[0] if near else None
    return None


def _all_actions(parser: argparse.ArgumentParser):
    """The parser's actions and those of every subcommand (unrecognised flags of a subcommand
    are reported by the top-level parser)."""
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ascend-patch", description="Stock vLLM on Huawei Ascend NPUs, as an overlay.",
        epilog=f"Report problems to {ISSUES}, with the output of `ascend-patch collect-env`.",
    )
    parser.add_argument("--version", action="version", version=f"ascend-patch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    doctor = commands.add_parser(
        "doctor", help="would the overlay activate here, and why: verdict, counts, problems, versions"
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--targets", action="store_true", help="list every target and its state")
    doctor.add_argument("--verbose", action="store_true",
                        help="explain NNAL, quantisation and each known limitation in full")
    doctor.add_argument(
        "--apply",
        action="store_true",
        help="import vLLM and every target module so each patch is applied, not only verified",
    )
    doctor.set_defaults(func=_doctor)

    table = commands.add_parser("matrix", help="print compat_matrix.yaml: releases, patch sets, evidence")
    table.add_argument("--json", action="store_true", help="machine-readable output")
    table.add_argument("--constraints", action="store_true",
                       help="print the vLLM (and torch-npu) releases this ascend-patch serves as a pip "
                            "constraints file")
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
        metavar="VERSION|latest|PATH",
        help="a release on the index (0.33.0, or latest: the newest; its sdist is fetched into the "
        "cache), or a wheel, sdist, source tree, vllm package directory or installed site-packages",
    )
    probe.add_argument(
        "--version",
        default=None,
        help="the vLLM version of PATH, for a checkout that records none",
    )
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.add_argument("--targets", action="store_true", help="list every target and its state")
    probe.add_argument("--verbose", action="store_true", help="explain each known limitation in full")
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

    collect = commands.add_parser(
        "collect-env",
        help="print a bug-report bundle (JSON): versions, CANN/NNAL, SoC, settings, doctor, last verify record",
        description="Everything a bug report needs, nothing private: the home directory is written as ~, "
        "and only ASCEND_PATCH* and VLLM_* settings are included. Attach the output to your report.",
    )
    collect.add_argument("--record", default="ascend-patch-verify.json",
                         help="the verify record to include (default: ./ascend-patch-verify.json, if present)")
    collect.set_defaults(func=_collect_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `ascend-patch doctor | head`: the reader has what it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
