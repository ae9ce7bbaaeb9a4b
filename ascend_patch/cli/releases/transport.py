"""HTTP(S) from a package index that is not trusted: bodies under size limits, and a stall
deadline on every read of the connection, the status line and headers included.

The deadline (:data:`limits.STALL_BYTES` every :data:`limits.STALL_SECONDS`) is checked each
time the connection's socket is read, and each read's socket timeout is the time left before
it, so a server that sends nothing and one that sends a byte every few seconds are both cut
off; no thread watches. Only http and https are spoken, through the environment's proxies.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ascend_patch import __version__
from ascend_patch.cli.releases import limits
from ascend_patch.cli.releases.messages import ProbeError, amount, note

clock = time.monotonic
"""The deadline's clock (tests drive their own)."""
_CHUNK = 1 << 20


class _Deadline:
    """One request's stall deadline: the window restarts whenever STALL_BYTES have arrived in it."""

    def __init__(self) -> None:
        self.since, self.count, self.stalled = clock(), 0, False

    def time_left(self) -> float:
        left = self.since + limits.STALL_SECONDS - clock()
        if left <= 0:
            self.stalled = True
            raise TimeoutError("the stall deadline passed")
        return left

    def arrived(self, count: int) -> None:
        self.time_left()  # bytes that come after the deadline come too late
        self.count += count
        if self.count >= limits.STALL_BYTES:
            self.since, self.count = clock(), 0


class _DeadlineReader(io.RawIOBase):
    """The raw reads of a connection's socket, each under the deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._raw, self._deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(self._deadline.time_left())
        try:
            count = self._raw.readinto(buffer)
        except TimeoutError:
            self._deadline.stalled = True  # the timeout was the time left
            raise
        if count:
            self._deadline.arrived(count)
        return count

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """A connection's socket whose reader (``makefile``, which http.client reads responses
    through) keeps the deadline; everything else is the socket's own."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str = "rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _Connection:
    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self):
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _HTTPConnection(_Connection, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Connection, http.client.HTTPSConnection):
    pass


class _Handler(urllib.request.AbstractHTTPHandler):
    """http and https through connections that keep the request's deadline."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_HTTPConnection, req, deadline=self.deadline)

    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, deadline=self.deadline)

    http_request = https_request = urllib.request.AbstractHTTPHandler.do_request_


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """http(s) only (no file:, ftp: or data: handlers, so no redirect to them), with the
    environment's proxies."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(), urllib.request.UnknownHandler(),
        urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(), _Handler(deadline),
    ):
        opener.add_handler(handler)
    return opener


def is_http_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _stalled(url: str) -> ProbeError:
    return ProbeError(
        f"{url} sent less than {amount(limits.STALL_BYTES)} in {limits.STALL_SECONDS:g} s: the "
        "server or the network stalls. Run the probe again, or use --index-url for a mirror"
    )


@contextlib.contextmanager
def request(url: str, accept: str) -> Iterator[tuple[http.client.HTTPResponse, _Deadline]]:
    """The open response to a GET of ``url``, and its deadline for :func:`body`."""
    deadline = _Deadline()
    message = urllib.request.Request(
        url, headers={"Accept": accept, "User-Agent": f"ascend-patch/{__version__} probe"}
    )
    try:
        # The timeout bounds connecting and sending; reads take theirs from the deadline.
        response = _opener(deadline).open(message, timeout=limits.STALL_SECONDS)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise ProbeError(
            f"{url} answered HTTP {exc.code} {exc.reason}; --index-url must name a "
            "simple-API index such as https://pypi.org/simple"
        ) from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError, resets
        if deadline.stalled:
            raise _stalled(url) from None
        reason = getattr(exc, "reason", exc)
        raise ProbeError(
            f"cannot reach {url}: {reason}. Check the network (or proxy settings), "
            "use --index-url for a mirror, or probe a local sdist, wheel or source tree"
        ) from None
    with response:
        yield response, deadline


def body(response, deadline: _Deadline, url: str, limit: int, what: str) -> Iterator[bytes]:
    """The response body in chunks as they arrive: no more than ``limit`` bytes (``what``
    says what that limit is), and all that Content-Length announces."""
    announced = response.length  # Content-Length, None when chunked
    if announced is not None and announced > limit:
        raise ProbeError(f"{url} announces {amount(announced)}, more than {what}")
    received = 0
    while True:
        try:
            chunk = response.read1(_CHUNK)
        except (OSError, http.client.HTTPException) as exc:
            if deadline.stalled:
                raise _stalled(url) from None
            raise ProbeError(
                f"reading {url} broke off after {received} bytes ({exc}); run the probe again"
            ) from None
        if not chunk:
            break
        received += len(chunk)
        if received > limit:
            raise ProbeError(f"{url} sent more than {what}")
        yield chunk
    if announced is not None and received < announced:
        raise ProbeError(
            f"reading {url} broke off after {received} of {announced} bytes; run the probe again"
        )


class _Progress:
    """Download progress on stderr: a live line on a terminal, start and end lines otherwise."""

    def __init__(self, name: str, total: int | None):
        self.name, self.total, self.done = name, total, 0
        self.start = self.shown = time.monotonic()
        self.live = sys.stderr.isatty()
        size = f" ({total / 1e6:.1f} MB)" if total else ""
        if not self.live:
            note(f"downloading {name}{size}")

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
        note(f"downloaded {self.name} ({self.done / 1e6:.1f} MB) in {seconds:.1f} s")


def download(url: str, dest: Path, *, name: str, size: int | None, sha256: str | None) -> str:
    """Stream ``url`` (the file ``name``, of ``size`` bytes if the index says) to ``dest``;
    returns the sha256, checked against ``sha256`` when the index gives one."""
    digest = hashlib.sha256()
    if size is not None:
        limit, what = size, f"the {size} bytes the index lists for it"
    else:
        limit, what = limits.MAX_DOWNLOAD_BYTES, f"{amount(limits.MAX_DOWNLOAD_BYTES)}, the download limit"
    with request(url, "*/*") as (response, deadline):
        progress = _Progress(name, size or response.length)
        try:
            with dest.open("wb") as out:
                for chunk in body(response, deadline, url, limit, what):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
        except OSError as exc:
            raise ProbeError(f"cannot write {dest}: {exc.strerror}") from None
        progress.finish()
    found = digest.hexdigest()
    if size is not None and progress.done != size:
        raise ProbeError(
            f"{name} is incomplete: {progress.done} bytes received, the index lists "
            f"{size}. Run the probe again"
        )
    if sha256 and found != sha256.lower():
        raise ProbeError(
            f"{name} is corrupt: its sha256 is {found}, the index says {sha256} "
            f"({progress.done} bytes received). The download was deleted; run the probe again"
        )
    return found
