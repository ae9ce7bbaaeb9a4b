"""Which vLLM version a release file's name, its metadata or a source tree declares."""

from __future__ import annotations

from pathlib import Path

from packaging.metadata import parse_email
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    parse_sdist_filename,
    parse_wheel_filename,
)

from ascend_patch.overlay import version as versions

SDIST_SUFFIXES = (".tar.gz", ".tgz", ".zip")


def metadata_version(text: bytes | str) -> str | None:
    """The ``Version`` a PKG-INFO or a wheel's METADATA declares."""
    return parse_email(text)[0].get("version")


def file_name_version(name: str) -> str | None:
    """``vllm-0.33.0.tar.gz`` / ``vllm-0.33.0-cp38-abi3-….whl`` → ``0.33.0``."""
    try:
        if name.endswith(".whl"):
            return str(parse_wheel_filename(name)[1])
        if name.endswith(".tgz"):  # .tar.gz's short spelling, which packaging does not read
            name = name.removesuffix(".tgz") + ".tar.gz"
        return str(parse_sdist_filename(name)[1])
    except (InvalidSdistFilename, InvalidWheelFilename):
        return None


def tree_version(package_dir: Path) -> tuple[str | None, str, str]:
    """A directory's version, where it came from, and the input kind ("installed" when
    site-packages metadata owns it): sdist PKG-INFO, installed metadata, ``_version.py``."""
    pkg_info = package_dir.parent / "PKG-INFO"
    if pkg_info.is_file():
        found = metadata_version(pkg_info.read_text(errors="replace"))
        if found:
            return found, str(pkg_info), "tree"
    installed = versions.installed_distribution(package_dir)
    if installed is not None and installed.version:
        where = Path(str(getattr(installed, "_path", installed.name))).name  # the .dist-info directory
        return installed.version, f"installed distribution metadata ({where})", "installed"
    declared = versions.source_tree_version(package_dir)
    if versions.parse_or_none(declared):
        return declared, f"{package_dir}/_version.py", "tree"
    return None, (
        f"no version found: {package_dir} has no _version.py (a git checkout generates it only "
        "when built), no PKG-INFO beside it and no installed metadata"
    ), "tree"
