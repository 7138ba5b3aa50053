"""Corpus tables for corpus lookup (`decoding.corpus`): counted from the target's answers
(`build_table`, `train.build_corpus`), saved beside a drafter's params as a file of its own
(`ops.ngrams.CORPUS_FILE`, local or a URL), read with the drafter by `load_drafter` (`read`,
which refuses a table of another tokenizer or an empty one), held beside its params
(`LoadedDrafter.corpus`) and written again beside any copy of it (`save_drafter`,
`infer.convert`).

The table: for each n-gram (n = 1..max_ngram) of the corpus followed by an answer token, the
`continuation` tokens that most often followed it; stored as the n-grams' 32-bit hashes
(`ops.ngrams.ngram_hash`, the n folded in), sorted, with the continuations [E, continuation].
Two n-grams with one hash share an entry (the more frequent kept): about a dozen pairs in the
shipped table's 328,248, and a wrong copy costs speed, never the output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ConfigError
from dflash_jax.io import paths
from dflash_jax.io.hf import CheckpointError
from dflash_jax.ops.ngrams import CORPUS_FILE, ngram_hash

# The longest n-gram counted (the decode looks up as many: the table's "orders"), the tokens
# kept after each (a copy step of 4 proposes 3), and the file format.
MAX_NGRAM = 3
CONTINUATION = 3
# Format 2 added the tokenizer's vocabulary hash.
FORMAT_VERSION = 2
# Counting in bounded memory (`build_table`): rows counted per chunk, hash shards on disk.
CHUNK_ROWS = 1 << 21
SHARDS = 16


@dataclasses.dataclass(frozen=True)
class CorpusTable:
    """keys uint32 [E] (sorted, unique n-gram hashes), next int32 [E, continuation] (the tokens
    that most often followed each n-gram), counts int32 [E] (how often), for a target of
    `vocab_size` tokens; `source` says what it was counted from, `vocab_hash` in which
    tokenizer's ids."""

    keys: np.ndarray
    next: np.ndarray
    counts: np.ndarray
    vocab_size: int
    max_ngram: int
    source: str = ""
    vocab_hash: str = ""  # `vocabulary_hash` of the tokenizer whose ids it counts

    @property
    def continuation(self) -> int:
        return int(self.next.shape[1])


def vocabulary_hash(tokenizer) -> str:
    """A tokenizer's vocabulary (every token and its id) as 16 hex digits of sha256: two
    tokenizers of one size but other ids hash apart."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _rows(tokens, mask, vocab_size: int, max_ngram: int, continuation: int) -> np.ndarray:
    """One record's (n-gram hash, continuation) rows [R, 1 + continuation] int64."""
    t = np.asarray(tokens, np.int64)
    m = np.asarray(mask).astype(bool)
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ConfigError(f"a corpus record holds token ids outside [0, {vocab_size})")
    out = []
    for n in range(1, max_ngram + 1):
        starts = np.arange(n, t.size - continuation + 1)
        starts = starts[m[starts]]
        if starts.size:
            keys = t[starts[:, None] + np.arange(-n, 0)[None, :]]
            conts = t[starts[:, None] + np.arange(continuation)[None, :]]
            out.append(np.concatenate([ngram_hash(keys, n).astype(np.int64)[:, None], conts], 1))
    return np.concatenate(out) if out else np.zeros((0, 1 + continuation), np.int64)


