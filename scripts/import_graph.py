#!/usr/bin/env python3
"""Check the package's import graph and its walls: no cycle; no arrow from the overlay wing into
the NPU wing (or torch); no module outside the runner room (``ascend_patch/npu/runner/``) imports
``vllm.v1.worker``; every patch set module composes exactly one runner module, the one of the
generation it declares (``RUNNER = "v1"`` composes ``runner_v1``).

Every import statement of ``ascend_patch/**`` and of the manifest (``patches/``, shipped as
``ascend_patch.patches``) counts, those inside functions too; an arrow goes to the package's own
module it names (``from a import b`` names ``a.b`` when that is a module, else ``a``), and to each
package above that module which is not above the importer too: importing ``a.b.c`` runs
``a/b/__init__.py`` first, so a cycle through a package's ``__init__`` is a cycle. Code the
overlay reaches by a ``"module:attribute"`` path (the manifest's implementations, the loader's
``DEVICE_CHECK``) is resolved at run time and is no arrow.

    scripts/import_graph.py            # exit 1 on a cycle or arrow other than the known ones
    scripts/import_graph.py --strict   # the known ones fail too
    scripts/import_graph.py --edges    # and print every arrow

:data:`KNOWN_CYCLES` are cycles reported rather than failed while a restructuring removes them;
there are none.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()
OVERLAY, NPU = "ascend_patch.overlay", "ascend_patch.npu"
RUNNER_ROOM = "ascend_patch.npu.runner"
RUNNER_ONLY = "vllm.v1.worker"
PATCHES = "ascend_patch.patches"
SET_MODULE = re.compile(r"ascend_patch\.patches\.v\d+_\d+$")
RUNNER_MODULE = re.compile(r"ascend_patch\.patches\.runner_(\w+)$")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package as the installed package names it, with its file."""
    found = {}
    for base, prefix in ((root / "ascend_patch", ("ascend_patch",)),
                         (root / "patches", ("ascend_patch", "patches"))):
        for path in sorted(base.rglob("*.py")):
            parts = (*prefix, *path.relative_to(base).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Every import statement of module ``name``: (absolute module, names taken from it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.append((module, tuple(alias.name for alias in node.names)))
    return found


def _packages_above(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(arrows between the package's modules, the outside modules each imports)."""
    ours = modules(root)
    arrows: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in ours.items():
        arrows[name], outside[name] = set(), set()
        # a package's own modules run inside its import: importing them does not run it again
        running = _packages_above(name) | ({name} if path.name == "__init__.py" else set())
        for module, names in _imports(name, path):
            if module.split(".")[0] != "ascend_patch":
                outside[name] |= {module} | {f"{module}.{n}" for n in names}
                continue
            submodules = {f"{module}.{n}" for n in names} & ours.keys()
            # `from a import b` takes module a.b, or the name b from a
            targets = submodules | ({module} if len(submodules) < len(names) or not names else set())
            targets |= {p for t in targets for p in _packages_above(t)} - running
            arrows[name] |= {t for t in targets if t in ours and t != name}
    return arrows, outside


def cycles(arrows: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(arrows.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(arrows):
        if node not in index:
            visit(node)
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def wing_violations(arrows: dict[str, set[str]], outside: dict[str, set[str]]) -> list[str]:
    """Every arrow from the overlay wing into the NPU wing, and every torch import there."""
    found = []
    for name in sorted(n for n in arrows if _within(n, OVERLAY)):
        found += [f"{name} -> {t}" for t in sorted(arrows[name]) if _within(t, NPU)]
        found += [f"{name} -> {m}" for m in sorted(outside[name]) if _within(m, "torch")]
    return found


def runner_violations(arrows: dict[str, set[str]], outside: dict[str, set[str]],
                      root: Path = ROOT) -> list[str]:
    """Every import of ``vllm.v1.worker`` outside the runner room, and every patch set module
    that composes other than exactly the runner module of the generation it declares."""
    found = []
    for name in sorted(n for n in outside if not _within(n, RUNNER_ROOM)):
        hits = {m for m in outside[name] if _within(m, RUNNER_ONLY)}
        # `from a import b` records a and a.b: name the module once
        found += [f"{name} -> {m}" for m in sorted(hits) if m.rpartition(".")[0] not in hits]
    paths = modules(root)
    for name in sorted(n for n in arrows if SET_MODULE.match(n)):
        composed = sorted(t for t in arrows[name] if RUNNER_MODULE.match(t))
        declared = _declared_runner(paths[name])
        if composed != [f"{PATCHES}.runner_{declared}"]:
            found.append(f"{name} declares RUNNER = {declared!r} and composes "
                         f"{', '.join(composed) or 'no runner module'}")
    return found


def _declared_runner(path: Path) -> str | None:
    """The string a module assigns to ``RUNNER`` at its top level, or None."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RUNNER" for t in node.targets)
                and isinstance(node.value, ast.Constant)):
            return node.value.value
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--strict", action="store_true", help="fail on the known cycles too")
    parser.add_argument("--edges", action="store_true", help="print every arrow")
    args = parser.parse_args(argv)
    arrows, outside = graph()
    if args.edges:
        for name in sorted(arrows):
            for target in sorted(arrows[name]):
                print(f"{name} -> {target}")
    found = cycles(arrows)
    known = [c for c in found if c in KNOWN_CYCLES and not args.strict]
    failures = [f"cycle: {' <-> '.join(sorted(c))}" for c in found if c not in known]
    failures += [f"overlay -> npu/torch: {v}" for v in wing_violations(arrows, outside)]
    failures += [f"runner wall: {v}" for v in runner_violations(arrows, outside)]
    print(f"{len(arrows)} modules, {sum(map(len, arrows.values()))} arrows")
    for cycle in known:
        print(f"known cycle: {' <-> '.join(sorted(cycle))}")
    for failure in failures:
        print(failure)
    print("ok" if not failures else f"{len(failures)} violation(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
