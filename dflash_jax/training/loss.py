"""The block-diffusion loss (dflash-spec §7.5): same-position labels, decayed position weights and a
cross-entropy through the frozen target lm_head computed in row chunks.

Letters: B batch, S sequence, N blocks (anchors), J block slots (block_size), Q = N*J block rows,
R flattened rows, C rows per chunk, D model dim, V vocab, K the teacher's top-k.

Distillation (`distill_top_k` > 0): the target's top-K at each label's position (its ids and
probabilities renormalised over the K) are soft labels: the loss is (1 - a) * hard CE + a * soft
CE, -sum_k q_k log p_student(t_k). The K ids also join each row's candidate set as exact
negatives (their true logits in the normaliser, `distill_cross_entropy`), so under a sampled
softmax a token the target ranks high is never left out of a row's softmax.
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


def teacher_top_k(
    hidden_rd: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], k: int, chunk_rows: int
) -> tuple[jax.Array, jax.Array]:
    """The teacher's top-k at each row, [C,V] logits at a time -> (ids [R,K] int32, their
    probabilities renormalised over the K [R,K] fp32)."""

    def one_chunk(args):
        (h_cd,) = args
        values_ck, ids_ck = jax.lax.top_k(logits_fn(h_cd), k)
        return ids_ck.astype(jnp.int32), jax.nn.softmax(values_ck.astype(jnp.float32), axis=-1)

    return map_row_chunks(one_chunk, (hidden_rd,), chunk_rows)


def teacher_extras(
    teacher_ids_rk: jax.Array, ids_u: jax.Array, bias_u: jax.Array, num_negatives: int
) -> tuple[jax.Array, jax.Array]:
    """How each row's teacher ids join its candidates under a sampled softmax
    (`sampled_vocabulary`'s ids/bias, whose last `num_negatives` slots are the negatives).

    -> (extra_bias [R,K]: 0 for an id to add to the row's normaliser, NEG_INF for one that is
    already a positive candidate; hits [R,K] fp32: how many live negatives drew that id, whose
    corrected terms the normaliser takes out again so that the id counts exactly once)."""
    p = ids_u.shape[0] - num_negatives
    vocab_end = jnp.iinfo(jnp.int32).max
    # Real positive slots are sorted ascending; padding (bias NEG_INF) sorts last.
    positives = jnp.where(bias_u[:p] == 0.0, ids_u[:p], vocab_end)
    at = jnp.clip(jnp.searchsorted(positives, teacher_ids_rk), 0, p - 1)
    in_positives = jnp.take(positives, at) == teacher_ids_rk
    live = jnp.sort(jnp.where(bias_u[p:] > NEG_INF / 2, ids_u[p:], -1))
    hits = jnp.searchsorted(live, teacher_ids_rk, side="right") - jnp.searchsorted(
        live, teacher_ids_rk, side="left"
    )
    extra_bias = jnp.where(in_positives, NEG_INF, 0.0).astype(jnp.float32)
    return extra_bias, jnp.where(in_positives, 0, hits).astype(jnp.float32)


def distill_cross_entropy(
    hidden_rd: jax.Array,
    labels_r: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    rows_logits_fn: Callable[[jax.Array, jax.Array], jax.Array],
    teacher_ids_rk: jax.Array,
    teacher_q_rk: jax.Array,
    extra_bias_rk: jax.Array,
    hits_rk: jax.Array,
    correction: float,
    chunk_rows: int,
    remat: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`chunked_cross_entropy` with the teacher's ids in each row's softmax.

    logits_fn: [C,D] -> the candidates' fp32 logits [C,U] (with their biases; the full
    vocabulary when there is no sampled softmax, and then extra_bias is NEG_INF and hits 0);
    rows_logits_fn: ([C,D], ids [C,K]) -> the student's logits at those ids [C,K].
    Per row, with z the candidates' and t the teacher ids' logits:
      lse = log(sum_u e^{z_u} + sum_k e^{t_k + extra_bias_k} - sum_k hits_k e^{t_k + correction}),
    the hard CE lse - z_label, the soft CE -sum_k q_k (t_k - lse), and the row is correct when
    the label wins among the candidates and no added teacher id beats it.
    -> (hard ce [R], soft ce [R], correct [R] bool)."""

    def one_chunk(args):
        h_cd, y_c, ids_ck, q_ck, extra_ck, hits_ck = args
        z_cu = logits_fn(h_cd)
        t_ck = rows_logits_fn(h_cd, ids_ck)
        added_ck = t_ck + extra_ck
        m_c = jax.lax.stop_gradient(jnp.maximum(z_cu.max(-1), added_ck.max(-1)))[:, None]
        total_c = (
            jnp.exp(z_cu - m_c).sum(-1)
            + jnp.exp(added_ck - m_c).sum(-1)
            - (hits_ck * jnp.exp(t_ck + correction - m_c)).sum(-1)
        )
        lse_c = m_c[:, 0] + jnp.log(jnp.maximum(total_c, jnp.finfo(jnp.float32).tiny))
        gold_c = jnp.take_along_axis(z_cu, y_c[:, None], axis=-1)[:, 0]
        soft_c = -jnp.sum(q_ck * (t_ck - lse_c[:, None]), axis=-1)
        correct_c = (argmax_last(z_cu) == y_c) & (gold_c >= added_ck.max(-1))
        return lse_c - gold_c, soft_c, correct_c

    body = jax.checkpoint(one_chunk) if remat else one_chunk
    rows = (hidden_rd, labels_r, teacher_ids_rk, teacher_q_rk, extra_bias_rk, hits_rk)
    return map_row_chunks(body, rows, chunk_rows)


def block_diffusion_loss(
    hidden_bqd: jax.Array,
    labels_bnj: jax.Array,
    valid_bnj: jax.Array,
    weights_j: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk_rows: int,
    remat: bool = True,
    distill: dict | None = None,
) -> tuple[jax.Array, dict]:
    """loss = sum(w * CE) / sum(w) over valid slots; the anchor slots never reach the lm_head.
    `remat`: see `chunked_cross_entropy`. `distill`: {"weight": a, "rows_logits_fn",
    "teacher_ids"/"teacher_q"/"extra_bias"/"hits" [B,N,J-1,K], "correction"}: CE is then
    (1 - a) * hard CE + a * soft CE (`distill_cross_entropy`), and the stats add "soft_ce"
    (its weighted mean) and "hard_ce".

    -> (loss, {"correct": [J-1], "count": [J-1], "forced_accepted": [], "full_blocks": []}):
    per-slot (k = 1..J-1) sums for accuracy; and over the blocks whose J-1 slots are all valid,
    the sum of each block's leading run of correct slots (the drafts a greedy verify would accept
    from this block, were the labels the target's greedy continuation) and their count.
    """
    b, n, j = labels_bnj.shape
    hidden_bnjd = hidden_bqd.reshape(b, n, j, -1)[:, :, 1:]
    labels_bnk = labels_bnj[:, :, 1:]
    valid_bnk = valid_bnj[:, :, 1:]
    hidden_rd = hidden_bnjd.reshape(-1, hidden_bnjd.shape[-1])
    w_bnk = jnp.where(valid_bnk, weights_j[1:][None, None, :], 0.0)
    mean = lambda x_bnk: jnp.sum(w_bnk * x_bnk) / jnp.maximum(jnp.sum(w_bnk), 1e-9)
    extra = {}
    if distill is None:
        ce_r, correct_r = chunked_cross_entropy(
            hidden_rd, labels_bnk.reshape(-1), logits_fn, chunk_rows, remat
        )
        loss = mean(ce_r.reshape(labels_bnk.shape))
    else:
        k = distill["teacher_ids"].shape[-1]
        per_row = [
            distill[n].reshape(-1, k) for n in ("teacher_ids", "teacher_q", "extra_bias", "hits")
        ]
        hard_r, soft_r, correct_r = distill_cross_entropy(
            hidden_rd, labels_bnk.reshape(-1), logits_fn, distill["rows_logits_fn"], *per_row,
            correction=distill["correction"], chunk_rows=chunk_rows, remat=remat,
        )  # fmt: skip
        hard, soft = mean(hard_r.reshape(labels_bnk.shape)), mean(soft_r.reshape(labels_bnk.shape))
        a = distill["weight"]
        loss = (1.0 - a) * hard + a * soft
        extra = {"hard_ce": hard, "soft_ce": soft}
    hits_bnk = correct_r.reshape(labels_bnk.shape) & valid_bnk
    return loss, {**block_stats(hits_bnk, valid_bnk), **extra}


def block_stats(hits_bnk: jax.Array, valid_bnk: jax.Array) -> dict:
    """The step's accuracy counts from each block slot's hit [B,N,K] (a valid slot whose draft
    is the label) and validity: per slot "correct" and "count", and over full blocks the
    leading hits ("forced_accepted") and how many there were ("full_blocks"), as fp32."""
    full_bn = jnp.all(valid_bnk, axis=-1)
    run_bn = jnp.sum(jnp.cumprod(hits_bnk.astype(jnp.int32), axis=-1), axis=-1)
    return {
        "correct": jnp.sum(hits_bnk, axis=(0, 1)).astype(jnp.float32),
        "count": jnp.sum(valid_bnk, axis=(0, 1)).astype(jnp.float32),
        "forced_accepted": jnp.sum(jnp.where(full_bn, run_bn, 0)).astype(jnp.float32),
        "full_blocks": jnp.sum(full_bn).astype(jnp.float32),
    }


def implied_acceptance(accuracy_k: np.ndarray) -> float:
    """tau ~ 1 + sum_k prod_{j<=k} acc_j (k = 1..J-1): the acceptance length the per-position
    accuracies imply if draft errors were independent (bonus token included)."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(accuracy_k, np.float64))))
