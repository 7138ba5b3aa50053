"""Target taps cached on disk, so that training epochs after the first skip the frozen target.

One flat memory-mapped array holds every record's taps back to back, `[total_tokens, K*D]`
(records truncated to `seq_len`), plus a JSON index with each record's offset and length. Taps of
a causal target at positions < L do not depend on what follows, so a record's taps computed at
its own length equal those of the padded training row; the data pipeline pads them back.

When caching pays (measured in `trainer.py`'s docstring): the build costs one target forward per
token, as one epoch of online taps does, so it pays from the second epoch on. It costs
K*D*2 bytes per token in bf16 (5.6 KiB for SmolLM2, 40 KiB for Qwen3-8B).

The build is resumable: records are processed in batches of similar length, the array is
flushed after each batch and `done` counts finished batches. The index names a fingerprint of
the records, the taps and the target; a cache built for anything else is rebuilt, never read.

It also grows: when the records change (data generation added shards) but the taps, `seq_len`
and target do not, the finished cache is kept aside as `taps.prev.*` and every record found in
it (by a digest of its tokens) is copied, not recomputed; only new records pay a forward. The
old cache is deleted once the new one is complete, so a build killed mid-way still has it.

A cache directory may be a URL (`gs://...`): a memory map needs a local file, so the cache is
built and read in a local copy (`paths.local_mirror`) and copied to the URL once complete. A
machine without a local copy starts from the URL's (a resumed run on a new VM computes nothing
again); one with a local copy, finished or not, goes on from its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tqdm
from absl import logging

from dflash_jax.io import paths
from dflash_jax.models.target import Transformer
from dflash_jax.training.data import decode_record

INDEX_FILE = "taps.json"
DATA_FILE = "taps.bin"
PREV_INDEX_FILE = "taps.prev.json"  # a finished cache over other records (see above)
PREV_DATA_FILE = "taps.prev.bin"
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _base_fingerprint(tap_layers, seq_len, dtype, target) -> str:
    """What the taps of one record depend on besides its tokens."""
    h = hashlib.sha256()
    h.update(json.dumps([list(tap_layers), seq_len, dtype]).encode())
    # The config without run settings (the attention implementation does not change the taps).
    h.update(repr(dataclasses.replace(target.config, attention_impl="auto")).encode())
    # The weights themselves: a cheap, order-sensitive checksum of two tensors.
    for leaf in (target.params["embed_tokens"]["embedding"], target.params["norm"]["scale"]):
        h.update(np.asarray(jnp.sum(jnp.asarray(leaf, jnp.float32) ** 2)).tobytes())
    return h.hexdigest()[:16]


def _fingerprint(lengths, token_digest, base: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([list(lengths), token_digest, base]).encode())
    return h.hexdigest()[:16]


def _record_digest(tokens) -> str:
    return hashlib.sha1(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:20]


class TapCache:
    """Read side of a finished cache: `row(index)` -> taps [seq_len, F] (zero past the record)."""

    def __init__(self, directory: str | Path, index_file=INDEX_FILE, data_file=DATA_FILE):
        directory = Path(directory)
        meta = json.loads((directory / index_file).read_text())
        if not meta.get("complete"):
            raise ValueError(f"{directory}: the tap cache is incomplete; rebuild it")
        self.seq_len = meta["seq_len"]
        self.features = meta["features"]
        self.dtype = DTYPES[meta["dtype"]]
        self.offsets = np.asarray(meta["offsets"], np.int64)
        self.lengths = np.asarray(meta["lengths"], np.int64)
        self.fingerprint = meta["fingerprint"]
        self.base = meta.get("base")
        self.digests = meta.get("digests")
        total = int(self.lengths.sum())
        expected = total * self.features * np.dtype(self.dtype).itemsize
        size = (directory / data_file).stat().st_size
        if size != expected:
            raise ValueError(
                f"{directory / data_file}: {size} bytes, expected {expected} for {total} tokens "
                f"x {self.features} features; the cache is corrupt, delete it to rebuild"
            )
        self._path = directory / data_file
        self._data = None

    def __len__(self) -> int:
        return len(self.lengths)

    def _rows(self) -> np.ndarray:
        if self._data is None:  # opened lazily: one map per process/worker
            self._data = np.memmap(self._path, self.dtype, "r").reshape(-1, self.features)
        return self._data

    def tokens_taps(self, index: int) -> np.ndarray:
        """Record `index`'s taps [its length, F], unpadded."""
        start, n = self.offsets[index], self.lengths[index]
        return self._rows()[start : start + n]

    def row(self, index: int) -> np.ndarray:
        out = np.zeros((self.seq_len, self.features), self.dtype)
        out[: self.lengths[index]] = self.tokens_taps(index)
        return out

    def rows_by_digest(self) -> dict[str, int]:
        """Token digest -> record index (caches written before digests were kept: empty)."""
        return {d: i for i, d in enumerate(self.digests or ())}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_data"] = None
        return state


