"""vLLM version detection and parsing."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.version import Version

from ascend_patch.overlay import version as versions
from tests.helpers.process import vllm_package_dir


@pytest.mark.parametrize(
    ("text", "release", "is_dev", "local"),
    [
        ("0.33.0", "0.33.0", False, None),
        ("0.33", "0.33.0", False, None),
        ("0.29.0rc1", "0.29.0", False, None),
        ("0.33.1.dev12+gabc123", "0.33.1", True, "gabc123"),
        ("0.33.0+empty", "0.33.0", False, "empty"),
        ("0.32.0+cpu", "0.32.0", False, "cpu"),
        ("0.34.0.dev5+g0123abc.d20261129", "0.34.0", True, "g0123abc.d20261129"),
        ("v0.30.0", "0.30.0", False, None),
        ("0.27.1.post1", "0.27.1", False, None),
        ("1.0", "1.0.0", False, None),
    ],
)
def test_parse_and_release(text, release, is_dev, local):
    parsed = versions.parse(text)
    assert versions.release(parsed) == Version(release)
    assert parsed.is_devrelease is is_dev
    assert parsed.local == local


@pytest.mark.parametrize("text", ["", "main", "0.33.0-custom build", "latest", "0.33.x"])
def test_unparsable_versions_name_the_override(text):
    with pytest.raises(versions.VersionError) as err:
        versions.parse(text)
    assert "ASCEND_PATCH_VLLM_VERSION" in str(err.value)
    assert repr(text) in str(err.value)


def test_detects_the_installed_wheel(monkeypatch):
    monkeypatch.delenv("ASCEND_PATCH_VLLM_VERSION", raising=False)
    found = versions.find_vllm()
    assert found is not None
    assert found.distribution == "vllm"
    assert found.version == found.detected == importlib.metadata.version("vllm")
    assert Path(found.location) == vllm_package_dir()
    assert found.source == "metadata of distribution 'vllm'"


def test_override_wins_but_detected_is_kept(monkeypatch):
    monkeypatch.setenv("ASCEND_PATCH_VLLM_VERSION", "0.31.0+fork")
    found = versions.find_vllm()
    assert found.version == "0.31.0+fork"
    assert found.detected == importlib.metadata.version("vllm")
    assert found.source == "ASCEND_PATCH_VLLM_VERSION"
    assert found.release == Version("0.31.0")


@pytest.mark.parametrize(
    ("filename", "content", "expected"),
    [
        ("_version.py", "__version__ = version = '0.33.1.dev12+gabc123'\n", "0.33.1.dev12+gabc123"),
        ("_version.py", "version: str\n__version__: str\n__version__ = version = \"0.33.0+empty\"\n", "0.33.0+empty"),
        ("version.py", "__version__ = '0.30.0'\n", "0.30.0"),
        ("README", "nothing", None),
    ],
)
def test_source_tree_version(tmp_path, filename, content, expected):
    package = tmp_path / "vllm"
    package.mkdir()
    (package / filename).write_text(content)
    assert versions.source_tree_version(package) == expected


def test_other_distributions():
    assert versions.installed_version("torch").startswith("2.13.0")
    assert versions.installed_version("surely-not-installed-dist") is None
