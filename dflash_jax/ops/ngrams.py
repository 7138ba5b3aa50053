"""N-gram hashing for corpus lookup (`decoding.corpus`, `io.corpus_table`): one 32-bit hash of
a token n-gram, the same in numpy (building a table) and in jax.numpy (looking it up inside the
decode loop), and where a drafter's params keep the table."""

from __future__ import annotations

import numpy as np

# The table's key in a drafter's params (`io.corpus_table.attach`) and its file in a drafter
# directory.
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


def table_of(drafter_params) -> dict | None:
    """The corpus table arrays in a drafter's params ({"keys", "next", "orders"}), or None."""
    return drafter_params.get(PARAMS_KEY) if hasattr(drafter_params, "get") else None


def without_table(drafter_params):
    """A drafter's params without its corpus table (what an Orbax export saves: the table is a
    file of its own)."""
    if table_of(drafter_params) is None:
        return drafter_params
    return {k: v for k, v in drafter_params.items() if k != PARAMS_KEY}
