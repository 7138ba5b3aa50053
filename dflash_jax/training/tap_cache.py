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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tqdm
from absl import logging

from dflash_jax.models.target import Transformer
from dflash_jax.training.data import decode_record

INDEX_FILE = "taps.json"
DATA_FILE = "taps.bin"
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _fingerprint(lengths, token_digest, tap_layers, seq_len, dtype, target) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([list(lengths), token_digest, list(tap_layers), seq_len, dtype]).encode())
    # The config without run settings (the attention implementation does not change the taps).
    h.update(repr(dataclasses.replace(target.config, attention_impl="auto")).encode())
    # The weights themselves: a cheap, order-sensitive checksum of two tensors.
    for leaf in (target.params["embed_tokens"]["embedding"], target.params["norm"]["scale"]):
        h.update(np.asarray(jnp.sum(jnp.asarray(leaf, jnp.float32) ** 2)).tobytes())
    return h.hexdigest()[:16]


class TapCache:
    """Read side of a finished cache: `row(index)` -> taps [seq_len, F] (zero past the record)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        meta = json.loads((directory / INDEX_FILE).read_text())
        if not meta.get("complete"):
            raise ValueError(f"{directory}: the tap cache is incomplete; rebuild it")
        self.seq_len = meta["seq_len"]
        self.features = meta["features"]
        self.dtype = DTYPES[meta["dtype"]]
        self.offsets = np.asarray(meta["offsets"], np.int64)
        self.lengths = np.asarray(meta["lengths"], np.int64)
        self.fingerprint = meta["fingerprint"]
        total = int(self.lengths.sum())
        expected = total * self.features * np.dtype(self.dtype).itemsize
        size = (directory / DATA_FILE).stat().st_size
        if size != expected:
            raise ValueError(
                f"{directory / DATA_FILE}: {size} bytes, expected {expected} for {total} tokens "
                f"x {self.features} features; the cache is corrupt, delete it to rebuild"
            )
        self._path = directory / DATA_FILE
        self._data = None

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, index: int) -> np.ndarray:
        if self._data is None:  # opened lazily: one map per process/worker
            self._data = np.memmap(self._path, self.dtype, "r").reshape(-1, self.features)
        out = np.zeros((self.seq_len, self.features), self.dtype)
        start, n = self.offsets[index], self.lengths[index]
        out[:n] = self._data[start : start + n]
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_data"] = None
        return state


def build_tap_cache(
    directory: str | Path,
    source: Sequence[bytes],
    target,
    tap_layers: Sequence[int],
    seq_len: int,
    *,
    dtype: str = "bfloat16",
    batch_tokens: int = 8192,
    bucket: int = 64,
) -> TapCache:
    """Computes (or finishes, or reuses) the taps of every record of `source` -> its TapCache."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokens = [decode_record(source[i])["tokens"][:seq_len] for i in range(len(source))]
    lengths = np.asarray([len(t) for t in tokens], np.int64)
    digest = hashlib.sha256(np.concatenate([np.asarray(t, np.int32) for t in tokens])).hexdigest()
    fingerprint = _fingerprint(lengths.tolist(), digest, tap_layers, seq_len, dtype, target)
    features = len(tap_layers) * target.config.hidden_size
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    index_path, data_path = directory / INDEX_FILE, directory / DATA_FILE
    meta = json.loads(index_path.read_text()) if index_path.exists() else {}
    if meta.get("fingerprint") == fingerprint and meta.get("complete"):
        logging.info("tap cache %s is up to date (%d records)", directory, len(tokens))
        return TapCache(directory)
    done = meta.get("done", 0) if meta.get("fingerprint") == fingerprint else 0
    meta = {
        "fingerprint": fingerprint,
        "seq_len": seq_len,
        "features": features,
        "dtype": dtype,
        "tap_layers": list(tap_layers),
        "offsets": offsets.tolist(),
        "lengths": lengths.tolist(),
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

    # Longest first, so the first (largest) compile happens at once; batches of similar width.
    order = np.argsort(-lengths, kind="stable")
    batches: list[np.ndarray] = []
    i = 0
    while i < len(order):
        width = -(-int(lengths[order[i]]) // bucket) * bucket
        rows = max(1, batch_tokens // width)
        batches.append(order[i : i + rows])
        i += rows

    tap_config = dataclasses.replace(target.config, num_layers=max(tap_layers) + 1)

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

    bar = tqdm.tqdm(
        total=int(lengths.sum()),
        initial=int(sum(lengths[b].sum() for b in batches[:done])),
        desc="tap cache",
        unit="tok",
        unit_scale=True,
        dynamic_ncols=True,
    )
    for k in range(done, len(batches)):
        rows = batches[k]
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
        bar.update(int(lengths[rows].sum()))
    bar.close()
    del store
    meta["complete"] = True
    _write_json(index_path, meta)
    return TapCache(directory)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)
