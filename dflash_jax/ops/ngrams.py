"""N-gram hashing for corpus lookup (`decoding.corpus`, `io.corpus_table`): one 32-bit hash of
a token n-gram, the same in numpy (building a table) and in jax.numpy (looking it up inside the
decode loop), and how the table reaches a decode beside a drafter's params."""

from __future__ import annotations

import numpy as np

# The table's key in the params a decode takes (`with_table`; a drafter's own params never
# hold it: `io.drafter_io.LoadedDrafter`) and its file in a drafter directory.
PARAMS_KEY = "corpus_ngrams"
CORPUS_FILE = "corpus_ngrams.npz"
_FNV_OFFSET, _FNV_PRIME, _N_SALT = 2166136261, 16777619, 0x9E3779B9


def ngram_hash(tokens, n: int, xp=np):
    """The 32-bit hash of n-grams `tokens` [..., n] (int), numpy or jax.numpy alike: FNV-1a over
    the tokens from an offset that holds n (so a 2-gram and a 3-gram hash apart)."""
    lead = tokens.shape[:-1]
    flat = tokens.reshape(-1, n).astype(xp.uint32)  # 1-d at least: numpy scalars warn on wrap
    h = xp.full(flat.shape[:1], (_FNV_OFFSET ^ (n * _N_SALT)) & 0xFFFFFFFF, xp.uint32)
    for j in range(n):
        h = (h ^ flat[:, j]) * xp.uint32(_FNV_PRIME)
    return h.reshape(lead)


def with_table(drafter_params, arrays):
    """The params a decode takes: a drafter's params and its corpus table's arrays (None: the
    params alone). The table is the decode's input, not the drafter's weight."""
    return drafter_params if arrays is None else {**drafter_params, PARAMS_KEY: arrays}


def table_of(drafter_params) -> dict | None:
    """The corpus table arrays in a decode's params ({"keys", "next", "orders"}), or None."""
    return drafter_params.get(PARAMS_KEY) if hasattr(drafter_params, "get") else None
