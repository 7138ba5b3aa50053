"""DFlash2's training objective: the block-diffusion CE plus a candidate-selection CE.

As NVIDIA NeMo AutoModel trains DFlash2 (`nemo_automodel.components.speculative.dflash.
dflash2_core`, `DFlash2TrainerModule`; docs.nvidia.com/nemo/automodel, v0.5-v0.7):

    loss = base_loss + selector_loss_weight * selector_loss

* `base_loss` is DFlash's decay-weighted block CE (`loss.block_diffusion_loss`). It makes each
  slot's candidate list good, and it alone trains the convolutions, which are part of the
  backbone and need no supervision of their own.
* `selector_loss` is a CE over the `selector_top_k` candidates of each slot (the top-k of the
  unary logits over the full vocabulary), scored after the *ground-truth* predecessor (the token
  the walk would have committed had every earlier slot been right: teacher forcing, so all slots
  are scored in parallel) and supervised with the index of the true token among the
  candidates. Slots whose true token is not a candidate carry no selector signal and are left
  out (`candidate_recall` reports how often a valid slot's token is a candidate).
* Both terms use the same position decay weights.

vLLM's speculators documents the same shape (docs.vllm.ai/projects/speculators, "DFlash2") and
notes that the public DFlash2 release specifies inference only, not its training objective.

Ours: the unary logits and candidates enter the selector term as constants (computed by a
forward-only pass of the frozen head, `ce_chunk_rows` rows at a time, so never a [rows, V]
block at once); the term's gradient reaches the selector's params and, through its hidden
projection, the drafter. With a sampled-softmax base CE (`vocab_negatives`), this full-head
forward is the selector's main cost.

Letters: B batch, N blocks, J block slots, R rows (B*N*(J-1)), C rows per chunk, D model dim,
K candidates, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.models.dflash2 import CandidateSelector
from dflash_jax.training.loss import map_row_chunks


def top_candidates(
    hidden_rd: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    k: int,
    chunk_rows: int,
) -> tuple[jax.Array, jax.Array]:
    """Each row's top-k of the full-vocabulary logits ([C,D] -> fp32 [C,V]), `chunk_rows` rows
    at a time, as constants (no gradient). -> (unary [R,K] fp32, candidate ids [R,K] int32)."""
    unary_rk, cand_rk = map_row_chunks(
        lambda chunk: jax.lax.top_k(logits_fn(chunk[0]), k),
        (jax.lax.stop_gradient(hidden_rd),),
        chunk_rows,
    )
    return jax.lax.stop_gradient(unary_rk), cand_rk.astype(jnp.int32)


def selector_loss(
    selector_params,
    drafter_config: DrafterConfig,
    hidden_bqd: jax.Array,
    labels_bnj: jax.Array,
    valid_bnj: jax.Array,
    weights_j: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk_rows: int,
) -> tuple[jax.Array, dict]:
    """The selector term (module docstring). hidden [B,Q=N*J,D] the drafter's final-normed
    output; labels/valid [B,N,J] from `loss.block_labels` (slot 0 holds the anchor token, the
    first slot's predecessor); weights [J] the position weights; `logits_fn` the full-vocabulary
    head. -> (loss, {"selector_loss", "selector_accuracy", "candidate_recall"}), the accuracy
    being how often the selector's top score is the true token over the slots that count."""
    b, n, j = labels_bnj.shape
    hidden_rd = hidden_bqd.reshape(b, n, j, -1)[:, :, 1:].reshape(b * n * (j - 1), -1)
    true_r = labels_bnj[:, :, 1:].reshape(-1)
    previous_r = labels_bnj[:, :, :-1].reshape(-1)
    valid_r = valid_bnj[:, :, 1:].reshape(-1)
    w_r = jnp.broadcast_to(weights_j[1:], (b, n, j - 1)).reshape(-1)

    unary_rk, cand_rk = top_candidates(
        hidden_rd, logits_fn, drafter_config.selector_top_k, chunk_rows
    )
    hit_rk = cand_rk == true_r[:, None]
    found_r = jnp.any(hit_rk, axis=-1)
    scores_rk = CandidateSelector(drafter_config).apply(
        {"params": selector_params}, hidden_rd, unary_rk, previous_r, cand_rk
    )
    gold_r = jnp.sum(jnp.where(hit_rk, scores_rk, 0.0), axis=-1)
    ce_r = jax.nn.logsumexp(scores_rk, axis=-1) - gold_r
    counts_r = valid_r & found_r
    w_r = jnp.where(counts_r, w_r, 0.0)
    loss = jnp.sum(w_r * ce_r) / jnp.maximum(jnp.sum(w_r), 1e-9)
    picked_r = jnp.take_along_axis(hit_rk, jnp.argmax(scores_rk, -1)[:, None], 1)[:, 0]
    num_valid = jnp.maximum(jnp.sum(valid_r), 1)
    stats = {
        "selector_loss": loss,
        "selector_accuracy": jnp.sum(picked_r & counts_r) / jnp.maximum(jnp.sum(counts_r), 1),
        "candidate_recall": jnp.sum(counts_r) / num_valid,
    }
    return loss, stats
