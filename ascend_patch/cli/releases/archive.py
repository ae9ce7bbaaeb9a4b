"""A vLLM wheel's or sdist's ``vllm/**/*.py``, unpacked under the limits of :mod:`.limits`.

Only regular files named ``vllm/…/*.py`` (in an sdist, ``<top>/vllm/…``) whose path
components are plain names are kept, renamed below ``vllm/``, and checked against the limits
before a byte of them is read; the archive's own metadata (PKG-INFO, a wheel's METADATA) is read
for its version; nothing else is written. The writing is the standard library's: ``tarfile``
with its ``data`` extraction filter (no name outside the destination, no link or device, sane
permissions and owner), ``zipfile.extract`` (which drops ``..`` and absolute components).
tarfile has that filter from Python 3.10.12 and 3.11.4 on; on older Pythons an sdist is
refused (a wheel, or an extracted tree, still works there).
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from ascend_patch.cli.releases import limits
from ascend_patch.cli.releases.messages import ProbeError, amount
from ascend_patch.cli.releases.versions import metadata_version

_PLAIN = r"(?!\.\.?/)[^/\0]+"  # a path component that is a name: not empty, `.` or `..`
# `vllm/...py` in a wheel, `<top>/vllm/...py` in an sdist.
_PACKAGE_MEMBER = re.compile(rf"^(?:[^/]+/)?vllm/((?:{_PLAIN}/)*{_PLAIN}\.py)$")
_PKG_INFO = re.compile(r"^[^/]+/PKG-INFO$")
_WHEEL_METADATA = re.compile(r"^[^/]+\.dist-info/METADATA$")
_EXTENDED_HEADERS = (
    tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK,
)


def is_zip(path: Path) -> bool:
    return path.name.endswith((".whl", ".zip"))


def package_files(package_dir: str) -> set[str]:
    """Every file below ``package_dir``, by its path below it (plain strings: pathlib would
    double the cost of walking a release)."""
    found = set()
    for root, _, names in os.walk(package_dir):
        below = root[len(package_dir) + 1 :]
        found.update(f"{below}/{name}" if below else name for name in names)
    return found


def sha256_of(path: str) -> str:
    with open(path, "rb") as file:  # a kept file is at most MAX_MEMBER_BYTES
        return hashlib.sha256(file.read()).hexdigest()


class _OversizedHeader(Exception):
    pass


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses a pax or long-name header larger than any sane path list before tarfile
    reads it into memory."""

    @classmethod
    def frombuf(cls, buf, encoding, errors):
        info = super().frombuf(buf, encoding, errors)
        if info.type in _EXTENDED_HEADERS and info.size > limits.MAX_TAR_HEADER_BYTES:
            raise _OversizedHeader(info.size)
        return info


class _Unpacking:
    """The running totals of one extraction, against the limits."""

    def __init__(self, archive: str):
        self.archive = archive
        self.unpacked = 0
        self.kept_bytes = 0
        self.kept_files = 0
        self.metadata: bytes | None = None

    def refuse(self, what: str) -> ProbeError:
        return ProbeError(f"{self.archive} {what}: not a vLLM release, or a decompression bomb")

    def pass_over(self, size: int) -> None:
        self.unpacked += size
        if self.unpacked > limits.MAX_UNPACKED_BYTES:
            raise self.refuse(f"unpacks to more than {amount(limits.MAX_UNPACKED_BYTES)}")

    def check(self, name: str, size: int) -> None:
        if size > limits.MAX_MEMBER_BYTES:
            raise self.refuse(f"holds {name} of {amount(size)} (limit {amount(limits.MAX_MEMBER_BYTES)})")
        if self.kept_files >= limits.MAX_KEPT_FILES:
            raise self.refuse(f"holds more than {limits.MAX_KEPT_FILES} vllm/**/*.py files")
        self.kept_bytes += size
        if self.kept_bytes > limits.MAX_KEPT_BYTES:
            raise self.refuse(f"holds more than {amount(limits.MAX_KEPT_BYTES)} of vllm/**/*.py")

    def keep(self, relative: str, size: int) -> str:
        """Admit ``vllm/relative``; its name in the destination."""
        self.check(f"vllm/{relative}", size)
        self.kept_files += 1
        return f"vllm/{relative}"


