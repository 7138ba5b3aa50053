r"""Generate text with DFlash speculative decoding (the main job).

  python -m infer.generate --prompt="Write a Python function that reverses a string."
  python -m infer.generate --prompt="..." --compare_ar --json

Defaults: the embedded SmolLM2-135M-Instruct target and the drafter shipped with dflash-jax,
greedy decoding, the target's chat template, text streamed as the loop commits it. Then a few
summary lines: tau and steps by kind, tokens/s (DFlash, and with --compare_ar the target alone,
the speedup and whether the outputs are identical), dtype, load and compile time, which are
never counted in the speed. --json prints the same as one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding import calibration, grammar, programs, proposers, runner
from dflash_jax.decoding.settings import kind_label
from infer import cli, common, report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the target's chat template.")
flags.DEFINE_bool("compare_ar", False, "Also run the target alone; report speedup and identity.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of text and a summary.")
flags.DEFINE_string(
    "json_schema",
    None,
    "Structured output: a JSON schema file; the answer is JSON that fits it (the target's "
    "distribution masked to the schema's grammar at every step, drafts and verify alike).",
)
flags.DEFINE_string("regex", None, "Structured output: the answer matches this regular expression.")
flags.DEFINE_list("choices", None, "Structured output: the answer is one of these (comma list).")
flags.DEFINE_bool(
    "stream",
    True,
    "Print the text as the decode loop commits it (the jitted loop advanced a few steps at a "
    "time; the tokens are the same either way). Off with --json.",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    common.enable_compilation_cache()
    common.distributed.initialize()
    if not FLAGS.prompt:
        raise app.UsageError("--prompt is required (and must not be empty)")
    t0 = time.perf_counter()
    with common.usage_errors():
        target, drafter, dtype, dtype_why = common.load_models(ar_fallback=True)
        cfg = common.run_config(target, drafter)
        prompt, lengths = api.pad_prompts(
            [api.render_prompt(target.tokenizer, FLAGS.prompt, FLAGS.chat)]
        )
        api.check_inputs(target, drafter, prompt, lengths, cfg)
        constraint, table = common.grammar_constraint(
            target, cfg, FLAGS.json_schema, FLAGS.regex, FLAGS.choices
        )
    load_s = time.perf_counter() - t0
    # Every executable this run needs, compiled side by side (XLA compiles outside the GIL).
    needs_ar = drafter is not None and (FLAGS.compare_ar or cfg.adaptive)
    compile_s = api.compile_decodes(
        target, drafter, prompt, lengths, cfg, with_target_alone=needs_ar
    )
    step_costs = None
    if cfg.adaptive:
        step_costs = calibration.calibrate_step_costs(target, drafter, prompt, lengths, cfg)
    stream = FLAGS.stream and not FLAGS.json
    # Every process streams (the same program); only process 0 prints.
    primary = common.distributed.is_primary()
    show = (lambda row, text: print(text, end="", flush=True)) if primary else None
    run = api.timed_decode(
        target,
        drafter,
        prompt,
        lengths,
        FLAGS.seed,
        cfg,
        on_tokens=api.TokenStream(target.tokenizer, show) if stream else None,
        constraint=constraint,
        **({"step_costs": step_costs} if drafter else {}),
    )
    if stream and primary:
        print()
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
        "prefill_s": run.start_s,  # part of decode_s: the start half, the prompt's prefill
        "compile_s": compile_s + run.compile_s,
        "load_s": load_s,
        "mode": mode_name(cfg, drafter),
        "block_size": cfg.block_size,
        "dtype": dtype,
        "quantize": FLAGS.quantize,
        "dtype_choice": dtype_why or "--dtype",
        "batch_invariant": programs.run_target_config(target.config, cfg).invariant_rows
        is not None,
        # what `python -m infer.lower --platform=cpu` prints for the same config and shapes
        "program_fingerprints": dict(sorted(runner.FINGERPRINTS.items())),
    }
    if drafter is not None:  # steps and tokens by proposer, the drafted blocks' own tau
        result.update(proposers.report(run.output.block_sizes[0, :steps], acc[:steps]))
    if table is not None:  # the grammar's table and how many answer tokens it forced
        forced, total = grammar.forced_share(table, run.output.tokens, run.output.lengths)
        result.update(grammar_table_bytes=table.nbytes, forced_tokens=forced)
        result["grammar_table_shape"] = list(map(int, table.trans.shape))  # padded [S, C]
        if FLAGS.json_schema:
            result["valid_json"] = _parses(result["text"])
    if cfg.adaptive:
        kinds = np.asarray(run.output.block_sizes[0, :steps])
        result["step_kind_mix"] = {kind_label(k): int((kinds == k).sum()) for k in np.unique(kinds)}
        result["step_costs"] = {
            kind_label(b): float(c) for b, c in zip(cfg.all_kinds, step_costs, strict=True)
        }
    if FLAGS.compare_ar and drafter is not None:
        ar_cfg = api.baseline_config(cfg)
        ar = api.timed_decode(
            target, None, prompt, lengths, FLAGS.seed, ar_cfg, constraint=constraint
        )
        ar_n = int(ar.output.lengths[0])
        result.update(
            ar_tokens_per_s=ar_n / ar.run_s,
            ar_prefill_s=ar.start_s,
            ar_compile_s=ar.compile_s,  # 0 unless compile_decodes left it out
            speedup=(n / run.run_s) / (ar_n / ar.run_s),
            outputs_identical=bool(ar_n == n and np.array_equal(ar.output.tokens[0, :n], tokens)),
        )
    if not primary:
        return
    if FLAGS.json:
        print(json.dumps(result))
        return
    if not stream:
        print(result["text"])
    print(report.generate_summary(result), file=sys.stderr)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def mode_name(cfg, drafter) -> str:
    """What decodes: "autoregressive", "dflash" or "adaptive dflash", and its tree if any."""
    if drafter is None:
        return "autoregressive"
    name = "adaptive dflash" if cfg.adaptive else "dflash"
    return name + (f" + tree of {cfg.tree_nodes}" if cfg.tree_nodes else "")


if __name__ == "__main__":
    cli.run(main)
