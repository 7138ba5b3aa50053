"""One path type for every directory and file a user names: local paths and URLs alike.

`path("gs://bucket/run")` is an `etils.epath.Path` that Orbax (TensorStore's GCS driver), grain,
ArrayRecord and epath itself read and write as it is; `gs://` needs epath's GCS backend
(`gcsfs`, or TensorFlow) and Orbax's (`google-cloud-storage`) installed, and `s3://` / `az://`
likewise. `path("runs/x")` is the same type over the local disk, made absolute (Orbax refuses
relative paths). A URL is never made absolute: `pathlib.Path("gs://b/run").absolute()` is
`<cwd>/gs:/b/run`, a local directory.

What only works on a local file (a memory map, a library that writes local files) goes through
`local_mirror` (a local directory that stands for a URL), `localize` (a local copy of a URL's
file or directory) and `written_locally` (write locally, then publish in one step).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from etils import epath

from dflash_jax.files import cache_root

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
MIRRORS_DIR = "remote"  # under the cache root: local copies of URLs (see `local_mirror`)
_CHUNK = 16 << 20


def is_url(p: str | os.PathLike) -> bool:
    """True for `scheme://...` (gs://, s3://, ...), False for a local path."""
    return _URL.match(os.fspath(p)) is not None


def path(p: str | os.PathLike) -> epath.Path:
    """A user's path string -> epath.Path: a URL unchanged, a local path with `~` expanded and
    made absolute against the current directory."""
    p = os.fspath(p)
    if not is_url(p):
        return epath.Path(os.path.abspath(os.path.expanduser(p)))
    try:
        return epath.Path(p)
    except KeyError:  # epath maps URL schemes to path classes and knows only its own
        raise ValueError(
            f"{p}: etils.epath does not know the scheme {p.split('://')[0]}:// "
            "(it knows gs://, s3://, az://, hf://)"
        ) from None


def local_mirror(url: str | os.PathLike) -> Path:
    """The local directory that stands for the URL `url` on this machine (created):
    <cache root>/remote/<name>-<hash of the URL>. The same URL gets the same directory."""
    url = str(path(url))
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    directory = cache_root() / MIRRORS_DIR / f"{Path(url).name or 'root'}-{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Streams one file from `src` to `dst`, either of them local or a URL."""
    with path(src).open("rb") as reader, path(dst).open("wb") as writer:
        shutil.copyfileobj(reader, writer, _CHUNK)


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copies the directory `src` with everything below it to `dst` (local or URL)."""
    src, dst = path(src), path(dst)
    for root, _, files in src.walk():
        out = dst / root.relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            copy_file(root / name, out / name)


def move(src: epath.Path, dst: epath.Path) -> None:
    """Renames the file or directory `src` to `dst` (which must not exist). On local disk one
    rename; under a URL, where a directory is many objects, a copy and then a delete."""
    if not (is_url(src) or is_url(dst)):
        src.rename(dst)
    elif src.is_dir():
        copy_tree(src, dst)
        src.rmtree()
    else:
        copy_file(src, dst)
        src.unlink()


def localize(source: str | os.PathLike, patterns: Sequence[str] = ("*",)) -> Path:
    """A local path with the contents of `source`: `source` itself when it is local; for a URL
    its copy in `local_mirror(source)` of the file, or of the directory's files whose path
    inside it matches one of `patterns` (fnmatch, as the hub's allow_patterns). Files already
    there with the same size are not fetched again (weights do not change in place)."""
    src = path(source)
    if not is_url(src):
        return Path(src)
    local = local_mirror(src) / src.name
    pairs = [(src, local)]
    if src.is_dir():
        pairs = []
        for root, _, files in src.walk():
            inside = root.relative_to(src)
            for name in files:
                if any(fnmatch.fnmatch(os.path.normpath(inside / name), p) for p in patterns):
                    pairs.append((root / name, local / inside / name))
    for remote, mine in pairs:
        if mine.is_file() and mine.stat().st_size == remote.stat().length:
            continue
        mine.parent.mkdir(parents=True, exist_ok=True)
        part = mine.with_name(mine.name + ".part")
        copy_file(remote, part)
        os.replace(part, mine)
    return local


@contextlib.contextmanager
def written_locally(dst: str | os.PathLike) -> Iterator[Path]:
    """Yields a local file name to write `dst`'s contents to; when the block succeeds the file
    becomes `dst` in one step (a rename on local disk, one upload to a URL), so readers see the
    old `dst` or the new one, never a part of it."""
    dst = path(dst)
    if not is_url(dst):
        tmp = Path(os.fspath(dst) + ".tmp")
        try:
            yield tmp
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        return
    with tempfile.TemporaryDirectory(prefix="dflash_jax_") as scratch:
        tmp = Path(scratch) / dst.name
        yield tmp
        copy_file(tmp, dst)
