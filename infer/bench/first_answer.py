r"""Where a run of `infer.generate --compare_ar` spends its time, phase by phase.

  python -m infer.bench.first_answer --prompt="Write a Python function that checks whether a \
      number is prime." --output=first.json   # then the same again: a second run

Runs what `infer.generate --compare_ar` runs, in its order, with a clock around each phase:
imports, loading the target and drafter (and --dtype=auto's choice), lowering the programs
(tracing included), each program ready (compiled, or loaded from the persistent cache under
--compilation_cache), the warm-up steps, the step-cost calibration, the DFlash decode and the
target alone's. Prints (and with --output writes) one JSON object of seconds. Run it twice with
the same cache for a second run's phases; the README command adds the venv and pip's check of it.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import concurrent.futures  # noqa: E402

from absl import app, flags  # noqa: E402

from dflash_jax import api  # noqa: E402
from dflash_jax.decoding import calibration, runner  # noqa: E402
from dflash_jax.ops.invariance import machine_name, software_name  # noqa: E402
from infer import cli, common, report  # noqa: E402

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("prompt", None, "The user prompt (required).")
flags.DEFINE_string("output", None, "Also write the JSON object to this file.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.prompt:
        raise app.UsageError("--prompt is required (and must not be empty)")
    imports_s = time.perf_counter() - _T0
    common.quiet_library_logs()
    common.enable_compilation_cache()
    t = time.perf_counter()
    with common.usage_errors():
        target, drafter, dtype, _ = common.load_models()
        if drafter is None:
            raise app.UsageError("--drafter=none: this times a DFlash run beside the target alone")
        cfg = common.run_config(target, drafter)
        prompt, lengths = api.pad_prompts([api.render_prompt(target.tokenizer, FLAGS.prompt, True)])
        api.check_inputs(target, drafter, prompt, lengths, cfg)
    load_s = time.perf_counter() - t
    # api.compile_decodes' two stages apart: every half lowered and handed to a thread to
    # compile (or load), then the warm-up steps (compile_decodes finds the halves compiled).
    t = time.perf_counter()
    ready = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        decodes = [(target, d, prompt, lengths, cfg) for d in (drafter, None)]
        pending = runner.precompile(decodes, pool)
        lowered_s = time.perf_counter() - t
        for name, futures in zip(("dflash", "target_alone"), pending, strict=True):
            for half, future in zip(("start", "advance"), futures, strict=False):
                future.result()
                ready[f"{name}_{half}"] = time.perf_counter() - t
    programs_s = time.perf_counter() - t
    t = time.perf_counter()
    api.compile_decodes(target, drafter, prompt, lengths, cfg, with_target_alone=True)
    warm_s = time.perf_counter() - t
    t = time.perf_counter()
    costs = calibration.calibrate_step_costs(target, drafter, prompt, lengths, cfg)
    calibration_s = time.perf_counter() - t
    run = api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, cfg, step_costs=costs)
    ar = api.timed_decode(target, None, prompt, lengths, FLAGS.seed, api.baseline_config(cfg))
    n, ar_n = int(run.output.lengths[0]), int(ar.output.lengths[0])
    result = {
        "machine": machine_name(),
        "software": software_name(),
        "dtype": dtype,
        "imports_s": imports_s,
        "load_s": load_s,
        "lowering_s": lowered_s,  # tracing and lowering every half, in this thread
        "ready_s": ready,  # from the start of lowering until each half could run
        "programs_s": programs_s,
        "warm_up_s": warm_s,
        "calibration_s": calibration_s,
        "dflash_decode_s": run.run_s,
        "target_alone_decode_s": ar.run_s,
        "new_tokens": [n, ar_n],
        "total_s": time.perf_counter() - _T0,
    }
    report.emit_json(result, FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
