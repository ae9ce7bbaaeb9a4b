"""The README and docs/ say what the code does: every link resolves, every documented command,
flag and variable exists, and the generated tables match the matrix."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest

from ascend_patch import env
from ascend_patch.overlay import matrix
from tests.helpers.process import ROOT, clean_env

README = (ROOT / "README.md").read_text()
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def test_every_environment_variable_is_documented_with_its_default():
    rows = dict(re.findall(r"^\| `(ASCEND_PATCH\w*)` \| ([^|]+) \|", REFERENCE, re.MULTILINE))
    assert set(rows) == {v.name for v in env.VARIABLES}
    for var in env.VARIABLES:
        if var.default:
            assert var.default in rows[var.name], var.name


def test_compatibility_tables_are_generated_from_the_matrix():
    table = matrix.load()
    docs = ROOT / "docs"
    for text, rendered in [(README, matrix.render_markdown(table, compact=True)),
                           ((docs / "compatibility.md").read_text(), matrix.render_markdown(table)),
                           ((docs / "features.md").read_text(), matrix.render_features(table))]:
        assert rendered in text, "run: python scripts/render_readme_matrix.py"
    assert set(matrix.STATUS_LEGEND) == set(matrix.STATUSES), "the legend explains every status"


def test_the_readme_feature_table_is_generated_from_the_recorded_suites():
    """Each feature names suites that exist, and the README's table is what the matrix's records
    (and the main line, which runs them all) give."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render", ROOT / "scripts" / "render_readme_matrix.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    for suites in render.FEATURES.values():
        assert all((ROOT / suite).is_file() for suite in suites), suites
    table = matrix.render_feature_table(matrix.load(), render.FEATURES, render.main_line())
    assert f"{render.FEATURE_START}\n{table}\n{render.FEATURE_END}" in README, \
        "run: python scripts/render_readme_matrix.py"

def test_the_readme_is_a_front_door():
    assert len(README.encode()) <= 12 * 1024
    for needed in ("It has not run on Ascend hardware", "emulated", "ascend-patch verify", "## Requirements",
                   "## Install and quick start", "## Trying it without an NPU", "## Compatibility at a glance",
                   "## Commands", "## Contributing", "ascend-patch 0.1.0 active: vLLM"):
        assert needed in README, needed
    from ascend_patch import __version__

    assert f"ascend-patch {__version__} active:" in README
    commands = re.findall(r"^- `ascend-patch ([a-z][a-z-]*)", README, re.MULTILINE)
    assert sorted(commands) == sorted(_subcommands()), "one line per CLI command"


def _subcommands() -> dict:
    from ascend_patch.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_every_relative_link_resolves(document):
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", document.read_text(), flags=re.DOTALL))
    for target in re.findall(r"(?<!\\)\]\(([^)\s]+)\)", text):  # an escaped \] is no link
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        assert resolved.exists(), f"{document.name}: {target}"
        if anchor:
            assert anchor in _anchors(resolved), f"{document.name}: {target}"


def _docs_references(path) -> list[tuple[str, str]]:
    """The ``(page, heading)`` pairs a module docstring's "Docs:" paragraph names, written as
    ``Docs: docs/a.md, "Heading" and "Other"; docs/b.md, "Third".``"""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = doc.partition("Docs:")[2].split("\n\n")[0]
    return [(page, heading) for page, headings in re.findall(r"(\S+\.md), ((?:\"[^\"]+\"(?: and |\s)*)+)", paragraph)
            for heading in re.findall(r'"([^"]+)"', headings)]


MODULES = sorted((ROOT / "ascend_patch").rglob("*.py"))
ROOMS = sorted((ROOT / "ascend_patch" / "npu").rglob("__init__.py"))


def test_every_docs_reference_of_a_module_names_a_heading_of_its_page():
    named = {}
    for module in MODULES:
        for page, heading in _docs_references(module):
            assert (ROOT / page).is_file(), f"{module.relative_to(ROOT)}: {page}"
            assert _slug(heading) in _anchors(ROOT / page), f"{module.relative_to(ROOT)}: {page}, {heading!r}"
            named[module] = page
    assert len(named) >= len(ROOMS), "the references are read at all"


