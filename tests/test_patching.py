"""The patch engine on a small package written for the test.

These tests exercise the engine's own mechanics (verification, lazy and
immediate application, rebinding of ``from x import f`` copies, idempotency,
revert by identity) on a package whose source the test controls. The loader
tests run the same engine against the real vLLM.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import pytest

from ascend_patch.overlay.declarations import Contract, Patch
from ascend_patch.overlay.registry import PatchError, Registry
from ascend_patch.overlay.verification import verify
from ascend_patch.overlay.source import SourceTree, render_arguments, render_signature

MOD = """
def helper(a, b=1, *args, key, flag=False, **extra):
    return ("helper", a, b)

class Engine:
    def step(self, x):
        return ("step", x)

    @classmethod
    def build(cls, n=0):
        return ("build", n)

    @staticmethod
    def pure(y):
        return ("pure", y)

VALUE = 3
"""

USER = """
from {pkg}.mod import helper
"""


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    name = f"fixture_pkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text(textwrap.dedent(MOD))
    (root / "user.py").write_text(USER.format(pkg=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, SourceTree(root)
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


def tag(wrapped, instance, args, kwargs):
    return ("wrapped", wrapped(*args, **kwargs))


def patches(name: str) -> list[Patch | Contract]:
    return [
        Patch(f"{name}.mod:helper", "t", ">=0", ("(a, b=..., *args, key, flag=..., **extra)",), wrapper=tag),
        Patch(f"{name}.mod:Engine.step", "t", ">=0", ("(self, x)",), wrapper=tag),
        Patch(f"{name}.mod:Engine.build", "t", ">=0", ("(cls, n=...)",), wrapper=tag),
        Patch(f"{name}.mod:Engine.pure", "t", ">=0", ("(y)",), wrapper=tag),
        Contract(f"{name}.mod:Engine", "contract", ">=0"),
    ]


def test_verify_reports_each_target(pkg):
    name, tree = pkg
    statuses = verify(
        [
            *patches(name),
            Patch(f"{name}.mod:Engine.step", "t", ">=0", ("(self, x, y)",), wrapper=tag),
            Patch(f"{name}.mod:Engine.gone", "t", ">=0", ("(self)",), wrapper=tag),
            Patch(f"{name}.nomod:f", "t", ">=0", ("()",), wrapper=tag),
            Patch(f"{name}.mod:VALUE", "t", ">=0", ("()",), wrapper=tag),
        ],
        tree,
    )
    states = [(s.state, s.found) for s in statuses]
    assert [s for s, _ in states[:5]] == ["verified"] * 5
    assert states[5] == ("mismatch", "(self, x)")
    assert states[6] == ("missing", "no Engine.gone in " + f"{name}.mod")
    assert states[7] == ("missing", f"no module {name}.nomod")
    assert states[8] == ("mismatch", "a value")
    assert statuses[5].describe() == f"{name}.mod:Engine.step: expected (self, x, y), found (self, x)"


def test_verification_cache_follows_source_bytes(pkg, tmp_path, monkeypatch):
    name, tree = pkg
    cache = tmp_path / "verified"
    first = verify(patches(name), tree, cache_dir=cache)
    assert [s.state for s in first] == ["verified"] * 5 and len(list(cache.iterdir())) == 1

    def no_parsing(self, module):
        raise AssertionError("identical sources must be answered from the cache")

    with monkeypatch.context() as m:
        m.setattr(SourceTree, "_parse", no_parsing)
        again = verify(patches(name), SourceTree(tree.package_dir), cache_dir=cache)
    assert [(s.state, s.found) for s in again] == [(s.state, s.found) for s in first]

    mod = tree.package_dir / "mod.py"
    mod.write_text(mod.read_text().replace("def step(self, x):", "def step(self, x, y):"))
    edited = verify(patches(name), SourceTree(tree.package_dir), cache_dir=cache)
    assert (edited[1].state, edited[1].found) == ("mismatch", "(self, x, y)")
    assert len(list(cache.iterdir())) == 2


def test_unwritable_verification_cache_still_verifies(pkg, tmp_path):
    name, tree = pkg
    blocker = tmp_path / "file"
    blocker.write_text("")
    statuses = verify(patches(name), tree, cache_dir=blocker / "verified")
    assert [s.state for s in statuses] == ["verified"] * 5


def test_lazy_application_on_import(pkg):
    name, _ = pkg
    registry = Registry()
    registry.schedule(patches(name))
    assert f"{name}.mod" not in sys.modules
    mod = importlib.import_module(f"{name}.mod")
    user = importlib.import_module(f"{name}.user")
    assert mod.helper(1, key=0) == ("wrapped", ("helper", 1, 1))
    assert user.helper is mod.helper, "a later `from mod import helper` binds the wrapper"
    assert mod.Engine().step(5) == ("wrapped", ("step", 5))
    assert mod.Engine.build(2) == ("wrapped", ("build", 2))
    assert mod.Engine.pure(7) == ("wrapped", ("pure", 7))
    assert sorted(registry.applied_targets()) == sorted(p.target for p in patches(name)[:4])
    registry.revert_all()
    assert user.helper is mod.helper and mod.helper(1, key=0) == ("helper", 1, 1)


def test_immediate_application_rebinds_earlier_copies_and_reverts_by_identity(pkg):
    name, _ = pkg
    mod = importlib.import_module(f"{name}.mod")
    user = importlib.import_module(f"{name}.user")
    stock = {attr: vars(mod.Engine)[attr] for attr in ("step", "build", "pure")}
    stock_helper = mod.helper
    registry = Registry()
    registry.schedule(patches(name))
    assert user.helper is mod.helper is not stock_helper
    assert registry.get_original(f"{name}.mod:helper") is stock_helper
    assert registry.get_original(f"{name}.mod:Engine.build") is stock["build"]
    assert user.helper(2, key=1) == ("wrapped", ("helper", 2, 1))

    restored = registry.revert_all()
    assert len(restored) == 4
    assert mod.helper is stock_helper and user.helper is stock_helper
    for attr, original in stock.items():
        assert vars(mod.Engine)[attr] is original
    assert registry.applied_targets() == []


def test_scheduling_twice_applies_once(pkg):
    name, _ = pkg
    mod = importlib.import_module(f"{name}.mod")
    registry = Registry()
    registry.schedule(patches(name))
    first = mod.helper
    registry.schedule(patches(name))
    assert mod.helper is first
    assert mod.helper.__wrapped__ is registry.get_original(f"{name}.mod:helper")
    assert mod.helper(0, key=0) == ("wrapped", ("helper", 0, 1))
    registry.revert_all()


def test_revert_cancels_patches_not_yet_applied(pkg):
    name, _ = pkg
    registry = Registry()
    registry.schedule(patches(name))
    registry.revert_all()
    mod = importlib.import_module(f"{name}.mod")
    assert mod.helper(1, key=0) == ("helper", 1, 1)
    assert registry.applied_targets() == []


def test_refuses_a_live_object_that_differs_from_its_source(pkg):
    name, _ = pkg
    mod = importlib.import_module(f"{name}.mod")
    mod.helper = lambda a: a  # another package replaced it at runtime
    with pytest.raises(PatchError, match=r"expected \(a, b=\.\.\., .*found \(a\) at runtime"):
        Registry().schedule(patches(name)[:1])


def test_replacement_patches(pkg):
    name, _ = pkg
    mod = importlib.import_module(f"{name}.mod")
    registry = Registry()
    registry.schedule(
        [Patch(f"{name}.mod:Engine.pure", "t", ">=0", ("(y)",), replacement=lambda orig: staticmethod(lambda y: -y))]
    )
    assert mod.Engine.pure(3) == -3
    registry.revert_all()
    assert mod.Engine.pure(3) == ("pure", 3)


def test_declaration_errors():
    with pytest.raises(ValueError, match="module:qualname"):
        Patch("no_colon", "t", ">=0")
    with pytest.raises(ValueError, match="not both"):
        Patch("a:b", "t", ">=0", wrapper=tag, replacement=lambda o: o)
    with pytest.raises(ValueError, match="only relied on is a Contract"):
        Patch("a:b", "t", ">=0")
    with pytest.raises(ValueError, match="module:qualname"):
        Contract("no_colon", "t")


@pytest.mark.parametrize(
    "source",
    [
        "def f(): pass",
        "def f(a, b=1, *args, c, d=2, **kw): pass",
        "def f(a, /, b, *, c): pass",
        "def f(a, b=1, /, c=2): pass",
        "def f(*, only): pass",
        "def f(self, *args, **kwargs): pass",
    ],
)
def test_static_and_live_renderings_agree(source):
    import ast

    namespace: dict = {}
    exec(source, namespace)
    assert render_arguments(ast.parse(source).body[0].args) == render_signature(namespace["f"])
