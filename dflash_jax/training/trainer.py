"""Drafter training: configuration and the resumable loop (design.md §4.2).

The step itself (loss, AdamW update) is in `step.py`, the starting params in `init.py`, the
real-acceptance evaluation in `evaluation.py`, checkpoints in `checkpoint.py`.

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
import os
import time

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from absl import logging
from etils import epath

from dflash_jax import sharding
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.io import paths
from dflash_jax.io.target_loader import load_target
from dflash_jax.models.drafter import check_fits, default_target_layer_ids
from dflash_jax.training import checkpoint, data, dspark_loss, monitor, preemption, tap_cache
from dflash_jax.training.evaluation import (
    EVAL_SOURCES,
    eval_prompts,
    evaluate_acceptance,
    heldout_batch,
    heldout_metrics,
)
from dflash_jax.training.init import check_init_from_target, initial_params
from dflash_jax.training.loss import default_gamma, implied_acceptance
from dflash_jax.training.step import OptimizerConfig, train_step, train_step_on_mesh

METRICS_FILE = "metrics.jsonl"
NONFINITE_MODES = ("stop", "skip")
LR_SCHEDULES = ("cosine", "wsd")
SELECTOR_METRICS = ("selector_loss", "selector_accuracy", "candidate_recall")
DISTILL_METRICS = ("hard_ce", "soft_ce")
DSPARK_METRICS = ("kl_loss", "confidence_loss", "accept_rate")


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss or gradient (config.nonfinite = "stop")."""


