r"""What each adaptive step kind costs, in AR steps of the same run.

  python -m infer.bench.step_cost --prompt="Write a Python function that checks whether a number \
      is prime." --max_new_tokens=128 --repeats=5 --output=results/step_cost.json

Decodes the prompt with the target alone (AR) and with the adaptive loop forced to run one step
kind at every step (`speculative_decode`'s forced kind, the executable the real decode uses:
the kind is an input), alternately, --repeats times each after a warm-up, compilation
excluded, stop tokens ignored so every run takes the same number of steps, and the prefill
(timed as a one-token decode) subtracted. Prints (and writes
with --output) one JSON object: the median per-step time of each and its ratio to the AR step.
The "1" kind is a plain target step inside the adaptive loop, so its ratio is what the loop's
machinery (the kind switch, the drafter context row, the lookup proposal) adds to an AR step.
Unlike the controller's calibration (one run per kind, cached), every figure here is a median
of interleaved runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding.settings import kind_label
from infer import cli, common

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_integer("repeats", 5, "Timed runs per kind (the median is kept).", lower_bound=1)
flags.DEFINE_string("output", None, "Write the JSON object to this file as well.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    target, drafter, prompt, lengths = common.load_for_prompt(FLAGS.prompt)
    if drafter is None:
        raise app.UsageError("--drafter=none has no step kinds to time")
    with common.usage_errors():
        block = FLAGS.block_size or api.default_block_size(target, drafter)
        cfg = common.decode_config(block, (), adaptive=True)
        api.check_inputs(target, drafter, prompt, lengths, cfg)
    runs = [("ar", None, -1)] + [
        (kind_label(kind), drafter, index) for index, kind in enumerate(cfg.all_kinds)
    ]

    # Prefill (and the drafter's prompt context), the decode's start half, is timed apart and
    # subtracted.
    def seconds(d, index):
        run = api.timed_decode(target, d, prompt, lengths, FLAGS.seed, cfg, forced_kind=index)
        return run.run_s - run.start_s, int(np.max(run.output.num_steps))

    per_step: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    steps = {}
    for _, d, index in runs:  # compile and warm up
        seconds(d, index)
    for _ in range(FLAGS.repeats):
        for name, d, index in runs:
            loop_s, steps[name] = seconds(d, index)
            per_step[name].append(max(loop_s, 0.0) / max(steps[name], 1))
    median = {name: float(np.median(times)) for name, times in per_step.items()}
    result = {
        "block_size": block,
        "kinds": list(cfg.all_kinds),
        "steps": steps,
        "step_s": median,
        "ar_steps": {name: median[name] / median["ar"] for name in median if name != "ar"},
        "repeats": FLAGS.repeats,
        "max_new_tokens": cfg.max_new_tokens,
    }
    text = json.dumps(result)
    print(text)
    if FLAGS.output:
        Path(FLAGS.output).parent.mkdir(parents=True, exist_ok=True)
        Path(FLAGS.output).write_text(text + "\n")


if __name__ == "__main__":
    cli.run(main)
