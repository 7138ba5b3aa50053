"""Prints README.md's Quickstart command (its first ```bash block: venv, installs, main job)
with the venv at VENV instead of .venv and EXTRA_FLAGS appended to the main job, for .ci/run.
Read from README.md so that CI runs what users run; exits non-zero, saying why, when the block
is missing or no longer has the expected shape.

  python3 .ci/readme_command.py VENV [EXTRA_FLAGS...]
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import NoReturn

README = Path(__file__).resolve().parent.parent / "README.md"


def fail(why: str) -> NoReturn:
    sys.exit(f"{README.name}: {why} (.ci/readme_command.py reads the Quickstart's bash block)")


def main(venv: str, extra_flags: list[str]) -> None:
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Quickstart\b(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        fail("no '## Quickstart' section")
    block = re.search(r"^```bash[ \t]*\n(.*?)^```[ \t]*$", section.group(1), re.M | re.S)
    if block is None:
        fail("no ```bash block in the Quickstart section")
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 1 or lines[0].endswith("\\"):
        fail(f"the Quickstart's first bash block is not one command line: {lines}")
    command = lines[0]
    # `.venv` as a word (`python3 -m venv .venv`, `. .venv/bin/activate`), not inside a path.
    command, n = re.subn(r"(?<![\w./-])\.venv(?=/|\s|$)", venv, command)
    steps = [step.strip() for step in command.split("&&")]
    expected = [f"python3 -m venv {venv}", f". {venv}/bin/activate"]
    if n < 2 or steps[:2] != expected:
        fail(f"the command does not start with {' && '.join(expected)!r}: {lines[0]!r}")
    if not steps[-1].startswith("python -m infer.generate "):
        fail(f"the command does not end with the main job, python -m infer.generate: {steps[-1]!r}")
    if not any(step.startswith("pip install -r requirements.txt") for step in steps):
        fail(f"the command does not install requirements.txt: {lines[0]!r}")
    print(" ".join([command, *map(shlex.quote, extra_flags)]))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