def default_config() -> ml_collections.ConfigDict:
    """Every training setting with the paper's recipe as default (dflash-spec §7); the named
    configs in configs/ override what differs. `drafter.hidden_size` must equal the target's."""
    cfg = ml_collections.ConfigDict()
    cfg.target = "smollm2-135m-instruct"
    # Shards: comma-separated globs or directories from train.generate_data, local or URLs.
    cfg.data = ""
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
    # DFlash2 (all four > 0): convolutions around each sublayer and a candidate selector; the
    # selector's CE joins the loss with weight `selector_loss_weight` (training/selector_loss.py).
    cfg.drafter.conv_kernel_size = 0
    cfg.drafter.conv_group_size = 0
    cfg.drafter.selector_rank = 0
    cfg.drafter.selector_top_k = 0
    cfg.selector_loss_weight = 1.0
    # DSpark (any of: markov_rank > 0, enable_confidence_head, sample_from_anchor; `models/
    # dspark.py`): the loss becomes speculators' (training/dspark_loss.py: KL to the target's
    # logits, which the whole target computes in each step, so online taps only) plus the
    # confidence head's BCE with weight `confidence_loss_weight`.
    cfg.drafter.markov_rank = 0
    cfg.drafter.markov_head_type = "vanilla"
    cfg.drafter.enable_confidence_head = False
    cfg.drafter.confidence_head_with_markov = False
    cfg.drafter.sample_from_anchor = False
    cfg.confidence_loss_weight = 1.0
    cfg.block_size = 16
    cfg.seq_len = 3072
    cfg.num_anchors = 512
    # > 0: each batch is cropped to its longest row rounded up to a multiple of this (at most
    # seq_len) and its anchor slots to its rows' most valid anchors rounded up to a power of two
    # (at most num_anchors): only padding is cut, the loss is the same (data.py). Each shape
    # compiles the step once. 0: every batch padded to seq_len x num_anchors.
    cfg.bucket_tokens = 256
    # G > 0: batch records of similar length together (within each window of G batches of the
    # shuffled records, sorted by length), so that the crop above cuts more (data.py). 0: rows
    # drawn at random.
    cfg.group_batches = 0
    cfg.loss_gamma = 0.0  # 0: the published value (DFlash: 7 for block 16; DSpark: 4.0)
    cfg.ce_chunk_rows = 2048
    # 0: CE over the full vocabulary (the paper). M > 0: a sampled softmax over the batch's
    # distinct labels plus M uniform negatives with log(V/M) correction (loss.sampled_vocabulary),
    # ~V/(rows+M) times cheaper lm_head work; the logged accuracy is then over those candidates.
    cfg.vocab_negatives = 0
    # Distillation (training/loss.py): K > 0 takes the target's top-K at each label's position
    # (online taps: the tap pass runs the whole target, then its head) as soft labels with
    # weight distill_weight, and adds those K ids to each row's softmax as exact negatives.
    cfg.distill_top_k = 0
    cfg.distill_weight = 0.5
    # Taps: "online" (a frozen target forward inside every step) or "cached" (computed once into
    # <workdir>/tap_cache, then read; pays from the second epoch, see tap_cache.py).
    cfg.taps = "online"
    cfg.tap_cache_dtype = "bfloat16"  # or "float32"
    # Where the cache lives: "" = <workdir>/tap_cache. Runs over the same data and taps may share
    # one (the cache is fingerprinted: a mismatch is rebuilt, never read). A URL is built and
    # read in a local copy and copied there when complete (tap_cache.py).
    cfg.tap_cache_dir = ""
    # Start the drafter's final norm at the target's final-norm scale (both feed the same frozen
    # lm_head). Off by default: in a SmolLM2 CPU run with it (and lr 1.5e-3) the loss was still
    # 7.4 at step 100, where the same run without it (lr 1e-3) reached 7.1 at step 50.
    cfg.init_norm_from_target = False
    # Start the drafter from the target's top layers, with fc/hidden_norm set so that the context
    # K/V begin as the target's own (training/init.py).
    cfg.init_from_target = False
    # Warm start: params only from an exported drafter directory (e.g. a previous run's
    # <workdir>/drafter or the shipped default) when the workdir has no checkpoint yet. A DFlash
    # drafter may start a DFlash2 run (its convolutions and selector start fresh).
    cfg.init_from = ""
    # With init_from: let that drafter have fewer layers than this run; its layers come first
    # and the added ones start as identity (zero residual outputs), so step 0 is that drafter.
    cfg.init_grow_layers = False
    # Warm start with Adam's state: params and optimizer moments from the newest checkpoint of
    # another run's workdir (when this workdir has no checkpoint yet), e.g. to go on training
    # on new data. This run's schedule starts at its own step 0 (warm-up included: set
    # warmup_fraction 0 to go on at full rate, as a wsd run's stable phase does).
    cfg.init_from_checkpoint = ""
    # A step with a non-finite loss or gradient: "stop" the run naming the step (its checkpoints
    # stay intact) or "skip" it (params unchanged) and count it in the metrics.
    cfg.nonfinite = "stop"
    cfg.batch_size = 8  # the global batch: rows per optimizer step
    # k > 1: each step's batch in k micro-batches of batch_size / k rows, one after another,
    # gradients averaged (step.py): a batch's activations at a k-th of the memory.
    cfg.grad_accum_steps = 1
    # Recompute each drafter layer's activations in the backward instead of keeping them
    # (nn.remat): the same loss and gradients, less memory, ~one more drafter forward per step.
    cfg.remat = False
    cfg.num_epochs = 6
    cfg.num_steps = 0  # 0: num_epochs over the training records
    cfg.learning_rate = 6e-4
    cfg.warmup_fraction = 0.04
    # "cosine" (warm-up, cosine to 0) or "wsd" (warm-up, stable, linear decay over the last
    # decay_fraction of the steps; see step.OptimizerConfig.schedule).
    cfg.lr_schedule = "cosine"
    cfg.decay_fraction = 0.2
    cfg.adam_b1 = 0.9
    cfg.adam_b2 = 0.999
    cfg.adam_eps = 1e-8
    cfg.weight_decay = 0.0
    cfg.grad_clip = 1.0
    cfg.seed = 0
    cfg.data_threads = 4
    cfg.num_eval_prompts = 8  # records held out of training
    cfg.eval_prompts = "held_out"  # or "dev": the shipped dev set (24 mixed prompts)
    cfg.eval_block_size = 0  # 0: the trained block size
    cfg.eval_every = 1000
    cfg.eval_max_new_tokens = 256
    # At every evaluation also the held-out metric (training/evaluation.py): full-vocabulary
    # per-position accuracy, implied and teacher-forced tau on the held-out records.
    cfg.heldout_metrics = True
    cfg.log_every = 50
    cfg.checkpoint_every = 1000  # keep a multiple of log_every (throughput excludes saving)
    # The drafter export (<workdir>/drafter, gathered from every device) at the end and every
    # export_every steps (0: at the end only); a SIGTERM/SIGINT stop writes a checkpoint only.
    cfg.export_every = 0
    # The MFU estimate's peak, TFLOP/s per chip (0: the device's dense bf16 peak from
    # monitor.PEAK_TFLOPS; none on CPU, so no MFU there unless set).
    cfg.peak_tflops = 0.0
    # "a,b": a jax.profiler trace of steps a..b into <workdir>/profile ("": none).
    cfg.profile_steps = ""
    cfg.max_checkpoints = 3
    # Attention: "xla" (the reference), "pallas" (kernels; interpret mode on CPU) or "auto"
    # (pallas on GPU/TPU, xla on CPU); see ops/dispatch.py.
    cfg.attention_impl = "auto"
    # Device mesh, e.g. "fsdp=4,tensor=2" or "data=8" (sharding.parse_mesh): drafter params and
    # Adam state over fsdp x tensor, the frozen target over tensor (and fsdp), the batch over
    # data x fsdp. "": one device, or with several processes data parallel over all devices.
    cfg.mesh = ""
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
        conv_kernel_size=d.get("conv_kernel_size", 0),
        conv_group_size=d.get("conv_group_size", 0),
        selector_rank=d.get("selector_rank", 0),
        selector_top_k=d.get("selector_top_k", 0),
        markov_rank=d.get("markov_rank", 0),
        markov_head_type=d.get("markov_head_type", "vanilla"),
        enable_confidence_head=d.get("enable_confidence_head", False),
        confidence_head_with_markov=d.get("confidence_head_with_markov", False),
        sample_from_anchor=d.get("sample_from_anchor", False),
        dtype=cfg.compute_dtype,
        attention_impl=cfg.attention_impl,
    )
    check_fits(config, target)
    return config


