"""Plots a training run's `metrics.jsonl`: loss, acceptance length (implied by the logged
per-position accuracy, and measured by speculative decoding on held-out prompts) and the
per-position accuracy of the last logged window.

    python -m train.plot_metrics --workdir=runs/smollm2 --output=results/train_smollm2.png
"""

from __future__ import annotations

from pathlib import Path

from absl import app, flags

from dflash_jax.training.plots import plot, read_metrics

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "workdir", None,
    "Training run directory: the --workdir of train.train_drafter (it holds metrics.jsonl).",
    required=True,
)  # fmt: skip
flags.DEFINE_string("output", None, "PNG to write (default: <workdir>/metrics.png).")


def main(argv):
    del argv
    workdir = Path(FLAGS.workdir)
    path = workdir / "metrics.jsonl"
    if not path.exists():
        raise app.UsageError(f"{path} does not exist; is --workdir a training run?")
    records = read_metrics(path)
    output = Path(FLAGS.output or workdir / "metrics.png")
    plot(records, output, f"{workdir.name}: {records[-1]['step']} steps")
    print(f"wrote {output}")


if __name__ == "__main__":
    app.run(main)
