r"""What streaming costs: the same decode with and without `DecodeConfig(stream=True)`.

  python -m infer.stream_cost --prompt="Write a Python function that checks whether a number \
      is prime." --max_new_tokens=128 --repeats=5

Runs the decode (DFlash with the default drafter, or the target alone with --drafter=none)
alternately streamed (an ordered io_callback per loop step, to a handler that decodes the text as
`infer.generate --stream` does, without printing) and not, --repeats times each, compilation
excluded, and prints one JSON object: the median per-step time of each and the overhead.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from absl import app, flags

from dflash_jax import api
from infer import common

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_integer("repeats", 5, "Timed runs per mode (the median is kept).", lower_bound=1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    target, drafter, prompt, lengths = common.load_for_prompt(FLAGS.prompt)
    with common.usage_errors():
        block = FLAGS.block_size or (api.default_block_size(target, drafter) if drafter else 1)
        cfg = common.decode_config(block, api.stop_token_ids(target), adaptive=False)
        api.check_inputs(target, drafter, prompt, lengths, cfg)
    streamed_cfg = dataclasses.replace(cfg, stream=True)
    per_step = {"plain": [], "streamed": []}
    steps = {}
    with api.streaming(api.TokenStream(target.tokenizer, lambda row, text: None)):
        for c in (cfg, streamed_cfg):
            api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, c)  # compile, warm up
        for _ in range(FLAGS.repeats):
            for mode, c in (("plain", cfg), ("streamed", streamed_cfg)):
                run = api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, c)
                steps[mode] = int(run.output.num_steps[0])
                per_step[mode].append(run.run_s / max(steps[mode], 1))
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
                "repeats": FLAGS.repeats,
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