class MetricsLog:
    """Appends one JSON object per log line to `<workdir>/metrics.jsonl`. On resume, lines past
    the restored step (logged by the killed run after its last checkpoint) are dropped first.
    Object stores cannot append: under a URL every write rewrites the (small) file."""

    def __init__(self, path: epath.Path, resume_step: int, board=None):
        self.path = path
        self.board = board  # a monitor.TensorBoard that gets every record too
        self.enabled = jax.process_index() == 0  # one process writes the run's files
        self.lines: list[str] = []
        if self.enabled and path.exists():
            self.lines = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in self.lines))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.board is not None:
            self.board.write(record)
        line = json.dumps(record)
        if paths.is_url(self.path):
            self.lines.append(line)
            self.path.write_text("".join(x + "\n" for x in self.lines))
        else:
            with self.path.open("a") as f:
                f.write(line + "\n")


def summarize(
    window: list[dict], step: int, seconds: float, timed_steps: int, blocks_per_step: int, lr: float
) -> dict:
    """Host-side summary of the steps since the last log line; throughput over the `timed_steps`
    that `seconds` covers (None when there are none, e.g. only the compiling step). Steps whose
    update was skipped (non-finite) are counted, not averaged."""
    host = jax.device_get(window)
    good = [m for m in host if m["finite"]] or host
    correct = np.sum([m["correct"] for m in good], axis=0)
    count = np.sum([m["count"] for m in good], axis=0)
    acc_k = correct / np.maximum(count, 1.0)
    return {
        "step": step,
        "blocks": step * blocks_per_step,
        "loss": float(np.mean([m["loss"] for m in good])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in good])),
        "accuracy": [round(float(a), 5) for a in acc_k],
        "tau_implied": implied_acceptance(acc_k),
        "learning_rate": lr,
        "skipped_steps": int(sum(not m["finite"] for m in host)),
        "blocks_per_s": timed_steps * blocks_per_step / seconds if timed_steps else None,
        "step_time_s": seconds / timed_steps if timed_steps else None,
        # DFlash2's selector term (training/selector_loss.py) and distillation's two terms
        # (training/loss.py), when they are on
        **{
            k: float(np.mean([m[k] for m in good]))
            for k in (*SELECTOR_METRICS, *DISTILL_METRICS, *DSPARK_METRICS)
            if k in good[0]
        },
    }


