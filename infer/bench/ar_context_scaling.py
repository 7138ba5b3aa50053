r"""How the target's batched decode step grows with the prompt buffer (context length).

  python -m infer.bench.ar_context_scaling --batch_size=8 --buckets=32,512 --max_new_tokens=64

For each prompt bucket P, `autoregressive_decode` runs a batch of rows whose prompts fill the
bucket (real SmolLM2 tokens, every row P long), twice: with `max_new_tokens` and with 1 (prefill
only); the difference over the steps is the time of one batched step with a cache of
P + max_new_tokens slots. Compilation excluded, median of --repeats. Prints one JSON object with
the step times and each bucket's ratio to the first.
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import load_target
from infer import cli
from infer.logs import quiet_library_logs

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model (as infer.generate).")
flags.DEFINE_integer("batch_size", 8, "Rows decoded together.", lower_bound=1)
flags.DEFINE_list("buckets", ["32", "512"], "Prompt buffer widths to compare.")
flags.DEFINE_integer("max_new_tokens", 64, "Steps timed per run (+1 token).", lower_bound=2)
flags.DEFINE_integer("repeats", 3, "Timed runs per setting (the median is kept).", lower_bound=1)


def step_time(target, width: int) -> float:
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = target.tokenizer.encode(text, add_special_tokens=False)[:width]
    prompt = np.tile(np.asarray(ids, np.int32), (FLAGS.batch_size, 1))
    lengths = np.full((FLAGS.batch_size,), width, np.int32)
    times = {}
    for n in (1, FLAGS.max_new_tokens):
        cfg = DecodeConfig(max_new_tokens=n, block_size=1, stop_token_ids=())
        api.timed_decode(target, None, prompt, lengths, 0, cfg)  # compile and warm up
        runs = [
            api.timed_decode(target, None, prompt, lengths, 0, cfg) for _ in range(FLAGS.repeats)
        ]
        times[n] = float(np.median([r.run_s for r in runs]))
    return (times[FLAGS.max_new_tokens] - times[1]) / (FLAGS.max_new_tokens - 1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_library_logs()
    target = load_target(FLAGS.target)
    buckets = [int(b) for b in FLAGS.buckets]
    steps = {b: step_time(target, b) for b in buckets}
    print(
        json.dumps(
            {
                "batch_size": FLAGS.batch_size,
                "max_new_tokens": FLAGS.max_new_tokens,
                "step_s": {str(b): s for b, s in steps.items()},
                "ratio_to_first": {str(b): s / steps[buckets[0]] for b, s in steps.items()},
            }
        )
    )


if __name__ == "__main__":
    cli.run(main)
