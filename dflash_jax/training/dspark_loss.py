"""DSpark's training loss, as `speculators` 0.9.0 defines it (`models/dspark/metrics.py`,
`compute_metrics` with its defaults: `loss_fn` "kl_div", fixed-exp-decay weights, confidence
alpha 1).

Per block slot k at position p = anchor + k (teacher-forced: the block's true tokens feed the
Markov head, `dspark.previous_tokens`):
  draft logits   z_k = the target head on the slot's hidden + the Markov bias
  target logits  t_k = the target's own logits at p (`sample_from_anchor`: slot k drafts p+1)
                       or at p-1 (without: slot k drafts p, slot 0 drafts nothing)
  kl_k   = KL(softmax(t_k) || softmax(z_k)) over the whole vocabulary
  a_k    = sum_v min(softmax(z_k), softmax(t_k)) = 1 - TV: the analytical acceptance rate
  bce_k  = BCE(sigmoid(c_k), stop_gradient(a_k)), c_k the confidence head's logit
  m_k    = anchor valid, p < length and loss_mask[p] (the reference's mask is the loss mask at
           the slot's own position p, with either setting); slot 0 also off without
           `sample_from_anchor`
  w_k    = exp(-k/gamma) with `sample_from_anchor`, else exp(-(k-1)/gamma) and w_0 = 0
  loss   = mean over rows of sum(m w kl) / (sum(m) + 1e-5)
           + alpha * mean over rows of sum(m w bce) / (sum(m) + 1e-8)
(The decay weights only the numerators, as the reference's `loss_function` does.)

The [rows, V] logits are never held whole: the target head, the Markov head's markov_w2 and both
softmaxes run in rematerialised row chunks (`loss.map_row_chunks`).

Letters: B batch, S sequence, N blocks, J block slots, D model dim, R Markov rank, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models import dspark
from dflash_jax.models.drafter import hidden_to_logits
from dflash_jax.ops.reductions import argmax_last
from dflash_jax.training.loss import block_stats, map_row_chunks

KL_EPS = 1e-5  # the reference's _LOSS_REDUCTION_EPS
DSPARK_GAMMA = 4.0  # the reference's default decay (its loss_decay_factor), any block size
CONFIDENCE_EPS = 1e-8  # its metrics._EPS


def dspark_position_weights(block_size: int, gamma: float, sample_from_anchor: bool) -> np.ndarray:
    """The reference's `dflash_loss_decay` per slot -> [J] fp32."""
    k = np.arange(block_size, dtype=np.float64)
    if sample_from_anchor:
        return np.exp(-k / gamma).astype(np.float32)
    w = np.exp(-np.maximum(k - 1.0, 0.0) / gamma)
    w[0] = 0.0
    return w.astype(np.float32)


def dspark_slots(batch: dict, drafter_config: DrafterConfig):
    """Each block slot's position clipped into the row [B,N,J], its target-logit position
    [B,N,J], its token [B,N,J] and its loss mask m [B,N,J] bool (module docstring)."""
    tokens_bs = batch["tokens"]
    s = tokens_bs.shape[1]
    j = drafter_config.block_size
    pos_bnj = batch["anchors"][:, :, None] + jnp.arange(j)[None, None, :]
    inside_bnj = pos_bnj < batch["length"][:, None, None]
    pos_bnj = jnp.minimum(pos_bnj, s - 1)
    gather = jax.vmap(lambda x_s, p_nj: x_s[p_nj])
    tokens_bnj = gather(tokens_bs, pos_bnj)
    in_mask_bnj = gather(batch["loss_mask"], pos_bnj) > 0
    mask_bnj = batch["anchor_valid"][:, :, None] & inside_bnj & in_mask_bnj
    if drafter_config.sample_from_anchor:
        target_pos_bnj = pos_bnj
    else:
        mask_bnj = mask_bnj & (jnp.arange(j) >= 1)[None, None, :]
        target_pos_bnj = jnp.maximum(pos_bnj - 1, 0)
    return pos_bnj, target_pos_bnj, tokens_bnj, mask_bnj


