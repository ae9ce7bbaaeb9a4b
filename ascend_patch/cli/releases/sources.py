"""Any argument of ``ascend-patch probe`` to the ``vllm`` package it names: a release on an
index (through the cache), a local wheel or sdist, a source tree, an installed site-packages."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ascend_patch import env
from ascend_patch.cli.releases import archive, index, transport
from ascend_patch.cli.releases.cache import ReleaseCache
from ascend_patch.cli.releases.messages import ProbeError, note
from ascend_patch.cli.releases.versions import SDIST_SUFFIXES, file_name_version, tree_version
from ascend_patch.overlay import version as versions


@dataclass
class Source:
    """The ``vllm`` package to probe and what is known about where it came from."""

    package_dir: Path
    kind: str  # "release", "sdist", "wheel", "tree" or "installed"
    argument: str
    version: str | None
    version_source: str
    details: dict = field(default_factory=dict)


def _release_source(entry: Path, info: dict, argument: str, cached: bool) -> Source:
    details = {k: v for k, v in info.items() if k != "manifest"}
    return Source(
        entry / "vllm", "release", argument, info["version"], "the argument",
        {**details, "cache": str(entry), "cached": cached},
    )


def fetch_release(requested_text: str, index_url: str = index.DEFAULT_INDEX) -> Source:
    """The ``vllm`` package of a release on the index, from the cache or fetched into it;
    ``latest`` is the newest final release the index lists."""
    listing = None
    if requested_text.strip().lower() == "latest":
        listing = index.read_index(index_url)
        requested_text = index.latest(*listing)
    requested = versions.parse_or_none(requested_text)
    if requested is None:
        raise ProbeError(
            f"{requested_text!r} is neither an existing path nor a version; give a vLLM version "
            "such as 0.33.0, or the path of a wheel, sdist or source tree"
        )
    if not transport.is_http_url(index_url):
        raise ProbeError(
            f"--index-url {index_url!r} is not an http(s) URL; give a simple-API index such as "
            f"{index.DEFAULT_INDEX}"
        )
    cache = ReleaseCache(Path(env.cache_dir()) / "releases")
    hit = cache.lookup(requested)
    if hit is not None:
        return _release_source(*hit, requested_text, cached=True)
    files, listed = listing or index.read_index(index_url)
    item = index.release_file(files, requested)
    if item is None:
        around, newest = index.nearest(requested, listed)
        where = "PyPI" if index_url == index.DEFAULT_INDEX else index_url
        raise ProbeError(
            f"vLLM {requested_text}: no such release on {where} (newest: {newest}; nearest: "
            f"{', '.join(around) or 'none'}). For unreleased code, probe a source tree, e.g. "
            "`ascend-patch probe path/to/vllm-checkout --version X`"
        )
    index.check_release_file(item, index_url)
    version_text = str(requested)
    for text in listed:
        if versions.parse_or_none(text) == requested:
            version_text = text.strip()  # the index's own spelling: 0.33.0, not 0.33
    with cache.staging(version_text) as staging:
        downloaded = staging / item.filename
        sha256 = transport.download(item.url, downloaded, name=item.filename, size=item.size,
                                    sha256=item.sha256)
        manifest, _ = archive.extract(downloaded, staging, item.url)
        downloaded.unlink()  # keep only the .py files
        entry, info = cache.install(staging, requested, {
            "version": version_text,
            "archive": item.filename,
            "url": item.url,
            "sha256": sha256,
            "sha256_verified": item.sha256 is not None,
            "yanked": item.yanked,
            "files": len(manifest),
            "manifest": manifest,
        })
    note(f"extracted {info['files']} files of vllm/ to {entry}")
    return _release_source(entry, info, requested_text, cached=False)


def _package_dir_of(path: Path) -> Path | None:
    """``path`` itself if it is the ``vllm`` package, or its ``vllm/`` child."""
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return path
    if (path / "vllm" / "__init__.py").is_file():
        return path / "vllm"
    return None


@contextlib.contextmanager
def open_source(
    argument: str, version: str | None = None, index_url: str = index.DEFAULT_INDEX
) -> Iterator[Source]:
    """Resolve a version or path to a :class:`Source`; local archives are extracted to a
    temporary directory that lives as long as the context."""
    if version is not None and versions.parse_or_none(version) is None:
        raise ProbeError(f"--version {version!r} is not a PEP 440 version, e.g. 0.33.0")
    path = Path(argument).expanduser()
    if not path.exists():
        source = fetch_release(argument, index_url)
        if version is not None and versions.parse_or_none(version) != versions.parse_or_none(source.version):
            raise ProbeError(f"--version {version} contradicts the release asked for, {argument}")
        yield source
        return
    path = path.resolve()
    if path.is_dir():
        package_dir = _package_dir_of(path)
        if package_dir is None:
            raise ProbeError(
                f"{path} is not a vLLM source: expected the vllm package directory (with "
                "__init__.py) or a directory that contains one (a checkout, an extracted sdist, "
                "site-packages)"
            )
        found, source_of_version, kind = tree_version(package_dir)
        if version is not None:
            found, source_of_version = version, "--version"
        yield Source(package_dir, kind, argument, found, source_of_version)
        return
    if not path.name.endswith((".whl", *SDIST_SUFFIXES)):
        raise ProbeError(
            f"{path}: expected a wheel (.whl), an sdist (.tar.gz, .zip) or a directory"
        )
    with tempfile.TemporaryDirectory(prefix="ascend-patch-probe-") as scratch:
        manifest, declared = archive.extract(path, Path(scratch))
        package_dir = Path(scratch) / "vllm"
        candidates = [
            (version, "--version"),
            (declared, f"{path.name} metadata"),
            (file_name_version(path.name), f"the file name {path.name}"),
            (versions.source_tree_version(package_dir), "vllm/_version.py in the archive"),
        ]
        found, source_of_version = next(
            ((v, s) for v, s in candidates if versions.parse_or_none(v)),
            (None, f"no version in {path.name}'s metadata, name or vllm/_version.py"),
        )
        kind = "wheel" if path.name.endswith(".whl") else "sdist"
        yield Source(package_dir, kind, argument, found, source_of_version, {"files": len(manifest)})