def build_tap_cache(
    directory: str | os.PathLike,
    source: Sequence[bytes],
    target,
    tap_layers: Sequence[int],
    seq_len: int,
    *,
    dtype: str = "bfloat16",
    batch_tokens: int = 8192,
    bucket: int = 64,
) -> TapCache:
    """Computes (or finishes, extends, or reuses) the taps of every record of `source` in
    `directory` (local or a URL, see the module docstring) -> its TapCache."""
    build = functools.partial(
        _build,
        source=source,
        target=target,
        tap_layers=tap_layers,
        seq_len=seq_len,
        dtype=dtype,
        batch_tokens=batch_tokens,
        bucket=bucket,
    )
    if not paths.is_url(directory):
        return build(Path(paths.path(directory)))
    remote, local = paths.path(directory), paths.local_mirror(directory)
    if not (local / INDEX_FILE).exists() and (remote / INDEX_FILE).exists():
        logging.info("tap cache %s: copying it to %s", remote, local)
        paths.copy_file(remote / DATA_FILE, local / DATA_FILE)
        paths.copy_file(remote / INDEX_FILE, local / INDEX_FILE)  # last: it marks the copy done
    cache = build(local)
    index = remote / INDEX_FILE
    if not index.exists() or json.loads(index.read_text())["fingerprint"] != cache.fingerprint:
        logging.info("tap cache %s: copying it to %s", local, remote)
        remote.mkdir(parents=True, exist_ok=True)
        index.unlink(missing_ok=True)  # never the old index beside the new data
        paths.copy_file(local / DATA_FILE, remote / DATA_FILE)
        paths.copy_file(local / INDEX_FILE, index)
    return cache


