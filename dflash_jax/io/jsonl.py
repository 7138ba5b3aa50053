"""JSONL files read line by line, a bad line named by `file:line` with what was expected."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from dflash_jax.io import paths


def parse_line(line: str | bytes, where: str, expected: str) -> dict:
    """One JSONL line as a JSON object; anything else raises ValueError naming `where`
    ("file:line") and what was `expected` (e.g. 'a {"prompt": "..."} object')."""
    try:
        record = json.loads(line)
    except ValueError as e:
        msg = getattr(e, "msg", str(e))
        col = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"{where}: not valid JSON ({msg}{col}); expected {expected}") from e
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, expected {expected}")
    return record


def numbered_lines(lines: Iterable[str | bytes]) -> list[tuple[int, str | bytes]]:
    """(line number from 1, line) for each non-blank line."""
    return [(i, line) for i, line in enumerate(lines, 1) if line.strip()]


def read_objects(path: str | os.PathLike, expected: str) -> list[tuple[int, dict]]:
    """Every non-blank line of a JSONL file (local or a URL) as (line number, object); the
    first line that is not a JSON object raises ValueError naming `path:line` and `expected`."""
    text = paths.path(path).read_text(encoding="utf-8")
    return [
        (i, parse_line(line, f"{path}:{i}", expected))
        for i, line in numbered_lines(text.splitlines())
    ]
