"""Read patch targets out of vLLM source files without importing them.

Verifying a patch set must not import the modules it patches: the model-runner
module alone takes seconds to import, and the API-server process never needs
it. So targets are verified against the installed ``.py`` files with ``ast``,
the same way ``ascend-patch probe`` checks a release that is not installed.
Signatures are compared by parameter names, kinds and whether a default
exists; annotations and default values are ignored, because a wrapper that
forwards ``*args, **kwargs`` does not care about them.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Definition:
    kind: str  # "function", "class", "property" or "value"
    signature: str | None
    body_digest: str | None
    lineno: int


def render_arguments(args: ast.arguments) -> str:
    """``ast.arguments`` → ``(self, a, b=..., *args, c, **kw)``."""
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    parts = []
    for index, arg in enumerate(positional):
        parts.append(arg.arg + ("=..." if index >= first_default else ""))
        if args.posonlyargs and index == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        parts.append(arg.arg + ("=..." if default is not None else ""))
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return f"({', '.join(parts)})"


def render_signature(func) -> str:
    """The same rendering for a live function, from :func:`inspect.signature`."""
    signature = inspect.signature(func, follow_wrapped=False)
    parts = []
    kinds = inspect.Parameter
    seen_kw_only = False
    params = list(signature.parameters.values())
    for index, param in enumerate(params):
        if param.kind is kinds.VAR_POSITIONAL:
            parts.append(f"*{param.name}")
            seen_kw_only = True
            continue
        if param.kind is kinds.VAR_KEYWORD:
            parts.append(f"**{param.name}")
            continue
        if param.kind is kinds.KEYWORD_ONLY and not seen_kw_only:
            parts.append("*")
            seen_kw_only = True
        has_default = param.default is not inspect.Parameter.empty
        parts.append(param.name + ("=..." if has_default else ""))
        nxt = params[index + 1] if index + 1 < len(params) else None
        if param.kind is kinds.POSITIONAL_ONLY and (
            nxt is None or nxt.kind is not kinds.POSITIONAL_ONLY
        ):
            parts.append("/")
    return f"({', '.join(parts)})"


def _body_digest(node: ast.AST) -> str:
    body = list(getattr(node, "body", []))
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]  # a docstring edit is not a behaviour change
    dump = "\n".join(ast.dump(stmt, include_attributes=False) for stmt in body)
    return hashlib.sha256(dump.encode()).hexdigest()[:12]


def _statements(body: list[ast.stmt]):
    """Top-level statements, looking inside module-level ``if``/``try`` blocks."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _statements(stmt.body)
            yield from _statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from _statements(block)
            for handler in stmt.handlers:
                yield from _statements(handler.body)
        else:
            yield stmt


def _describe(node: ast.stmt, name: str) -> Definition | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
        decorators = {
            d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)
            for d in node.decorator_list
        }
        kind = "property" if "property" in decorators or "cached_property" in decorators else "function"
        return Definition(kind, render_arguments(node.args), _body_digest(node), node.lineno)
    if isinstance(node, ast.ClassDef) and node.name == name:
        return Definition("class", None, None, node.lineno)
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets = [node.target]
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
        return Definition("value", None, None, node.lineno)
    return None


def _find(body: list[ast.stmt], path: list[str]) -> Definition | None:
    head, rest = path[0], path[1:]
    for stmt in _statements(body):
        found = _describe(stmt, head)
        if found is None:
            continue
        if not rest:
            return found
        return _find(stmt.body, rest) if isinstance(stmt, ast.ClassDef) else None
    return None


class SourceTree:
    """The ``vllm`` package of one installation, sdist or checkout, parsed lazily."""

    def __init__(self, package_dir: Path):
        self.package_dir = Path(package_dir)
        self._modules: dict[str, ast.Module | None] = {}

    def module_path(self, module: str) -> Path | None:
        parts = module.split(".")
        if parts[0] != self.package_dir.name:
            return None
        base = self.package_dir.joinpath(*parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def _parse(self, module: str) -> ast.Module | None:
        if module not in self._modules:
            path = self.module_path(module)
            self._modules[module] = (
                ast.parse(path.read_bytes(), filename=str(path)) if path else None
            )
        return self._modules[module]

    def has_module(self, module: str) -> bool:
        return self.module_path(module) is not None

    def lookup(self, module: str, qualname: str) -> Definition | None:
        tree = self._parse(module)
        if tree is None:
            return None
        return _find(tree.body, qualname.split("."))
