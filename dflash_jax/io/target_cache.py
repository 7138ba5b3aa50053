"""On-disk cache of converted targets: a GGUF's dequantisation and tokenizer conversion (or an
HF checkpoint's transposes and casts) run once per source and dtype; later loads read arrays.

    <root>/targets/<source name>-<dtype>-<key[:16]>/
        manifest.json        key, source, dtype, config, array names/shapes/dtypes, file sizes+crc32
        params.safetensors   the param tree flattened with "/", already in the requested dtype
        tokenizer/           the converted fast tokenizer (GGUF only: an HF directory's own
                             tokenizer files load as fast as a copy of them would)
    <root>/source_hashes.json  sha256 of source files by (path, size, mtime, ctime, inode)

<root> is $DFLASH_JAX_CACHE, else $XDG_CACHE_HOME/dflash_jax, else ~/.cache/dflash_jax.
DFLASH_JAX_NO_CACHE=1 (or `load_target(..., cache=False)`) turns the cache off.

The key hashes the source files' bytes, the dtype, CACHE_FORMAT and the versions of the packages
that convert the source, so a changed file never meets an old entry (and the old entry of that
source and dtype is removed). An entry is written to a temporary directory and renamed into
place: a killed process leaves no entry rather than half of one. Every read checks the files
against the manifest; an entry that fails is logged in one warning, removed and rebuilt.

Per shard. A target loaded onto a mesh is written from its device shards, one at a time, into
the memory-mapped file (`write_safetensors(fill=...)`), and read back the same way (`place`
slices each device's part out of the memory map): no host array is ever larger than one shard,
so an 8-GPU node caches a 70B target without 140 GB of host memory. Only a single-process load
writes an entry (the loader skips it, with one log line, when params are sharded over several
processes): on a TPU pod or a multi-node GPU job each process holds only its slices, and a
whole-array entry would have to gather the others' over the network onto one host's disk; an
entry of each process's own slices would be tied to one mesh and process layout and rebuilt
whenever either changes. Nor is one needed there: each process already reads only its slices
from the source (safetensors memory-mapped, a GGUF dequantised by rows, see `gguf`), so the
conversion costs each host its share of the model. An entry that exists (a single-process run
on the host wrote it) is read per slice by every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dflash_jax.config import TargetConfig
from dflash_jax.files import cache_root, read_json_table, write_json_atomic
from dflash_jax.io.hf import read_safetensors_header, write_safetensors

# Bump whenever the conversion or this layout changes what an entry holds: old entries then miss.
CACHE_FORMAT = 2  # 2: linear-attention projections and conv split per key head
NO_CACHE_ENV = "DFLASH_JAX_NO_CACHE"

_MANIFEST = "manifest.json"
_PARAMS = "params.safetensors"
_TOKENIZER = "tokenizer"
_HASHES = "source_hashes.json"
_CACHE_ON = ("", "0", "false", "no", "off")  # values of DFLASH_JAX_NO_CACHE that keep it on
# git's "racy clean" rule: a file rewritten within one timestamp tick of being hashed could keep
# its size, mtime and ctime, so a digest is memoised only for files untouched this long before.
_RACY_NS = 2_000_000_000
# Temporary directories left by writers that died are removed once they are this old.
_STALE_TMP_S = 24 * 3600


class CacheError(ValueError):
    """A cache entry whose files do not match its manifest."""


class Cached(NamedTuple):
    """What an entry holds; tokenizer is None when it holds none."""

    config: TargetConfig
    params: dict
    tokenizer: Any


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where the conversion of one source (resolved path) to one dtype is stored."""

    directory: Path
    key: str
    source: str
    dtype: str


def enabled(cache: bool = True) -> bool:
    """False when the caller passed cache=False or DFLASH_JAX_NO_CACHE is set (not 0/false)."""
    return cache and os.environ.get(NO_CACHE_ENV, "").strip().lower() in _CACHE_ON


