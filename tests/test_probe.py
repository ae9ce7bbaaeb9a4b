"""``ascend-patch probe``: static checks of a vLLM release, sdist, wheel or source tree.

The fixtures are real vLLM sources: the ``.py`` files of every patch target,
copied from the vLLM installed in this environment, then packed as an sdist or
a wheel, or edited (a signature changed, a target removed, a body rewritten).
Downloads go to a package index served on 127.0.0.1 with the same PEP 691 /
PEP 503 pages PyPI serves, so only the last test needs the network.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

from ascend_patch import cli
from ascend_patch.cli import probe, releases
from ascend_patch.cli.releases import limits, transport
from ascend_patch.overlay import matrix
from ascend_patch.overlay.decision import load_patch_set
from ascend_patch.overlay.verification import verify
from ascend_patch.overlay.source import SourceTree
from tests.helpers.patch_sets import installed, matrix_up_to_installed
from tests.helpers.process import ROOT, clean_env, require_pypi, vllm_package_dir

TREE_RELEASE = "0.33.0"
"""The release the probe's source-tree tests copy and edit (the v0_29 set's reference release, from
the probe's release cache): a V1-runner tree whose targets these tests name."""


def _all_sets() -> list[str]:
    return [spec.name for spec in matrix.load().patch_sets]


