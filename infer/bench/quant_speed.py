r"""What quantized weights cost or gain on this machine: the same prompt decoded by the float32,
bfloat16, int8 and int4 targets (the quantized ones computing in --quant_dtype), by the target
alone and by the default decode, in one run, with each setting's GEMM floors.

  python -m infer.bench.quant_speed --prompt="Write a Python function that reverses a \
      string." --max_new_tokens=64 --repeats=3 --output=results/issue42_quant_speed.json

Every (setting, decode) pair is compiled and warmed up first (the default decode's step costs
calibrated as infer.generate calibrates them), then the pairs run one after another, --repeats
rounds, so a slowdown of the shared machine hits every pair alike. Beside each setting: its
GEMM floors (`decoding.floors.gemm_floors`: one AR row, and a block of rows through target,
drafter and head, each product as the decode computes it, a quantized kernel dequantized inside
the timed loop as the decode does). Prints (and writes with --output) one JSON object: each
pair's tokens per second (best and median), its new tokens, and whether its tokens equal the
same target's alone.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding import calibration
from dflash_jax.decoding import floors as floors_lib
from infer import cli, common, report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_integer("repeats", 3, "Timed rounds (best and median kept).", lower_bound=1)
flags.DEFINE_enum(
    "quant_dtype", "float32", ["float32", "bfloat16"],
    "The compute dtype of the quantized targets (their kernels are dequantized to it).",
)  # fmt: skip
flags.DEFINE_string("output", None, "Write the JSON object to this file as well.")


def settings() -> tuple[tuple[str, str | None], ...]:
    """(dtype, quantize) of each target compared."""
    q = FLAGS.quant_dtype
    return (("float32", None), ("bfloat16", None), (q, "int8"), (q, "int4"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.prompt:
        raise app.UsageError("--prompt is required")
    common.quiet_library_logs()
    runs, floors = {}, {}
    prompt = lengths = None
    for dtype, quantize in settings():
        setting = f"{quantize or dtype}" + (f" ({dtype})" if quantize else "")
        with common.usage_errors():
            target, drafter = common.with_attention_impl(
                *api.load_pair(
                    FLAGS.target, FLAGS.drafter, dtype, FLAGS.target_cache, quantize=quantize
                )
            )
            if drafter is None:
                raise app.UsageError("--drafter=none: nothing to compare")
            if prompt is None:
                text = api.render_prompt(target.tokenizer, FLAGS.prompt)
                prompt, lengths = api.pad_prompts([text])
            block = FLAGS.block_size or api.default_block_size(target, drafter)
            default = common.decode_config(block, api.stop_token_ids(target), adaptive=True)
        tcfg = floors_lib.run_config(target.config, dtype, default.batch_invariant)
        floors[setting] = {
            k: round(v * 1e3, 2)
            for k, v in floors_lib.gemm_floors(
                target.params, tcfg, drafter.params, block, repeats=5
            ).items()
        }
        for mode in ("target alone", "default"):
            d, cfg, kw = drafter, default, {}
            if mode == "target alone":
                d, cfg = None, api.baseline_config(default)
            else:
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
    out = {"runs": result, "gemm_floors_ms": floors, "repeats": FLAGS.repeats}
    report.emit_json(out, FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