def check_config(cfg: ml_collections.ConfigDict) -> None:
    """Refuses settings the trainer cannot honour, before anything is loaded."""
    if cfg.taps not in ("online", "cached"):
        raise ValueError(f"config.taps must be 'online' or 'cached', got {cfg.taps!r}")
    if cfg.tap_cache_dtype not in tap_cache.DTYPES:
        raise ValueError(
            f"config.tap_cache_dtype must be one of {sorted(tap_cache.DTYPES)}, "
            f"got {cfg.tap_cache_dtype!r}"
        )
    if cfg.distill_top_k < 0:
        raise ValueError(f"config.distill_top_k must be >= 0, got {cfg.distill_top_k}")
    if cfg.distill_top_k and cfg.taps != "online":
        raise ValueError(
            "config.distill_top_k needs config.taps='online' (the teacher's top-k comes from the "
            "target's forward inside each step; the tap cache holds no logits)"
        )
    d = cfg.drafter
    dspark = (
        d.get("markov_rank", 0) or d.get("enable_confidence_head") or d.get("sample_from_anchor")
    )
    if dspark and cfg.taps != "online":
        raise ValueError(
            "a DSpark drafter needs config.taps='online' (its KL loss reads the target's logits, "
            "which the whole target computes inside each step; the tap cache holds no logits)"
        )
    if dspark and (cfg.distill_top_k or cfg.vocab_negatives):
        raise ValueError(
            "a DSpark drafter's loss is a full-vocabulary KL to the target's logits: set "
            "config.distill_top_k=0 and config.vocab_negatives=0"
        )
    if not 0.0 <= cfg.distill_weight <= 1.0:
        raise ValueError(f"config.distill_weight must be in [0, 1], got {cfg.distill_weight}")
    if cfg.vocab_negatives < 0:
        raise ValueError(f"config.vocab_negatives must be >= 0, got {cfg.vocab_negatives}")
    if cfg.nonfinite not in NONFINITE_MODES:
        raise ValueError(
            f"config.nonfinite must be one of {NONFINITE_MODES}, got {cfg.nonfinite!r}"
        )
    if cfg.eval_prompts not in EVAL_SOURCES:
        raise ValueError(
            f"config.eval_prompts must be one of {EVAL_SOURCES}, got {cfg.eval_prompts!r}"
        )
    starts = [k for k in ("init_from", "init_from_target", "init_from_checkpoint") if cfg.get(k)]
    if len(starts) > 1:
        raise ValueError(f"config.{' and config.'.join(starts)} exclude each other")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(
            f"config.lr_schedule must be one of {LR_SCHEDULES}, got {cfg.lr_schedule!r}"
        )
    if not 0.0 <= cfg.decay_fraction <= 1.0:
        raise ValueError(f"config.decay_fraction must be in [0, 1], got {cfg.decay_fraction}")
    if cfg.get("init_from_checkpoint"):
        ckpt = paths.path(cfg.init_from_checkpoint) / checkpoint.CHECKPOINT_DIR
        if not ckpt.is_dir():
            raise ValueError(
                f"config.init_from_checkpoint={cfg.init_from_checkpoint!r}: no {ckpt.name}/ "
                "there (give a training run's workdir)"
            )
    if cfg.init_grow_layers and not cfg.init_from:
        raise ValueError("config.init_grow_layers needs config.init_from (the drafter to grow)")
    if cfg.init_from and not paths.path(cfg.init_from).is_dir():
        raise ValueError(f"config.init_from={cfg.init_from!r}: no such drafter directory")
    if cfg.get("mesh"):
        sharding.parse_mesh(cfg.mesh)
    accum = cfg.get("grad_accum_steps", 1)
    if accum < 1 or cfg.batch_size % accum:
        raise ValueError(
            f"config.grad_accum_steps={accum} must be >= 1 and divide config.batch_size="
            f"{cfg.batch_size}"
        )
    for key in ("bucket_tokens", "group_batches"):
        if cfg.get(key, 0) < 0:
            raise ValueError(f"config.{key} must be >= 0 (0: off), got {cfg[key]}")
    monitor.parse_profile_steps(cfg.get("profile_steps", ""))
    if cfg.taps == "cached" and jax.process_count() > 1:
        raise ValueError(
            "config.taps='cached' runs on one process (the cache is one local file); use "
            f"taps='online' with {jax.process_count()} processes"
        )