def _copy_minimal_tree(dest_root: Path) -> Path:
    """``dest_root/vllm`` with ``__init__``, ``_version`` and every file verifying each set's
    manifest reads (the target modules and the modules they re-export from)."""
    require_pypi("the source tree of vLLM 0.33.0 (the probe's release cache)")
    installed = SourceTree(releases.fetch_release(TREE_RELEASE).package_dir)
    table = matrix.load()
    for name in _all_sets():
        verify(load_patch_set(table, name), installed)
    files = {installed.package_dir / "__init__.py", installed.package_dir / "_version.py"}
    files |= installed.read_paths
    for path in files:
        target = dest_root / "vllm" / path.relative_to(installed.package_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return dest_root / "vllm"


@pytest.fixture(scope="session")
def base_tree(tmp_path_factory) -> Path:
    return _copy_minimal_tree(tmp_path_factory.mktemp("tree"))


@pytest.fixture
def tree(base_tree, tmp_path) -> Path:
    """A private, editable copy of the minimal tree: ``<root>/vllm``."""
    shutil.copytree(base_tree, tmp_path / "checkout" / "vllm")
    return tmp_path / "checkout" / "vllm"


def _files(package_dir: Path):
    for path in sorted(package_dir.rglob("*.py")):
        yield path.relative_to(package_dir).as_posix(), path.read_bytes()


def make_sdist(package_dir: Path, out_dir: Path, version: str = TREE_RELEASE) -> Path:
    path = out_dir / f"vllm-{version}.tar.gz"
    top = f"vllm-{version}"
    with tarfile.open(path, "w:gz") as tf:
        members = [(f"{top}/PKG-INFO", f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n".encode())]
        members += [(f"{top}/vllm/{name}", data) for name, data in _files(package_dir)]
        members.append((f"{top}/tests/test_x.py", b"x = 1\n"))  # outside vllm/: not extracted
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def make_wheel(package_dir: Path, out_dir: Path, version: str = TREE_RELEASE) -> Path:
    path = out_dir / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in _files(package_dir):
            zf.writestr(f"vllm/{name}", data)
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
    return path


def run_probe(capsys, *argv: str) -> tuple[int, dict]:
    """``ascend-patch probe ARGV --json`` in this process; (exit status, document)."""
    code, data, _ = run_probe_with_stderr(capsys, *argv)
    return code, data


def run_probe_with_stderr(capsys, *argv: str) -> tuple[int, dict, str]:
    code = cli.main(["probe", *argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def _target(data: dict, suffix: str) -> dict:
    return next(t for t in data["targets"] if t["target"].endswith(suffix))


def _edit(tree: Path, relative: str, old: str, new: str) -> None:
    path = tree / relative
    text = path.read_text()
    assert old in text, f"fixture drift: {old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


# -- input kinds ----------------------------------------------------------------


def test_source_tree_by_root_and_by_package_dir(tree, capsys):
    for argument in (tree.parent, tree):
        code, data = run_probe(capsys, str(argument))
        assert code == 0, data["verdict"]
        assert data["input"]["kind"] == "tree"
        assert data["input"]["package_dir"] == str(tree)
        assert data["vllm"]["version"] == TREE_RELEASE
        assert data["vllm"]["version_source"].endswith("vllm/_version.py")
        assert data["selection"]["patch_set"] == data["selection"]["probed_set"] == "v0_29"
        states = {t["target"]: t["state"] for t in data["targets"]}
        # torch is not part of a vLLM release: its device-API targets are checked at import.
        assert {s for target, s in states.items() if not target.startswith("torch")} == {"verified"}
        assert {s for target, s in states.items() if target.startswith("torch")} == {"unchecked"}
        assert data["would_activate"] is True


def test_sdist(tree, tmp_path, capsys):
    sdist = make_sdist(tree, tmp_path)
    code, data = run_probe(capsys, str(sdist))
    assert code == 0
    assert data["input"]["kind"] == "sdist"
    assert data["vllm"] == {
        "version": TREE_RELEASE,
        "version_source": f"{sdist.name} metadata",
        "release": TREE_RELEASE,
    }
    assert data["summary"]["verified"] + data["summary"]["unchecked"] == data["summary"]["targets"] > 30


def test_wheel(tree, tmp_path, capsys):
    wheel = make_wheel(tree, tmp_path)
    code, data = run_probe(capsys, str(wheel))
    assert code == 0
    assert data["input"]["kind"] == "wheel"
    assert data["vllm"]["version"] == TREE_RELEASE
    assert data["vllm"]["version_source"] == f"{wheel.name} metadata"


def test_installed_site_packages():
    """The real installed vLLM, by its package directory and by site-packages."""
    package_dir = vllm_package_dir()
    for argument in (package_dir, package_dir.parent):
        with releases.open_source(str(argument)) as source:
            data = probe.probe(source, matrix.load())
        assert data["input"]["kind"] == "installed"
        assert data["vllm"]["version"] == installed().vllm
        assert data["vllm"]["version_source"] == f"installed distribution metadata (vllm-{installed().vllm}.dist-info)"
        assert data["would_activate"] is True


# -- what the probe finds -----------------------------------------------------


def test_changed_signature_is_a_mismatch(tree, tmp_path, capsys, monkeypatch):
    _edit(
        tree,
        "v1/worker/utils.py",
        "    kernel_block_sizes: list[int] | None = None,\n) -> dict[str, torch.Tensor]:",
        "    kernel_block_sizes: list[int] | None = None,\n    pin: bool = False,\n) -> dict[str, torch.Tensor]:",
    )
    code, data = run_probe(capsys, str(make_sdist(tree, tmp_path)))
    assert code == 1
    target = _target(data, ":allocate_kv_cache")
    assert target["state"] == "mismatch" and target["present"] and target["signature_match"] is False
    assert target["expected"] == ("(kv_cache_config, device, layout, kernel_block_sizes=...) or "
                                  "(kv_cache_config, device, layout, kernel_block_sizes=..., allocate=...)")
    assert target["found"] == "(kv_cache_config, device, layout, kernel_block_sizes=..., pin=...)"
    assert data["summary"]["mismatch"] == 1 and data["would_activate"] is False
    assert data["verdict"].startswith("1 of ") and "would patch nothing" in data["verdict"]

    monkeypatch.setenv("COLUMNS", "1000")  # one problem per line
    assert cli.main(["probe", str(tree)]) == 1
    table = capsys.readouterr().out
    verdict, counts, problem = table.splitlines()[:3]
    assert re.fullmatch(r"verdict\s+would NOT activate: 1 of \d+ targets of v0_29 differ: the loader would patch nothing",
                        verdict)
    assert re.fullmatch(r"targets\s+\d+ targets: \d+ verified, 22 unchecked, 1 mismatch; 0 bodies changed since "
                        r"0\.33\.0", counts)
    assert problem.split(None, 1)[1] == (
        "vllm.v1.worker.utils:allocate_kv_cache: expected (kv_cache_config, device, layout, "
        "kernel_block_sizes=...) or (kv_cache_config, device, layout, kernel_block_sizes=..., allocate=...), "
        "found (kv_cache_config, device, layout, kernel_block_sizes=..., pin=...)")
    assert re.search(r"^next step\s+use a release the patch sets serve", table, re.MULTILINE)
    assert "vllm.platforms:resolve_current_platform_cls_qualname" not in table, "behind --targets"
    assert cli.main(["probe", str(tree), "--targets"]) == 1
    assert re.search(r"^verified\s+wrap\s+vllm.platforms:resolve_current_platform_cls_qualname$",
                     capsys.readouterr().out, re.MULTILINE)


def test_removed_targets_are_missing(tree, capsys):
    (tree / "v1" / "worker" / "block_table.py").unlink()
    _edit(tree, "v1/worker/utils.py", "def request_memory(", "def request_memory_v2(")
    code, data = run_probe(capsys, str(tree))
    assert code == 1
    module_gone = _target(data, "BlockTable.compute_slot_mapping")
    assert (module_gone["state"], module_gone["present"]) == ("missing", False)
    assert module_gone["found"] == "no module vllm.v1.worker.block_table"
    renamed = _target(data, ":request_memory")
    assert renamed["found"] == "no request_memory in vllm.v1.worker.utils"
    assert data["summary"]["missing"] == 2


def test_body_change_is_reported_but_does_not_block(tree, capsys):
    path = tree / "model_executor" / "warmup" / "kernel_warmup.py"
    function = next(
        node for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "kernel_warmup"
    )
    lines = path.read_text().splitlines(keepends=True)
    first = function.body[0]
    lines.insert(first.lineno - 1, " " * first.col_offset + "print('changed')\n")
    path.write_text("".join(lines))
    code, data = run_probe(capsys, str(tree))
    assert code == 0, "a body change is informational"
    assert data["body_reference"] == TREE_RELEASE
    changed = _target(data, ":kernel_warmup")
    assert (changed["state"], changed["body"]) == ("verified", "changed")
    others = [t["body"] for t in data["targets"] if t is not changed]
    assert set(others) <= {"same", None} and "same" in others
    assert data["summary"]["body_changed"] == 1


# -- versions and selection -----------------------------------------------------


def test_tree_without_version_file(tree, capsys, monkeypatch, tmp_path):
    # The newest set is assumed: here the newest that serves the tree's release (the installed one).
    table, newest = matrix_up_to_installed(tmp_path, TREE_RELEASE)
    monkeypatch.setenv("ASCEND_PATCH_MATRIX", table)
    (tree / "_version.py").unlink()
    code, data = run_probe(capsys, str(tree.parent))
    assert code == 0
    assert data["vllm"]["version"] is None and data["vllm"]["release"] is None
    assert data["selection"]["kind"] == "unknown"
    assert data["selection"]["patch_set"] == newest.name
    assert "no _version.py" in data["warnings"][0] and "--version X" in data["warnings"][0]
    assert "as assumed" in data["verdict"]

    # 0.33.1, a patch release of the tree's 0.33: any claim of 0.32 or older is a mismatch
    # (0.33 moved unify_hybrid_kv_cache_specs to kv_cache_planning, which the set declares).
    code, data = run_probe(capsys, str(tree.parent), "--version", "0.33.1")
    assert code == 0
    assert data["vllm"]["version_source"] == "--version"
    assert (data["selection"]["kind"], data["selection"]["patch_set"]) == ("in-range", "v0_29")
    assert data["warnings"] == []


def test_newer_and_older_versions(tree, capsys, monkeypatch, tmp_path):
    # "Newer" takes the newest set: here the newest that serves the tree's release (the installed one).
    monkeypatch.setenv("ASCEND_PATCH_MATRIX", matrix_up_to_installed(tmp_path, TREE_RELEASE)[0])
    sets = matrix.load().patch_sets
    code, data = run_probe(capsys, str(tree), "--version", "0.40.0")
    assert code == 0
    assert (data["selection"]["kind"], data["selection"]["patch_set"]) == ("newer", sets[-1].name)
    assert "newer than every patch set" in data["warnings"][0]

    code, data = run_probe(capsys, str(tree), "--version", "0.11.0")
    assert code == 1
    assert (data["selection"]["kind"], data["selection"]["patch_set"]) == ("older", None)
    assert data["selection"]["probed_set"] == sets[0].name, "an older release is shown against the oldest set"
    assert "older than every patch set" in data["verdict"] and "stay inert" in data["verdict"]
    assert data["would_activate"] is False


def test_json_schema(tree, capsys):
    code, data = run_probe(capsys, str(tree))
    assert set(data) == {
        "schema", "kind", "input", "vllm", "selection", "matrix_status", "limitations", "body_reference",
        "targets", "summary", "would_activate", "verdict", "problems", "next_step", "warnings",
    }
    assert (data["schema"], data["kind"]) == (1, "ascend-patch-probe")
    assert data["problems"] == [] and data["next_step"] is None
    assert set(data["selection"]) == {"kind", "patch_set", "probed_set", "range", "reason"}
    assert data["matrix_status"] == matrix.load().versions[TREE_RELEASE].status
    assert {lim["id"] for lim in data["limitations"]} >= {"model-runner-v2"}
    for target in data["targets"]:
        assert set(target) == {
            "target", "kind", "state", "present", "signature_match", "expected", "found", "body", "reason",
            "implementation", "upstream", "remove_when",
        }
        assert target["kind"] in ("wrap", "replace", "contract", "setting", "seam")
        assert target["body"] in ("same", "changed", None)
    assert set(data["summary"]) == {"targets", "verified", "missing", "mismatch", "unchecked", "body_changed"}


def test_bad_inputs_exit_2(tree, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    broken = tmp_path / "vllm-0.33.0.tar.gz"
    broken.write_bytes(make_sdist(tree, tmp_path).read_bytes()[:5000])
    empty = tmp_path / "vllm-0.1.0.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    cases = {
        "not-a-version": "neither an existing path nor a version",
        str(tmp_path / "notes.txt"): "expected a wheel (.whl), an sdist",
        str(tmp_path): "is not a vLLM source",
        str(broken): "is not a readable tar archive",
        str(empty): "holds no vllm/__init__.py",
    }
    for argument, message in cases.items():
        code, data = run_probe(capsys, argument)
        assert code == 2, argument
        assert message in data["error"], data["error"]
    code, data = run_probe(capsys, str(tree), "--version", "one")
    assert code == 2 and "is not a PEP 440 version" in data["error"]


# -- downloads, through a package index on 127.0.0.1 ----------------------------------


@contextlib.contextmanager
def serve(routes: dict, requests: list[str] | None = None):
    """A package index: ``routes`` maps a path to (content type, body), or to a function
    that answers the request itself (a hostile server); ``requests`` collects the paths asked."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if requests is not None:
                requests.append(self.path)
            if self.path not in routes:
                self.send_error(404)
                return
            if callable(routes[self.path]):
                with contextlib.suppress(OSError):  # the probe hung up
                    routes[self.path](self)
                return
            content_type, body = routes[self.path]
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/simple"
    finally:
        server.shutdown()
        server.server_close()


def json_index(archives: list[Path], versions: list[str], sha256: dict[str, str] | None = None):
    files = [
        {
            "filename": a.name,
            "url": f"../../files/{a.name}",
            "hashes": {"sha256": (sha256 or {}).get(a.name) or hashlib.sha256(a.read_bytes()).hexdigest()},
            "size": a.stat().st_size,
            "yanked": False,
        }
        for a in archives
    ]
    document = {"meta": {"api-version": "1.1"}, "name": "vllm", "files": files, "versions": versions}
    routes = {"/simple/vllm/": ("application/vnd.pypi.simple.v1+json", json.dumps(document).encode())}
    routes.update({f"/files/{a.name}": ("application/octet-stream", a.read_bytes()) for a in archives})
    return routes


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ASCEND_PATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    return tmp_path / "cache"


def cached_names(cache: Path) -> list[str]:
    """What the release cache holds besides its lock file: entries, staging directories."""
    return sorted(p.name for p in (cache / "releases").iterdir() if p.name != ".lock")


def test_download_verifies_extracts_and_reuses_the_cache(tree, tmp_path, cache, capsys):
    archives = [make_sdist(tree, tmp_path), make_wheel(tree, tmp_path)]
    with serve(json_index(archives, ["0.32.0", TREE_RELEASE])) as index:
        code, data = run_probe(capsys, "0.33", "--index-url", index)
    assert code == 0
    given = data["input"]
    assert given["kind"] == "release" and given["archive"] == f"vllm-{TREE_RELEASE}.tar.gz", "the sdist, not the wheel"
    assert given["sha256_verified"] is True and given["cached"] is False
    assert data["vllm"]["version"] == TREE_RELEASE, "the index's spelling of the version"
    release_dir = cache / "releases" / f"vllm-{TREE_RELEASE}"
    assert sorted(p.name for p in release_dir.iterdir()) == ["release.json", "vllm"]
    assert not (release_dir / "vllm" / "tests").exists()

    # The server is gone: a warm cache needs no network.
    code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 0 and data["input"]["cached"] is True


def test_latest_is_the_newest_final_release_the_index_has_a_file_for(tree, tmp_path, cache, capsys):
    """``probe latest``: a pre-release and a version listed without a file are passed over."""
    versions = ["0.32.0", TREE_RELEASE, "0.98.0", "0.99.0rc1"]
    with serve(json_index([make_sdist(tree, tmp_path)], versions)) as index:
        code, data = run_probe(capsys, "latest", "--index-url", index)
    assert code == 0 and data["vllm"]["version"] == TREE_RELEASE and data["input"]["kind"] == "release"


def test_download_progress_goes_to_stderr(tree, tmp_path, cache, capsys):
    with serve(json_index([make_sdist(tree, tmp_path)], [TREE_RELEASE])) as index:
        assert cli.main(["probe", TREE_RELEASE, "--index-url", index]) == 0
    captured = capsys.readouterr()
    assert f"downloading vllm-{TREE_RELEASE}.tar.gz" in captured.err
    assert "extracted" in captured.err
    assert "downloading" not in captured.out
    assert re.match(r"verdict\s+would activate: ", captured.out)


def test_html_index_and_wheel_only_release(tree, tmp_path, cache, capsys):
    wheel = make_wheel(tree, tmp_path, "0.33.1")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    page = f'<html><body><a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a></body></html>'
    routes = {
        "/simple/vllm/": ("text/html", page.encode()),
        f"/files/{wheel.name}": ("application/octet-stream", wheel.read_bytes()),
    }
    with serve(routes) as index:
        code, data = run_probe(capsys, "0.33.1", "--index-url", index)
    assert code == 0
    assert data["input"]["archive"] == wheel.name and data["input"]["sha256_verified"] is True
    assert data["vllm"]["version"] == "0.33.1"


def test_corrupt_download_is_refused_and_not_cached(tree, tmp_path, cache, capsys):
    sdist = make_sdist(tree, tmp_path)
    with serve(json_index([sdist], [TREE_RELEASE], sha256={sdist.name: "0" * 64})) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2
    assert f"{sdist.name} is corrupt" in data["error"] and "the index says " + "0" * 64 in data["error"]
    assert cached_names(cache) == []


def test_unknown_version_lists_the_nearest(tree, tmp_path, cache, capsys):
    with serve(json_index([make_sdist(tree, tmp_path)], ["0.31.0", "0.32.0", TREE_RELEASE])) as index:
        code, data = run_probe(capsys, "0.34.0", "--index-url", index)
    assert code == 2
    assert f"vLLM 0.34.0: no such release on {index}" in data["error"]
    assert f"newest: {TREE_RELEASE}; nearest: 0.32.0, {TREE_RELEASE}" in data["error"]
    assert "probe a source tree" in data["error"]


def test_no_network(cache, capsys):
    with serve({}) as index:
        pass  # the port is closed again
    code, data = run_probe(capsys, "0.30.0", "--index-url", index)
    assert code == 2
    assert data["error"].startswith(f"cannot reach {index}/vllm/")
    assert "Check the network" in data["error"]


# -- a hostile index ----------------------------------------------------------------
#
# The limits are shrunk through the module's constants so each case takes well under a second.


def list_file_as(routes: dict, **fields) -> None:
    """Change fields of the first file a JSON index page lists (None drops the field)."""
    content_type, body = routes["/simple/vllm/"]
    document = json.loads(body)
    for key, value in fields.items():
        document["files"][0][key] = value
        if value is None:
            del document["files"][0][key]
    routes["/simple/vllm/"] = (content_type, json.dumps(document).encode())


def _tree_snapshot(root: Path, skip: Path) -> dict[str, tuple[bytes, int]]:
    """Every file below ``root`` but under ``skip``: contents and mtime."""
    return {
        str(p): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*") if p.is_file() and skip not in p.parents
    }


@pytest.mark.parametrize("form", ["relative", "absolute", "html-escaped"])
def test_index_file_names_cannot_reach_outside_the_cache(form, tree, tmp_path, cache, capsys):
    """A name the index lists is never a path: nothing outside the cache is created,
    overwritten or deleted, and nothing is cached to be reused."""
    sdist = make_sdist(tree, tmp_path)
    victim = tmp_path / "victim" / sdist.name  # ../../../victim/… from a staging directory
    victim.parent.mkdir()
    victim.write_text("user data\n")
    name = str(victim) if form == "absolute" else f"../../../victim/{sdist.name}"
    if form == "html-escaped":
        escaped = f"..%2F..%2F..%2Fvictim%2F{sdist.name}"
        page = f'<a href="../../files/{escaped}">x</a>'
        routes = {"/simple/vllm/": ("text/html", page.encode()),
                  f"/files/{escaped}": ("application/octet-stream", sdist.read_bytes())}
    else:
        routes = json_index([sdist], [TREE_RELEASE])
        list_file_as(routes, filename=name)
    before = _tree_snapshot(tmp_path, cache / "releases")
    requests: list[str] = []
    with serve(routes, requests) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2
    assert data["error"] == (
        f"{index} names the file {name!r}, which is not a plain file name; refusing it "
        "(a path would write outside the cache)"
    )
    assert requests == ["/simple/vllm/"], "nothing was downloaded"
    assert _tree_snapshot(tmp_path, cache / "releases") == before
    assert cached_names(cache) == []
    code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)  # the server is gone
    assert code == 2 and data["error"].startswith("cannot reach"), "nothing poisoned to reuse"


def test_only_http_downloads_are_followed(tree, tmp_path, cache, capsys):
    secret = tmp_path / f"vllm-{TREE_RELEASE}.tar.gz"  # a local file the index points at
    make_sdist(tree, tmp_path)
    routes = json_index([secret], [TREE_RELEASE])
    list_file_as(routes, url=secret.as_uri())
    with serve(routes) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2
    assert data["error"] == (
        f"{index} gives {secret.as_uri()!r} for {secret.name}: only http(s) downloads are fetched"
    )
    assert cached_names(cache) == []


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:3000])


def _flip_a_byte(path: Path) -> None:
    """Bit rot: same size, same mtime."""
    stat, data = path.stat(), bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _drop_manifest(entry: Path) -> None:
    """release.json as ascend-patch wrote it before entries recorded their files."""
    info = json.loads((entry / "release.json").read_text())
    del info["manifest"]
    (entry / "release.json").write_text(json.dumps(info))


DAMAGE = {
    "release.json cut short": (
        lambda e: (e / "release.json").write_text('{"version": "0.33.0", "arch'),
        "its release.json is unreadable",
    ),
    "release.json deleted": (lambda e: (e / "release.json").unlink(), "it has no release.json"),
    "release.json of an older ascend-patch": (
        _drop_manifest, "its release.json records no files (an older ascend-patch wrote it)"),
    "target truncated": (
        lambda e: _truncate(e / "vllm/v1/worker/utils.py"),
        "vllm/v1/worker/utils.py changed since it was extracted",
    ),
    "target flipped in place": (
        lambda e: _flip_a_byte(e / "vllm/v1/worker/utils.py"),
        "vllm/v1/worker/utils.py changed since it was extracted",
    ),
    "target deleted": (
        lambda e: (e / "vllm/v1/worker/block_table.py").unlink(),
        "vllm/v1/worker/block_table.py is missing",
    ),
    "file added": (
        lambda e: (e / "vllm/v1/worker/extra.py").write_text("x = 1\n"),
        "vllm/v1/worker/extra.py is not part of the release",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_cache_entry_gives_no_verdict_and_is_replaced(damage, tree, tmp_path, cache, capsys):
    damage_entry, problem = DAMAGE[damage]
    routes = json_index([make_sdist(tree, tmp_path)], [TREE_RELEASE])
    requests: list[str] = []
    with serve(routes, requests) as index:
        entry = releases.fetch_release(TREE_RELEASE, index).package_dir.parent
    damage_entry(entry)

    # Offline: no verdict from the damaged copy, and the copy is kept until one replaces it.
    code, data, err = run_probe_with_stderr(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2 and set(data) == {"schema", "kind", "error"} and data["error"].startswith("cannot reach")
    assert f"the cached {entry} is damaged ({problem}); fetching the release again" in err
    assert cached_names(cache) == [entry.name]

    with serve(routes, requests) as index:
        code, data, err = run_probe_with_stderr(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 0 and data["input"]["cached"] is False
    assert f"is damaged ({problem})" in err
    assert requests.count(f"/files/vllm-{TREE_RELEASE}.tar.gz") == 2
    assert cached_names(cache) == [entry.name]
    assert "manifest" not in data["input"] and data["input"]["files"] == len(list(tree.rglob("*.py")))
    assert releases.fetch_release(TREE_RELEASE, index).details["cached"] is True  # offline again


def _zeros(size: int) -> io.BufferedReader:
    class Zeros(io.RawIOBase):
        left = size

        def readable(self):
            return True

        def readinto(self, buffer):
            count = min(len(buffer), self.left)
            buffer[:count] = bytes(count)
            self.left -= count
            return count

    return io.BufferedReader(Zeros())


def _bomb_sdist(out_dir: Path, name: str, size: int, **pax) -> Path:
    """A small sdist that unpacks to a ``size``-byte member ``name``; ``pax`` headers on it."""
    path = out_dir / f"vllm-{TREE_RELEASE}.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        for member, data in ((f"vllm-{TREE_RELEASE}/PKG-INFO", f"Version: {TREE_RELEASE}\n".encode()),
                             (f"vllm-{TREE_RELEASE}/vllm/__init__.py", b"")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(f"vllm-{TREE_RELEASE}/{name}")
        info.size, info.pax_headers = size, pax
        tf.addfile(info, _zeros(size))
    return path


def _bomb_wheel(out_dir: Path, name: str, size: int) -> Path:
    path = out_dir / f"vllm-{TREE_RELEASE}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("vllm/__init__.py", "")
        with zf.open(name, "w") as member:
            shutil.copyfileobj(_zeros(size), member)
    return path


MiB = 1 << 20
UNPACKING_LIMITS = {
    "one member": ("MAX_MEMBER_BYTES", 64 << 10, lambda d, tree: _bomb_sdist(d, "vllm/big.py", MiB),
                   "holds vllm/big.py of 1 MiB (limit 64 KiB)"),
    "one wheel member": ("MAX_MEMBER_BYTES", 64 << 10, lambda d, tree: _bomb_wheel(d, "vllm/big.py", MiB),
                         "holds vllm/big.py of 1 MiB (limit 64 KiB)"),
    "everything kept": ("MAX_KEPT_BYTES", 64 << 10, lambda d, tree: make_sdist(tree, d),
                        "holds more than 64 KiB of vllm/**/*.py"),
    "files kept": ("MAX_KEPT_FILES", 5, lambda d, tree: make_sdist(tree, d),
                   "holds more than 5 vllm/**/*.py files"),
    "members passed over": ("MAX_UNPACKED_BYTES", 256 << 10,
                            lambda d, tree: _bomb_sdist(d, "tests/big.bin", MiB), "unpacks to more than 256 KiB"),
    "extended header": ("MAX_TAR_HEADER_BYTES", 4096,
                        lambda d, tree: _bomb_sdist(d, "vllm/x.py", 0, comment="x" * (64 << 10)),
                        "extended header (limit 4 KiB)"),
}


@pytest.mark.parametrize("limit", list(UNPACKING_LIMITS))
def test_archive_bombs_are_refused(limit, tree, tmp_path, cache, capsys, monkeypatch):
    constant, value, build, message = UNPACKING_LIMITS[limit]
    monkeypatch.setattr(limits, constant, value)
    archive = build(tmp_path, tree)
    # the minimal tree (every target file of the patch set) packs to a few hundred KiB
    assert archive.stat().st_size < MiB, "small download, large contents"
    with serve(json_index([archive], [TREE_RELEASE])) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2
    assert message in data["error"] and "decompression bomb" in data["error"], data["error"]
    assert cached_names(cache) == []


def _hostile_sdist(tree: Path, out_dir: Path) -> Path:
    """The tree's sdist plus members that name a place outside ``vllm/``, and a link."""
    path = make_sdist(tree, out_dir)
    plain = path.read_bytes()
    top = f"vllm-{TREE_RELEASE}"
    with tarfile.open(path, "w:gz") as tf:
        with tarfile.open(fileobj=io.BytesIO(plain), mode="r:gz") as original:
            for member in original:
                tf.addfile(member, original.extractfile(member))
        for name in (f"{top}/vllm/../../escaped.py", f"{top}/vllm/./dot.py", f"/{top}/vllm/absolute.py"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tf.addfile(info, io.BytesIO(b"x=1\n"))
        link = tarfile.TarInfo(f"{top}/vllm/linked.py")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/hostname"
        tf.addfile(link)
    return path


def _hostile_wheel(tree: Path, out_dir: Path) -> Path:
    path = make_wheel(tree, out_dir)
    with zipfile.ZipFile(path, "a") as zf:
        for name in ("vllm/../escaped.py", "vllm/./dot.py", "/vllm/absolute.py"):
            zf.writestr(name, "x = 1\n")
    return path


@pytest.mark.parametrize("build", [_hostile_sdist, _hostile_wheel], ids=["sdist", "wheel"])
def test_archive_names_outside_vllm_are_never_written(build, tree, tmp_path, cache, capsys):
    """A member named ``..``, ``.`` or absolute, or a link, is passed over: the release is the
    tree's files exactly, and nothing appears outside the cache."""
    archive = build(tree, tmp_path)
    before = _tree_snapshot(tmp_path, cache)
    with serve(json_index([archive], [TREE_RELEASE])) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 0, data
    entry = cache / "releases" / f"vllm-{TREE_RELEASE}" / "vllm"
    assert sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.py"))
    assert _tree_snapshot(tmp_path, cache) == before


def _send(body: bytes, *, length: int | None, content_type: str = "application/octet-stream"):
    """A route that sends ``body`` under a Content-Length of ``length`` (None: none, the
    connection's end ends the body)."""
    def respond(handler):
        handler.send_response(200)
        handler.send_header("Content-Type", content_type)
        if length is not None:
            handler.send_header("Content-Length", str(length))
        handler.end_headers()
        handler.wfile.write(body)
    return respond


def test_oversized_index_pages_are_cut_off(cache, capsys, monkeypatch):
    monkeypatch.setattr(limits, "MAX_PAGE_BYTES", 64 << 10)
    page = b"<html>" + b"<!-- padding -->" * 65536  # 1 MiB
    for length, error in ((len(page), "announces 1 MiB, more than 64 KiB, the limit for an index page"),
                          (None, "sent more than 64 KiB, the limit for an index page")):
        with serve({"/simple/vllm/": _send(page, length=length, content_type="text/html")}) as index:
            code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
        assert code == 2 and data["error"] == f"{index}/vllm/ {error}"


def test_downloads_must_match_the_size_the_index_lists(tree, tmp_path, cache, capsys, monkeypatch):
    sdist = make_sdist(tree, tmp_path)
    data_bytes = sdist.read_bytes()
    size = len(data_bytes)
    url_path = f"/files/{sdist.name}"
    cases = [
        (_send(data_bytes + b"x" * 1000, length=size + 1000), "KiB, more than the "
         f"{size} bytes the index lists for it"),
        (_send(data_bytes + b"x" * 1000, length=None), f"sent more than the {size} bytes the index lists for it"),
        (_send(data_bytes[:-1000], length=size - 1000),
         f"is incomplete: {size - 1000} bytes received, the index lists {size}"),
        (_send(data_bytes[:-1000], length=size), f"broke off after {size - 1000} of {size} bytes"),
    ]
    for route, error in cases:
        routes = json_index([sdist], [TREE_RELEASE])
        routes[url_path] = route
        with serve(routes) as index:
            code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
        assert code == 2 and error in data["error"], data["error"]
        assert cached_names(cache) == []

    monkeypatch.setattr(limits, "MAX_DOWNLOAD_BYTES", 64 << 10)
    requests: list[str] = []
    with serve(json_index([sdist], [TREE_RELEASE]), requests) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2 and data["error"].startswith(f"{index} lists {sdist.name} at ")
    assert data["error"].endswith("KiB, more than the 64 KiB the probe downloads")
    assert url_path not in requests
    routes = json_index([sdist], [TREE_RELEASE])
    list_file_as(routes, size=None)  # HTML pages and JSON pages before API 1.1 may not say
    routes[url_path] = _send(data_bytes, length=None)
    with serve(routes) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2 and data["error"].endswith("sent more than 64 KiB, the download limit")


class _Clock:
    """The stall deadline's clock, moved only by the server: sending a byte takes it 0.02 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _trickle(body: bytes, *, headers_too: bool, clock: _Clock, every: float = 0.02):
    """A server that sends one byte at a time: a socket timeout never fires on it."""
    def respond(handler):
        head = (b"HTTP/1.0 200 OK\r\nContent-Type: application/vnd.pypi.simple.v1+json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        if not headers_too:
            handler.wfile.write(head)
            head = b""
        for byte in head + body:
            handler.wfile.write(bytes([byte]))
            clock.now += every
    return respond


def _silent(handler):
    """Says nothing until the probe hangs up."""
    handler.connection.settimeout(60)
    handler.rfile.read(1)


@pytest.mark.parametrize("server", ["trickles the page", "trickles the headers", "says nothing",
                                    "trickles the download"])
def test_a_stalling_server_is_cut_off(server, tree, tmp_path, cache, capsys, monkeypatch):
    """Cut off by the deadline, counted in a clock only the server moves (no wall time is
    measured); the server that says nothing is cut off by the socket timeout the deadline sets."""
    clock = _Clock()
    monkeypatch.setattr(transport, "clock", clock)
    monkeypatch.setattr(limits, "STALL_SECONDS", 0.4)
    monkeypatch.setattr(limits, "STALL_BYTES", 4096)
    sdist = make_sdist(tree, tmp_path)
    routes = json_index([sdist], [TREE_RELEASE])
    page = routes["/simple/vllm/"][1]
    stalled = "/simple/vllm/"
    if server == "trickles the page":
        routes[stalled] = _trickle(page, headers_too=False, clock=clock)
    elif server == "trickles the headers":
        routes[stalled] = _trickle(page, headers_too=True, clock=clock)
    elif server == "says nothing":
        routes[stalled] = _silent
    else:
        stalled = f"/files/{sdist.name}"
        routes[stalled] = _trickle(sdist.read_bytes(), headers_too=False, clock=clock)
    with serve(routes) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    url = f"{index}/vllm/" if stalled.startswith("/simple") else f"{index.rsplit('/', 1)[0]}{stalled}"
    assert code == 2
    assert data["error"] == (
        f"{url} sent less than 4 KiB in 0.4 s: the server or the network stalls. "
        "Run the probe again, or use --index-url for a mirror"
    )
    assert cached_names(cache) == []


@pytest.mark.parametrize("index_url", ["notaurl", "ftp://example.org/simple", "file:///srv/simple",
                                       "http://[::1/simple", "https:///simple"])
def test_an_index_url_that_is_not_http_fails_in_one_line(index_url, cache, capsys):
    code = cli.main(["probe", TREE_RELEASE, "--index-url", index_url])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == (
        f"ascend-patch probe: --index-url {index_url!r} is not an http(s) URL; give a simple-API "
        f"index such as {releases.DEFAULT_INDEX}\n"
    )
    code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index_url)
    assert code == 2 and set(data) == {"schema", "kind", "error"}


@pytest.mark.parametrize("document", [[], {"files": "x"}, {"files": [{"url": "x"}]},
                                      {"files": [{"filename": 1, "url": "x"}]}])
def test_a_malformed_json_page_fails_in_one_line(document, cache, capsys):
    routes = {"/simple/vllm/": ("application/vnd.pypi.simple.v1+json", json.dumps(document).encode())}
    with serve(routes) as index:
        code, data = run_probe(capsys, TREE_RELEASE, "--index-url", index)
    assert code == 2 and data["error"] == f"{index}/vllm/ is not a valid simple-API JSON page"


def test_an_unexpected_error_still_exits_2_in_one_line(tree, monkeypatch, capsys):
    """A bug in the probe is "the probe failed", never "would not activate"."""
    def broken(*args):
        raise KeyError("version")

    monkeypatch.setattr(probe, "decide", broken)
    assert cli.main(["probe", str(tree)]) == 2
    assert capsys.readouterr().err == \
        "ascend-patch probe: internal error, please report it: KeyError: 'version'\n"


def test_a_killed_probe_leaves_no_staging_behind(tree, tmp_path, cache, capsys):
    """A live probe's staging directory is left alone; a killed one's goes on the next run."""
    sdist, older = make_sdist(tree, tmp_path), make_sdist(tree, tmp_path, "0.33.1")
    release = threading.Event()

    def half_then_hang(handler):
        body = sdist.read_bytes()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body[: len(body) // 2])
        release.wait(30)

    routes = json_index([sdist, older], [TREE_RELEASE, "0.33.1"])
    full = routes[f"/files/{sdist.name}"]
    routes[f"/files/{sdist.name}"] = half_then_hang
    with serve(routes) as index:
        child = subprocess.Popen(
            [sys.executable, "-m", "ascend_patch", "probe", TREE_RELEASE, "--index-url", index],
            env=clean_env(ASCEND_PATCH_CACHE_DIR=str(cache), no_proxy="127.0.0.1"), cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            # No wall-clock bound: the child's own stall deadline ends it if it never downloads.
            while not list((cache / "releases").glob(f".vllm-{TREE_RELEASE}-*/{sdist.name}")):
                assert child.poll() is None, "the child exited before it downloaded"
                time.sleep(0.05)
            (staging,) = (cache / "releases").glob(f".vllm-{TREE_RELEASE}-*")
            legacy = cache / "releases" / ".vllm-0.31.0-oldstyle"  # an older ascend-patch's
            legacy.mkdir()

            code, _, err = run_probe_with_stderr(capsys, "0.33.1", "--index-url", index)
            assert code == 0
            assert staging.is_dir(), "a concurrent probe's staging directory is live"
            assert f"removed {legacy}, left by an interrupted probe" in err and not legacy.exists()

            child.kill()
            child.wait(30)
            assert staging.is_dir()
            routes[f"/files/{sdist.name}"] = full
            code, _, err = run_probe_with_stderr(capsys, TREE_RELEASE, "--index-url", index)
        finally:
            child.kill()
            child.wait(30)
            release.set()
    assert code == 0
    assert f"removed {staging}, left by an interrupted probe" in err
    assert cached_names(cache) == [f"vllm-{TREE_RELEASE}", "vllm-0.33.1"]


# -- the command, the digests -------------------------------------------------


def test_cli_entry_point_imports_neither_torch_nor_vllm(tree, tmp_path):
    sdist = make_sdist(tree, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_patch", "probe", str(sdist), "--json"],
        capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["would_activate"] is True

    script = Path(sys.executable).parent / "ascend-patch"
    if script.exists():
        proc = subprocess.run([str(script), "probe", str(tree), "--version", "0.11.0"],
                              capture_output=True, text=True, env=clean_env(), timeout=120)
        assert proc.returncode == 1 and re.match(r"verdict\s+would NOT activate", proc.stdout)

    code = f"""
        import sys
        from ascend_patch.cli import main
        status = main(["probe", {str(tree)!r}, "--json"])
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm"))
        assert status == 0 and not heavy, (status, heavy)
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("set_name", _all_sets())
def test_digests_cover_every_target(set_name):
    digests = probe.load_digests(set_name)
    assert digests is not None, f"no {probe.digests_path(set_name)}; run scripts/update_digests.py {set_name}"
    table = matrix.load()
    assert digests["reference"] == probe.reference_release(table, set_name), (
        f"the matrix's newest {set_name} release moved; run scripts/update_digests.py {set_name}"
    )
    targets = [p.target for p in probe.patches_of(set_name)]
    assert list(digests["digests"]) == targets, f"targets changed; run scripts/update_digests.py {set_name}"


def test_digests_match_the_installed_reference():
    """Where the installed vLLM is a set's reference release, its digests are reproducible here."""
    table = matrix.load()
    checked = 0
    for name in _all_sets():
        if probe.reference_release(table, name) != installed().vllm:
            continue
        expected = probe.compute_digests(probe.patches_of(name), SourceTree(vllm_package_dir()))
        assert probe.load_digests(name)["digests"] == expected
        checked += 1
    assert checked, f"no patch set has {installed().vllm} as its reference"


def test_wheel_ships_the_digests(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("ascend_patch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for set_name in _all_sets():
        assert f"ascend_patch/patches/{set_name}_digests.json" in names


def test_update_digests_script_refuses_the_wrong_reference(tree, tmp_path):
    sdist = make_sdist(tree, tmp_path, "0.32.0")
    proc = subprocess.run(
        [sys.executable, "scripts/update_digests.py", f"v0_29={sdist}"],
        capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert "is vLLM 0.32.0, but the reference release of v0_29 is" in proc.stderr


# -- the real index ------------------------------------------------------------------


def test_real_release_from_pypi(tmp_path, monkeypatch, capsys):
    require_pypi("probing a real release")
    cache = tmp_path / "pypi-cache"
    monkeypatch.setenv("ASCEND_PATCH_CACHE_DIR", str(cache))
    try:
        code, data = run_probe(capsys, "0.29.0")
        assert code == 0, data
        # the sdist (about 40 MB), not a 340 MB wheel
        assert data["input"]["archive"] == "vllm-0.29.0.tar.gz" and data["input"]["sha256_verified"]
        assert data["selection"]["patch_set"] == "v0_29"
        assert data["summary"]["body_changed"] > 0, "0.29's bodies differ from the 0.33 reference"

        with serve({}) as offline:
            pass  # its port is closed again: the cached release needs no network
        code, data = run_probe(capsys, "0.29.0", "--index-url", offline)
        assert code == 0 and data["input"]["cached"] is True
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # ~40 MB of .py files
