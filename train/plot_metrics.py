"""Plots a training run's `metrics.jsonl`: loss, acceptance length (implied by the logged
per-position accuracy, and measured by speculative decoding on held-out prompts) and the
per-position accuracy of the last logged window. With two or more measured points it also
fits tau - 1 = c * blocks^p to them and prints (and draws) where that curve reaches tau = 3.

    python -m train.plot_metrics --workdir=runs/smollm2 --output=results/train_smollm2.png
"""

from __future__ import annotations

from absl import app, flags

from dflash_jax.io import paths
from dflash_jax.training.plots import plot, read_metrics, tau_projection
from infer import cli

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "workdir", None,
    "Training run directory: the --workdir of train.train_drafter (it holds metrics.jsonl).",
    required=True,
)  # fmt: skip
flags.DEFINE_string("output", None, "PNG to write (default: <workdir>/metrics.png).")


def main(argv):
    del argv
    workdir = paths.path(FLAGS.workdir)
    path = workdir / "metrics.jsonl"
    if not path.exists():
        raise app.UsageError(f"{path} does not exist; is --workdir a training run?")
    records = read_metrics(path)
    output = paths.path(FLAGS.output) if FLAGS.output else workdir / "metrics.png"
    plot(records, output, f"{workdir.name}: {records[-1]['step']} steps")
    print(f"wrote {output}")
    evals = [(r["blocks"], r["tau_eval"]) for r in records if "tau_eval" in r and "blocks" in r]
    for x, tau in evals:
        print(f"measured tau {tau:.3f} after {x:,} blocks")
    fit = tau_projection(evals, goal=3.0)
    if fit:
        print(
            f"power-law fit tau - 1 = {fit['c']:.3g} * blocks^{fit['p']:.3f}: "
            f"tau 3 after about {fit['x_goal']:.3g} blocks"
        )


if __name__ == "__main__":
    cli.run(main)