def training_mesh(cfg: ml_collections.ConfigDict):
    """The run's mesh: config.mesh; without one, None on one process (no sharding at all), or
    data parallel over every device when several processes run. Refuses a batch that the
    mesh's batch axes do not split (every device would then compute the whole batch)."""
    if cfg.get("mesh"):
        mesh = sharding.mesh_from_spec(cfg.mesh)
    elif jax.process_count() > 1:
        logging.info("config.mesh is empty: data parallel over %d devices", jax.device_count())
        mesh = sharding.make_mesh()
    else:
        return None
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % ways:
        raise ValueError(
            f"config.batch_size={cfg.batch_size} does not split over data x fsdp = {ways} "
            f"devices of mesh {dict(mesh.shape)}; use a multiple of {ways}"
        )
    accum = cfg.get("grad_accum_steps", 1)
    if (cfg.batch_size // accum) % ways:
        raise ValueError(
            f"config.batch_size={cfg.batch_size} / config.grad_accum_steps={accum} rows per "
            f"micro-batch do not split over data x fsdp = {ways} devices of mesh "
            f"{dict(mesh.shape)}; use fewer accumulation steps or a larger batch"
        )
    return mesh


def initial_state(cfg, drafter_config: DrafterConfig, target, optimizer, mesh) -> dict:
    """A fresh run's train state {"step", "params", "opt_state"}, on `mesh` when given (params
    placed first, so Adam's moments are created sharded)."""
    params = initial_params(cfg, drafter_config, target)
    if mesh is not None:
        params = sharding.put(params, sharding.param_shardings(params, mesh))
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optimizer.build().init(params),
    }
    return state if mesh is None else sharding.put(state, sharding.state_shardings(state, mesh))


def loss_gamma_for(cfg, drafter_config: DrafterConfig) -> float:
    """The loss decay of run `cfg`: its `loss_gamma`, else the published one for its drafter
    (DSpark: speculators' default `dspark_loss.DSPARK_GAMMA`; DFlash: the paper's per block
    size, `loss.default_gamma`)."""
    if cfg.loss_gamma:
        return float(cfg.loss_gamma)
    if drafter_config.is_dspark:
        return dspark_loss.DSPARK_GAMMA
    return float(default_gamma(cfg.block_size))


def step_settings(cfg, target_config, drafter_config, optimizer) -> dict:
    """The keyword arguments of `train_step` for training config `cfg` (loss decay, CE chunks,
    vocabulary negatives, distillation, DFlash2's selector term): what `train` runs and
    `infer.aot.train_program` lowers."""
    settings = {
        "target_config": target_config,
        "drafter_config": drafter_config,
        "optimizer": optimizer,
        "loss_gamma": loss_gamma_for(cfg, drafter_config),
        "ce_chunk_rows": cfg.ce_chunk_rows,
        "vocab_negatives": cfg.vocab_negatives,
    }
    if cfg.distill_top_k:
        settings["distill_top_k"] = int(cfg.distill_top_k)
        settings["distill_weight"] = float(cfg.distill_weight)
    if drafter_config.is_dflash2:
        settings["selector_loss_weight"] = float(cfg.selector_loss_weight)
    if drafter_config.is_dspark:
        settings["confidence_loss_weight"] = float(cfg.get("confidence_loss_weight", 1.0))
    if cfg.get("grad_accum_steps", 1) > 1:
        settings["grad_accum_steps"] = int(cfg.grad_accum_steps)
    if cfg.get("remat", False):
        settings["remat"] = True
    return settings


