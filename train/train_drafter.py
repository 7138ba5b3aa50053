"""Trains a DFlash drafter for a frozen target.

    python -m train.train_drafter --config=configs/smollm2_135m_b16.py --workdir=runs/smollm2 \\
        [--config.num_steps=2000 --config.data=data/smollm2]

Rerunning with the same workdir resumes from the last checkpoint (same data order, same
losses). A rerun whose drafter or data settings differ from the checkpoints' (saved in
`<workdir>/run_config.json`) is refused before anything is touched, naming the fields: rerun
with the old values, or use a new workdir (`--config.init_from_checkpoint=<old workdir>` starts
it from the old run's weights and Adam state when only the data changed). Unreadable
checkpoints are moved to `<workdir>/checkpoints_unreadable/`; when no readable one is left, the
workdir is refused until `--start_over`. With `--taps_only` it only builds (or grows) the tap
cache of a `taps="cached"` config and exits, e.g. while data generation is still writing
shards. The drafter is exported to
`<workdir>/drafter` at the end (and every `--config.export_every` steps); load it with
`dflash_jax.load_drafter("<workdir>/drafter", target)`. Metrics: `<workdir>/metrics.jsonl`.

On a mesh and several processes (every process runs the same command; process 0 logs and
exports, all write their part of each checkpoint):

    python -m train.train_drafter --config=configs/qwen3_8b_b16.py --workdir=runs/q8 \
        --mesh=fsdp=4,tensor=2 [--coordinator_address=HOST:PORT --num_processes=N --process_id=I]

--mesh sets config.mesh; a run resumes on any mesh shape (checkpoints are resharded on load).

SIGTERM (a preemption notice) or Ctrl-C finishes the current step, saves a checkpoint of it and
exits 0 with the command that resumes (on several hosts jax's preemption sync picks one step
that every host saves).
"""

from __future__ import annotations

import shlex
import sys

from absl import flags
from ml_collections import config_flags

from dflash_jax.training.trainer import build_taps, train
from infer import cli, distributed

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None,
    "Training config: a configs/*.py file such as configs/smollm2_135m_b16.py (its get_config() "
    "lists every field). Override a field with --config.<field>=<value>, e.g. "
    "--config.num_steps=2000 --config.data=data/smollm2.",
    lock_config=True,
)  # fmt: skip
flags.DEFINE_string(
    "workdir", None,
    "Run directory, local or a URL such as gs://bucket/run: checkpoints, metrics.jsonl and the "
    "exported drafter (<workdir>/drafter). Rerunning with the same directory resumes from its "
    "last checkpoint; a rerun whose drafter or data settings differ from those of the "
    "checkpoints there (<workdir>/run_config.json) is refused, naming them.",
)  # fmt: skip
flags.DEFINE_bool(
    "taps_only", False,
    "Only build (or finish, or grow) the tap cache of a config with taps='cached' for the "
    "data as it is now, then exit; e.g. while train.generate_data is still writing shards. "
    "Records the cache already has are copied, so the run later computes only new shards.",
)  # fmt: skip
flags.DEFINE_bool(
    "start_over", False,
    "Train from step 0 in a workdir whose checkpoints were all found unreadable and set aside "
    "in <workdir>/checkpoints_unreadable (its metrics.jsonl and exported drafter are then "
    "replaced). Without it such a workdir is refused on every rerun, so that a retry never "
    "silently restarts a run. No effect while a readable checkpoint is left.",
)  # fmt: skip
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    distributed.initialize()
    if FLAGS.mesh:
        FLAGS.config.mesh = FLAGS.mesh
    distributed.mesh(FLAGS.config.mesh)  # a bad mesh is a usage error before anything loads
    if FLAGS.taps_only:
        cache = build_taps(FLAGS.config, FLAGS.workdir)
        print(f"tap cache: {len(cache)} records, {int(cache.lengths.sum())} tokens")
        return
    last = train(FLAGS.config, FLAGS.workdir, start_over=FLAGS.start_over)
    if "stopped_at" in last:
        command = " ".join(
            shlex.quote(a) for a in ["python", "-m", "train.train_drafter", *sys.argv[1:]]
        )
        print(
            f"stopped by {last['stopped_by']} after step {last['stopped_at']}, checkpoint saved; "
            f"resume with the same command: {command}",
            flush=True,
        )


if __name__ == "__main__":
    cli.run(main)
