"""The block-diffusion loss (dflash-spec §7.5): same-position labels, decayed position weights and a
cross-entropy through the frozen target lm_head computed in row chunks.

Letters: B batch, S sequence, N blocks (anchors), J block slots (block_size), Q = N*J block rows,
R flattened rows, C rows per chunk, D model dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ConfigError
from dflash_jax.ops.reductions import argmax_last

# Paper Eq. 4: gamma per block size.
PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size not in PUBLISHED_GAMMA:
        raise ConfigError(
            f"no published loss decay gamma for block_size={block_size} (known: "
            f"{sorted(PUBLISHED_GAMMA)}); set the config's loss_gamma explicitly"
        )
    return PUBLISHED_GAMMA[block_size]


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..J-1; the anchor slot 0 has weight 0. -> [J]."""
    k = np.arange(block_size, dtype=np.float64)
    w = np.exp(-(k - 1.0) / gamma)
    w[0] = 0.0
    return w.astype(np.float32)


def block_inputs(
    tokens_bs: jax.Array, anchors_bn: jax.Array, block_size: int, mask_token_id: int
) -> jax.Array:
    """Each block is [x_anchor, MASK x (J-1)]. -> [B, Q] int32."""
    b, n = anchors_bn.shape
    anchor_tok_bn = jnp.take_along_axis(tokens_bs, anchors_bn, axis=1)
    blocks_bnj = jnp.full((b, n, block_size), mask_token_id, dtype=tokens_bs.dtype)
    blocks_bnj = blocks_bnj.at[:, :, 0].set(anchor_tok_bn)
    return blocks_bnj.reshape(b, n * block_size)


