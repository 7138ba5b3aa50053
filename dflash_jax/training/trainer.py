"""Drafter training: the jitted train step and the resumable loop around it (design.md §4.2).

train_step: frozen target forward (no grad) -> taps -> drafter over all N anchor blocks of each
sequence at once under the block mask -> chunked CE through the frozen lm_head with decayed
position weights -> AdamW on the drafter params only.

Taps are computed online, inside the step, by default (`taps="online"`), or read from a cache
built once by `tap_cache` (`taps="cached"`). Which is cheaper depends on how many epochs a budget
buys. Measured for SmolLM2-135M on our 2-core CPU while a data-generation job shared it (fp32,
batch 4 x 384 tokens, 3 layers, 32 anchors, block 16; `train_step` timed over 3 steps
each after compilation): online taps with the full-vocabulary CE 23.7-27.1 s/step; cached taps
13.9-14.3 s; cached taps with a 4096-negative sampled softmax (`vocab_negatives`) 8.1-8.3 s.
Building the cache ran at 133 tokens/s under the same load (one target forward per token, as one
epoch of online taps costs). So caching pays from the second epoch, and with the sampled softmax
a CPU run is ~3x faster per step. On accelerators, where caching costs 40 KiB/token for Qwen3-8B
(dflash-spec §7.6) and the full CE is cheap, the paper's online recipe is the default.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from absl import logging

from dflash_jax.config import DecodeConfig, DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_jax.decoding import speculative_decode
from dflash_jax.io.target_loader import load_target
from dflash_jax.models.drafter import (
    Drafter,
    check_fits,
    embed_block,
    hidden_to_logits,
    hidden_to_subset_logits,
    init_drafter_params,
    unembedding_rows,
)
from dflash_jax.models.target import Transformer
from dflash_jax.training import checkpoint, data, tap_cache
from dflash_jax.training.loss import (
    block_diffusion_loss,
    block_inputs,
    block_labels,
    default_gamma,
    implied_acceptance,
    position_weights,
    sampled_vocabulary,
)

METRICS_FILE = "metrics.jsonl"


def default_config() -> ml_collections.ConfigDict:
    """Every training setting with the paper's recipe as default (dflash-spec §7); the named
    configs in configs/ override what differs. `drafter.hidden_size` must equal the target's."""
    cfg = ml_collections.ConfigDict()
    cfg.target = "smollm2-135m-instruct"
    cfg.data = ""  # shards: comma-separated globs or directories from train.generate_data
    cfg.compute_dtype = "bfloat16"  # master weights and Adam state stay fp32
    cfg.drafter = ml_collections.ConfigDict()
    cfg.drafter.hidden_size = 0
    cfg.drafter.intermediate_size = 0
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 32
    cfg.drafter.num_kv_heads = 8
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = -1
    cfg.drafter.target_layer_ids = ()  # empty: the reference rule for num_layers taps
    cfg.block_size = 16
    cfg.seq_len = 3072
    cfg.num_anchors = 512
    cfg.loss_gamma = 0.0  # 0: the published value for block_size (7 for 16)
    cfg.ce_chunk_rows = 2048
    # 0: CE over the full vocabulary (the paper). M > 0: a sampled softmax over the batch's
    # distinct labels plus M uniform negatives with log(V/M) correction (loss.sampled_vocabulary),
    # ~V/(rows+M) times cheaper lm_head work; the logged accuracy is then over those candidates.
    cfg.vocab_negatives = 0
    # Taps: "online" (a frozen target forward inside every step) or "cached" (computed once into
    # <workdir>/tap_cache, then read; pays from the second epoch, see tap_cache.py).
    cfg.taps = "online"
    cfg.tap_cache_dtype = "bfloat16"  # or "float32"
    # Start the drafter's final norm at the target's final-norm scale (both feed the same frozen
    # lm_head). Off by default: in a SmolLM2 CPU run with it (and lr 1.5e-3) the loss was still
    # 7.4 at step 100, where the same run without it (lr 1e-3) reached 7.1 at step 50.
    cfg.init_norm_from_target = False
    cfg.batch_size = 8
    cfg.num_epochs = 6
    cfg.num_steps = 0  # 0: num_epochs over the training records
    cfg.learning_rate = 6e-4
    cfg.warmup_fraction = 0.04
    cfg.adam_b1 = 0.9
    cfg.adam_b2 = 0.999
    cfg.adam_eps = 1e-8
    cfg.weight_decay = 0.0
    cfg.grad_clip = 1.0
    cfg.seed = 0
    cfg.data_threads = 4
    cfg.num_eval_prompts = 8  # records held out; their prompts measure the real tau
    cfg.eval_every = 1000
    cfg.eval_max_new_tokens = 256
    cfg.log_every = 50
    cfg.checkpoint_every = 1000  # keep a multiple of log_every (throughput excludes saving)
    cfg.max_checkpoints = 3
    return cfg


