"""Getting at the vLLM source a probe reads: a release from a package index, a local
wheel or sdist, a source tree or an installed ``site-packages``.

A version is fetched as its sdist (30–50 MB, against about 340 MB for the wheel)
from the index's simple API, checked against the sha256 the index publishes, and
only its ``vllm/**/*.py`` files are kept in the cache (``ascend_patch.env.cache_dir()``
``/releases``), so a second probe of the same release needs no network. ``pip
download`` is not used: it insists on building an sdist, which vLLM's cannot do
without CUDA.

An index is not trusted: its pages and files are streamed under size limits and a
stall deadline, the file name it gives must be a plain name, and an archive is
unpacked under limits too. A cache entry records the sha256 of every file it holds
and is reused only while they all match; otherwise it is fetched again and replaced.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import html.parser
import http.client
import json
import os
import re
import shutil
import socket
import sys
import tarfile
import tempfile
import threading
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


def _tree_version(package_dir: Path) -> tuple[str | None, str, str]:
    """A directory's version, where it came from, and the input kind ("installed" when
    site-packages metadata owns it): sdist PKG-INFO, installed metadata, ``_version.py``."""
    pkg_info = package_dir.parent / "PKG-INFO"
    if pkg_info.is_file():
        found = _metadata_version(pkg_info.read_text(errors="replace"))
        if found:
            return found, str(pkg_info), "tree"
    installed = versions.installed_distribution(package_dir)
    if installed is not None and installed.version:
        where = Path(str(getattr(installed, "_path", installed.name))).name  # the .dist-info directory
        return installed.version, f"installed distribution metadata ({where})", "installed"
    declared = versions.source_tree_version(package_dir)
    if parse_version(declared):
        return declared, f"{package_dir}/_version.py", "tree"
    return None, (
        f"no version found: {package_dir} has no _version.py (a git checkout generates it only "
        "when built), no PKG-INFO beside it and no installed metadata"
    ), "tree"


# -- archives -----------------------------------------------------------------

# What an archive may unpack to, checked before the bytes are read (a 7 MB sdist can hold
# a 4 GB file of zeros). Module constants so tests can shrink them.
MAX_MEMBER_BYTES = 16 << 20  # one kept file; 0.33.0's largest vllm/*.py is 0.3 MB
MAX_KEPT_BYTES = 512 << 20  # every kept file; 0.33.0's vllm/**/*.py are 44 MB
MAX_KEPT_FILES = 50_000  # 0.33.0 has 2,991
MAX_UNPACKED_BYTES = 4 << 30  # all members of a tar, the skipped ones decompressed too
MAX_TAR_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header, which tarfile reads whole


_EXTENDED_HEADERS = (
    tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK,
)


def _amount(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} bytes"


class _OversizedHeader(Exception):
    pass


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses a pax or long-name header larger than any sane path list before tarfile
    reads it into memory."""

    @classmethod
    def frombuf(cls, buf, encoding, errors):
        info = super().frombuf(buf, encoding, errors)
        if info.type in _EXTENDED_HEADERS and info.size > MAX_TAR_HEADER_BYTES:
            raise _OversizedHeader(info.size)
        return info


class _Unpacking:
    """The running totals of one extraction, against the limits."""

    def __init__(self, archive: str):
        self.archive = archive
        self.unpacked = 0
        self.kept = 0
        self.manifest: dict[str, str] = {}  # path below vllm/ -> sha256

    def refuse(self, what: str) -> ProbeError:
        return ProbeError(f"{self.archive} {what}: not a vLLM release, or a decompression bomb")

    def pass_over(self, size: int) -> None:
        self.unpacked += size
        if self.unpacked > MAX_UNPACKED_BYTES:
            raise self.refuse(f"unpacks to more than {_amount(MAX_UNPACKED_BYTES)}")

    def check(self, name: str, size: int) -> None:
        if size > MAX_MEMBER_BYTES:
            raise self.refuse(f"holds {name} of {_amount(size)} (limit {_amount(MAX_MEMBER_BYTES)})")
        if len(self.manifest) >= MAX_KEPT_FILES:
            raise self.refuse(f"holds more than {MAX_KEPT_FILES} vllm/**/*.py files")
        self.kept += size
        if self.kept > MAX_KEPT_BYTES:
            raise self.refuse(f"holds more than {_amount(MAX_KEPT_BYTES)} of vllm/**/*.py")