def block_labels(
    tokens_bs: jax.Array,
    loss_mask_bs: jax.Array,
    lengths_b: jax.Array,
    anchors_bn: jax.Array,
    anchor_valid_bn: jax.Array,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Slot k of block n is labelled with the token at anchors[n] + k (same position, no shift).

    -> (labels [B,N,J] int32, valid [B,N,J] bool). Invalid: slot 0 (the anchor itself), padding
    anchors, positions at or past the row's length, and positions outside the loss mask.
    """
    s = tokens_bs.shape[1]
    pos_bnj = anchors_bn[:, :, None] + jnp.arange(block_size)[None, None, :]
    b = pos_bnj.shape[0]
    flat_pos = jnp.minimum(pos_bnj, s - 1).reshape(b, -1)
    labels_bnj = jnp.take_along_axis(tokens_bs, flat_pos, axis=1).reshape(pos_bnj.shape)
    in_mask_bnj = jnp.take_along_axis(loss_mask_bs, flat_pos, axis=1).reshape(pos_bnj.shape) > 0
    valid_bnj = (
        anchor_valid_bn[:, :, None]
        & (jnp.arange(block_size) >= 1)[None, None, :]
        & (pos_bnj < lengths_b[:, None, None])
        & in_mask_bnj
    )
    return labels_bnj, valid_bnj


NEG_INF = -1e9  # finite, so a masked candidate never turns a logsumexp gradient into NaN


def sampled_vocabulary(
    labels_bnj: jax.Array,
    valid_bnj: jax.Array,
    vocab_size: int,
    num_negatives: int,
    rng: jax.Array,
    max_distinct: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A sampled softmax's candidate set, for a CE that never builds [rows, V] logits.

    Candidates are every distinct valid label of the batch (the positives P) plus `num_negatives`
    ids drawn uniformly from the whole vocabulary with replacement; a negative that falls in P is
    masked. Each negative's logit gets + log(V / M): sum_i exp(z_{s_i} + log(V/M)) over negatives
    not in P is an unbiased estimate of sum_{j not in P} exp(z_j), so the candidates' logsumexp
    estimates the full one and the CE is a consistent estimate of the full-vocabulary CE.

    `max_distinct` is a bound on the number of distinct labels that holds by construction (the
    trainer passes B*S: every label is one of the batch's B*S tokens). It must never be tighter
    than that: `unique(size=)` would silently drop labels beyond it.

    -> (ids [U] int32, bias [U] fp32, labels remapped to candidate positions [B,N,J]), with
    U = min(B*N*J, max_distinct, V) + M static (unused positive slots are padding with bias
    NEG_INF).
    """
    flat_y = labels_bnj.reshape(-1)
    flat_ok = valid_bnj.reshape(-1)
    r = flat_y.shape[0]
    size = min(r, vocab_size, max_distinct or r)
    # Sorted distinct valid labels; invalid rows and padding become the sentinel vocab_size.
    pos_p = jnp.unique(jnp.where(flat_ok, flat_y, vocab_size), size=size, fill_value=vocab_size)
    neg_m = jax.random.randint(rng, (num_negatives,), 0, vocab_size, dtype=jnp.int32)
    hit = jnp.take(pos_p, jnp.clip(jnp.searchsorted(pos_p, neg_m), 0, size - 1)) == neg_m
    ids_u = jnp.concatenate([jnp.minimum(pos_p, vocab_size - 1), neg_m]).astype(jnp.int32)
    correction = float(np.log(vocab_size / num_negatives))
    bias_u = jnp.concatenate(
        [
            jnp.where(pos_p < vocab_size, 0.0, NEG_INF),
            jnp.where(hit, NEG_INF, correction),
        ]
    ).astype(jnp.float32)
    remapped = jnp.clip(jnp.searchsorted(pos_p, flat_y), 0, size - 1).astype(jnp.int32)
    return ids_u, bias_u, jnp.where(flat_ok, remapped, 0).reshape(labels_bnj.shape)


def even_chunk_rows(rows: int, chunk_rows: int) -> int:
    """The chunk size for `rows` rows in chunks of at most `chunk_rows`: the fewest chunks that
    divide `rows` exactly (no padded rows) if that takes at most 1.5x the minimum number of
    chunks, else `chunk_rows` (the last chunk padded). 7,680 rows at 1,024 -> 8 chunks of 960."""
    if rows <= chunk_rows:
        return max(rows, 1)
    fewest = -(-rows // chunk_rows)
    for n in range(fewest, fewest + fewest // 2 + 1):
        if rows % n == 0:
            return rows // n
    return chunk_rows


def map_row_chunks(fn: Callable, rows: tuple, chunk_rows: int):
    """`fn` over `rows` (arrays sharing a leading [R] axis) in `lax.map` chunks of at most
    `chunk_rows` rows (`even_chunk_rows`: padded only where R has no divisor near it); fn maps a
    tuple of [C, ...] chunks to a pytree of [C, ...] arrays. -> that pytree over all R rows."""
    r = rows[0].shape[0]
    c = even_chunk_rows(r, chunk_rows)
    pad = (-r) % c
    chunked = tuple(
        jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(-1, c, *x.shape[1:])
        for x in rows
    )
    out = jax.lax.map(fn, chunked)
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:r], out)


def chunked_cross_entropy(
    hidden_rd: jax.Array,
    labels_r: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk_rows: int,
    remat: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Hard-label CE and argmax hits per row, at most `chunk_rows` rows at a time.

    `logits_fn` maps [C,D] -> fp32 [C,V]. With `remat` the chunk body is rematerialised, so
    neither the forward nor the backward pass holds more than one [C,V] logits block; without it
    the backward reuses the forward's logits (all R x V of them are kept: only for a small V,
    e.g. a sampled candidate set). Rows are split into equal chunks without padding where R has
    a divisor near `chunk_rows` (`even_chunk_rows`).
    -> (ce [R] fp32, correct [R] bool).
    """

    def one_chunk(args):
        h_cd, y_c = args
        logits_cv = logits_fn(h_cd)
        lse_c = jax.nn.logsumexp(logits_cv, axis=-1)
        gold_c = jnp.take_along_axis(logits_cv, y_c[:, None], axis=-1)[:, 0]
        return lse_c - gold_c, argmax_last(logits_cv) == y_c

    body = jax.checkpoint(one_chunk) if remat else one_chunk
    return map_row_chunks(body, (hidden_rd, labels_r), chunk_rows)


def block_diffusion_loss(
    hidden_bqd: jax.Array,
    labels_bnj: jax.Array,
    valid_bnj: jax.Array,
    weights_j: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk_rows: int,
    remat: bool = True,
) -> tuple[jax.Array, dict]:
    """loss = sum(w * CE) / sum(w) over valid slots; the anchor slots never reach the lm_head.
    `remat`: see `chunked_cross_entropy`.

    -> (loss, {"correct": [J-1], "count": [J-1], "forced_accepted": [], "full_blocks": []}):
    per-slot (k = 1..J-1) sums for accuracy; and over the blocks whose J-1 slots are all valid,
    the sum of each block's leading run of correct slots (the drafts a greedy verify would accept
    from this block, were the labels the target's greedy continuation) and their count.
    """
    b, n, j = labels_bnj.shape
    hidden_bnjd = hidden_bqd.reshape(b, n, j, -1)[:, :, 1:]
    labels_bnk = labels_bnj[:, :, 1:]
    valid_bnk = valid_bnj[:, :, 1:]
    ce_r, correct_r = chunked_cross_entropy(
        hidden_bnjd.reshape(-1, hidden_bnjd.shape[-1]),
        labels_bnk.reshape(-1),
        logits_fn,
        chunk_rows,
        remat,
    )
    ce_bnk = ce_r.reshape(labels_bnk.shape)
    w_bnk = jnp.where(valid_bnk, weights_j[1:][None, None, :], 0.0)
    loss = jnp.sum(w_bnk * ce_bnk) / jnp.maximum(jnp.sum(w_bnk), 1e-9)
    hits_bnk = correct_r.reshape(labels_bnk.shape) & valid_bnk
    full_bn = jnp.all(valid_bnk, axis=-1)
    run_bn = jnp.sum(jnp.cumprod(hits_bnk.astype(jnp.int32), axis=-1), axis=-1)
    stats = {
        "correct": jnp.sum(hits_bnk, axis=(0, 1)).astype(jnp.float32),
        "count": jnp.sum(valid_bnk, axis=(0, 1)).astype(jnp.float32),
        "forced_accepted": jnp.sum(jnp.where(full_bn, run_bn, 0)).astype(jnp.float32),
        "full_blocks": jnp.sum(full_bn).astype(jnp.float32),
    }
    return loss, stats


def implied_acceptance(accuracy_k: np.ndarray) -> float:
    """tau ~ 1 + sum_k prod_{j<=k} acc_j (k = 1..J-1): the acceptance length the per-position
    accuracies imply if draft errors were independent (bonus token included)."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(accuracy_k, np.float64))))