def drafter_config_for(cfg: ml_collections.ConfigDict, target: TargetConfig) -> DrafterConfig:
    """The drafter a config describes for `target` (rope, eps and vocab follow the target, as
    dflash-spec §7.6 builds new drafters); refused with ConfigError when it does not fit."""
    d = cfg.drafter
    tap_ids = tuple(d.target_layer_ids) or default_target_layer_ids(target.num_layers, d.num_layers)
    config = DrafterConfig(
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_layers=d.num_layers,
        num_heads=d.num_heads,
        num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim,
        vocab_size=target.vocab_size,
        mask_token_id=d.mask_token_id,
        target_layer_ids=tap_ids,
        num_target_layers=target.num_layers,
        block_size=cfg.block_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        dtype=cfg.compute_dtype,
    )
    check_fits(config, target)
    return config


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
        )

    def schedule(self) -> optax.Schedule:
        """Linear warm-up from 0, then cosine to 0 at num_steps."""
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
):
    """One batch: tokens/loss_mask [B,S], length [B], anchors/anchor_valid [B,N], and taps
    [B,S,F] when they are cached. -> (loss, {"correct", "count"} per slot k = 1..J-1)."""
    tokens_bs = batch["tokens"]
    b, s = tokens_bs.shape
    block_size = drafter_config.block_size
    if "taps" in batch:  # cached by tap_cache
        taps_bsf = batch["taps"]
    else:
        positions_bs = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
        # Layers after the last tap cannot change the taps: skip them (their params go unused).
        tap_config = dataclasses.replace(
            target_config, num_layers=max(drafter_config.target_layer_ids) + 1
        )
        _, taps_bsf, _ = Transformer(tap_config).apply(
            {"params": target_params},
            tokens_bs,
            positions_bs,
            tap_layers=drafter_config.target_layer_ids,
            logit_indices=jnp.zeros((b, 1), jnp.int32),
        )
    taps_bsf = jax.lax.stop_gradient(taps_bsf)
    anchors_bn = batch["anchors"]
    block_tokens_bq = block_inputs(tokens_bs, anchors_bn, block_size, drafter_config.mask_token_id)
    x_bqd = embed_block(target_params, target_config, drafter_config, block_tokens_bq)
    hidden_bqd = Drafter(drafter_config).apply(
        {"params": params},
        taps_bsf.astype(x_bqd.dtype),
        x_bqd,
        batch["length"],
        anchors_bn,
        block_size,
        method="forward_from_taps",
    )
    labels_bnj, valid_bnj = block_labels(
        tokens_bs,
        batch["loss_mask"],
        batch["length"],
        anchors_bn,
        batch["anchor_valid"],
        block_size,
    )
    if vocab_negatives:
        ids_u, bias_u, labels_bnj = sampled_vocabulary(
            labels_bnj, valid_bnj, target_config.vocab_size, vocab_negatives, vocab_rng
        )
        rows_ud = jax.lax.stop_gradient(unembedding_rows(target_params, target_config, ids_u))

        def logits_fn(h_cd):
            return (
                hidden_to_subset_logits(target_params, target_config, drafter_config, h_cd, rows_ud)
                + bias_u
            )
    else:

        def logits_fn(h_cd):
            return hidden_to_logits(target_params, target_config, drafter_config, h_cd)

    return block_diffusion_loss(
        hidden_bqd, labels_bnj, valid_bnj, weights_j, logits_fn, ce_chunk_rows
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "target_config",
        "drafter_config",
        "optimizer",
        "loss_gamma",
        "ce_chunk_rows",
        "vocab_negatives",
    ),
    donate_argnums=0,
)
def train_step(
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
):
    """-> (state, metrics). `state` is {"step", "params", "opt_state"} (donated); only the
    drafter params receive gradients, the target params are a plain input. Sampled negatives
    come from a key folded from the step, so a resumed run draws the same ones."""
    weights_j = jnp.asarray(position_weights(drafter_config.block_size, loss_gamma))
    vocab_rng = jax.random.fold_in(jax.random.key(0x5EED), state["step"])

    def loss_fn(params):
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
        )

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = optimizer.build().update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **stats}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def evaluate_acceptance(
    target, drafter_config: DrafterConfig, params, prompts: list[list[int]], max_new_tokens: int
) -> float:
    """Greedy `speculative_decode` on held-out prompts -> mean tau (tokens per verify step,
    bonus included), averaged per prompt then over prompts."""
    width = max(len(p) for p in prompts)
    prompt_bp = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        prompt_bp[i, : len(p)] = p
    lengths_b = np.asarray([len(p) for p in prompts], np.int32)
    decode_config = DecodeConfig(
        max_new_tokens=max_new_tokens,
        block_size=drafter_config.block_size,
        stop_token_ids=target.config.eos_token_ids,
    )
    out = speculative_decode(
        target.params,
        params,
        prompt_bp,
        lengths_b,
        jax.random.key(0),
        target_config=target.config,
        drafter_config=drafter_config,
        decode_config=decode_config,
    )
    acc = np.asarray(out.acceptance_lengths)
    steps = np.asarray(out.num_steps)
    ran = steps > 0
    return float(np.mean(acc[ran].sum(axis=1) / steps[ran])) if ran.any() else float("nan")


