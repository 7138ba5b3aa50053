r"""What batch invariance costs: the same prompt decoded in bf16 with and without it, and in fp32,
by the target alone, a fixed block and the default decode, in one run.

  python -m infer.bench.invariance_cost --prompt="Write a Python function that reverses a \
      string." --max_new_tokens=64 --repeats=5 --output=results/issue38_invariance_cost.json

Every (setting, decode) pair is compiled and warmed up first (the default decode's step costs
calibrated as infer.generate calibrates them), then the pairs run one after another, --repeats
rounds, so a slowdown of a shared machine hits every pair alike. Prints (and writes with
--output) one JSON object: each pair's tokens per second, best and median over the rounds
(decode time, prefill included, compilation excluded), its new tokens, and whether its tokens
equal the target alone's in the same setting.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding import calibration
from infer import cli, common, report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_integer("repeats", 5, "Timed rounds (best and median kept).", lower_bound=1)
flags.DEFINE_string("output", None, "Write the JSON object to this file as well.")

SETTINGS = (("bfloat16", False), ("bfloat16", True), ("float32", False))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.prompt:
        raise app.UsageError("--prompt is required")
    common.quiet_library_logs()
    runs = {}
    prompt = lengths = None
    for dtype, invariant in SETTINGS:
        with common.usage_errors():
            target, drafter = common.with_attention_impl(
                *api.load_pair(FLAGS.target, FLAGS.drafter, dtype, FLAGS.target_cache)
            )
            if drafter is None:
                raise app.UsageError("--drafter=none: nothing to compare")
            if prompt is None:
                text = api.render_prompt(target.tokenizer, FLAGS.prompt)
                prompt, lengths = api.pad_prompts([text])
            block = FLAGS.block_size or api.default_block_size(target, drafter)
            stops = api.stop_token_ids(target)
            default = common.decode_config(block, stops, adaptive=True)
            fixed = common.decode_config(block, stops, adaptive=False)
        setting = f"{dtype} {'batch-invariant' if invariant else 'plain'}"
        modes = (("target alone", default), (f"block {block}", fixed), ("default", default))
        for mode, cfg in modes:
            cfg = dataclasses.replace(cfg, batch_invariant=invariant)
            d, kw = drafter, {}
            if mode == "target alone":
                d, cfg = None, api.baseline_config(cfg)
            elif cfg.adaptive:
                costs = calibration.calibrate_step_costs(target, drafter, prompt, lengths, cfg)
                kw = {"step_costs": costs}
            api.timed_decode(target, d, prompt, lengths, FLAGS.seed, cfg, **kw)  # compile, warm
            runs[f"{setting}, {mode}"] = (target, d, cfg, kw, f"{setting}, target alone")
    rates: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    for _ in range(FLAGS.repeats):
        for name, (target, d, cfg, kw, _) in runs.items():
            run = api.timed_decode(target, d, prompt, lengths, FLAGS.seed, cfg, **kw)
            n = int(run.output.lengths[0])
            rates[name].append(n / run.run_s)
            tokens[name] = np.asarray(run.output.tokens[0, :n]).tolist()
    result = {
        name: {
            "tokens_per_s_best": max(rates[name]),
            "tokens_per_s_median": float(np.median(rates[name])),
            "new_tokens": len(tokens[name]),
            "identical_to_target_alone": tokens[name] == tokens[runs[name][4]],
        }
        for name in runs
    }
    report.emit_json({"runs": result, "repeats": FLAGS.repeats}, FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
