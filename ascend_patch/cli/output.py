"""What every command prints: one JSON envelope for ``--json``, and text that fits the terminal.

Every JSON document the command writes (doctor, probe, matrix, collect-env, and the verify
record) carries ``schema`` (:data:`SCHEMA`, the verify record's version: one schema for all)
and ``kind`` (``ascend-patch-<command>``); an error in ``--json`` mode is the same envelope
with an ``error`` string. docs/reference.md documents the fields.
"""

from __future__ import annotations

import json
import shutil
import textwrap

from ascend_patch.kit import record

SCHEMA = record.SCHEMA


def document(command: str, body: dict) -> dict:
    """``body`` in the envelope of ``command``'s JSON output."""
    return {"schema": SCHEMA, "kind": f"ascend-patch-{command}", **body}


def error(command: str, message: str) -> dict:
    return document(command, {"error": " ".join(message.split())})


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2)


def width() -> int:
    """The terminal's width (80 where there is none, e.g. in a pipe), at least 60."""
    return max(60, shutil.get_terminal_size((80, 24)).columns)


def field(label: str, text: str, label_width: int, columns: int | None = None) -> list[str]:
    """``label  text``, the text wrapped under itself so no line is wider than the terminal."""
    columns = columns or width()
    indent = " " * (label_width + 2)
    return textwrap.wrap(f"{label.ljust(label_width)}  {text}", columns, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False) or [label]


def fields(rows: list[tuple[str, str]], columns: int | None = None) -> list[str]:
    label_width = max(len(label) for label, _ in rows)
    return [line for label, text in rows for line in field(label, text, label_width, columns)]