class MetricsLog:
    """Appends one JSON object per log line to `<workdir>/metrics.jsonl`. On resume, lines past
    the restored step (logged by the killed run after its last checkpoint) are dropped first."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        if path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def summarize(
    window: list[dict], step: int, seconds: float, timed_steps: int, tokens_per_step: int, lr: float
) -> dict:
    """Host-side summary of the steps since the last log line; throughput over the `timed_steps`
    that `seconds` covers (None when there are none, e.g. only the compiling step)."""
    host = jax.device_get(window)
    correct = np.sum([m["correct"] for m in host], axis=0)
    count = np.sum([m["count"] for m in host], axis=0)
    acc_k = correct / np.maximum(count, 1.0)
    return {
        "step": step,
        "loss": float(np.mean([m["loss"] for m in host])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in host])),
        "accuracy": [round(float(a), 5) for a in acc_k],
        "tau_implied": implied_acceptance(acc_k),
        "learning_rate": lr,
        "tokens_per_s": timed_steps * tokens_per_step / seconds if timed_steps else None,
        "step_time_s": seconds / timed_steps if timed_steps else None,
    }


def train(cfg: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Trains (or resumes) the run in `workdir`; -> the last logged metrics."""
    if cfg.taps not in ("online", "cached"):
        raise ValueError(f"config.taps must be 'online' or 'cached', got {cfg.taps!r}")
    if cfg.tap_cache_dtype not in tap_cache.DTYPES:
        raise ValueError(
            f"config.tap_cache_dtype must be one of {sorted(tap_cache.DTYPES)}, "
            f"got {cfg.tap_cache_dtype!r}"
        )
    if cfg.vocab_negatives < 0:
        raise ValueError(f"config.vocab_negatives must be >= 0, got {cfg.vocab_negatives}")
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target, dtype=cfg.compute_dtype)
    drafter_config = drafter_config_for(cfg, target.config)
    loss_gamma = cfg.loss_gamma or default_gamma(cfg.block_size)

    source = data.record_source(data.expand_paths(cfg.data))
    train_records, held_out = data.split_holdout(source, cfg.num_eval_prompts, cfg.seed)
    epoch_steps = len(train_records) // cfg.batch_size
    num_steps = cfg.num_steps or cfg.num_epochs * epoch_steps
    num_epochs = math.ceil(num_steps * cfg.batch_size / len(train_records))
    cache = None
    if cfg.taps == "cached":
        cache = tap_cache.build_tap_cache(
            workdir / "tap_cache",
            source,
            target,
            drafter_config.target_layer_ids,
            cfg.seq_len,
            dtype=cfg.tap_cache_dtype,
        )
    dataset = data.batched_dataset(
        train_records,
        seq_len=cfg.seq_len,
        num_anchors=cfg.num_anchors,
        batch_size=cfg.batch_size,
        num_epochs=num_epochs,
        seed=cfg.seed,
        tap_cache=cache,
    )
    read_options = grain.ReadOptions(num_threads=cfg.data_threads, prefetch_buffer_size=8)
    data_iter = iter(dataset.to_iter_dataset(read_options))
    logging.info(
        "%d training records, %d held out; %d steps (%.2f epochs of %d steps); drafter %s",
        len(train_records),
        len(held_out),
        num_steps,
        num_steps / max(epoch_steps, 1),
        epoch_steps,
        drafter_config,
    )

    optimizer = OptimizerConfig.from_config(cfg, num_steps)
    schedule = optimizer.schedule()
    params = init_drafter_params(drafter_config, jax.random.key(cfg.seed))
    if cfg.init_norm_from_target:
        scale = target.params["norm"]["scale"]
        # A copy: the train state is donated, the target must keep its own buffer.
        own = jnp.array(scale, params["norm"]["scale"].dtype, copy=True)
        params = {**params, "norm": {"scale": own}}
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optimizer.build().init(params),
    }
    manager = checkpoint.checkpoint_manager(workdir, cfg.max_checkpoints)
    restored = checkpoint.restore_latest(manager, state, data_iter)
    if restored is not None:
        state = restored
    start = int(state["step"])
    if start:
        logging.info("resumed from step %d in %s", start, workdir)
    metrics_log = MetricsLog(workdir / METRICS_FILE, start)
    step_settings = {
        "target_config": target.config,
        "drafter_config": drafter_config,
        "optimizer": optimizer,
        "loss_gamma": float(loss_gamma),
        "ce_chunk_rows": cfg.ce_chunk_rows,
        "vocab_negatives": cfg.vocab_negatives,
    }
    eval_prompts = [data.prompt_tokens(r) for r in held_out]
    tokens_per_step = cfg.batch_size * cfg.seq_len

    last: dict = {}
    window: list[dict] = []
    timed_steps, t0 = 0, time.perf_counter()
    bar = tqdm.tqdm(total=num_steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    for step in range(start + 1, num_steps + 1):
        state, metrics = train_step(state, target.params, next(data_iter), **step_settings)
        window.append(metrics)
        bar.update(1)
        final = step == num_steps
        if step == start + 1:
            # The first step compiles: keep it out of the throughput.
            jax.block_until_ready(metrics)
            timed_steps, t0 = -1, time.perf_counter()
        timed_steps += 1
        if step % cfg.log_every == 0 or final:
            jax.block_until_ready(metrics)
            seconds = time.perf_counter() - t0
            last = summarize(
                window, step, seconds, timed_steps, tokens_per_step, float(schedule(step - 1))
            )
            metrics_log.write(last)
            logging.info("step %d: %s", step, last)
            bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau_implied']:.2f}")
            window = []
        if cfg.eval_every and eval_prompts and (step % cfg.eval_every == 0 or final):
            tau = evaluate_acceptance(
                target, drafter_config, state["params"], eval_prompts, cfg.eval_max_new_tokens
            )
            metrics_log.write({"step": step, "tau_eval": tau})
            logging.info("step %d: speculative decoding tau on held-out prompts %.3f", step, tau)
        if step % cfg.checkpoint_every == 0 or final:
            checkpoint.save_checkpoint(manager, step, state, data_iter)
            checkpoint.export_drafter(workdir, drafter_config, state["params"])
        if not window:
            # Throughput covers train steps only, not evaluation or checkpointing.
            timed_steps, t0 = 0, time.perf_counter()
    bar.close()
    manager.wait_until_finished()
    return last