def _kept_tar_members(tf: tarfile.TarFile, unpacking: _Unpacking) -> Iterator[tarfile.TarInfo]:
    """The members to extract, renamed below ``vllm/``; PKG-INFO is read on the way."""
    for member in tf:  # streaming: the compressed file is read once, front to back
        unpacking.pass_over(member.size)
        if not member.isfile():
            continue  # links and devices are never needed, and never safe
        match = _PACKAGE_MEMBER.match(member.name)
        if match:
            kept = copy.copy(member)
            kept.name = unpacking.keep(match.group(1), member.size)
            yield kept
        elif _PKG_INFO.match(member.name):
            unpacking.check(member.name, member.size)
            unpacking.metadata = tf.extractfile(member).read()


def _extract_zip(archive: Path, dest: Path, unpacking: _Unpacking) -> None:
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
            if match:
                kept = copy.copy(info)
                kept.filename = unpacking.keep(match.group(1), info.file_size)
                zf.extract(kept, dest)
            else:
                unpacking.check(info.filename, info.file_size)
                unpacking.metadata = zf.read(info)


def extract(archive: Path, dest: Path, name: str | None = None) -> tuple[dict[str, str], str | None]:
    """Write the archive's ``vllm/**/*.py`` under ``dest/vllm``; errors call it ``name``
    (a download's URL rather than its short-lived path).

    Returns the sha256 of each file written (by its path below ``vllm/``) and the version
    the archive's own metadata (PKG-INFO or the wheel's METADATA) declares, if any.
    """
    name = name or str(archive)
    unpacking = _Unpacking(name)
    if not is_zip(archive) and not hasattr(tarfile, "data_filter"):
        raise ProbeError(
            f"unpacking {name} safely needs tarfile's extraction filters (Python 3.10.12+ or "
            f"3.11.4+; this is {sys.version.split()[0]}): upgrade Python, or probe a wheel or an "
            "extracted source tree"
        )
    try:
        if is_zip(archive):
            _extract_zip(archive, dest, unpacking)
        else:
            with tarfile.open(archive, "r|*", tarinfo=_BoundedTarInfo) as tf:
                tf.extractall(dest, members=_kept_tar_members(tf, unpacking), filter="data")
    except _OversizedHeader as exc:
        raise unpacking.refuse(
            f"holds a {exc.args[0]}-byte extended header (limit {amount(limits.MAX_TAR_HEADER_BYTES)})"
        ) from None
    except OSError as exc:
        if exc.filename and Path(exc.filename).is_relative_to(dest):
            raise ProbeError(f"cannot write {exc.filename}: {exc.strerror}") from None
        raise _unreadable(name, archive, exc) from None
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise _unreadable(name, archive, exc) from None
    package = dest / "vllm"
    if not (package / "__init__.py").is_file():
        raise ProbeError(
            f"{name} holds no vllm/__init__.py: expected a vLLM sdist "
            "(vllm-X.tar.gz with vllm-X/vllm/) or wheel (vllm-X-….whl with vllm/)"
        )
    manifest = {f: sha256_of(os.path.join(package, f)) for f in sorted(package_files(str(package)))}
    declared = metadata_version(unpacking.metadata) if unpacking.metadata is not None else None
    return manifest, declared


def _unreadable(name: str, archive: Path, exc: Exception) -> ProbeError:
    return ProbeError(
        f"{name} is not a readable {'zip' if is_zip(archive) else 'tar'} archive ({exc}); "
        "is the file complete?"
    )
