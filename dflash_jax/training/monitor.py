"""Watching a training run: TensorBoard events, throughput, an MFU estimate, profiler traces.

* `TensorBoard`: every metrics.jsonl record's numbers also as TensorBoard scalars in
  `<workdir>/tensorboard` (tensorboardX: no TensorFlow), process 0 only. On resume, events
  past the restored step (written by the stopped run after its last checkpoint) are purged.
* `step_flops`: the model FLOPs of one training step, counted from the configs (matmuls at 2
  FLOPs per multiply-add, backward twice the forward, the causal attention's used half):
  the frozen target's forward for the taps over every row's S positions (up to the last
  tapped layer; all of it when distillation or DSpark need its logits), the drafter's
  forward and backward (its fc and context K/V over the S positions, its layers over the
  N x block queries, their attention to the context before each anchor, S/2 on average, and
  to the block), and the frozen lm_head's forward and input gradient over the queries.
  Dense MLPs (a MoE target is counted with its active experts); the sampled softmax
  (`vocab_negatives`) is counted as the full vocabulary. Padding counts: the trainer
  counts each step at its batch's shape (`seq_len` x anchors after the bucket crop, data.py).
* `peak_flops`: the accelerator's dense bf16 peak per chip, from its device kind (a table of
  vendor figures); None where unknown (CPU): then `config.peak_tflops` names it, else no MFU.
  MFU = step_flops / step time / (peak x devices).
* `Profiler`: `config.profile_steps="a,b"` traces steps a..b with `jax.profiler` into
  `<workdir>/profile` (open it with TensorBoard's profile plugin or Perfetto).
"""

from __future__ import annotations

import math
import os

import jax
from absl import logging

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.io import paths

TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"

