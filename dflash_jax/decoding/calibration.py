"""Step costs for the adaptive controller (`decoding.adaptive`): each step kind's cost in AR
steps, measured on this machine for a target, drafter, batch and shape by short runs of the
decode's own executables, and cached on disk. Every kind of `DecodeConfig.all_kinds` is timed
alike, a tree kind (`tree_nodes` in adaptive mode) included: forced at every step it runs the
loop's tree branch (build, verify of its N nodes under the tree mask, the path's commit), so
its cost is what a tree step costs in that loop; its N is part of the kinds, hence of the
cache key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import numpy as np

from dflash_jax.decoding import programs
from dflash_jax.decoding.plan import Plan
from dflash_jax.decoding.runner import plan_run, timed_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.files import cache_root, read_json_table, write_json_atomic
from dflash_jax.ops.invariance import machine_name, software_name

# Loop steps each kind runs while calibrating: enough to average a step's noise on a CPU, few
# enough that all kinds together take seconds.
CALIBRATION_STEPS = 16
# Part of the cache key: 2 since every product accumulates in fp32 (`ops.dots`), which changed
# what a bf16 step costs.
COSTS_VERSION = 2
# The widest prompt buffer a calibration runs at: a longer prompt is calibrated on its first
# this many tokens (the costs are ratios to an AR step at the same context, and the loops'
# prefills would otherwise dominate: a 5k-token prompt took many minutes before its first
# token), so every long prompt shares one measurement per machine and setting.
CALIBRATION_MAX_PROMPT = 256


def _cache_file() -> Path:
    return cache_root() / "step_costs.json"


def calibration_key(
    target, drafter, prompt_shape, cfg: DecodeConfig, plan: Plan | None = None
) -> str:
    """What a step's cost depends on: both models, batch and buffer shapes, the kinds, the
    sampling arithmetic, the row rule the run keeps to (batch-invariant or not: `plan`'s, the
    decode's resolved plan; None: resolved here), the device (a CPU's GEMM features included)
    and how the products are computed (`COSTS_VERSION`)."""
    device = jax.devices()[0]
    if plan is None:
        run_config = programs.run_target_config(target.config, cfg)
    else:
        run_config = plan.target_config
    parts = [
        f"costs{COSTS_VERSION}",
        repr(run_config.invariant_rows),
        machine_name(),
        repr(target.config),
        repr(drafter.config),
        str(getattr(drafter, "source", "")),
        str(tuple(prompt_shape)),
        str(cfg.max_new_tokens),
        str(cfg.all_kinds),
        str(cfg.lookup_ngram),
        str(cfg.greedy),
        device.platform,
        device.device_kind,
        software_name(),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def calibrate_step_costs(
    target,
    drafter,
    prompt,
    prompt_lengths,
    cfg: DecodeConfig,
    *,
    use_cache: bool = True,
    repeats: int = 2,
    steps: int = CALIBRATION_STEPS,
    traced_budget: bool = False,
    plan: Plan | None = None,
) -> np.ndarray:
    """Measures each step kind's cost in AR steps on `prompt`, and caches the result under
    $DFLASH_JAX_CACHE or ~/.cache/dflash_jax.

    Every kind runs `steps` loop steps with the kind forced at each step, through the very
    executables the decode itself runs (the forced kind and the step limit are inputs: nothing
    compiles beyond them), timed from the loop state the prefill left (the prefill is not a
    step); the AR loop likewise. The first run of each executable warms it up and is not
    counted. A row that stops early ends its run early: the cost is per step taken.
    -> costs [num_kinds] float32 (each loop's fastest of `repeats` rounds). A prompt buffer
    wider than `CALIBRATION_MAX_PROMPT` is calibrated on its first that many tokens.
    traced_budget: the start half takes the token budget as an input (`cfg.max_new_tokens`),
    as a decode given one does (`timed_decode(max_new=...)`, `api.generate`), so that the
    calibration runs that decode's own programs. plan: the decode's (`runner.plan_run`), when
    the caller resolved it already; the target-alone runs take its `Plan.target_alone`."""
    if np.shape(prompt)[1] > CALIBRATION_MAX_PROMPT:
        prompt = np.asarray(prompt)[:, :CALIBRATION_MAX_PROMPT]
        prompt_lengths = np.minimum(np.asarray(prompt_lengths), CALIBRATION_MAX_PROMPT)
    if plan is None:
        plan = plan_run(target, drafter, cfg)
    alone = plan.target_alone()
    key = calibration_key(target, drafter, np.shape(prompt), cfg, plan)
    path = _cache_file()
    table = read_json_table(path) if use_cache else {}
    if key in table and len(table[key]) == len(cfg.all_kinds):
        return np.asarray(table[key], np.float32)

    def per_step(drafter_or_none, **kw) -> float:
        budget = cfg.max_new_tokens if traced_budget else None
        run = timed_decode(
            target, drafter_or_none, prompt, prompt_lengths, 0, cfg, step_limit=steps,
            max_new=budget, plan=plan if drafter_or_none is not None else alone, **kw,
        )  # fmt: skip
        taken = max(int(np.max(np.asarray(run.output.num_steps))), 1)
        return max(run.run_s - run.start_s, 1e-9) / taken

    # (drafter, forced kind) per timed loop: the target alone, then every kind.
    loops = [(None, {})] + [(drafter, {"forced_kind": i}) for i in range(len(cfg.all_kinds))]
    per_step(None)  # warm-up runs, one per executable (the forced kind is an input)
    per_step(drafter, forced_kind=0)
    # Rounds over all loops, the fastest of each kept: a passing slowdown of the machine
    # hits one round of every loop alike, not all rounds of one.
    best = np.full(len(loops), np.inf)
    for _ in range(repeats):
        best = np.minimum(best, [per_step(d, **kw) for d, kw in loops])
    costs = (best[1:] / best[0]).astype(np.float32)
    if 1 in cfg.step_kinds:
        plain = cfg.step_kinds.index(1)
        costs[plain] = max(costs[plain], 1.0)  # a plain step is never cheaper than AR
    if use_cache:
        table[key] = [round(float(c), 4) for c in costs]
        write_json_atomic(path, table)
    return costs
