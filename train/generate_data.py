"""Generates drafter training data: prompts answered by the target itself.

    python -m train.generate_data --target=smollm2-135m-instruct --code_prompts=1200 \\
        --math_prompts=1200 --chat_prompts=1000 --self_prompts=600 --output=data/smollm2

Prompts come from files (single prompts, or conversations whose every assistant turn the target
regenerates: `--prompts`), the Python standard library (offline code prompts), templated math
word problems and chat instructions, and the target's own chat template (self prompts);
HumanEval / MT-Bench / dev-set look-alikes are dropped and listed in
`<output>/overlap_dropped.jsonl`. Rerunning the same command resumes; a `mixture.json` in the
output directory counts records and response tokens per source. Answers are generated in fixed
padded batches (`--engine=fixed`) or by continuous batching (`--engine=slots`), greedy unless
--temperature, in the chat template's thinking mode unless --thinking.

--mesh spreads each batch over this process's devices (e.g. --mesh=data=8 on one 8-GPU node,
or tensor=2 for a target too big for one). With several processes (--coordinator_address ...,
or --distributed on a cluster), process p of P answers prompts p, p+P, ... on its own devices
and writes its own shards into the shared --output; process 0 samples the self prompts (the
others wait for them) and writes the lists and mixture.json.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from absl import app, flags, logging
from etils import epath

from dflash_jax.io import paths
from dflash_jax.io.target_loader import load_target
from dflash_jax.io.tokenizer import THINKING_MODES
from dflash_jax.training.generate import (
    ChatFormat,
    cached_self_prompts,
    generate_records,
    mixture,
    self_prompts,
)
from dflash_jax.training.prompt_templates import chat_prompts, math_prompts
from dflash_jax.training.prompts import (
    OverlapFilter,
    Prompt,
    dedupe,
    read_prompt_file,
    stdlib_code_prompts,
)
from infer import cli, distributed

SELF_PROMPTS_FILE = "self_prompts.jsonl"

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "target", "smollm2-135m-instruct",
    "Target that answers the prompts (the one the drafter will serve): 'smollm2-135m-instruct' "
    "(embedded, offline), an HF directory, a .gguf file or a hub id such as Qwen/Qwen3-8B.",
)  # fmt: skip
flags.DEFINE_enum(
    "dtype", "auto", ["auto", "float32", "bfloat16"],
    "Dtype the target runs in: float32 (use it on CPU), bfloat16 (half the memory, GPU/TPU), "
    "or auto: bfloat16 on GPU/TPU, float32 on CPU.",
)  # fmt: skip
flags.DEFINE_enum(
    "thinking", "template", list(THINKING_MODES),
    "Thinking mode of the answers, passed to the chat template as enable_thinking (Qwen3-style "
    "templates): off, on, or template (the template's own default; the only choice for a "
    "template without the switch). Train the drafter in the mode it will serve: the mode is "
    "recorded in each shard's manifest, train.train_drafter records it in the exported "
    "drafter, and loading that drafter for a target whose template serves the other mode warns.",
)  # fmt: skip
flags.DEFINE_enum(
    "engine", "fixed", ["slots", "fixed"],
    "How answers are batched: fixed (padded batches, each run until its longest answer stops; "
    "spreads over --mesh) or slots (continuous batching: a row whose answer stops takes the "
    "next prompt at once; one device). fixed is the default because slots measured no faster on "
    "a 2-core CPU (0.97x the tokens/s on 64 mixed-length answers, docs/training.md).",
)  # fmt: skip
flags.DEFINE_enum(
    "quantize", None, ["int8", "int4", "fp8", "mxfp4"],
    "The target with quantized layer kernels (docs/quantization.md; mxfp4: gpt-oss's experts as "
    "stored): the answers are then the quantized model's, the data for a drafter that serves it. "
    "Unset: float weights.",
)  # fmt: skip
flags.DEFINE_multi_string(
    "prompts", [],
    "Prompts or conversations (repeatable): .jsonl whose lines each hold a 'prompt', OpenAI "
    "'messages' (role/content) or ShareGPT 'conversations' (from/value; system turns "
    "included), detected per line; a .parquet file or a Hugging Face datasets directory "
    "(save_to_disk) with those columns (they need pyarrow / datasets installed); any other "
    "text file holds one prompt a line. Every assistant turn of a conversation is regenerated "
    "by the target, in order, given the conversation so far with its earlier turns "
    "regenerated; the record's loss mask covers every regenerated turn.",
)  # fmt: skip
flags.DEFINE_integer(
    "code_prompts", 0,
    "How many code prompts to build from Python stdlib functions' docstrings (offline).",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "fenced_code_prompts", 0,
    "How many code prompts to build as a stdlib function's fenced signature + docstring behind "
    "the HumanEval instruction.",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "math_prompts", 0,
    "How many templated grade-school math word problems to build (random names, quantities).",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "chat_prompts", 0,
    "How many general-chat instructions to build (instruction templates x topic lists).",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "self_prompts", 0,
    "How many user turns to sample from the target itself, prompted with its own chat template "
    f"(kept in <output>/{SELF_PROMPTS_FILE}, reused when rerun).",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_float(
    "self_prompt_temperature", 1.0,
    "Sampling temperature of the self prompts (near 0 they repeat and are deduplicated away).",
    lower_bound=0.0,
)  # fmt: skip
flags.DEFINE_integer(
    "self_prompt_max_tokens", 96,
    "Most tokens sampled for one self prompt; prompts still unfinished there are dropped.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_string(
    "output", None,
    "Output directory (local or a URL such as gs://bucket/data): data shards with their "
    "manifests, mixture.json (records and tokens per source) and overlap_dropped.jsonl. "
    "Rerunning into the same directory resumes.",
    required=True,
)  # fmt: skip
flags.DEFINE_enum(
    "format", "arrayrecord", ["arrayrecord", "jsonl"],
    "Shard format: arrayrecord (compact, what training reads at scale) or jsonl (one JSON "
    "record a line, readable). train.train_drafter reads either.",
)  # fmt: skip
flags.DEFINE_integer(
    "batch_size", 16,
    "Rows decoding together: the slots of --engine=slots, the batch of --engine=fixed.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "max_new_tokens", 2048,
    "Longest answer (one assistant turn) in tokens; longer answers are cut there.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "max_prompt_tokens", 1024,
    "Longest prompt in tokens (chat template applied; for a later turn of a conversation, the "
    "conversation so far): a prompt whose first turn is longer is dropped, a conversation "
    "stops at the first turn that is.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_float(
    "temperature", 0.0, "Sampling temperature of the responses; 0 is greedy.", lower_bound=0.0
)
flags.DEFINE_float(
    "top_p", 1.0, "Nucleus sampling of the responses (with --temperature > 0); 1 is off.",
    lower_bound=0.0, upper_bound=1.0,
)  # fmt: skip
flags.DEFINE_integer(
    "top_k", 0, "Top-k sampling of the responses (with --temperature > 0); 0 is off.",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "block_size", 16,
    "Block size of the drafter to be trained: responses shorter than 2x this many tokens are "
    "dropped (too short to train a block on).",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "prompts_per_shard", 256,
    "Prompts per output shard. A shard is written once all its prompts are answered; a rerun "
    "skips the prompts of the shards already written.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "bucket", 32,
    "--engine=fixed: prompt batches are padded to a width that is a multiple of this, so few "
    "shapes compile.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "overlap_ngram", 13,
    "Prompts sharing a word n-gram of this length with HumanEval, MT-Bench or the dev set (or "
    "equal to one) are dropped and listed in <output>/overlap_dropped.jsonl.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "max_prompts", 0,
    "Answer at most this many prompts, taken after the sources are shuffled together (0: all).",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer("seed", 0, "Seed for the prompt order, templated prompts and sampling.")


def _self_prompts(target, chat: ChatFormat, output: epath.Path, mesh) -> list[Prompt]:
    """`self_prompts` sampled once per output directory (`cached_self_prompts`)."""
    sample = lambda n: self_prompts(  # noqa: E731
        target, chat, n, batch_size=FLAGS.batch_size, temperature=FLAGS.self_prompt_temperature,
        max_tokens=FLAGS.self_prompt_max_tokens, seed=FLAGS.seed, mesh=mesh,
    )  # fmt: skip
    return cached_self_prompts(
        output / SELF_PROMPTS_FILE, FLAGS.self_prompts, sample,
        is_primary=distributed.is_primary(),
        barrier=lambda: distributed.barrier("self prompts written"),
    )  # fmt: skip


def main(argv):
    del argv
    distributed.initialize()
    mesh = distributed.local_mesh()
    output = paths.path(FLAGS.output)
    output.mkdir(parents=True, exist_ok=True)
    dtype = FLAGS.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    target = load_target(FLAGS.target, dtype=dtype, mesh=mesh, quantize=FLAGS.quantize)
    try:
        chat = ChatFormat(target.tokenizer, target.chat_template, FLAGS.thinking)
    except ValueError as e:
        raise app.UsageError(f"--thinking: {e}") from e

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
        prompts += _self_prompts(target, chat, output, mesh)
    prompts = dedupe(prompts)
    if not prompts:
        raise app.UsageError(
            "no prompts: give --prompts, --code_prompts, --math_prompts, --chat_prompts or "
            "--self_prompts"
        )

    overlap = OverlapFilter.for_benchmarks(FLAGS.overlap_ngram)
    dropped = [p for p in prompts if overlap.overlaps(p.text)]
    prompts = [p for p in prompts if not overlap.overlaps(p.text)]
    if distributed.is_primary():
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
        top_p=FLAGS.top_p,
        top_k=FLAGS.top_k,
        engine=FLAGS.engine,
        min_loss_tokens=2 * FLAGS.block_size,
        prompts_per_shard=FLAGS.prompts_per_shard,
        bucket=FLAGS.bucket,
        seed=FLAGS.seed,
        mesh=mesh,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    counts["overlap_dropped"] = len(dropped)
    logging.info("done: %s", counts)
    distributed.barrier("all shards written")
    if not distributed.is_primary():
        return
    mix = {**mixture(output), "thinking": chat.thinking_mode()}
    (output / "mixture.json").write_text(json.dumps(mix, indent=1))
    print(json.dumps({"this_run": counts, "mixture": mix}))


if __name__ == "__main__":
    cli.run(main)
