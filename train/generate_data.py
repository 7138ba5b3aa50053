"""Generates drafter training data: prompts answered by the target itself.

    python -m train.generate_data --target=smollm2-135m-instruct --code_prompts=1200 \\
        --math_prompts=1200 --chat_prompts=1000 --self_prompts=600 --output=data/smollm2

Prompts come from files, the Python standard library (offline code prompts), templated math
word problems and chat instructions, and the target's own chat template (self prompts);
HumanEval / MT-Bench / dev-set look-alikes are dropped and listed in
`<output>/overlap_dropped.jsonl`. Rerunning the same command resumes; a `mixture.json` in the
output directory counts records and response tokens per source.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from absl import app, flags, logging

from dflash_jax.io.target_loader import load_target
from dflash_jax.training.generate import ChatFormat, generate_records, mixture, self_prompts
from dflash_jax.training.prompt_templates import chat_prompts, math_prompts
from dflash_jax.training.prompts import (
    OverlapFilter,
    Prompt,
    dedupe,
    read_prompt_file,
    stdlib_code_prompts,
)

SELF_PROMPTS_FILE = "self_prompts.jsonl"

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "Target: HF dir, .gguf, hub id or name.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Target dtype (fp32 on CPU).")
flags.DEFINE_multi_string(
    "prompts", [], "Prompt files: .jsonl with a 'prompt' field, or text with one prompt a line."
)
flags.DEFINE_integer("code_prompts", 0, "Prompts built from Python stdlib functions' docstrings.")
flags.DEFINE_integer(
    "fenced_code_prompts",
    0,
    "Stdlib functions shown as a fenced signature + docstring behind the HumanEval instruction.",
)
flags.DEFINE_integer(
    "math_prompts", 0, "Templated grade-school math word problems (random names and quantities)."
)
flags.DEFINE_integer(
    "chat_prompts", 0, "General-chat instructions: instruction templates x topic lists."
)
flags.DEFINE_integer(
    "self_prompts",
    0,
    "User turns sampled from the target's own chat template (cached in "
    f"<output>/{SELF_PROMPTS_FILE}).",
)
flags.DEFINE_float("self_prompt_temperature", 1.0, "Sampling temperature for self prompts.")
flags.DEFINE_integer("self_prompt_max_tokens", 96, "Longest self prompt; longer ones are dropped.")
flags.DEFINE_string("output", None, "Output directory for shards and manifests.", required=True)
flags.DEFINE_enum("format", "arrayrecord", ["arrayrecord", "jsonl"], "Shard format.")
flags.DEFINE_integer("batch_size", 16, "Prompts decoded together.")
flags.DEFINE_integer("max_new_tokens", 384, "Longest response (responses are cut there).")
flags.DEFINE_integer("max_prompt_tokens", 128, "Prompts longer than this (templated) are dropped.")
flags.DEFINE_float("temperature", 0.0, "Response temperature; 0 is greedy.")
flags.DEFINE_integer("block_size", 16, "Drafter block size: responses need 2x this many tokens.")
flags.DEFINE_integer("prompts_per_shard", 256, "Prompts covered by each shard.")
flags.DEFINE_integer("bucket", 32, "Prompt widths are rounded up to a multiple of this.")
flags.DEFINE_integer("overlap_ngram", 13, "Word n-gram length of the evaluation-overlap test.")
flags.DEFINE_integer("max_prompts", 0, "Use at most this many prompts (0: all).")
flags.DEFINE_integer("seed", 0, "Seed for prompt order and sampling.")


def _self_prompts(target, chat: ChatFormat, output: Path) -> list[Prompt]:
    cache = output / SELF_PROMPTS_FILE
    cached = []
    if cache.exists():
        cached = [Prompt(**json.loads(line)) for line in cache.read_text().splitlines() if line]
    if len(cached) >= FLAGS.self_prompts:
        return cached[: FLAGS.self_prompts]
    prompts = self_prompts(
        target,
        chat,
        FLAGS.self_prompts,
        batch_size=FLAGS.batch_size,
        temperature=FLAGS.self_prompt_temperature,
        max_tokens=FLAGS.self_prompt_max_tokens,
        seed=FLAGS.seed,
    )
    cache.write_text(
        "".join(json.dumps({"text": p.text, "source": p.source}) + "\n" for p in prompts)
    )
    return prompts


def main(argv):
    del argv
    output = Path(FLAGS.output)
    output.mkdir(parents=True, exist_ok=True)
    target = load_target(FLAGS.target, dtype=FLAGS.dtype)
    chat = ChatFormat(target.tokenizer, target.chat_template)

    prompts = [p for path in FLAGS.prompts for p in read_prompt_file(path)]
    if FLAGS.code_prompts:
        prompts += stdlib_code_prompts(FLAGS.code_prompts)
    if FLAGS.fenced_code_prompts:
        prompts += stdlib_code_prompts(FLAGS.fenced_code_prompts, fenced=True)
    if FLAGS.math_prompts:
        prompts += math_prompts(FLAGS.math_prompts, seed=FLAGS.seed)
    if FLAGS.chat_prompts:
        prompts += chat_prompts(FLAGS.chat_prompts, seed=FLAGS.seed)
    if FLAGS.self_prompts:
        prompts += _self_prompts(target, chat, output)
    prompts = dedupe(prompts)
    if not prompts:
        raise app.UsageError(
            "no prompts: give --prompts, --code_prompts, --math_prompts, --chat_prompts or "
            "--self_prompts"
        )

    overlap = OverlapFilter.for_benchmarks(FLAGS.overlap_ngram)
    dropped = [p for p in prompts if overlap.overlaps(p.text)]
    prompts = [p for p in prompts if not overlap.overlaps(p.text)]
    (output / "overlap_dropped.jsonl").write_text(
        "".join(json.dumps({"prompt": p.text, "source": p.source}) + "\n" for p in dropped)
    )
    logging.info("dropped %d prompts overlapping HumanEval/MT-Bench", len(dropped))

    # Interleave the sources so that a run stopped early still has a mix of them.
    order = np.random.default_rng(FLAGS.seed).permutation(len(prompts))
    prompts = [prompts[i] for i in order]
    if FLAGS.max_prompts:
        prompts = prompts[: FLAGS.max_prompts]
    counts = generate_records(
        target,
        chat,
        prompts,
        output,
        fmt=FLAGS.format,
        batch_size=FLAGS.batch_size,
        max_new_tokens=FLAGS.max_new_tokens,
        max_prompt_tokens=FLAGS.max_prompt_tokens,
        temperature=FLAGS.temperature,
        min_loss_tokens=2 * FLAGS.block_size,
        prompts_per_shard=FLAGS.prompts_per_shard,
        bucket=FLAGS.bucket,
        seed=FLAGS.seed,
    )
    counts["overlap_dropped"] = len(dropped)
    logging.info("done: %s", counts)
    mix = mixture(output)
    (output / "mixture.json").write_text(json.dumps(mix, indent=1))
    print(json.dumps({"this_run": counts, "mixture": mix}))


if __name__ == "__main__":
    app.run(main)
