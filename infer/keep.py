"""What a long measuring run keeps as it goes, so that the same command run again after a kill
skips what is done (infer.acceptance): one JSON file, written whole or not at all, reused only
by a run with the same settings. No flags are defined here (tests import it)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import dflash_jax


def code_digest() -> str:
    """A digest of the package's sources: results kept by other code are not reused."""
    root = Path(dflash_jax.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def load(path: str, settings: dict) -> dict:
    """What an earlier run with the same `settings` kept at `path` ({} when nothing fits)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{path}: unreadable ({e}); starting over", flush=True)
        return {}
    if kept.get("settings") != settings:
        print(f"{path}: kept by a run with other settings; starting over", flush=True)
        return {}
    return kept


def save(path: str, kept: dict) -> None:
    """Writes `kept` whole or not at all (a kill mid-write leaves the previous file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(kept, f)
    os.replace(path + ".tmp", path)