@pytest.mark.parametrize("room", ROOMS, ids=[str(r.parent.relative_to(ROOT)) for r in ROOMS])
def test_every_room_says_what_it_owns_and_links_its_docs_page(room):
    doc = ast.get_docstring(ast.parse(room.read_text())) or ""
    assert len(doc.partition("Docs:")[0].split()) >= 10, "what the room owns"
    assert _docs_references(room), "Docs: docs/<page>.md, \"<heading>\""


def _documented_invocations() -> list[tuple[str, str]]:
    """Every ``ascend-patch ...`` invocation the documents show, in code spans and blocks."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        snippets = re.findall(r"```.*?```", text, flags=re.DOTALL) + re.findall(r"`([^`\n]+)`", text)
        for snippet in snippets:
            for line in snippet.splitlines():
                for match in re.finditer(r"(?:^|<\(|\$\()ascend-patch ((?:[a-z][a-z-]*|--[a-z-]+)[^#|;)]*)",
                                         line.strip()):
                    found.append((document.name, match.group(1).strip()))
    return found


def test_every_documented_command_and_flag_exists():
    commands = _subcommands()
    invocations = _documented_invocations()
    assert len(invocations) > 30
    for document, invocation in invocations:
        words = invocation.split()
        if words[0] == "--version":
            continue
        assert words[0] in commands, (document, invocation)
        flags = {flag for action in commands[words[0]]._actions for flag in action.option_strings}
        for word in words[1:]:
            if word.startswith("-"):
                assert word.split("=")[0] in flags, (document, invocation)


def test_every_documented_variable_exists():
    known = {v.name for v in env.VARIABLES} | set(env.SCRIPT_VARIABLES)
    for document in DOCUMENTS:
        named = set(re.findall(r"\bASCEND_PATCH(?:_[A-Z]+)*\b", document.read_text()))
        named.discard("ASCEND_PATCH_EMULATED_HMB")  # the misspelling the reference shows being warned about
        assert named <= known, (document.name, named - known)


def test_two_commands_exist_and_ci_runs_the_test_command():
    assert "scripts/demo.sh" in README and "scripts/test.sh" in README
    for script in ("scripts/demo.sh", "scripts/test.sh", "scripts/setup_env.sh"):
        assert (ROOT / script).stat().st_mode & 0o111, script
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_readme_main_command_generates_on_the_emulated_npu():
    """``scripts/demo.sh`` as a user runs it: it reuses the environment, builds the tiny
    model, prints doctor, and generates through an unchanged ``LLM(...)`` script (whose
    engine core is a spawned process). Numerics are the engine tests' job."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh")],
        env=clean_env(), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert re.search(r"^verdict\s+would activate \(emulate mode\)$", result.stdout, re.MULTILINE)
    built = [line for line in result.stderr.splitlines() if line.startswith("building /")]
    assert all("/tiny-llama (" in line for line in built), "only the model it runs"
    assert "The text is noise because the tiny model's weights are random" in result.stdout
    assert re.search(r"^    PASS: \d+/72 tokens are HF fp32's argmax", result.stdout, re.MULTILINE)
    assert "platform: EmulatedNPUPlatform (Ascend NPU (emulated on CPU, 1.0 GiB HBM))" in result.stdout
    generations = re.findall(r"^    token ids: \[([\d, ]+)\]$", result.stdout, re.MULTILINE)
    assert [len(ids.split(", ")) for ids in generations] == [24, 24, 24]


def test_the_acceptance_kit_section_lists_every_check_and_the_commands():
    from ascend_patch.kit import record

    kit = (ROOT / "docs" / "hardware-kit.md").read_text()
    section = kit.split("## Hardware acceptance kit: `ascend-patch verify`", 1)[1].split("\n## ", 1)[0]
    table = section.split("| check | family", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9-]+)` \| ", table, re.MULTILINE)
    assert listed == list(record.CHECKS)
    for command in ("ascend-patch verify ", "source /usr/local/Ascend/nnal/atb/set_env.sh",
                    "python scripts/record_matrix_run.py --evidence ascend-patch-verify.json",
                    "ascend-patch verify --emulate"):
        assert command in section, command
