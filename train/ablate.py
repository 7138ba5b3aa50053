r"""Recipe ablations at an equal CPU budget per arm, judged by real acceptance.

  python -m train.ablate --config=configs/smollm2_135m_b16.py --workdir=workdir/ablate \
      --minutes=10 --output=results/ablation_smollm2.json

Each arm is the base config plus a few overrides (ARMS below, or --arms to pick). An arm first
times a few steps (compile excluded) in a scratch run, sets num_steps so that its training takes
--minutes, trains with that schedule (from scratch, or from --config.init_from for every arm),
then measures tau with greedy `speculative_decode` on the dev set
(dflash_jax/assets/eval/dev_mixed.jsonl) at several block sizes. With cached taps (the configs'
default) every arm shares one tap cache. Rerunning skips finished arms (their results are kept
in --output) and resumes an interrupted one.

DFlash against DSpark the same way (docs/results.md, "DSpark against DFlash at equal CPU
time"): the command below with --arms=base,dspark --minutes=10 --eval_block_sizes=16
--workdir=workdir/ablate_dspark --output=results/ablation_dspark_smollm2.json.

DFlash against DFlash2 at equal CPU time, both continuing the shipped drafter on its unseen
records with online taps (README, "DFlash2"):

  D=data/smollm2; python -m train.ablate --config=configs/smollm2_135m_b16.py \
      --workdir=workdir/ablate_dflash2 --arms=base,dflash2 --minutes=20 --eval_block_sizes=16,8 \
      --config.taps=online --config.init_from=dflash_jax/assets/drafters/smollm2-135m-instruct-b16 \
      "--config.data=$D/data-0000[89].array_record,$D/data-000[1-3]?.array_record" \
      --output=results/ablation_dflash2_smollm2.json
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from configs.smollm2_135m_b16 import get_config as smollm2_config
from configs.smollm2_135m_dflash2_b16 import get_config as smollm2_dflash2_config
from configs.smollm2_135m_dspark_b16 import get_config as smollm2_dspark_config
from dflash_jax.io.drafter_io import load_drafter
from dflash_jax.io.target_loader import load_target
from dflash_jax.training import trainer
from dflash_jax.training.evaluation import eval_prompts, evaluate_acceptance
from infer import cli

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_overrides() -> dict:
    """configs/smollm2_135m_dflash2_b16.py's additions to the DFlash recipe, as overrides."""
    cfg = smollm2_dflash2_config()
    drafter = {f"drafter.{k}": cfg.drafter[k] for k in DFLASH2_FIELDS}
    return {**drafter, "selector_loss_weight": cfg.selector_loss_weight}


def dspark_overrides() -> dict:
    """configs/smollm2_135m_dspark_b16.py's changes to the DFlash recipe (its heads, loss, lr,
    anchors, full vocabulary, online taps), as overrides."""
    base, cfg = smollm2_config(), smollm2_dspark_config()
    out = {f"drafter.{k}": v for k, v in cfg.drafter.items() if base.drafter.get(k) != v}
    skip = {"drafter", "init_from"}  # the arm's start comes from --config.init_from
    out |= {k: v for k, v in cfg.items() if k not in skip and base.get(k) != v}
    return out


# name -> config overrides (dotted keys) relative to the base config.
ARMS = {
    "base": {},
    "init_from_target": {"init_from_target": True},
    "full_ce": {"vocab_negatives": 0},
    "gamma_4": {"loss_gamma": 4.0},
    "layers_1": {"drafter.num_layers": 1},
    "layers_2": {"drafter.num_layers": 2},
    # With --config.init_from a 1-layer drafter: that drafter plus a second layer that starts as
    # identity (training/init.py, "Growing").
    "grow_2": {"drafter.num_layers": 2, "init_grow_layers": True},
    # Shorter blocks trained with a faster decay and twice the anchors (the same blocks' tokens
    # per step as block 16 at 64 anchors).
    "block_8": {"block_size": 8, "loss_gamma": 4.0, "num_anchors": 128},
    # The target's top-32 as soft labels (weight 0.5) and exact negatives (online taps only).
    "distill": {"distill_top_k": 32, "distill_weight": 0.5},
    "lr_3e-3": {"learning_rate": 3e-3},
    "lr_3e-4": {"learning_rate": 3e-4},
    # DFlash2: with --config.init_from a DFlash drafter, it starts from that drafter, its
    # convolutions and selector fresh.
    "dflash2": dflash2_overrides(),
    # DSpark: with --config.init_from a DFlash drafter, that drafter plus a fresh Markov and
    # confidence head, trained with speculators' KL loss.
    "dspark": dspark_overrides(),
}

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "The base config (configs/*.py).", lock_config=False
)
flags.DEFINE_string("workdir", None, "Directory for the arms' runs and the shared tap cache.")
flags.DEFINE_float("minutes", 10.0, "Training time per arm (compile and evaluation excluded).")
flags.DEFINE_list(
    "arms",
    list(ARMS),
    f"Arms to run, from: {', '.join(ARMS)}; join names with '+' to combine their overrides "
    "(e.g. init_from_target+layers_1).",
)
flags.DEFINE_list("eval_block_sizes", ["16", "8", "4"], "Block sizes at which tau is measured.")
flags.DEFINE_integer("eval_max_new_tokens", 128, "New tokens per dev prompt in the evaluation.")
flags.DEFINE_integer("calibration_steps", 4, "Steps timed (after the compiling one) per arm.")
flags.DEFINE_string("output", None, "JSON file with every arm's result (updated after each arm).")
flags.mark_flags_as_required(["config", "workdir", "output"])


