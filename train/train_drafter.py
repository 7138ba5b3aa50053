"""Trains a DFlash drafter for a frozen target.

    python -m train.train_drafter --config=configs/smollm2_135m_b16.py --workdir=runs/smollm2 \\
        [--config.num_steps=2000 --config.data=data/smollm2]

Rerunning with the same workdir resumes from the last checkpoint (same data order, same
losses). The drafter is exported to `<workdir>/drafter` at every checkpoint; load it with
`dflash_jax.load_drafter("<workdir>/drafter", target)`. Metrics: `<workdir>/metrics.jsonl`.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from dflash_jax.training.trainer import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "A configs/*.py file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, exported drafter.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    train(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