def _build(
    directory: Path,
    *,
    source: Sequence[bytes],
    target,
    tap_layers: Sequence[int],
    seq_len: int,
    dtype: str,
    batch_tokens: int,
    bucket: int,
) -> TapCache:
    """build_tap_cache in the local `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = [decode_record(source[i])["tokens"][:seq_len] for i in range(len(source))]
    lengths = np.asarray([len(t) for t in tokens], np.int64)
    digest = hashlib.sha256(np.concatenate([np.asarray(t, np.int32) for t in tokens])).hexdigest()
    base = _base_fingerprint(tap_layers, seq_len, dtype, target)
    fingerprint = _fingerprint(lengths.tolist(), digest, base)
    features = len(tap_layers) * target.config.hidden_size
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    index_path, data_path = directory / INDEX_FILE, directory / DATA_FILE
    meta = json.loads(index_path.read_text()) if index_path.exists() else {}
    if meta.get("fingerprint") == fingerprint and meta.get("complete"):
        logging.info("tap cache %s is up to date (%d records)", directory, len(tokens))
        return TapCache(directory)
    if meta.get("complete") and meta.get("base") == base:
        # Other records, same taps: keep this cache aside to copy the records both share.
        data_path.replace(directory / PREV_DATA_FILE)
        index_path.replace(directory / PREV_INDEX_FILE)
        meta = {}
    prev = _previous_cache(directory, base)
    digests = [_record_digest(t) for t in tokens]

    # Batch 0 copies the records the previous cache has (when it has any); then batches of
    # similar width, longest first, so the first (largest) compile happens at once.
    known = prev.rows_by_digest() if prev is not None else {}
    reused = [i for i, d in enumerate(digests) if d in known]
    batches: list[np.ndarray | None] = [None] if reused else []
    fresh = np.asarray([i for i, d in enumerate(digests) if d not in known], np.int64)
    order = fresh[np.argsort(-lengths[fresh], kind="stable")]
    i = 0
    while i < len(order):
        width = -(-int(lengths[order[i]]) // bucket) * bucket
        rows = max(1, batch_tokens // width)
        batches.append(order[i : i + rows])
        i += rows
    # `done` counts batches of this plan: a resumed build with another plan (the previous cache
    # gone, another batch_tokens) starts over rather than trust rows it did not write.
    plan = hashlib.sha256(
        json.dumps([None if b is None else b.tolist() for b in batches]).encode()
    ).hexdigest()[:16]
    same = meta.get("fingerprint") == fingerprint and meta.get("plan") == plan
    done = meta.get("done", 0) if same else 0
    meta = {
        "fingerprint": fingerprint,
        "base": base,
        "plan": plan,
        "seq_len": seq_len,
        "features": features,
        "dtype": dtype,
        "tap_layers": list(tap_layers),
        "offsets": offsets.tolist(),
        "lengths": lengths.tolist(),
        "digests": digests,
        "done": done,
        "complete": False,
    }
    np_dtype = DTYPES[dtype]
    total_bytes = int(lengths.sum()) * features * np.dtype(np_dtype).itemsize
    if not data_path.exists() or data_path.stat().st_size != total_bytes or done == 0:
        with open(data_path, "wb") as f:
            f.truncate(total_bytes)
        done = meta["done"] = 0
    store = np.memmap(data_path, np_dtype, "r+").reshape(-1, features)
    if reused:
        logging.info(
            "tap cache %s: %d of %d records copied from the previous cache, %d to compute",
            directory,
            len(reused),
            len(tokens),
            len(fresh),
        )

    tap_config = target.config.first_layers(max(*tap_layers, 0) + 1)

    @jax.jit
    def taps_fn(params, tokens_bt):
        b, t = tokens_bt.shape
        positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
        _, taps_btf, _ = Transformer(tap_config).apply(
            {"params": params},
            tokens_bt,
            positions,
            tap_layers=tuple(tap_layers),
            logit_indices=jnp.zeros((b, 1), jnp.int32),
        )
        return taps_btf

    def batch_tokens_done(k: int) -> int:
        return int(lengths[reused].sum()) if batches[k] is None else int(lengths[batches[k]].sum())

    bar = tqdm.tqdm(
        total=int(lengths.sum()),
        initial=sum(batch_tokens_done(k) for k in range(done)),
        desc="tap cache",
        unit="tok",
        unit_scale=True,
        dynamic_ncols=True,
    )
    for k in range(done, len(batches)):
        rows = batches[k]
        if rows is None:
            for r in reused:
                store[offsets[r] : offsets[r] + lengths[r]] = prev.tokens_taps(known[digests[r]])
        else:
            width = -(-int(lengths[rows].max()) // bucket) * bucket
            tokens_bt = np.zeros((len(rows), width), np.int32)
            for j, r in enumerate(rows):
                tokens_bt[j, : lengths[r]] = tokens[r]
            taps_btf = np.asarray(taps_fn(target.params, tokens_bt).astype(np_dtype))
            for j, r in enumerate(rows):
                store[offsets[r] : offsets[r] + lengths[r]] = taps_btf[j, : lengths[r]]
        store.flush()
        meta["done"] = k + 1
        _write_json(index_path, meta)
        bar.update(batch_tokens_done(k))
    bar.close()
    del store
    meta["complete"] = True
    _write_json(index_path, meta)
    for name in (PREV_DATA_FILE, PREV_INDEX_FILE):  # the new cache holds all it had
        (directory / name).unlink(missing_ok=True)
    return TapCache(directory)


def _previous_cache(directory: Path, base: str) -> TapCache | None:
    """The cache kept aside by a build over other records with the same taps, if readable."""
    if not (directory / PREV_INDEX_FILE).exists():
        return None
    try:
        prev = TapCache(directory, index_file=PREV_INDEX_FILE, data_file=PREV_DATA_FILE)
    except (ValueError, OSError, KeyError) as e:
        logging.warning(
            "tap cache %s: the previous cache is unusable (%s); recomputing", directory, e
        )
        return None
    return prev if prev.base == base and prev.digests else None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)