def arm_config(base, overrides: dict, workdir: Path):
    cfg = base.copy_and_resolve_references()
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    if cfg.taps == "cached":  # one cache for every arm (--config.taps=online: none)
        cfg.tap_cache_dir = str(workdir / "tap_cache")
    cfg.eval_every = 0  # evaluated below, once, at several block sizes
    return cfg


def step_time(cfg, scratch: Path) -> float:
    """Seconds per train step of this arm, from a short scratch run (compile excluded)."""
    cfg = cfg.copy_and_resolve_references()
    cfg.num_steps = 1 + FLAGS.calibration_steps
    cfg.log_every = cfg.num_steps
    cfg.checkpoint_every = cfg.num_steps
    shutil.rmtree(scratch, ignore_errors=True)
    last = trainer.train(cfg, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    return float(last["step_time_s"])


def arm_overrides(name: str) -> dict:
    """The overrides of an arm; 'a+b' merges the overrides of arms a and b."""
    merged = {}
    for part in name.split("+"):
        merged.update(ARMS[part])
    return merged


def run_arm(name: str, base, workdir: Path) -> dict:
    cfg = arm_config(base, arm_overrides(name), workdir)
    run_dir = workdir / name
    plan = run_dir / "plan.json"
    if plan.exists():  # resuming: same schedule as planned
        seconds = json.loads(plan.read_text())["step_time_s"]
    else:
        seconds = step_time(cfg, workdir / f"{name}.calibration")
        run_dir.mkdir(parents=True, exist_ok=True)
        plan.write_text(json.dumps({"step_time_s": seconds}))
    cfg.num_steps = max(int(FLAGS.minutes * 60 / seconds), 10)
    cfg.checkpoint_every = max(cfg.num_steps // 10, 1)
    cfg.log_every = max(cfg.num_steps // 40, 1)
    t0 = time.perf_counter()
    last = trainer.train(cfg, run_dir)
    train_s = time.perf_counter() - t0
    target = load_target(cfg.target, dtype=cfg.compute_dtype)
    drafter = load_drafter(run_dir / "drafter", target)
    prompts = eval_prompts("dev", target, [])
    # A drafter drafts at most the block size it was trained at (decoding refuses more).
    taus = {
        b: evaluate_acceptance(
            target, drafter.config, drafter.params, prompts, FLAGS.eval_max_new_tokens, int(b)
        )
        if int(b) <= drafter.config.block_size
        else None
        for b in FLAGS.eval_block_sizes
    }
    return {
        "overrides": arm_overrides(name),
        "step_time_s": seconds,
        "num_steps": cfg.num_steps,
        "blocks": cfg.num_steps * cfg.batch_size * cfg.num_anchors,
        "train_wall_s": train_s,
        "final_loss": last["loss"],
        "accuracy": last["accuracy"],
        "tau_implied": last["tau_implied"],
        "tau_dev": taus,
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = [p for a in FLAGS.arms for p in a.split("+") if p not in ARMS]
    if unknown:
        raise app.UsageError(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
    workdir, output = Path(FLAGS.workdir), Path(FLAGS.output)
    results = json.loads(output.read_text()) if output.exists() else {}
    for name in FLAGS.arms:
        if name in results:
            logging.info("arm %s: done already", name)
            continue
        logging.info("arm %s: %s", name, arm_overrides(name))
        results[name] = run_arm(name, FLAGS.config, workdir)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=1))
        print(name, json.dumps(results[name]["tau_dev"]), flush=True)
    print(table(results))


def table(results: dict) -> str:
    """The README's ablation table (markdown)."""
    blocks = FLAGS.eval_block_sizes
    head = "| arm | overrides | s/step | steps | loss | acc@1 | " + " | ".join(
        f"tau dev (block {b})" for b in blocks
    )
    lines = [head + " |", "|" + "---|" * (6 + len(blocks))]
    for name, r in results.items():
        taus = " | ".join(
            "-" if r["tau_dev"].get(b) is None else f"{r['tau_dev'][b]:.2f}" for b in blocks
        )
        lines.append(
            f"| {name} | {r['overrides'] or '-'} | {r['step_time_s']:.2f} | {r['num_steps']} | "
            f"{r['final_loss']:.2f} | {r['accuracy'][0]:.2f} | {taus} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main)