def _process_shard(mesh, batch_size: int) -> dict:
    """batched_dataset's shard_index/shard_count: the rows of each global batch that this
    process's devices hold (all of them without a mesh)."""
    if mesh is None:
        return {}
    index, count = sharding.process_rows(mesh, batch_size)
    return {"shard_index": index, "shard_count": count}


def _stepper(mesh, batch_size: int, settings: dict):
    """-> step(state, target_params, host batch) -> (state, metrics): `train_step`, or on a
    mesh its sharded twin fed with this process's rows as global arrays."""
    if mesh is None:
        return lambda state, target_params, batch: train_step(
            state, target_params, batch, **settings
        )
    compiled = []

    def step(state, target_params, batch):
        batch = sharding.put_batch(batch, mesh, batch_size)
        if not compiled:
            compiled.append(train_step_on_mesh(mesh, state, target_params, batch, **settings))
        return compiled[0](state, target_params, batch)

    return step


def _tap_cache(cfg, workdir: epath.Path, source, target, drafter_config) -> tap_cache.TapCache:
    return tap_cache.build_tap_cache(
        paths.path(cfg.tap_cache_dir) if cfg.tap_cache_dir else workdir / "tap_cache",
        source,
        target,
        drafter_config.target_layer_ids,
        cfg.seq_len,
        dtype=cfg.tap_cache_dtype,
    )


def build_taps(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike) -> tap_cache.TapCache:
    """Builds (or finishes, or grows) the run's tap cache for the data as it is now, without
    training: e.g. while data generation is still adding shards, so that the run itself only
    computes the taps of the shards written since (`tap_cache` copies the rest)."""
    check_config(cfg)
    if cfg.taps != "cached":
        raise ValueError("building the tap cache needs config.taps='cached'")
    workdir = paths.path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target, dtype=cfg.compute_dtype)
    drafter_config = drafter_config_for(cfg, target.config)
    source = data.record_source(data.expand_paths(cfg.data))
    return _tap_cache(cfg, workdir, source, target, drafter_config)