def _merge(rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Equal rows summed: (unique rows sorted by hash, then tokens; their counts)."""
    if not len(rows):
        return rows, counts
    order = np.lexsort(rows.T[::-1])
    rows, counts = rows[order], counts[order]
    new = np.ones(len(rows), bool)
    new[1:] = np.any(rows[1:] != rows[:-1], axis=1)
    starts = np.flatnonzero(new)
    return rows[starts], np.add.reduceat(counts, starts)


def build_table(
    records: Iterable[tuple[np.ndarray, np.ndarray]],
    vocab_size: int,
    max_ngram: int = MAX_NGRAM,
    continuation: int = CONTINUATION,
    min_count: int = 1,
    source: str = "",
    vocab_hash: str = "",
    chunk_rows: int = CHUNK_ROWS,
    shards: int = SHARDS,
) -> CorpusTable:
    """Counts (tokens [L], loss_mask [L]) records: for every position i whose token is an answer
    token (mask 1) with `continuation` tokens from i inside the record, each n-gram that ends at
    i - 1 (n = 1..max_ngram) and the tokens i .. i + continuation - 1 that follow it. Keeps, per
    n-gram, its most frequent continuation (ties: the smallest tokens), when seen at least
    `min_count` times. `vocab_hash`: the tokenizer's (`vocabulary_hash`), kept to refuse the
    table for another one.

    Streams in bounded memory: rows are counted `chunk_rows` at a time, each chunk's counts
    split by hash into `shards` files on local disk, and each shard's files folded one by one
    (its distinct rows in memory, however often they repeat), so a data set of many GB counts
    on one host; the result is the same as counting everything at once."""
    width = 1 + continuation
    with tempfile.TemporaryDirectory(prefix="corpus_counts_") as tmp:
        spilled, pending, pending_n = 0, [], 0

        def spill():
            nonlocal spilled, pending, pending_n
            rows, counts = _merge(np.concatenate(pending), np.ones(pending_n, np.int64))
            shard = rows[:, 0] % shards
            for k in range(shards):
                pick = shard == k
                np.save(f"{tmp}/{k}.{spilled}.rows.npy", rows[pick])
                np.save(f"{tmp}/{k}.{spilled}.counts.npy", counts[pick])
            spilled, pending, pending_n = spilled + 1, [], 0

        for tokens, mask in records:
            rows = _rows(tokens, mask, vocab_size, max_ngram, continuation)
            if len(rows):
                pending.append(rows)
                pending_n += len(rows)
            if pending_n >= chunk_rows:
                spill()
        if pending:
            spill()
        if not spilled:
            raise ConfigError("no answer tokens to count: the corpus is empty or has no loss mask")
        keys, nexts, kept = [], [], []
        for k in range(shards):
            rows, counts = np.zeros((0, width), np.int64), np.zeros(0, np.int64)
            for c in range(spilled):
                rows, counts = _merge(
                    np.concatenate([rows, np.load(f"{tmp}/{k}.{c}.rows.npy")]),
                    np.concatenate([counts, np.load(f"{tmp}/{k}.{c}.counts.npy")]),
                )
            # Per hash the most frequent continuation (rows are sorted by hash, then tokens).
            order = np.lexsort((-counts, rows[:, 0]))
            rows, counts = rows[order], counts[order]
            first = np.ones(len(rows), bool)
            first[1:] = rows[1:, 0] != rows[:-1, 0]
            keep = first & (counts >= min_count)
            keys.append(rows[keep, 0])
            nexts.append(rows[keep, 1:])
            kept.append(counts[keep])
    keys, nexts, kept = np.concatenate(keys), np.concatenate(nexts), np.concatenate(kept)
    if not keys.size:
        raise ConfigError(
            f"no n-gram was seen --min_count={min_count} times: the table would be empty; "
            "lower --min_count or count more data"
        )
    order = np.argsort(keys, kind="stable")
    return CorpusTable(
        keys=keys[order].astype(np.uint32),
        next=nexts[order].astype(np.int32),
        counts=kept[order].astype(np.int32),
        vocab_size=int(vocab_size),
        max_ngram=int(max_ngram),
        source=source,
        vocab_hash=vocab_hash,
    )


def save_table(table: CorpusTable, path: str | os.PathLike) -> None:
    """Writes `table` as a compressed .npz (tokens as uint16 where the vocabulary allows) to a
    local path or a URL (the checkpoints' file layer, `io.paths`), whole or not at all."""
    small = table.vocab_size <= np.iinfo(np.uint16).max + 1
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        format_version=np.int32(FORMAT_VERSION),
        keys=table.keys,
        next=table.next.astype(np.uint16 if small else np.int32),
        counts=table.counts,
        vocab_size=np.int64(table.vocab_size),
        max_ngram=np.int32(table.max_ngram),
        source=np.str_(table.source),
        vocab_hash=np.str_(table.vocab_hash),
    )
    path = paths.path(path)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)  # over an older table