def entry_for(
    source: Path, files: Sequence[Path], dtype: str, converters: Sequence[str] = ()
) -> Entry:
    """The entry of `source` converted to `dtype`.

    files: every file the conversion reads (hashed, in this order); converters: names of the
    installed packages whose version can change the converted result.
    """
    root = cache_root()
    digests = _file_digests(files, root / _HASHES)
    identity = {
        "format": CACHE_FORMAT,
        "dtype": dtype,
        "files": [[f.name, d] for f, d in zip(files, digests, strict=True)],
        "converters": {p: importlib.metadata.version(p) for p in converters},
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    source = source.resolve()
    return Entry(root / "targets" / f"{source.name}-{dtype}-{key[:16]}", key, str(source), dtype)


def read(entry: Entry, place=None) -> Cached | None:
    """The entry's contents, or None when it does not exist or fails its checks (then it is
    removed, with one warning, for the caller to rebuild). `place(param path, read)` makes each
    leaf from its memory-mapped array (as in `hf.convert_to_params`); default: a private copy
    on the default device."""
    if not entry.directory.is_dir():
        return None
    try:
        cached = _read(entry, place)
    # A damaged or foreign manifest surfaces as any of these; all mean "rebuild".
    except (CacheError, OSError, ValueError, KeyError, TypeError) as e:
        why = str(e) if isinstance(e, CacheError) else f"{type(e).__name__}: {e}"
        logging.warning("target cache %s is invalid (%s); rebuilding it", entry.directory, why)
        _remove(entry.directory)
        return None
    logging.info("target %s read from its cache %s", entry.source, entry.directory)
    return cached


def write(entry: Entry, config: TargetConfig, params: dict, tokenizer: Any = None) -> None:
    """Stores a converted target as `entry`, atomically, then removes the entries of the same
    source and dtype under other keys. A failure (read-only or full disk) is logged and the
    load goes on uncached."""
    targets = entry.directory.parent
    try:
        targets.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.directory.name}.", dir=targets))
        try:
            _fill(tmp, entry, config, params, tokenizer)
            os.rename(tmp, entry.directory)  # fails if another process stored it first
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # The caller holds a good target whatever went wrong here; the cache only saves time.
    except Exception as e:
        if not entry.directory.is_dir():
            logging.warning(
                "cannot write the target cache %s (%s); the next load converts again",
                entry.directory,
                e,
            )
        return
    logging.info("target %s cached in %s", entry.source, entry.directory)
    _prune(entry)


def _read(entry: Entry, place=None) -> Cached:
    d = entry.directory
    manifest = json.loads((d / _MANIFEST).read_text())
    if manifest["key"] != entry.key:
        raise CacheError(f"manifest key {manifest['key']!r} is not the expected {entry.key!r}")
    files = manifest["files"]
    present = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - {_MANIFEST}
    if present != set(files):
        raise CacheError(f"files {sorted(present ^ set(files))} differ from the manifest's")
    for name, expected in files.items():
        size = (d / name).stat().st_size
        if size != expected["bytes"]:
            raise CacheError(f"{name} has {size} bytes, the manifest says {expected['bytes']}")
        if _crc32(d / name) != expected["crc32"]:
            raise CacheError(f"{name} fails its crc32 check")
    stored = read_safetensors_header(d / _PARAMS)
    arrays = manifest["arrays"]
    if set(stored) != set(arrays):
        raise CacheError(f"{_PARAMS} holds other arrays than the manifest lists")
    want_dtype = jnp.dtype(entry.dtype)
    params: dict = {}
    for name, spec in arrays.items():
        w = stored[name].read()
        if list(w.shape) != spec["shape"] or w.dtype.name != spec["dtype"] or w.dtype != want_dtype:
            raise CacheError(
                f"array {name!r} is {w.dtype.name}{list(w.shape)}; the manifest says "
                f"{spec['dtype']}{spec['shape']} and the entry is for {entry.dtype}"
            )
        node = params
        *path, leaf = name.split("/")
        for key in path:
            node = node.setdefault(key, {})
        if place is not None:
            node[leaf] = place((*path, leaf), stored[name].read)
            continue
        # A private copy: jax may alias host memory, and a mapped cache file that is replaced
        # or truncated later would fault.
        node[leaf] = jnp.asarray(np.array(w))
    config = TargetConfig(**{k: _tuples(v) for k, v in manifest["config"].items()})
    tokenizer = None
    if manifest["tokenizer"] is not None:
        info = manifest["tokenizer"]
        module, _, name = info["class"].rpartition(".")
        if not module.startswith("transformers."):
            raise CacheError(f"tokenizer class {info['class']!r} is not a transformers class")
        # The stored class itself, not AutoTokenizer: the same class as the uncached load, and
        # it spares importing torch (half the time of a cached load).
        cls = getattr(importlib.import_module(module), name)
        tokenizer = cls.from_pretrained(str(d / _TOKENIZER), local_files_only=True)
        tokenizer.name_or_path = info["name_or_path"]
    return Cached(config, params, tokenizer)