def _read_small(member, name: str, size: int, unpacking: _Unpacking) -> str:
    unpacking.check(name, size)
    return member.read(size).decode(errors="replace")


def _write_member(dest: Path, relative: str, member, size: int, unpacking: _Unpacking) -> None:
    """Copy one archive member to ``dest/vllm/relative`` in chunks, noting its digest."""
    parts = relative.split("/")
    if any(part in ("", ".", "..") or "\0" in part for part in parts):
        return  # never write outside dest
    unpacking.check(f"vllm/{relative}", size)
    target = dest.joinpath("vllm", *parts)
    digest = hashlib.sha256()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as out:
            while chunk := member.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
    except OSError as exc:
        raise ProbeError(f"cannot write {target}: {exc.strerror}") from None
    unpacking.manifest[relative] = digest.hexdigest()


def extract(archive: Path, dest: Path, name: str | None = None) -> tuple[dict[str, str], str | None]:
    """Write the archive's ``vllm/**/*.py`` under ``dest/vllm``; errors call it ``name``
    (a download's URL rather than its short-lived path).

    Returns the sha256 of each file written (by its path below ``vllm/``) and the version
    the archive's own metadata (PKG-INFO or the wheel's METADATA) declares, if any.
    """
    name = name or str(archive)
    unpacking, declared = _Unpacking(name), None
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    match = _PACKAGE_MEMBER.match(info.filename)
                    is_metadata = _WHEEL_METADATA.match(info.filename) or _PKG_INFO.match(info.filename)
                    if not (match or is_metadata):
                        continue  # never decompressed
                    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                        raise unpacking.refuse(f"compresses {info.filename} with method "
                                                f"{info.compress_type}, not deflate")
                    with zf.open(info) as member:
                        if match:
                            _write_member(dest, match.group(1), member, info.file_size, unpacking)
                        else:
                            declared = _metadata_version(
                                _read_small(member, info.filename, info.file_size, unpacking))
        else:
            # Streaming mode reads the compressed file once, front to back.
            with tarfile.open(archive, "r|*", tarinfo=_BoundedTarInfo) as tf:
                for member in tf:
                    unpacking.pass_over(member.size)
                    if not member.isfile():
                        continue  # links and devices are never needed, and never safe
                    match = _PACKAGE_MEMBER.match(member.name)
                    if match:
                        _write_member(dest, match.group(1), tf.extractfile(member), member.size,
                                      unpacking)
                    elif _PKG_INFO.match(member.name):
                        declared = _metadata_version(
                            _read_small(tf.extractfile(member), member.name, member.size, unpacking))
    except _OversizedHeader as exc:
        raise unpacking.refuse(
            f"holds a {exc.args[0]}-byte extended header (limit {_amount(MAX_TAR_HEADER_BYTES)})"
        ) from None
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
        raise ProbeError(
            f"{name} is not a readable {'zip' if archive.suffix in ('.whl', '.zip') else 'tar'} "
            f"archive ({exc}); is the file complete?"
        ) from None
    if not (dest / "vllm" / "__init__.py").is_file():
        raise ProbeError(
            f"{name} holds no vllm/__init__.py: expected a vLLM sdist "
            "(vllm-X.tar.gz with vllm-X/vllm/) or wheel (vllm-X-….whl with vllm/)"
        )
    return unpacking.manifest, declared


# -- the package index --------------------------------------------------------

