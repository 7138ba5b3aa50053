"""One drafter training step: the loss over a batch of anchor blocks and the jitted AdamW update.

drafter_loss: frozen target forward (no grad, or cached taps) -> taps -> drafter over all N
anchor blocks of each sequence at once under the block mask -> chunked CE through the frozen
lm_head (full vocabulary or a sampled softmax) with decayed position weights; a DFlash2 drafter
adds its candidate selector's CE (`selector_loss.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dflash_jax import sharding
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import (
    Drafter,
    embed_block,
    hidden_to_logits,
    hidden_to_subset_logits,
    unembedding_rows,
)
from dflash_jax.models.target import Transformer
from dflash_jax.training.dspark_loss import dspark_loss
from dflash_jax.training.loss import (
    NEG_INF,
    block_diffusion_loss,
    block_inputs,
    block_labels,
    position_weights,
    sampled_vocabulary,
    teacher_extras,
    teacher_top_k,
)
from dflash_jax.training.selector_loss import selector_loss


def _split_batch(x_b, mesh):
    """x [B,...] pinned to the batch axes of `mesh` (a no-op without one): GSPMD would otherwise
    follow the fc kernel's sharding back into the taps and replicate their batch dim."""
    if mesh is None:
        return x_b
    return jax.lax.with_sharding_constraint(x_b, sharding.batch_shardings(x_b, mesh))


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Hashable optimizer settings, so the jitted step is cached across `train` calls."""

    learning_rate: float
    warmup_steps: int
    num_steps: int
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float
    kind: str = "cosine"  # or "wsd"
    decay_steps: int = 0  # wsd: the last decay_steps fall linearly to 0

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict, num_steps: int) -> OptimizerConfig:
        return cls(
            learning_rate=cfg.learning_rate,
            warmup_steps=int(round(cfg.warmup_fraction * num_steps)),
            num_steps=num_steps,
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            grad_clip=cfg.grad_clip,
            kind=cfg.lr_schedule,
            decay_steps=int(round(cfg.decay_fraction * num_steps)),
        )

    def schedule(self) -> optax.Schedule:
        """cosine: linear warm-up from 0, then cosine to 0 at num_steps. wsd (warmup-stable-
        decay): linear warm-up, the peak rate held, then linear to 0 over the last decay_steps.
        A wsd run can be continued: a later run that starts from one of its checkpoints before
        the decay (`config.init_from_checkpoint`, Adam's moments kept) goes on at the same rate,
        where a cosine run's rate depends on the step count it was planned for."""
        if self.kind == "wsd":
            stable_end = max(self.num_steps - self.decay_steps, self.warmup_steps)
            pieces = [
                optax.linear_schedule(0.0, self.learning_rate, max(self.warmup_steps, 1)),
                optax.constant_schedule(self.learning_rate),
                optax.linear_schedule(self.learning_rate, 0.0, max(self.decay_steps, 1)),
            ]
            if not self.warmup_steps:
                pieces = pieces[1:]
                return optax.join_schedules(pieces, [stable_end])
            return optax.join_schedules(pieces, [self.warmup_steps, stable_end])
        return optax.warmup_cosine_decay_schedule(
            0.0,
            self.learning_rate,
            self.warmup_steps,
            max(self.num_steps, self.warmup_steps + 1),
            end_value=0.0,
        )

    def build(self) -> optax.GradientTransformation:
        """Global-norm clipping, then AdamW on the schedule."""
        return optax.chain(
            optax.clip_by_global_norm(self.grad_clip),
            optax.adamw(
                self.schedule(), self.b1, self.b2, self.eps, weight_decay=self.weight_decay
            ),
        )


HEAD_KEEP_BYTES = 1 << 30  # logits kept for the backward below this; rematerialised above


def distill_inputs(
    teacher, anchors_bn, block_size, target_params, target_config, drafter_config, sampled
) -> dict:
    """The teacher's top-k (ids, q) [B,S,K] at each block slot's label position: slot k of the
    block at anchor a is labelled x_{a+k}, which the target predicts at position a+k-1. With a
    sampled softmax (`sampled` = (ids_u, bias_u, negatives)) the ids' place in each row's
    candidates comes from `loss.teacher_extras`; over the full vocabulary they are already in.
    -> `block_diffusion_loss`'s `distill` dict (without its weight)."""
    ids_bsk, q_bsk = teacher
    s = ids_bsk.shape[1]
    # [B,N,J-1] positions a + k - 1 for k = 1..J-1 (clipped: slots past the end are invalid).
    pos_bnk = jnp.clip(anchors_bn[:, :, None] + jnp.arange(block_size - 1)[None, None, :], 0, s - 1)
    gather = jax.vmap(lambda x_sk, p_nk: x_sk[p_nk])
    ids_bnkk, q_bnkk = gather(ids_bsk, pos_bnk), gather(q_bsk, pos_bnk)
    if sampled is None:
        extra = jnp.full(ids_bnkk.shape, NEG_INF, jnp.float32)
        hits, correction = jnp.zeros(ids_bnkk.shape, jnp.float32), 0.0
    else:
        ids_u, bias_u, negatives = sampled
        extra, hits = teacher_extras(ids_bnkk, ids_u, bias_u, negatives)
        correction = float(np.log(target_config.vocab_size / negatives))

    def rows_logits_fn(h_cd, ids_ck):
        rows = unembedding_rows(target_params, target_config, ids_ck.reshape(-1))  # [C*K, D]
        rows_ckd = jax.lax.stop_gradient(rows).reshape(*ids_ck.shape, -1)
        # Each row against its own K head rows: the sampled head's subset logits, per row.
        one_row = lambda h_d, rows_kd: hidden_to_subset_logits(
            target_params, target_config, drafter_config, h_d[None], rows_kd
        )[0]
        return jax.vmap(one_row)(h_cd, rows_ckd)

    return {
        "teacher_ids": ids_bnkk,
        "teacher_q": q_bnkk,
        "extra_bias": extra,
        "hits": hits,
        "correction": correction,
        "rows_logits_fn": rows_logits_fn,
    }


def drafter_loss(
    params,
    target_params,
    batch: dict,
    *,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    weights_j: jax.Array,
    ce_chunk_rows: int,
    vocab_negatives: int = 0,
    vocab_rng: jax.Array | None = None,
    mesh=None,
    selector_loss_weight: float = 1.0,
    distill_top_k: int = 0,
    distill_weight: float = 0.5,
    loss_gamma: float = 0.0,
    confidence_loss_weight: float = 1.0,
    remat: bool = False,
):
    """One batch: tokens/loss_mask [B,S], length [B], anchors/anchor_valid [B,N], and taps
    [B,S,F] when they are cached. -> (loss, {"correct", "count"} per slot k = 1..J-1, and for a
    DFlash2 drafter the selector term's figures, `selector_loss.selector_loss`).
    On a `mesh` the taps and the drafter's hidden states stay split over the batch axes.
    distill_top_k > 0 (online taps): the whole target runs, and its top-k at each label's
    position are soft labels and exact candidates (`loss.distill_cross_entropy`).
    A DSpark drafter (online taps: the whole target runs for its logits) takes
    `dspark_loss.dspark_loss` instead, with decay `loss_gamma` and the confidence term's weight
    `confidence_loss_weight`. `remat`: the drafter's layers recompute their activations in
    the backward (`Drafter.remat`)."""
    tokens_bs = batch["tokens"]
    b, s = tokens_bs.shape
    block_size = drafter_config.block_size
    teacher = None
    is_dspark = drafter_config.is_dspark
    whole_target = bool(distill_top_k) or is_dspark
    if "taps" in batch:  # cached by tap_cache
        if whole_target:
            raise ValueError(
                "distillation and DSpark need online taps: a tap cache holds no logits"
            )
        taps_bsf = batch["taps"]
    else:
        positions_bs = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
        # Without distillation the layers after the last tap cannot change the taps: skip them
        # (their params go unused), and keep one final hidden row instead of all S.
        pass_config = (
            target_config
            if whole_target
            else target_config.first_layers(max(*drafter_config.target_layer_ids, 0) + 1)
        )
        final_bsd, taps_bsf, _ = Transformer(pass_config).apply(
            {"params": target_params},
            tokens_bs,
            positions_bs,
            tap_layers=drafter_config.target_layer_ids,
            logit_indices=None if whole_target else jnp.zeros((b, 1), jnp.int32),
            method="hidden",
        )
        if distill_top_k:
            ids_rk, q_rk = teacher_top_k(
                jax.lax.stop_gradient(final_bsd).reshape(b * s, -1),
                lambda h: hidden_to_logits(target_params, target_config, drafter_config, h),
                distill_top_k,
                ce_chunk_rows,
            )
            teacher = (ids_rk.reshape(b, s, -1), q_rk.reshape(b, s, -1))
    taps_bsf = _split_batch(jax.lax.stop_gradient(taps_bsf), mesh)
    anchors_bn = batch["anchors"]
    block_tokens_bq = block_inputs(tokens_bs, anchors_bn, block_size, drafter_config.mask_token_id)
    x_bqd = embed_block(target_params, target_config, drafter_config, block_tokens_bq)
    hidden_bqd = Drafter(drafter_config, remat=remat).apply(
        {"params": params},
        taps_bsf.astype(x_bqd.dtype),
        x_bqd,
        batch["length"],
        anchors_bn,
        block_size,
        method="forward_from_taps",
    )
    hidden_bqd = _split_batch(hidden_bqd, mesh)
    if is_dspark:
        return dspark_loss(
            params, target_params, hidden_bqd, final_bsd, batch, target_config=target_config,
            drafter_config=drafter_config, loss_gamma=loss_gamma, chunk_rows=ce_chunk_rows,
            confidence_weight=confidence_loss_weight,
        )  # fmt: skip
    labels_bnj, valid_bnj = block_labels(
        tokens_bs,
        batch["loss_mask"],
        batch["length"],
        anchors_bn,
        batch["anchor_valid"],
        block_size,
    )
    true_labels_bnj = labels_bnj
    if vocab_negatives:
        # Every label is one of the batch's b*s tokens: an exact bound on the distinct ones.
        ids_u, bias_u, labels_bnj = sampled_vocabulary(
            labels_bnj, valid_bnj, target_config.vocab_size, vocab_negatives, vocab_rng,
            max_distinct=b * s,
        )  # fmt: skip
        rows_ud = jax.lax.stop_gradient(unembedding_rows(target_params, target_config, ids_u))

        def logits_fn(h_cd):
            return (
                hidden_to_subset_logits(target_params, target_config, drafter_config, h_cd, rows_ud)
                + bias_u
            )
    else:

        def logits_fn(h_cd):
            return hidden_to_logits(target_params, target_config, drafter_config, h_cd)

    # Remat the head only where keeping its logits for the backward would cost real memory:
    # the sampled candidate set for SmolLM2 is 7,680 rows x ~7K columns (~0.2 GB fp32), kept;
    # a full 49K..152K vocabulary is recomputed chunk by chunk.
    columns = ids_u.shape[0] if vocab_negatives else target_config.vocab_size
    keep_bytes = labels_bnj[:, :, 1:].size * columns * 4
    distill = None
    if teacher is not None:
        distill = distill_inputs(
            teacher, anchors_bn, block_size, target_params, target_config, drafter_config,
            (ids_u, bias_u, vocab_negatives) if vocab_negatives else None,
        )  # fmt: skip
        distill["weight"] = distill_weight
    loss, stats = block_diffusion_loss(
        hidden_bqd, labels_bnj, valid_bnj, weights_j, logits_fn, ce_chunk_rows,
        remat=keep_bytes > HEAD_KEEP_BYTES, distill=distill,
    )  # fmt: skip
    if drafter_config.is_dflash2:
        full_logits_fn = lambda h_cd: hidden_to_logits(
            target_params, target_config, drafter_config, h_cd
        )
        selector, selector_stats = selector_loss(
            params["candidate_selector"], drafter_config, hidden_bqd, true_labels_bnj,
            valid_bnj, weights_j, full_logits_fn, ce_chunk_rows,
        )  # fmt: skip
        loss = loss + selector_loss_weight * selector
        stats = {**stats, **selector_stats}
    return loss, stats


def _train_step(
    state: dict,
    target_params,
    batch: dict,
    *,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    optimizer: OptimizerConfig,
    loss_gamma: float,
    ce_chunk_rows: int,
    vocab_negatives: int = 0,
    mesh=None,
    selector_loss_weight: float = 1.0,
    distill_top_k: int = 0,
    distill_weight: float = 0.5,
    confidence_loss_weight: float = 1.0,
    grad_accum_steps: int = 1,
    remat: bool = False,
):
    """-> (state, metrics). `state` is {"step", "params", "opt_state"} (donated); only the
    drafter params receive gradients, the target params are a plain input. Sampled negatives
    come from a key folded from the step, so a resumed run draws the same ones.
    `grad_accum_steps` k > 1: the batch's rows in k micro-batches (rows i, i+k, ...: each
    spread over every device of the batch axes), one after another (`lax.scan`, so that only
    one micro-batch's activations are live), gradients averaged (`_accumulated`). `remat`:
    the drafter's layers recompute their activations in the backward (`Drafter.remat`).

    A step whose loss or gradient is not finite leaves params and optimizer state as they
    were (the step counter still advances, with the data) and reports `finite = False`; the
    training loop then stops or counts a skipped step (`config.nonfinite`).
    """
    weights_j = jnp.asarray(position_weights(drafter_config.block_size, loss_gamma))
    vocab_rng = jax.random.fold_in(jax.random.key(0x5EED), state["step"])

    def loss_fn(params, batch, vocab_rng):
        return drafter_loss(
            params,
            target_params,
            batch,
            target_config=target_config,
            drafter_config=drafter_config,
            weights_j=weights_j,
            ce_chunk_rows=ce_chunk_rows,
            vocab_negatives=vocab_negatives,
            vocab_rng=vocab_rng,
            mesh=mesh,
            selector_loss_weight=selector_loss_weight,
            distill_top_k=distill_top_k,
            distill_weight=distill_weight,
            loss_gamma=loss_gamma,
            confidence_loss_weight=confidence_loss_weight,
            remat=remat,
        )

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum_steps == 1:
        (loss, stats), grads = grad_fn(state["params"], batch, vocab_rng)
    else:
        loss, stats, grads = _accumulated(grad_fn, state["params"], batch, vocab_rng,
                                          grad_accum_steps, mesh)  # fmt: skip
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.build().update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, **stats}
    return {
        "step": state["step"] + 1,
        "params": keep(params, state["params"]),
        "opt_state": keep(opt_state, state["opt_state"]),
    }, metrics


