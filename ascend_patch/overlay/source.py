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
import sys
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


def _imported(stmt: ast.stmt, name: str, package: str) -> tuple[str, str] | None:
    """``(module, name)`` a ``from X import ...`` statement binds ``name`` to; ``name`` is "*"
    when only a star import could. ``package`` resolves relative imports."""
    if not isinstance(stmt, ast.ImportFrom) or stmt.module is None and stmt.level == 0:
        return None
    if stmt.level:
        base = package.rsplit(".", stmt.level - 1)[0] if stmt.level > 1 else package
        module = f"{base}.{stmt.module}" if stmt.module else base
    else:
        module = stmt.module
    for alias in stmt.names:
        if alias.name == "*" or (alias.asname or alias.name) == name:
            return module, alias.name
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
    """Top-level packages (``vllm``, and ``torch`` for the torch targets) of one
    installation, sdist or checkout, parsed lazily. C extension modules are read from
    their ``.pyi`` stubs; names a module re-exports with ``from x import name`` (or
    ``*``) are looked up where they are defined."""

    _MAX_HOPS = 4  # re-export chains are short; this only stops a cycle

    def __init__(self, package_dir: Path, *more: Path):
        self.package_dir = Path(package_dir)
        self._roots = {p.name: p for p in (self.package_dir, *map(Path, more))}
        self._modules: dict[str, ast.Module | None] = {}
        self._errors: dict[str, str] = {}
        self.read_paths: set[Path] = set()
        """Every file parsed so far (re-exports lead beyond the declared modules)."""

    def module_path(self, module: str) -> Path | None:
        parts = module.split(".")
        root = self._roots.get(parts[0])
        if root is None:
            return None
        base = root.joinpath(*parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py",
                          base.with_suffix(".pyi"), base / "__init__.pyi"):
            if candidate.is_file():
                return candidate
        return None

    def _parse(self, module: str) -> ast.Module | None:
        if module not in self._modules:
            path = self.module_path(module)
            tree = None
            if path is not None:
                try:
                    tree = ast.parse(path.read_bytes(), filename=str(path))
                except (SyntaxError, ValueError, OSError) as exc:  # ValueError: NUL bytes
                    where = f":{exc.lineno}" if getattr(exc, "lineno", None) else ""
                    detail = getattr(exc, "msg", None) or getattr(exc, "strerror", None) or exc
                    self._errors[module] = (
                        f"{path}{where} cannot be read by this Python "
                        f"({sys.version.split()[0]}): {detail}"
                    )
            self._modules[module] = tree
            if path is not None:
                self.read_paths.add(path)
        return self._modules[module]

    def parse_error(self, module: str) -> str | None:
        """Why the module's file exists but cannot be parsed, if it cannot."""
        self._parse(module)
        return self._errors.get(module)

    def has_module(self, module: str) -> bool:
        return self.module_path(module) is not None

    def has_root(self, module: str) -> bool:
        """Whether the module's top-level package is part of this tree at all."""
        return module.partition(".")[0] in self._roots

    def lookup(self, module: str, qualname: str, _hops: int = 0) -> Definition | None:
        tree = self._parse(module)
        if tree is None:
            return None
        path = qualname.split(".")
        found = _find(tree.body, path)
        if found is not None or _hops >= self._MAX_HOPS:
            return found
        is_package = self.module_path(module).stem == "__init__"
        package = module if is_package else module.rpartition(".")[0]
        for stmt in _statements(tree.body):
            origin = _imported(stmt, path[0], package)
            if origin is None:
                continue
            source_module, name = origin
            rest = ".".join([path[0] if name == "*" else name, *path[1:]])
            found = self.lookup(source_module, rest, _hops + 1)
            if found is not None:
                return found
        return None

    def mentions(self, module: str, text: str) -> bool:
        """Whether the module's code holds the string constant ``text`` (an env variable name)."""
        tree = self._parse(module)
        return tree is not None and any(
            isinstance(node, ast.Constant) and node.value == text for node in ast.walk(tree)
        )
