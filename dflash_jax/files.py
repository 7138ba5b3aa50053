"""Where this machine keeps what it computed and measured (converted targets, step costs,
dtype floors, mirrored files): the cache directory and its JSON tables, read and written
atomically. On the ground
floor beside config.py: io/ and decoding/ (the step costs) both keep files there."""

from __future__ import annotations

import json
import os
from pathlib import Path

CACHE_DIR_ENV = "DFLASH_JAX_CACHE"


def cache_root() -> Path:
    """Where this machine's converted targets, step costs and row rules are kept:
    $DFLASH_JAX_CACHE, else $XDG_CACHE_HOME/dflash_jax, else ~/.cache/dflash_jax."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dflash_jax"


def read_json_table(path: Path) -> dict:
    """The JSON object kept at `path` (`write_json_atomic`'s), or {} when the file is missing,
    unreadable, damaged or not an object: a cache whose entries are measured again."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_json_atomic(path: Path, obj) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and a rename, so a reader never
    sees half a file; an unwritable cache (read-only, full) is left as it is: what it keeps is
    measured or computed again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
