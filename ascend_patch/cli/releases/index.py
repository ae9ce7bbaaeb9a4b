"""The ``vllm`` project's page on a simple-API package index (PEP 691 JSON, or PEP 503 HTML for
mirrors that serve no JSON), and which of its files to fetch for a release."""

from __future__ import annotations

import bisect
import html.parser
import json
import re
import urllib.parse
from dataclasses import dataclass

from packaging.version import Version

from ascend_patch.cli.releases import limits, transport
from ascend_patch.cli.releases.messages import ProbeError, amount
from ascend_patch.cli.releases.versions import SDIST_SUFFIXES, file_name_version
from ascend_patch.overlay import version as versions

DEFAULT_INDEX = "https://pypi.org/simple"
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
    """PEP 503 HTML pages."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, bool]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            values = dict(attrs)
            if values.get("href"):
                self.links.append((values["href"], "data-yanked" in values))


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
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
    with transport.request(page, accept) as (response, deadline):
        content_type = response.headers.get("Content-Type", "")
        what = f"{amount(limits.MAX_PAGE_BYTES)}, the limit for an index page"
        body = b"".join(transport.body(response, deadline, page, limits.MAX_PAGE_BYTES, what))
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
        listed = sorted({v for f in files if (v := file_name_version(f.filename))})
    return files, listed


def nearest(requested: Version, listed: list[str]) -> tuple[list[str], str | None]:
    """The listed releases around ``requested``, and the newest."""
    releases = sorted({v for text in listed if (v := versions.parse_or_none(text))})
    if not releases:
        return [], None
    position = bisect.bisect_left(releases, requested)
    around = releases[max(0, position - 2) : position + 2]
    return [str(v) for v in around], str(releases[-1])


def latest(files: list[IndexFile], listed: list[str]) -> str:
    """The newest final release the index lists with a file that is not yanked."""
    available = {versions.parse_or_none(file_name_version(f.filename)) for f in files if not f.yanked}
    finals = [v for text in listed if (v := versions.parse_or_none(text)) and not v.is_prerelease
              and v in available]
    if not finals:
        raise ProbeError("the index lists no final vLLM release with a file to probe")
    return str(max(finals))


def release_file(files: list[IndexFile], requested: Version) -> IndexFile | None:
    """The sdist of ``requested`` if it has one, else its smallest wheel; unyanked first."""
    mine = [f for f in files if versions.parse_or_none(file_name_version(f.filename)) == requested]

    def preference(f: IndexFile):
        return (f.yanked, not f.filename.endswith(SDIST_SUFFIXES), f.size or 0)

    return min(mine, key=preference, default=None)


def check_release_file(item: IndexFile, index_url: str) -> None:
    """Refuse what the index says about the file before anything is fetched or written."""
    if not _PLAIN_FILE_NAME.fullmatch(item.filename):
        raise ProbeError(
            f"{index_url} names the file {item.filename!r}, which is not a plain file name; "
            "refusing it (a path would write outside the cache)"
        )
    if not transport.is_http_url(item.url):
        raise ProbeError(
            f"{index_url} gives {item.url!r} for {item.filename}: only http(s) downloads are fetched"
        )
    if item.size is not None and item.size > limits.MAX_DOWNLOAD_BYTES:
        raise ProbeError(
            f"{index_url} lists {item.filename} at {amount(item.size)}, more than the "
            f"{amount(limits.MAX_DOWNLOAD_BYTES)} the probe downloads"
        )