def dspark_loss(
    params,
    target_params,
    hidden_bqd: jax.Array,
    target_final_bsd: jax.Array,
    batch: dict,
    *,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    loss_gamma: float,
    chunk_rows: int,
    confidence_weight: float = 1.0,
):
    """The loss of the module docstring. hidden: the drafter's final-normed hidden over the
    batch's blocks [B, N*J, D]; target_final: the target's final-normed hidden [B,S,D] (its
    logits' input). -> (loss, stats): per draft slot "correct" (argmax of the draft equals the
    target's argmax) and "count" [J'] (J' = J with `sample_from_anchor`, else J-1), the greedy
    forced-acceptance sums as `loss.block_diffusion_loss` gives them, and "kl_loss",
    "accept_rate" (mean a_k over m) and, with a confidence head, "confidence_loss"."""
    c = drafter_config
    b, n = batch["anchors"].shape
    j = c.block_size
    _, target_pos_bnj, tokens_bnj, mask_bnj = dspark_slots(batch, c)
    hidden_bnjd = hidden_bqd.reshape(b, n, j, -1)
    target_bnjd = jax.vmap(lambda x_sd, p_nj: x_sd[p_nj])(
        jax.lax.stop_gradient(target_final_bsd), target_pos_bnj
    )
    prev_bnj = dspark.previous_tokens(c, tokens_bnj)
    z_bnjr = e_bnjr = markov = variables = None
    if c.markov_rank:
        markov = dspark.MarkovHead(c)
        variables = {"params": params["markov_head"]}
        e_bnjr = markov.apply(variables, prev_bnj, method="embed")
        z_bnjr = markov.apply(variables, e_bnjr, hidden_bnjd, method="block_z")

    def one_chunk(args):
        h_cd, t_cd = args[:2]
        logits_cv = hidden_to_logits(target_params, target_config, c, h_cd)
        if c.markov_rank:
            logits_cv = logits_cv + markov.apply(variables, args[2], method="bias")
        t_cv = jax.lax.stop_gradient(hidden_to_logits(target_params, target_config, c, t_cd))
        return row_terms(logits_cv, t_cv)

    rows = lambda x_bnjx: x_bnjx.reshape(b * n * j, x_bnjx.shape[-1])
    inputs = (rows(hidden_bnjd), rows(target_bnjd))
    if c.markov_rank:
        inputs += (rows(z_bnjr),)
    kl_r, accept_r, hit_r = map_row_chunks(jax.checkpoint(one_chunk), inputs, chunk_rows)
    kl_bnj, accept_bnj = kl_r.reshape(b, n, j), accept_r.reshape(b, n, j)
    w_j = jnp.asarray(dspark_position_weights(j, loss_gamma, c.sample_from_anchor))
    m_bnj = mask_bnj.astype(jnp.float32)
    mw_bnj = m_bnj * w_j[None, None, :]
    count_b = jnp.sum(m_bnj, axis=(1, 2))
    kl_loss = jnp.mean(jnp.sum(mw_bnj * kl_bnj, axis=(1, 2)) / (count_b + KL_EPS))
    loss = kl_loss
    extra = {"kl_loss": kl_loss}
    if c.enable_confidence_head:
        conf_bnj = dspark.ConfidenceHead(c).apply(
            {"params": params["confidence_head"]}, hidden_bnjd, e_bnjr
        )
        bce_bnj = binary_cross_entropy_with_logits(conf_bnj, accept_bnj)
        conf_loss = jnp.mean(jnp.sum(mw_bnj * bce_bnj, axis=(1, 2)) / (count_b + CONFIDENCE_EPS))
        loss = loss + confidence_weight * conf_loss
        extra["confidence_loss"] = conf_loss
    first = 0 if c.sample_from_anchor else 1
    hits_bnk = hit_r.reshape(b, n, j)[:, :, first:] & mask_bnj[:, :, first:]
    stats = {
        **block_stats(hits_bnk, mask_bnj[:, :, first:]),
        "accept_rate": jnp.sum(accept_bnj * m_bnj) / jnp.maximum(jnp.sum(m_bnj), 1.0),
        **extra,
    }
    return loss, stats


def row_terms(logits_cv, targets_cv):
    """Draft and target logits [C,V] -> (KL(p || q) [C], the acceptance rate sum min(q, p) [C]
    without gradient, argmax hits [C] bool), q = softmax(draft), p = softmax(target): the
    reference's eager `kl_div_loss` and `1 - tv_loss`."""
    logq_cv = jax.nn.log_softmax(logits_cv, axis=-1)
    logp_cv = jax.nn.log_softmax(targets_cv, axis=-1)
    p_cv = jnp.exp(logp_cv)
    kl_c = jnp.sum(jnp.where(p_cv > 0, p_cv * (logp_cv - logq_cv), 0.0), axis=-1)
    accept_c = jnp.sum(jnp.minimum(jnp.exp(logq_cv), p_cv), axis=-1)
    hit_c = argmax_last(logits_cv) == argmax_last(targets_cv)
    return kl_c, jax.lax.stop_gradient(accept_c), hit_c


def binary_cross_entropy_with_logits(x, y):
    """torch's binary_cross_entropy_with_logits, elementwise: max(x,0) - x*y + log(1+e^-|x|)."""
    return jnp.maximum(x, 0.0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))