# Dense bf16 peak TFLOP/s per chip (vendor figures), by a prefix of jax's device_kind.
PEAK_TFLOPS = (
    ("TPU v6 lite", 918.0),  # v6e
    ("TPU v5 lite", 197.0),  # v5e
    ("TPU v5p", 459.0),
    ("TPU v5", 459.0),  # v5p reports "TPU v5"
    ("TPU v4", 275.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H100", 989.0),  # SXM; PCIe is lower (756)
    ("NVIDIA GH200", 989.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA A100", 312.0),
)


def peak_flops(device=None) -> tuple[float, str] | None:
    """(dense bf16 peak FLOP/s of one chip, its device kind) for `device` (default: the first),
    or None when the table does not know it (CPUs)."""
    kind = (device or jax.devices()[0]).device_kind
    for prefix, tflops in PEAK_TFLOPS:
        if kind.startswith(prefix):
            return tflops * 1e12, kind
    return None


def _layer_matmul_params(d: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> int:
    return d * heads * head_dim * 2 + 2 * d * kv_heads * head_dim + 3 * d * ffn


def _target_ffn(t: TargetConfig) -> int:
    if t.num_experts:
        ffn = t.num_experts_per_tok * t.moe_intermediate_size
        return ffn + t.shared_expert_intermediate_size
    return t.intermediate_size


def step_flops(
    target: TargetConfig,
    drafter: DrafterConfig,
    batch_size: int,
    seq_len: int,
    num_anchors: int,
    whole_target: bool = False,
    cached_taps: bool = False,
) -> dict:
    """The model FLOPs of one training step (module docstring) by part -> {"target",
    "drafter", "lm_head", "total"}."""
    b, s, n, blk = batch_size, seq_len, num_anchors, drafter.block_size
    tokens, queries = b * s, b * n * blk
    layers = target.num_layers if whole_target else max(drafter.target_layer_ids) + 1
    t_layer = _layer_matmul_params(
        target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim,
        _target_ffn(target),
    )  # fmt: skip
    t_attn = 2 * 2 * b * (s * s / 2) * target.num_heads * target.head_dim
    target_flops = 0.0 if cached_taps else layers * (2 * t_layer * tokens + t_attn)
    d = drafter.hidden_size
    fc = len(drafter.target_layer_ids) * target.hidden_size * d
    context_kv = 2 * d * drafter.num_kv_heads * drafter.head_dim
    d_layer = _layer_matmul_params(
        d, drafter.num_heads, drafter.num_kv_heads, drafter.head_dim, drafter.intermediate_size
    )
    d_attn = 2 * 2 * queries * (s / 2 + blk) * drafter.num_heads * drafter.head_dim
    forward = 2 * fc * tokens + drafter.num_layers * (
        2 * context_kv * tokens + 2 * d_layer * queries + d_attn
    )
    drafter_flops = 3 * forward  # forward + backward (weights and inputs)
    head = 4 * target.vocab_size * d * queries  # forward + the input's gradient (frozen)
    total = target_flops + drafter_flops + head
    return {"target": target_flops, "drafter": drafter_flops, "lm_head": head, "total": total}


class Throughput:
    """Tokens/s and MFU of a summary window: `figures(steps, seconds)` -> {"tokens_per_s",
    "model_tflops_per_s", "mfu"} (mfu None without a peak). `flops` is a full-size step's
    (`step_flops` at `seq_len`); with `shape_flops(seq_len, anchors)` the window's steps count
    at the shapes `add` was told (bucketed batches, data.py), else at full size. Tokens are the
    batch's `rows` x its (cropped) length: padding inside a bucket counts, padding cut does
    not."""

    def __init__(
        self, flops: dict, rows: int, seq_len: int, peak_tflops: float = 0.0, shape_flops=None
    ):
        self.flops = flops
        self.rows, self.seq_len = rows, seq_len
        self.shape_flops = shape_flops
        self.window: list[tuple[int, int]] = []  # (seq_len, anchors) of the window's steps
        peak = (peak_tflops * 1e12, "config.peak_tflops") if peak_tflops else peak_flops()
        self.devices = jax.device_count()
        self.peak = None if peak is None else peak[0] * self.devices
        where = "unknown (set config.peak_tflops for an MFU)" if peak is None else (
            f"{peak[0] / 1e12:.0f} TFLOP/s per chip ({peak[1]}) x {self.devices}"
        )  # fmt: skip
        logging.info(
            "MFU estimate = model FLOPs per step %.4g (target taps %.3g, drafter fwd+bwd %.3g, "
            "lm_head %.3g; monitor.step_flops) / step time / peak %s",
            flops["total"], flops["target"], flops["drafter"], flops["lm_head"], where,
        )  # fmt: skip

    def add(self, seq_len: int, anchors: int) -> None:
        """A timed step of batch shape (seq_len, anchors)."""
        self.window.append((seq_len, anchors))

    def reset(self) -> None:
        self.window = []

    def figures(self, steps: int, seconds: float) -> dict:
        if not steps or seconds <= 0:
            return {"tokens_per_s": None, "model_tflops_per_s": None, "mfu": None}
        window = self.window if len(self.window) == steps else [(self.seq_len, 0)] * steps
        per_shape: dict = {}
        for shape in window:
            if shape not in per_shape:
                full = self.shape_flops is None or shape[1] == 0
                per_shape[shape] = self.flops["total"] if full else self.shape_flops(*shape)
        flops = sum(per_shape[shape] for shape in window)
        tokens = sum(self.rows * length for length, _ in window)
        rate = flops / seconds
        return {
            "tokens_per_s": tokens / seconds,
            "model_tflops_per_s": rate / 1e12,
            "mfu": rate / self.peak if self.peak else None,
        }


class TensorBoard:
    """Scalars of metrics records into `<workdir>/tensorboard` (process 0; tensorboardX). A
    list value (per-position accuracy) becomes one scalar per position (`accuracy/1`, ...);
    None and non-numbers are left out. Failing to write disables it with one warning."""

    def __init__(self, workdir, resume_step: int):
        self.writer = None
        if jax.process_index() != 0:
            return
        try:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(
                str(paths.path(workdir) / TENSORBOARD_DIR), purge_step=resume_step + 1
            )
        except Exception as e:  # noqa: BLE001 (a missing package or an unwritable place)
            logging.warning("TensorBoard events are off (%s: %s)", type(e).__name__, e)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = int(record["step"])
        try:
            for key, value in record.items():
                if key == "step":
                    continue
                values = value if isinstance(value, list) else [value]
                for k, v in enumerate(values, start=1):
                    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
                        continue
                    name = f"{key}/{k}" if isinstance(value, list) else key
                    self.writer.add_scalar(name, v, step)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001
            logging.warning("TensorBoard events are off (%s: %s)", type(e).__name__, e)
            self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
    """ "a,b" -> (a, b) with 1 <= a <= b; "" -> None; anything else raises ValueError."""
    if not spec.strip():
        return None
    try:
        a, b = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(
            f"config.profile_steps={spec!r}: give 'first,last' steps, e.g. '100,105'"
        ) from None
    if not 1 <= a <= b:
        raise ValueError(f"config.profile_steps={spec!r}: need 1 <= first <= last")
    return a, b


class Profiler:
    """Traces steps first..last (`parse_profile_steps`) into `<workdir>/profile`: `before(step)`
    before the step runs, `after(step, outputs)` once it ran (waits for its outputs)."""

    def __init__(self, workdir, spec: str):
        self.steps = parse_profile_steps(spec)
        self.directory = os.fspath(paths.path(workdir) / PROFILE_DIR)
        self.running = False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and not self.running:
            jax.profiler.start_trace(self.directory)
            self.running = True

    def after(self, step: int, outputs) -> None:
        if self.running and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.running = False
            logging.info("profile of steps %d..%d written to %s", *self.steps, self.directory)