def _fill(directory: Path, entry: Entry, config: TargetConfig, params: dict, tokenizer) -> None:
    arrays = dict(_flatten(params))
    write_safetensors(directory / _PARAMS, arrays, lambda name, out: _store(arrays[name], out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory / _TOKENIZER))
    files = {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
    manifest = {
        "format": CACHE_FORMAT,
        "key": entry.key,
        "source": entry.source,
        "dtype": entry.dtype,
        "config": dataclasses.asdict(config),
        "tokenizer": None if tokenizer is None else _tokenizer_info(tokenizer),
        "arrays": {
            n: {"shape": list(w.shape), "dtype": np.dtype(w.dtype).name} for n, w in arrays.items()
        },
        "files": files,
    }
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=1))


def _store(w, out: np.ndarray) -> None:
    """Writes the array `w` into `out` (same shape): a jax.Array one addressable shard at a time,
    each distinct slice once (replicas are skipped), so the host holds one shard at most."""
    if not isinstance(w, jax.Array):
        out[...] = np.asarray(w)
        return
    written = set()
    for shard in w.addressable_shards:
        key = tuple(s.indices(n)[:2] for s, n in zip(shard.index, w.shape, strict=True))
        if key not in written:
            written.add(key)
            out[shard.index] = np.asarray(shard.data)


def _tokenizer_info(tokenizer) -> dict[str, str]:
    cls = type(tokenizer)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "name_or_path": tokenizer.name_or_path}


def _prune(entry: Entry) -> None:
    """Removes the entries of `entry`'s source and dtype under other keys (the source changed,
    or the format did) and temporary directories of writers that died long ago."""
    for d in entry.directory.parent.iterdir():
        if d == entry.directory:
            continue
        try:
            if d.name.startswith("."):
                if time.time() - d.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(d, ignore_errors=True)
                continue
            manifest = json.loads((d / _MANIFEST).read_text())
        except (OSError, ValueError):
            continue  # being written or removed by another process, or not ours
        if isinstance(manifest, dict) and (manifest.get("source"), manifest.get("dtype")) == (
            entry.source,
            entry.dtype,
        ):
            _remove(d)


def _remove(directory: Path) -> None:
    """Renames the entry away first, so no reader ever sees it half deleted."""
    gone = directory.with_name(f".gone-{directory.name}-{os.getpid()}")
    try:
        os.rename(directory, gone)
    except OSError:
        return  # already removed by another process
    shutil.rmtree(gone, ignore_errors=True)


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, (*prefix, key))
        else:
            yield "/".join((*prefix, key)), value


def _tuples(value: Any) -> Any:
    """JSON lists back to the (nested) tuples a TargetConfig holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _stat_id(path: Path) -> list[int]:
    s = path.stat()
    return [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev]


def _file_digests(files: Sequence[Path], memo_file: Path) -> list[str]:
    """sha256 of each file, memoised in `memo_file` while the file's size, mtime, ctime and
    inode stay the same (rewriting a file changes its ctime; nothing resets that)."""
    memo = read_json_table(memo_file)
    digests, changed = [], False
    for file in files:
        path, stat = str(file.resolve()), _stat_id(file)
        known = memo.get(path)
        if isinstance(known, dict) and known.get("stat") == stat and "sha256" in known:
            digests.append(str(known["sha256"]))
            continue
        started = time.time_ns()
        digests.append(_sha256(file))
        if _stat_id(file) == stat and stat[2] < started - _RACY_NS:
            memo[path] = {"stat": stat, "sha256": digests[-1]}
            changed = True
    if changed:
        memo = {p: v for p, v in memo.items() if os.path.exists(p)}
        # the memo only saves hashing time; unwritten, the next load hashes again
        write_json_atomic(memo_file, memo)
    return digests
