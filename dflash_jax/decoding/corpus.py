"""Corpus lookup: copied blocks from the target's own past answers, where the text so far has
nothing to copy.

Prompt lookup (`decoding.lookup`) copies what followed an earlier occurrence of the text's last
tokens. Where the text has none (or only a one-token match), the copy step kinds instead propose
what most often followed the text's last 1-3 tokens in a corpus of the target's answers: the
data the drafter was trained on (`train.generate_data`), counted once into a table of n-grams
(`io.corpus_table`, `train.build_corpus`) that ships beside the drafter. This is
retrieval drafting (REST, He et al. 2023) with the target's own words: a small model's answers
repeat their phrasing ("Here is a Python function that", "In conclusion,"), so a copied block
is accepted far more often than when nothing is copied. It costs a few table reads a step (no
drafter pass); the target verifies every copied token as it verifies drafts, so the output is
the target's own, greedy or sampled (a copy is a deterministic proposal: `lookup.one_hot_logp`).

On device (`device_proposal`) the text's last n tokens are hashed (`ops.ngrams.ngram_hash`)
and found by binary search (`jnp.searchsorted`) among the table's sorted hashes; the longest n
found wins.

`load_drafter` adds a drafter directory's table to the drafter's params
(`ops.ngrams.PARAMS_KEY`), so every decode that copies (`DecodeConfig.lookup_kinds`) uses it; a
drafter without one copies from the text alone, as before.
"""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.ops.ngrams import ngram_hash


def device_proposal(table: dict, text_bn, end_b, length: int):
    """Per row, `length` tokens copied from the corpus after the text's last tokens (row b's
    text is text_bn[b, : end_b[b] + 1]): the continuation of the longest of its last 1..N
    tokens the table holds (N: the table's longest n-gram, the length of its "orders"),
    continued from the proposal's own tail when `length` exceeds the table's continuation.
    -> (proposal [B, length] int32, n [B] int32: the n-gram length that matched first, 0
    where none did, whose proposal is zeros)."""
    keys, nxt = table["keys"], table["next"]
    max_ngram = table["orders"].shape[0]
    g = nxt.shape[1]
    b = text_bn.shape[0]
    # The last max_ngram tokens of each row, oldest first; `have` of them exist.
    offs = jnp.arange(-max_ngram + 1, 1, dtype=jnp.int32)
    idx_bm = jnp.clip(end_b[:, None] + offs[None, :], 0, text_bn.shape[1] - 1)
    tail_bm = jnp.take_along_axis(text_bn, idx_bm, 1)
    have_b = jnp.minimum(end_b + 1, max_ngram)
    rounds, first_n = [], None
    for _ in range(-(-length // g)):
        best_n = jnp.zeros((b,), jnp.int32)
        best_i = jnp.zeros((b,), jnp.int32)
        for n in range(1, max_ngram + 1):
            h_b = ngram_hash(tail_bm[:, max_ngram - n :], n, jnp)
            i_b = jnp.clip(jnp.searchsorted(keys, h_b), 0, keys.shape[0] - 1).astype(jnp.int32)
            hit_b = (keys[i_b] == h_b) & (have_b >= n)
            best_n = jnp.where(hit_b, n, best_n)  # the longer n-gram wins
            best_i = jnp.where(hit_b, i_b, best_i)
        cont_bg = jnp.where((best_n > 0)[:, None], nxt[best_i], 0)
        rounds.append(cont_bg)
        first_n = best_n if first_n is None else first_n
        tail_bm = jnp.concatenate([tail_bm, cont_bg], 1)[:, -max_ngram:]
        have_b = jnp.where(best_n > 0, jnp.minimum(have_b + g, max_ngram), 0)
    return jnp.concatenate(rounds, 1)[:, :length].astype(jnp.int32), first_n