# An index named by --index-url is someone else's server: what it may send is bounded.
# Module constants so tests can shrink them.
MAX_PAGE_BYTES = 32 << 20  # PyPI's vllm page: 128 KB for 309 files of 101 versions
MAX_DOWNLOAD_BYTES = 2 << 30  # the sdist is about 50 MB; PyPI's largest vllm file, 509 MB
# A request must bring STALL_BYTES, or its end, every STALL_SECONDS, headers included; a
# socket timeout alone never fires on a server that sends a byte every few seconds.
STALL_SECONDS = 30.0
STALL_BYTES = 64 << 10
_SCHEMES = ("http", "https")
# A file name the index lists: a plain name, never a path (it names a file in the cache).
_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


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


class _Watchdog:
    """Shuts a request's socket down once it stalls (see STALL_SECONDS); the blocked read
    then fails and :attr:`stalled` says why."""

    def __init__(self) -> None:
        self.stalled = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._since, self._count = time.monotonic(), 0
        threading.Thread(target=self._run, name="ascend-patch-watchdog", daemon=True).start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.stalled:
                self._shut(sock)

    def received(self, count: int) -> None:
        self._count += count
        if self._count >= STALL_BYTES:
            self._since, self._count = time.monotonic(), 0

    def close(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(max(0.0, self._since + STALL_SECONDS - time.monotonic())):
            if time.monotonic() >= self._since + STALL_SECONDS:
                with self._lock:
                    self.stalled = True
                    for sock in self._sockets:
                        self._shut(sock)
                return

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:  # socket.socket's own: SSLSocket.shutdown would pull TLS state from the reader
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


class _Watched:
    """A connection whose socket its request's watchdog may shut down."""

    def __init__(self, *args, watchdog: _Watchdog, **kwargs):
        super().__init__(*args, **kwargs)
        self.watchdog = watchdog

    def connect(self):
        super().connect()
        self.watchdog.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _WatchedHandler(urllib.request.AbstractHTTPHandler):
    """http and https through connections the request's watchdog watches."""

    def __init__(self, watchdog: _Watchdog):
        super().__init__()
        self.watchdog = watchdog

    def http_open(self, req):
        return self.do_open(_WatchedHTTP, req, watchdog=self.watchdog)

    def https_open(self, req):
        return self.do_open(_WatchedHTTPS, req, watchdog=self.watchdog)

    http_request = https_request = urllib.request.AbstractHTTPHandler.do_request_


def _opener(watchdog: _Watchdog) -> urllib.request.OpenerDirector:
    """http(s) only (no file:, ftp: or data: handlers, so no redirect to them), with the
    environment's proxies."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(), urllib.request.UnknownHandler(),
        urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(), _WatchedHandler(watchdog),
    ):
        opener.add_handler(handler)
    return opener


def _is_http_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in _SCHEMES and bool(parts.netloc)


def _stalled(url: str) -> ProbeError:
    return ProbeError(
        f"{url} sent less than {_amount(STALL_BYTES)} in {STALL_SECONDS:g} s: the server or the "
        "network stalls. Run the probe again, or use --index-url for a mirror"
    )


@contextlib.contextmanager
def _request(url: str, accept: str) -> Iterator[tuple[http.client.HTTPResponse, _Watchdog]]:
    request = urllib.request.Request(
        url, headers={"Accept": accept, "User-Agent": f"ascend-patch/{__version__} probe"}
    )
    watchdog = _Watchdog()
    try:
        try:
            response = _opener(watchdog).open(request, timeout=STALL_SECONDS)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise ProbeError(
                f"{url} answered HTTP {exc.code} {exc.reason}; --index-url must name a "
                "simple-API index such as https://pypi.org/simple"
            ) from None
        except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError, resets
            if watchdog.stalled:
                raise _stalled(url) from None
            reason = getattr(exc, "reason", exc)
            raise ProbeError(
                f"cannot reach {url}: {reason}. Check the network (or proxy settings), "
                "use --index-url for a mirror, or probe a local sdist, wheel or source tree"
            ) from None
        with response:
            yield response, watchdog
    finally:
        watchdog.close()


def _body(response, watchdog: _Watchdog, url: str, limit: int, what: str) -> Iterator[bytes]:
    """The response body in chunks as they arrive: no more than ``limit`` bytes (``what``
    says what that limit is), and all that Content-Length announces."""
    announced = response.length  # Content-Length, None when chunked
    if announced is not None and announced > limit:
        raise ProbeError(f"{url} announces {_amount(announced)}, more than {what}")
    received = 0
    while True:
        try:
            chunk = response.read1(_CHUNK)
        except (OSError, http.client.HTTPException) as exc:
            if watchdog.stalled:
                raise _stalled(url) from None
            raise ProbeError(
                f"reading {url} broke off after {received} bytes ({exc}); run the probe again"
            ) from None
        if not chunk:
            break
        received += len(chunk)
        if received > limit:
            raise ProbeError(f"{url} sent more than {what}")
        watchdog.received(len(chunk))
        yield chunk
    if watchdog.stalled:
        raise _stalled(url)
    if announced is not None and received < announced:
        raise ProbeError(
            f"reading {url} broke off after {received} of {announced} bytes; run the probe again"
        )


def _json_files(data, page: str) -> tuple[list[IndexFile], list[str] | None]:
    def text(value) -> str | None:
        return value if isinstance(value, str) else None

    files = []
    for item in data["files"]:
        hashes = item.get("hashes")
        size = item.get("size")
        name, url = item["filename"], item["url"]
        if not (isinstance(name, str) and isinstance(url, str)):
            raise TypeError(f"filename {name!r}, url {url!r}")
        files.append(
            IndexFile(
                name,
                urllib.parse.urljoin(page, url),
                text(hashes.get("sha256")) if isinstance(hashes, dict) else None,
                size if isinstance(size, int) and size >= 0 else None,
                bool(item.get("yanked")),
            )
        )
    listed = data.get("versions")
    return files, [v for v in listed if isinstance(v, str)] if isinstance(listed, list) else None


def read_index(index_url: str) -> tuple[list[IndexFile], list[str]]:
    """Every file of the ``vllm`` project on the index, and every version it lists."""
    page = index_url.rstrip("/") + "/vllm/"
    with _request(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as (response, watchdog):
        content_type = response.headers.get("Content-Type", "")
        what = f"{_amount(MAX_PAGE_BYTES)}, the limit for an index page"
        body = b"".join(_body(response, watchdog, page, MAX_PAGE_BYTES, what))
    files: list[IndexFile] = []
    if "json" in content_type:
        try:
            files, listed = _json_files(json.loads(body), page)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ProbeError(f"{page} is not a valid simple-API JSON page") from None
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


def _check_release_file(item: IndexFile, index_url: str) -> None:
    """Refuse what the index says about the file before anything is fetched or written."""
    if not _PLAIN_FILE_NAME.fullmatch(item.filename):
        raise ProbeError(
            f"{index_url} names the file {item.filename!r}, which is not a plain file name; "
            "refusing it (a path would write outside the cache)"
        )
    if not _is_http_url(item.url):
        raise ProbeError(
            f"{index_url} gives {item.url!r} for {item.filename}: only http(s) downloads are fetched"
        )
    if item.size is not None and item.size > MAX_DOWNLOAD_BYTES:
        raise ProbeError(
            f"{index_url} lists {item.filename} at {_amount(item.size)}, more than the "
            f"{_amount(MAX_DOWNLOAD_BYTES)} the probe downloads"
        )


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
    if item.size is not None:
        limit, what = item.size, f"the {item.size} bytes the index lists for it"
    else:
        limit, what = MAX_DOWNLOAD_BYTES, f"{_amount(MAX_DOWNLOAD_BYTES)}, the download limit"
    with _request(item.url, "*/*") as (response, watchdog):
        progress = _Progress(item.filename, item.size or response.length)
        try:
            with dest.open("wb") as out:
                for chunk in _body(response, watchdog, item.url, limit, what):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
        except OSError as exc:
            raise ProbeError(f"cannot write {dest}: {exc.strerror}") from None
        progress.finish()
    found = digest.hexdigest()
    if item.size is not None and progress.done != item.size:
        raise ProbeError(
            f"{item.filename} is incomplete: {progress.done} bytes received, the index lists "
            f"{item.size}. Run the probe again"
        )
    if item.sha256 and found != item.sha256.lower():
        raise ProbeError(
            f"{item.filename} is corrupt: its sha256 is {found}, the index says {item.sha256} "
            f"({progress.done} bytes received). The download was deleted; run the probe again"
        )
    return found


# -- the cache ----------------------------------------------------------------
#
# releases/vllm-X/ holds release.json (with the sha256 of every file) and vllm/; an entry
# is reused only while every file matches, and is replaced once a fresh copy is ready.
# A probe extracts into releases/.vllm-X-*/ and holds a lock on its .live file while it
# does; a staging directory nobody holds is left by a killed probe, and removed.
# releases/.lock serialises the short steps that look at or change entries.

_LIVE = ".live"


@contextlib.contextmanager
def _hold(lock: Path) -> Iterator[None]:
    """An exclusive lock on ``lock`` (created if need be), released when the process ends
    however it ends."""
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _is_held(lock: Path) -> bool:
    descriptor = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


def _remove_stale_staging(releases: Path) -> None:
    """Under the cache lock: staging directories whose probe is gone."""
    for path in releases.glob(".vllm-*"):
        if not path.is_dir() or (path / _LIVE).exists() and _is_held(path / _LIVE):
            continue
        shutil.rmtree(path, ignore_errors=True)
        _note(f"removed {path}, left by an interrupted probe")


def _entry_problem(entry: Path, requested: Version) -> tuple[dict | None, str | None]:
    """An entry's release.json if its files are exactly those it records, else what is wrong."""
    try:
        info = json.loads((entry / "release.json").read_text())
        manifest, version = info.get("manifest"), info.get("version")
    except FileNotFoundError:
        return None, "it has no release.json"
    except (OSError, ValueError, AttributeError):
        return None, "its release.json is unreadable"
    if not isinstance(manifest, dict) or "__init__.py" not in manifest:
        return None, "its release.json records no files (an older ascend-patch wrote it)"
    if not isinstance(version, str) or parse_version(version) != requested:
        return None, f"its release.json records vLLM {version!r}"
    package = str(entry / "vllm")  # plain strings: pathlib would double the cost of the walk
    found = set()
    for root, _, names in os.walk(package):
        below = root[len(package) + 1 :]
        found.update(f"{below}/{name}" if below else name for name in names)
    for name in sorted(manifest.keys() - found):
        return None, f"vllm/{name} is missing"
    for name in sorted(found - manifest.keys()):
        return None, f"vllm/{name} is not part of the release"
    for name, recorded in sorted(manifest.items()):
        try:
            with open(os.path.join(package, name), "rb") as file:
                digest = hashlib.sha256(file.read()).hexdigest()
        except OSError as exc:
            return None, f"vllm/{name} is unreadable ({exc.strerror})"
        if digest != recorded:
            return None, f"vllm/{name} changed since it was extracted"
    return info, None


def _entries(releases: Path, requested: Version) -> list[Path]:
    """The cache entries of ``requested``, however the index spelled it (0.33, 0.33.0)."""
    return sorted(
        path for path in releases.glob("vllm-*")
        if path.is_dir() and parse_version(path.name[len("vllm-") :]) == requested
    )


def _intact_entry(releases: Path, requested: Version, report: bool) -> tuple[Path, dict] | None:
    for entry in _entries(releases, requested):
        info, problem = _entry_problem(entry, requested)
        if info is not None:
            return entry, info
        if report:
            _note(f"the cached {entry} is damaged ({problem}); fetching the release again")
    return None


def _release_source(entry: Path, info: dict, argument: str, cached: bool) -> Source:
    details = {k: v for k, v in info.items() if k != "manifest"}
    return Source(
        entry / "vllm", "release", argument, info["version"], "the argument",
        {**details, "cache": str(entry), "cached": cached},
    )


def _install(staging: Path, releases: Path, requested: Version, info: dict) -> tuple[Path, dict]:
    """Under the cache lock: move ``staging`` in as the entry of ``requested``, replacing
    damaged entries; a concurrent probe's intact entry wins instead."""
    winner = _intact_entry(releases, requested, report=False)
    if winner is not None:
        shutil.rmtree(staging, ignore_errors=True)
        return winner
    trash = Path(tempfile.mkdtemp(prefix=".vllm-replaced-", dir=releases))
    for damaged in _entries(releases, requested):
        damaged.rename(trash / damaged.name)
    final = releases / f"vllm-{info['version']}"
    (staging / _LIVE).unlink()
    staging.rename(final)
    shutil.rmtree(trash, ignore_errors=True)
    return final, info


def fetch_release(requested_text: str, index_url: str = DEFAULT_INDEX) -> Source:
    """The ``vllm`` package of a release on the index, from the cache or fetched into it."""
    requested = parse_version(requested_text)
    if requested is None:
        raise ProbeError(
            f"{requested_text!r} is neither an existing path nor a version; give a vLLM version "
            "such as 0.33.0, or the path of a wheel, sdist or source tree"
        )
    if not _is_http_url(index_url):
        raise ProbeError(
            f"--index-url {index_url!r} is not an http(s) URL; give a simple-API index such as "
            f"{DEFAULT_INDEX}"
        )
    releases = Path(env.cache_dir()) / "releases"
    try:
        releases.mkdir(parents=True, exist_ok=True)
        with _hold(releases / ".lock"):
            _remove_stale_staging(releases)
            hit = _intact_entry(releases, requested, report=True)
    except OSError as exc:
        raise ProbeError(
            f"cannot use the cache in {releases}: {exc.strerror}; set ASCEND_PATCH_CACHE_DIR "
            "to a writable directory"
        ) from None
    if hit is not None:
        return _release_source(*hit, requested_text, cached=True)
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
    _check_release_file(item, index_url)
    version_text = str(requested)
    for text in listed:
        if parse_version(text) == requested:
            version_text = text.strip()  # the index's own spelling: 0.33.0, not 0.33
    with contextlib.ExitStack() as stack:
        try:
            with _hold(releases / ".lock"):  # so a cleaner never sees it unlocked
                staging = Path(tempfile.mkdtemp(prefix=f".vllm-{version_text}-", dir=releases))
                stack.enter_context(_hold(staging / _LIVE))
        except OSError as exc:
            raise ProbeError(f"cannot create a staging directory in {releases}: {exc.strerror}") from None
        try:
            archive = staging / item.filename
            sha256 = _download(item, archive)
            manifest, _ = extract(archive, staging, item.url)
            archive.unlink()  # keep only the .py files
            info = {
                "version": version_text,
                "archive": item.filename,
                "url": item.url,
                "sha256": sha256,
                "sha256_verified": item.sha256 is not None,
                "yanked": item.yanked,
                "files": len(manifest),
                "manifest": manifest,
            }
            (staging / "release.json").write_text(json.dumps(info, indent=1) + "\n")
            with _hold(releases / ".lock"):
                entry, info = _install(staging, releases, requested, info)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise ProbeError(
                f"cannot write the release into {releases} ({exc.strerror}); "
                "run the probe again"
            ) from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # while it is still locked as ours
            raise
    _note(f"extracted {info['files']} files of vllm/ to {entry}")
    return _release_source(entry, info, requested_text, cached=False)


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
        manifest, declared = extract(path, Path(scratch))
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
        yield Source(package_dir, kind, argument, found, source_of_version, {"files": len(manifest)})