def train(
    cfg: ml_collections.ConfigDict, workdir: str | os.PathLike, start_over: bool = False
) -> dict:
    """Trains (or resumes) the run in `workdir` (a local directory or a URL such as
    `gs://bucket/run`); -> the last logged metrics. A rerun whose drafter or data differs from
    the checkpoints' is refused before anything is touched (`checkpoint.check_run_config`); so
    is a workdir whose checkpoints were all set aside as unreadable, unless `start_over`
    (then it trains from step 0 there)."""
    check_config(cfg)
    workdir = paths.path(workdir)
    shards = data.expand_paths(cfg.data)  # missing data is named before anything loads
    thinking = data.data_thinking(shards)  # data made in two modes is refused here too
    checkpoint.check_resumable(workdir, start_over)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = training_mesh(cfg)
    # The frozen target is placed shard by shard on the mesh (its taps are computed online).
    on_mesh = {} if mesh is None else {"mesh": mesh}
    target = load_target(cfg.target, dtype=cfg.compute_dtype, **on_mesh)
    target = dataclasses.replace(
        target, config=dataclasses.replace(target.config, attention_impl=cfg.attention_impl)
    )
    drafter_config = drafter_config_for(cfg, target.config)
    signature = checkpoint.run_signature(cfg, drafter_config)
    checkpoint.check_run_config(workdir, signature, cfg)
    if cfg.init_from_target:  # refused before a tap cache is built, not after
        check_init_from_target(target.config)

    source = data.record_source(shards)
    train_records, held_out = data.split_holdout(source, cfg.num_eval_prompts, cfg.seed)
    epoch_steps = len(train_records) // cfg.batch_size
    num_steps = cfg.num_steps or cfg.num_epochs * epoch_steps
    num_epochs = math.ceil(num_steps * cfg.batch_size / len(train_records))
    cache = (
        _tap_cache(cfg, workdir, source, target, drafter_config) if cfg.taps == "cached" else None
    )
    dataset = data.batched_dataset(
        train_records,
        seq_len=cfg.seq_len,
        num_anchors=cfg.num_anchors,
        batch_size=cfg.batch_size,
        num_epochs=num_epochs,
        seed=cfg.seed,
        tap_cache=cache,
        bucket_tokens=cfg.get("bucket_tokens", 0),
        group_batches=cfg.get("group_batches", 0),
        **_process_shard(mesh, cfg.batch_size),
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
    manager = checkpoint.checkpoint_manager(workdir, cfg.max_checkpoints)
    abstract = checkpoint.abstract_state(drafter_config, optimizer, mesh)
    restored = checkpoint.restore_latest(manager, abstract, data_iter)
    if restored is not None:
        state = restored
        logging.info("resumed from step %d in %s", int(state["step"]), workdir)
    elif cfg.get("init_from_checkpoint"):
        state = checkpoint.warm_state(cfg.init_from_checkpoint, abstract)
        logging.info(
            "warm start from %s: params and Adam's moments of its step %d; this run's schedule "
            "starts at 0",
            cfg.init_from_checkpoint,
            int(state.pop("source_step")),
        )
    else:
        state = initial_state(cfg, drafter_config, target, optimizer, mesh)
    checkpoint.save_run_config(workdir, signature, cfg)
    start = int(state["step"])
    board = monitor.TensorBoard(workdir, start)
    metrics_log = MetricsLog(workdir / METRICS_FILE, start, board)
    flops_at = functools.partial(  # a step's FLOPs at batch shape (seq_len, anchors)
        monitor.step_flops, target.config, drafter_config, cfg.batch_size,
        whole_target=bool(cfg.distill_top_k) or drafter_config.is_dspark,
        cached_taps=cfg.taps == "cached",
    )  # fmt: skip
    throughput = monitor.Throughput(
        flops_at(cfg.seq_len, cfg.num_anchors), cfg.batch_size, cfg.seq_len,
        cfg.get("peak_tflops", 0), lambda *shape: flops_at(*shape)["total"],
    )  # fmt: skip
    profiler = monitor.Profiler(workdir, cfg.get("profile_steps", ""))
    settings = step_settings(cfg, target.config, drafter_config, optimizer)
    run_step = _stepper(mesh, cfg.batch_size, settings)
    prompts = eval_prompts(cfg.eval_prompts, target, held_out) if cfg.eval_every else []
    heldout = None
    if cfg.eval_every and cfg.heldout_metrics and held_out:
        heldout = heldout_batch(held_out, cfg.seq_len, cfg.num_anchors)
    blocks_per_step = cfg.batch_size * cfg.num_anchors

    last: dict = {}
    window: list[dict] = []
    timed_steps, t0 = 0, time.perf_counter()
    bar = tqdm.tqdm(
        total=num_steps,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=jax.process_index() != 0,
    )
    stop_request = preemption.StopRequest()
    stopped_at = None
    unchecked: list[tuple[int, dict]] = []  # (step, metrics) the host has not looked at yet
    shapes: set[tuple[int, int]] = set()  # the batch shapes (buckets) seen: one compile each
    with stop_request:
        for step in range(start + 1, num_steps + 1):
            profiler.before(step)
            batch = next(data_iter)
            shape = (batch["tokens"].shape[1], batch["anchors"].shape[1])  # its bucket
            compiles = shape not in shapes
            if compiles:
                shapes.add(shape)
                logging.info("step %d: batch shape %s (tokens, anchors) compiles the step", step,
                             shape)  # fmt: skip
            state, metrics = run_step(state, target.params, batch)
            profiler.after(step, metrics)
            window.append(metrics)
            unchecked.append((step, metrics))
            bar.update(1)
            final = step == num_steps
            stopping = stop_request.stop(step)  # SIGTERM/SIGINT, or the hosts' preemption sync
            # The host reads the steps' figures only where it must (a log line, a checkpoint,
            # an evaluation, an export, the end), so that it never waits on every step.
            if (
                final
                or stopping
                or step % cfg.log_every == 0
                or step % cfg.checkpoint_every == 0
                or (prompts and step % cfg.eval_every == 0)
                or (cfg.export_every and step % cfg.export_every == 0)
            ):
                _check_finite(unchecked, cfg.nonfinite, manager, bar)
                unchecked = []
            if compiles:
                # The first step, and the first of each new batch shape, compile: keep them out
                # of the throughput (the host waits for these steps only).
                jax.block_until_ready(metrics)
                timed_steps, t0 = -1, time.perf_counter()
                throughput.reset()
            else:
                throughput.add(*shape)
            timed_steps += 1
            if step % cfg.log_every == 0 or final or stopping:
                jax.block_until_ready(metrics)
                seconds = time.perf_counter() - t0
                last = summarize(
                    window, step, seconds, timed_steps, blocks_per_step, float(schedule(step - 1))
                )
                last.update(throughput.figures(timed_steps, seconds))
                metrics_log.write(last)
                logging.info("step %d: %s", step, last)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau_implied']:.2f}")
                window = []
            # The checkpoint first: an evaluation that fails loses no training.
            if step % cfg.checkpoint_every == 0 or final or stopping:
                checkpoint.save_checkpoint(manager, step, state, data_iter)
            if final or (cfg.export_every and step % cfg.export_every == 0):
                checkpoint.export_drafter(
                    workdir, drafter_config, state["params"], thinking and {"thinking": thinking}
                )
            if stopping:
                stopped_at = step
                break
            if prompts and (step % cfg.eval_every == 0 or final):
                record = {"step": step, "blocks": step * blocks_per_step}
                record.update(
                    _evaluate(cfg, target, drafter_config, state["params"], prompts, heldout, mesh)
                )
                metrics_log.write(record)
            if not window:
                # Throughput covers train steps only, not evaluation or checkpointing.
                timed_steps, t0 = 0, time.perf_counter()
                throughput.reset()
    bar.close()
    board.close()
    manager.wait_until_finished()
    if stopped_at is not None:
        logging.warning(
            "stopped by %s after step %d of %d: checkpoint saved in %s; rerun the same command "
            "to resume from step %d",
            stop_request.signal_name,
            stopped_at,
            num_steps,
            workdir / checkpoint.CHECKPOINT_DIR,
            stopped_at,
        )
        last = {**last, "stopped_at": stopped_at, "stopped_by": stop_request.signal_name}
    return last


def _check_finite(steps: list[tuple[int, dict]], mode: str, manager, bar) -> None:
    """Looks at the `finite` flag of each (step, metrics): a non-finite step stops the run
    naming it (`mode` "stop"; the checkpoints so far are complete and intact) or is warned
    about (skipped: the step left params and Adam's state as they were)."""
    for step, metrics in steps:
        if bool(metrics["finite"]):
            continue
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if mode == "stop":
            bar.close()
            manager.wait_until_finished()
            raise NonFiniteError(
                f"step {step}: non-finite loss {loss} or gradient norm {norm}; the run "
                f"stops without saving (checkpoints up to step "
                f"{manager.latest_step() or 0} are intact). Set config.nonfinite='skip' "
                "to skip such steps, or lower the learning rate, then rerun to resume."
            )
        logging.warning("step %d: non-finite loss %s / grad norm %s, skipped", step, loss, norm)


def _evaluate(cfg, target, drafter_config, params, prompts, heldout, mesh) -> dict:
    """One evaluation on the run's mesh: tau of greedy speculative decoding on the evaluation
    prompts and, when `heldout` is a batch, the held-out metric (evaluation.py)."""
    tau = evaluate_acceptance(
        target,
        drafter_config,
        params,
        prompts,
        cfg.eval_max_new_tokens,
        cfg.eval_block_size or None,
        mesh,
    )
    record = {"tau_eval": tau}
    if heldout is not None:
        loss_gamma = loss_gamma_for(cfg, drafter_config)
        record.update(
            heldout_metrics(
                target, drafter_config, params, heldout, loss_gamma, cfg.ce_chunk_rows, mesh
            )
        )
    logging.info(
        "speculative decoding tau on %s prompts %.3f; held-out records: %s",
        cfg.eval_prompts,
        tau,
        {k: v for k, v in record.items() if k.startswith("heldout_tau")},
    )
    return record
