"""Corpus tables for corpus lookup (`decoding.corpus`): counted from the target's answers
(`build_table`, `train.build_corpus`), saved beside a drafter (`ops.ngrams.CORPUS_FILE`), and
added to its params when `load_drafter` reads it (`attach`).

The table: for each n-gram (n = 1..max_ngram) of the corpus followed by an answer token, the
`continuation` tokens that most often followed it; stored as the n-grams' 32-bit hashes
(`ops.ngrams.ngram_hash`, the n folded in), sorted, with the continuations [E, continuation].
Two n-grams with one hash share an entry (the more frequent kept): about a dozen pairs in the
shipped table's 328,248, and a wrong copy costs speed, never the output.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ConfigError
from dflash_jax.io.hf import CheckpointError
from dflash_jax.ops.ngrams import CORPUS_FILE, PARAMS_KEY, ngram_hash

# The longest n-gram counted (the decode looks up as many: the table's "orders"), the tokens
# kept after each (a copy step of 4 proposes 3), and the file format.
MAX_NGRAM = 3
CONTINUATION = 3
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class CorpusTable:
    """keys uint32 [E] (sorted, unique n-gram hashes), next int32 [E, continuation] (the tokens
    that most often followed each n-gram), counts int32 [E] (how often), for a target of
    `vocab_size` tokens; `source` says what it was counted from."""

    keys: np.ndarray
    next: np.ndarray
    counts: np.ndarray
    vocab_size: int
    max_ngram: int
    source: str = ""

    @property
    def continuation(self) -> int:
        return int(self.next.shape[1])


def build_table(
    records: Iterable[tuple[np.ndarray, np.ndarray]],
    vocab_size: int,
    max_ngram: int = MAX_NGRAM,
    continuation: int = CONTINUATION,
    min_count: int = 1,
    source: str = "",
) -> CorpusTable:
    """Counts (tokens [L], loss_mask [L]) records: for every position i whose token is an answer
    token (mask 1) with `continuation` tokens from i inside the record, each n-gram that ends at
    i - 1 (n = 1..max_ngram) and the tokens i .. i + continuation - 1 that follow it. Keeps, per
    n-gram, its most frequent continuation (ties: the smallest tokens), when seen at least
    `min_count` times."""
    hashes, conts = [], []
    for tokens, mask in records:
        t = np.asarray(tokens, np.int64)
        m = np.asarray(mask).astype(bool)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ConfigError(f"a corpus record holds token ids outside [0, {vocab_size})")
        length = t.size
        for n in range(1, max_ngram + 1):
            starts = np.arange(n, length - continuation + 1)
            starts = starts[m[starts]]
            if not starts.size:
                continue
            keys = t[starts[:, None] + np.arange(-n, 0)[None, :]]
            hashes.append(ngram_hash(keys, n))
            conts.append(t[starts[:, None] + np.arange(continuation)[None, :]])
    if not hashes:
        raise ConfigError("no answer tokens to count: the corpus is empty or has no loss mask")
    h = np.concatenate(hashes).astype(np.int64)
    c = np.concatenate(conts)
    rows, counts = np.unique(np.concatenate([h[:, None], c], 1), axis=0, return_counts=True)
    # Per hash the most frequent continuation (np.unique sorted rows by hash, then tokens).
    order = np.lexsort((-counts, rows[:, 0]))
    rows, counts = rows[order], counts[order]
    first = np.ones(len(rows), bool)
    first[1:] = rows[1:, 0] != rows[:-1, 0]
    keep = first & (counts >= min_count)
    return CorpusTable(
        keys=rows[keep, 0].astype(np.uint32),
        next=rows[keep, 1:].astype(np.int32),
        counts=counts[keep].astype(np.int32),
        vocab_size=int(vocab_size),
        max_ngram=int(max_ngram),
        source=source,
    )


def save_table(table: CorpusTable, path: str | os.PathLike) -> None:
    """Writes `table` as a compressed .npz (tokens as uint16 where the vocabulary allows)."""
    small = table.vocab_size <= np.iinfo(np.uint16).max + 1
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp,
        format_version=np.int32(FORMAT_VERSION),
        keys=table.keys,
        next=table.next.astype(np.uint16 if small else np.int32),
        counts=table.counts,
        vocab_size=np.int64(table.vocab_size),
        max_ngram=np.int32(table.max_ngram),
        source=np.str_(table.source),
    )
    os.replace(tmp, path)


def load_table(path) -> CorpusTable:
    """Reads a `save_table` file (a Path, or an epath for a URL); a damaged or foreign one
    raises CheckpointError."""
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
    return table


def attach(params: dict, directory, vocab_size: int, mesh=None) -> dict:
    """`params` with the corpus table of drafter `directory` (a Path, or an epath for a URL)
    under `PARAMS_KEY` (replicated on `mesh`), or as they are when the directory has none. A
    table for another vocabulary is refused: it was counted in another tokenizer's ids."""
    path = directory / CORPUS_FILE
    if not path.is_file():
        return params
    table = load_table(path)
    if table.vocab_size != vocab_size or (table.next.size and table.next.max() >= vocab_size):
        raise ConfigError(
            f"the corpus table {path} counts a vocabulary of {table.vocab_size} tokens, the "
            f"target has {vocab_size}: it belongs to another target; rebuild it from this "
            "target's data (python -m train.build_corpus) or delete it"
        )
    arrays = {
        "keys": jnp.asarray(table.keys),
        "next": jnp.asarray(table.next),
        # 1..max_ngram: its length tells the jitted lookup (a static shape) which n to try.
        "orders": jnp.arange(1, table.max_ngram + 1, dtype=jnp.int32),
    }
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arrays = jax.device_put(arrays, replicated)
    return {**params, PARAMS_KEY: arrays}
