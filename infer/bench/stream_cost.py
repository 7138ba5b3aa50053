r"""What streaming costs: the same decode run in one call and streamed in chunks of steps.

  python -m infer.bench.stream_cost --prompt="Write a Python function that checks whether a number \
      is prime." --max_new_tokens=128 --repeats=5

Runs the decode (DFlash with the default drafter, or the target alone with --drafter=none)
alternately streamed (the loop advanced --chunk_steps steps at a time, each chunk's tokens sent
to a handler that decodes the text as `infer.generate --stream` does, without printing) and not,
--repeats times each, compilation excluded, and prints one JSON object: the median per-step time
of each and the overhead.
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding.runner import STREAM_CHUNK_STEPS
from infer import cli, common

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_integer("repeats", 5, "Timed runs per mode (the median is kept).", lower_bound=1)
flags.DEFINE_integer(
    "chunk_steps", STREAM_CHUNK_STEPS, "Loop steps per streamed chunk.", lower_bound=1
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    target, drafter, prompt, lengths = common.load_for_prompt(FLAGS.prompt)
    with common.usage_errors():
        block = FLAGS.block_size or (api.default_block_size(target, drafter) if drafter else 1)
        cfg = common.decode_config(block, api.stop_token_ids(target), adaptive=False)
        api.check_inputs(target, drafter, prompt, lengths, cfg)
    per_step = {"plain": [], "streamed": []}
    steps = {}

    def run(mode):
        stream = api.TokenStream(target.tokenizer, lambda row, text: None)
        return api.timed_decode(
            target, drafter, prompt, lengths, FLAGS.seed, cfg,
            on_tokens=stream if mode == "streamed" else None, chunk_steps=FLAGS.chunk_steps,
        )  # fmt: skip

    run("plain")  # compile, warm up
    for _ in range(FLAGS.repeats):
        for mode in ("plain", "streamed"):
            timed = run(mode)
            steps[mode] = int(timed.output.num_steps[0])
            per_step[mode].append(timed.run_s / max(steps[mode], 1))
    plain, streamed = (float(np.median(per_step[m])) for m in ("plain", "streamed"))
    print(
        json.dumps(
            {
                "mode": "dflash" if drafter else "autoregressive",
                "block_size": block,
                "steps": steps,
                "plain_step_s": plain,
                "streamed_step_s": streamed,
                "overhead": streamed / plain - 1.0,
                "chunk_steps": FLAGS.chunk_steps,
                "repeats": FLAGS.repeats,
            }
        )
    )


if __name__ == "__main__":
    cli.run(main)
