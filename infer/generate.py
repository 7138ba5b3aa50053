r"""Generate text with DFlash speculative decoding (the main job).

  python -m infer.generate --prompt="Write a Python function that reverses a string."
  python -m infer.generate --prompt="..." --compare_ar --json

Defaults: the embedded SmolLM2-135M-Instruct target and the drafter shipped with dflash-jax,
greedy decoding, the target's chat template. Prints the text, then a summary (new tokens, mean
acceptance length tau, tokens/s); compilation time is reported apart and never counted in speed.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from absl import app, flags

from dflash_jax import api
from infer import common

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the target's chat template.")
flags.DEFINE_bool("compare_ar", False, "Also run the target alone; report speedup and identity.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of text and a summary.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    if not FLAGS.prompt:
        raise app.UsageError("--prompt is required (and must not be empty)")
    with common.usage_errors():
        target, drafter = api.load_pair(FLAGS.target, FLAGS.drafter, FLAGS.dtype)
        block = FLAGS.block_size or (drafter.config.block_size if drafter else 1)
        cfg = common.decode_config(block, api.stop_token_ids(target))
        prompt, lengths = api.pad_prompts(
            [api.render_prompt(target.tokenizer, FLAGS.prompt, FLAGS.chat)]
        )
        api.check_inputs(target, drafter, prompt, lengths, cfg)
    run = api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, cfg)
    n = int(run.output.lengths[0])
    tokens = np.asarray(run.output.tokens[0, :n]).tolist()
    acc = np.asarray(run.output.acceptance_lengths[0])
    steps = int(run.output.num_steps[0])
    result = {
        "text": target.tokenizer.decode(tokens, skip_special_tokens=True),
        "token_ids": tokens,
        "new_tokens": n,
        "steps": steps,
        "tau_mean": float(acc[:steps].mean()) if steps else None,
        "tokens_per_s": n / run.run_s,
        "decode_s": run.run_s,
        "compile_s": run.compile_s,
        "mode": "dflash" if drafter else "autoregressive",
        "block_size": block,
    }
    if FLAGS.compare_ar and drafter is not None:
        ar = api.timed_decode(target, None, prompt, lengths, FLAGS.seed, cfg)
        ar_n = int(ar.output.lengths[0])
        result.update(
            ar_tokens_per_s=ar_n / ar.run_s,
            ar_compile_s=ar.compile_s,
            speedup=(n / run.run_s) / (ar_n / ar.run_s),
            outputs_identical=bool(ar_n == n and np.array_equal(ar.output.tokens[0, :n], tokens)),
        )
    if FLAGS.json:
        print(json.dumps(result))
        return
    print(result["text"])
    print("-" * 60, file=sys.stderr)
    tau = f"{result['tau_mean']:.2f}" if result["tau_mean"] is not None else "n/a"
    print(
        f"{result['mode']}: {n} new tokens in {steps} steps, tau {tau}, "
        f"{result['tokens_per_s']:.1f} tok/s (incl. prefill; compile {run.compile_s:.1f}s apart)",
        file=sys.stderr,
    )
    if "speedup" in result:
        print(
            f"autoregressive: {result['ar_tokens_per_s']:.1f} tok/s -> speedup "
            f"{result['speedup']:.2f}x, outputs identical: {result['outputs_identical']}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    app.run(main)
