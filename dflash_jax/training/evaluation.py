"""Evaluation during training, on what the drafter never trains on.

* Real acceptance: greedy `speculative_decode` with the current params on held-out prompts (the
  held-out records' prompts, or the shipped dev set) -> tau (`evaluate_acceptance`).
* The held-out metric: the training loss's own forward on the held-out records (their target
  responses, anchors fixed once), through the **full vocabulary** (no sampled softmax): the loss,
  per-position top-1 accuracy, the tau those accuracies imply, and the teacher-forced tau (each
  full block's leading run of correct drafts, + 1), which is the acceptance a greedy verify would
  give at those anchors when the records hold the target's greedy responses
  (`heldout_metrics`). It needs no decoding, and unlike the logged training accuracy it is not an
  argmax over the batch's candidate set.
"""

from __future__ import annotations

import jax
import numpy as np

from dflash_jax import sharding
from dflash_jax.config import DrafterConfig
from dflash_jax.decoding import speculative_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.training import data
from dflash_jax.training.loss import implied_acceptance, position_weights
from dflash_jax.training.step import drafter_loss

EVAL_SOURCES = ("held_out", "dev")


def eval_prompts(source: str, target, held_out_records) -> list[list[int]]:
    """Token ids of the evaluation prompts: the held-out records' prompts, or the 24 prompts of
    the dev set rendered with the target's chat template."""
    if source == "held_out":
        return [data.prompt_tokens(r) for r in held_out_records]
    if source == "dev":
        from dflash_jax.io.assets import load_dev_prompts
        from dflash_jax.io.tokenizer import render_prompt

        return [render_prompt(target.tokenizer, r["prompt"]) for r in load_dev_prompts()]
    raise ValueError(f"config.eval_prompts must be one of {EVAL_SOURCES}, got {source!r}")


def eval_decode_config(
    target_config, drafter_config: DrafterConfig, max_new_tokens: int, block_size: int | None
) -> DecodeConfig:
    """The evaluation decode's settings (greedy, the trained or the given block size, the
    target's stop tokens): what `evaluate_acceptance` runs and `infer.aot` lowers."""
    return DecodeConfig(
        max_new_tokens=max_new_tokens,
        block_size=block_size or drafter_config.block_size,
        stop_token_ids=target_config.eos_token_ids,
    )


def evaluate_acceptance(
    target,
    drafter_config: DrafterConfig,
    params,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int | None = None,
    mesh=None,
) -> float:
    """Greedy `speculative_decode` on `prompts` (one batch; on `mesh` when given) -> mean tau
    (tokens per verify step, bonus included), averaged per prompt then over prompts."""
    width = max(len(p) for p in prompts)
    prompt_bp = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        prompt_bp[i, : len(p)] = p
    lengths_b = np.asarray([len(p) for p in prompts], np.int32)
    decode_config = eval_decode_config(target.config, drafter_config, max_new_tokens, block_size)
    out = speculative_decode(
        target.params,
        params,
        prompt_bp,
        lengths_b,
        jax.random.key(0),
        target_config=target.config,
        drafter_config=drafter_config,
        decode_config=decode_config,
        mesh=mesh,
    )
    acc = np.asarray(out.acceptance_lengths)
    steps = np.asarray(out.num_steps)
    ran = steps > 0
    return float(np.mean(acc[ran].sum(axis=1) / steps[ran])) if ran.any() else float("nan")


HELDOUT_SEED = 0x4E1D  # the held-out anchors: drawn once, the same at every evaluation


def heldout_batch(records: list[dict], seq_len: int, num_anchors: int) -> dict:
    """The held-out records as one batch of the training's shapes (padded/truncated to
    `seq_len`, `num_anchors` anchors each), anchors drawn once from a fixed seed per record."""
    pad = data.PadAndSampleAnchors(seq_len, num_anchors)
    rows = [
        pad.random_map(data.record_element(r, i), np.random.default_rng((HELDOUT_SEED, i)))
        for i, r in enumerate(records)
    ]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "index"}


HELDOUT_SETTINGS = ("target_config", "drafter_config", "loss_gamma", "ce_chunk_rows")


def _heldout_stats(params, target_params, batch, *, target_config, drafter_config, loss_gamma,
                   ce_chunk_rows, mesh=None):  # fmt: skip
    weights_j = jax.numpy.asarray(position_weights(drafter_config.block_size, loss_gamma))
    return drafter_loss(
        params, target_params, batch, target_config=target_config,
        drafter_config=drafter_config, weights_j=weights_j, ce_chunk_rows=ce_chunk_rows,
        loss_gamma=loss_gamma, mesh=mesh,
    )  # fmt: skip


heldout_jit = jax.jit(_heldout_stats, static_argnames=HELDOUT_SETTINGS)
_ON_MESH: dict = {}


def heldout_on_mesh(mesh, params, target_params, batch, **settings):
    """The held-out metric's program for a run on `mesh`, sharded like the training step
    (`step.train_step_on_mesh`): drafter and target params as `sharding.param_shardings`
    places them, the batch split over its rows, the figures replicated, traced under the mesh
    so that the attention kernels run in `shard_map`. -> a function of (params, target_params,
    batch) returning (loss, stats); compiled once per mesh, settings and input structure."""
    in_shardings = (
        sharding.param_shardings(params, mesh),
        sharding.param_shardings(target_params, mesh),
        sharding.batch_shardings(batch, mesh),
    )
    return sharding.jit_on_mesh(
        _ON_MESH, mesh, _heldout_stats, in_shardings, sharding.replicated(mesh), settings
    )


def heldout_metrics(
    target,
    drafter_config: DrafterConfig,
    params,
    batch: dict,
    loss_gamma: float,
    ce_chunk_rows: int,
    mesh=None,
) -> dict:
    """The held-out metric (module docstring) on `batch` (`heldout_batch`; taps computed online
    from the target; on `mesh` when given, `heldout_on_mesh`) -> {"heldout_loss",
    "heldout_accuracy" [J-1], "heldout_tau_implied", "heldout_tau_forced"}."""
    settings = dict(
        target_config=target.config,
        drafter_config=drafter_config,
        loss_gamma=float(loss_gamma),
        ce_chunk_rows=ce_chunk_rows,
    )
    if mesh is None:
        loss, stats = heldout_jit(params, target.params, batch, **settings)
    else:
        batch = sharding.put(batch, sharding.batch_shardings(batch, mesh))
        fn = heldout_on_mesh(mesh, params, target.params, batch, **settings)
        loss, stats = fn(params, target.params, batch)
    stats = jax.device_get(stats)
    acc_k = stats["correct"] / np.maximum(stats["count"], 1.0)
    forced = 1.0 + stats["forced_accepted"] / max(float(stats["full_blocks"]), 1.0)
    return {
        "heldout_loss": float(loss),
        "heldout_accuracy": [round(float(a), 5) for a in acc_k],
        "heldout_tau_implied": implied_acceptance(acc_k),
        "heldout_tau_forced": float(forced) if stats["full_blocks"] else float("nan"),
    }
