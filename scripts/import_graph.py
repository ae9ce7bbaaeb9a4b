#!/usr/bin/env python3
"""Check the package's import graph: no cycle, and no arrow from the overlay wing into the NPU
wing (or torch).

Every import statement of ``ascend_patch/**`` and of the manifest (``patches/``, shipped as
``ascend_patch.patches``) counts, those inside functions too; an arrow goes to the package's own
module it names (``from a import b`` names ``a.b`` when that is a module, else ``a``). Code the
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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()
OVERLAY, NPU = "ascend_patch.overlay", "ascend_patch.npu"


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


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(arrows between the package's modules, the outside top-level packages each imports)."""
    ours = modules(root)
    arrows: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in ours.items():
        arrows[name], outside[name] = set(), set()
        for module, names in _imports(name, path):
            if module.split(".")[0] != "ascend_patch":
                outside[name].add(module.split(".")[0])
                continue
            submodules = {f"{module}.{n}" for n in names} & ours.keys()
            # `from a import b` takes module a.b, or the name b from a
            targets = submodules | ({module} if len(submodules) < len(names) or not names else set())
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


def wing_violations(arrows: dict[str, set[str]], outside: dict[str, set[str]]) -> list[str]:
    """Every arrow from the overlay wing into the NPU wing, and every torch import there."""
    found = []
    for name in sorted(n for n in arrows if n == OVERLAY or n.startswith(OVERLAY + ".")):
        found += [f"{name} -> {t}" for t in sorted(arrows[name]) if t == NPU or t.startswith(NPU + ".")]
        if "torch" in outside[name]:
            found.append(f"{name} -> torch")
    return found


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
    print(f"{len(arrows)} modules, {sum(map(len, arrows.values()))} arrows")
    for cycle in known:
        print(f"known cycle: {' <-> '.join(sorted(cycle))}")
    for failure in failures:
        print(failure)
    print("ok" if not failures else f"{len(failures)} violation(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