def load_table(path) -> CorpusTable:
    """Reads a `save_table` file (a local path or a URL); a damaged, foreign or empty one
    raises CheckpointError."""
    path = paths.path(path)
    try:
        with path.open("rb") as f, np.load(io.BytesIO(f.read()), allow_pickle=False) as z:
            version = int(z["format_version"])
            if version != FORMAT_VERSION:
                raise CheckpointError(
                    f"corpus table {path} has format {version}, this code reads "
                    f"{FORMAT_VERSION}: rebuild it with python -m train.build_corpus"
                )
            table = CorpusTable(
                keys=np.asarray(z["keys"], np.uint32),
                next=np.asarray(z["next"]).astype(np.int32),
                counts=np.asarray(z["counts"], np.int32),
                vocab_size=int(z["vocab_size"]),
                max_ngram=int(z["max_ngram"]),
                source=str(z["source"]),
                vocab_hash=str(z["vocab_hash"]),
            )
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - zip, key and value errors all mean "damaged"
        raise CheckpointError(
            f"cannot read the corpus table {path} ({type(e).__name__}: {e}): rebuild it with "
            "python -m train.build_corpus, or delete it to decode without it"
        ) from e
    keys = table.keys
    if keys.ndim != 1 or table.next.shape[0] != keys.size or np.any(keys[1:] <= keys[:-1]):
        raise CheckpointError(
            f"corpus table {path} is damaged (keys not sorted and unique, or not one row of "
            "continuation per key): rebuild it with python -m train.build_corpus"
        )
    if not keys.size:
        raise CheckpointError(
            f"corpus table {path} is empty: rebuild it with python -m train.build_corpus (a "
            "lower --min_count, or more data), or delete it to decode without it"
        )
    return table


def read(directory, vocab_size: int, vocab_hash: str | None = None) -> CorpusTable | None:
    """The corpus table beside a drafter's params in `directory` (local or a URL), or None when
    it has none. A table of another tokenizer is refused: its ids mean other tokens. With the
    target's `vocab_hash` (`vocabulary_hash` of its tokenizer) the table's must equal it; the
    vocabulary size must always."""
    path = paths.path(directory) / CORPUS_FILE
    if not path.is_file():
        return None
    table = load_table(path)
    other = vocab_hash is not None and table.vocab_hash != vocab_hash
    if other or table.vocab_size != vocab_size or table.next.max() >= vocab_size:
        got = f"vocabulary {table.vocab_hash} of {table.vocab_size} tokens"
        want = f"{vocab_hash} of {vocab_size}" if vocab_hash else f"{vocab_size} tokens"
        raise ConfigError(
            f"the corpus table {path} counts the {got}; the target's tokenizer has {want}: it "
            "belongs to another tokenizer; rebuild it from this target's data (python -m "
            "train.build_corpus --tokenizer=...) or delete it"
        )
    return table


def device_arrays(table: CorpusTable, mesh=None) -> dict:
    """The arrays the jitted lookup reads (`decoding.corpus`), replicated on `mesh`."""
    arrays = {
        "keys": jnp.asarray(table.keys),
        "next": jnp.asarray(table.next),
        # 1..max_ngram: its length tells the jitted lookup (a static shape) which n to try.
        "orders": jnp.arange(1, table.max_ngram + 1, dtype=jnp.int32),
    }
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arrays = jax.device_put(arrays, replicated)
    return arrays