# Per-slot counts add up over micro-batches; every other figure is averaged.
SUMMED_STATS = ("correct", "count", "forced_accepted", "full_blocks")


def _accumulated(grad_fn, params, batch: dict, vocab_rng, k: int, mesh):
    """(loss, stats, grads) of `grad_fn` over `batch` in k micro-batches: rows i, i+k, ... form
    micro-batch i; the loss and the gradients are the micro-batches' mean (each micro-batch's
    loss is its own positions' weighted mean, as the whole batch's would be), the per-slot
    counts their sum. Each micro-batch draws its sampled negatives from the step's key folded
    with its index."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % k:
        raise ValueError(f"grad_accum_steps={k} does not divide the batch's {rows} rows")

    def split(x):
        x = x.reshape(rows // k, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)  # [k, rows/k, ...]: micro-batch i = rows i, i+k, ...

    micro = jax.tree.map(split, batch)

    def one(grads, xs):
        i, part = xs
        part = jax.tree.map(lambda x: _split_batch(x, mesh), part)
        (loss, stats), g = grad_fn(params, part, jax.random.fold_in(vocab_rng, i))
        return jax.tree.map(jnp.add, grads, g), (loss, stats)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (losses, stats) = jax.lax.scan(one, zeros, (jnp.arange(k), micro))
    grads = jax.tree.map(lambda g: g / k, grads)
    stats = {
        key: jnp.sum(v, axis=0) if key in SUMMED_STATS else jnp.mean(v, axis=0)
        for key, v in stats.items()
    }
    return jnp.mean(losses), stats, grads


STEP_SETTINGS = (
    "target_config",
    "drafter_config",
    "optimizer",
    "loss_gamma",
    "ce_chunk_rows",
    "vocab_negatives",
    "selector_loss_weight",
    "distill_top_k",
    "distill_weight",
    "confidence_loss_weight",
    "grad_accum_steps",
    "remat",
)
train_step = jax.jit(_train_step, static_argnames=STEP_SETTINGS, donate_argnums=0)
_ON_MESH: dict = {}


def train_step_on_mesh(mesh, state, target_params, batch, **settings):
    """`train_step` for a run on `mesh`: jitted with in/out shardings from the logical table
    (the train state as `sharding.state_shardings` places it, the frozen target as
    `param_shardings`, the batch split over its rows, metrics replicated), the state donated.
    -> a function of (state, target_params, batch) returning (state, metrics); compiled once
    per mesh, settings and input structure."""
    in_shardings = (
        sharding.state_shardings(state, mesh),
        sharding.param_shardings(target_params, mesh),
        sharding.batch_shardings(batch, mesh),
    )
    out_shardings = (in_shardings[0], sharding.replicated(mesh))
    return sharding.jit_on_mesh(
        _ON_MESH, mesh, _train_step, in_shardings, out_shardings, settings, donate_argnums=0
    )
