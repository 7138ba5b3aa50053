r"""Training-data generation's two engines on the same prompts: answer tokens per second of
fixed padded batches (each run until its longest answer stops) against the slot engine
(continuous batching: a row whose answer stops takes the next prompt at once).

  python -m infer.bench.data_engines --num_prompts=64 --batch_size=16 --max_new_tokens=256

The prompts mix answer lengths on purpose: a quarter ask for one word, a quarter for a short answer,
a quarter for an explanation, a quarter for a long essay (topics from
`training.prompt_templates.TOPICS`); `--prompts=mtbench` answers MT-Bench's first turns instead
(real prompts, whose answers' lengths are not tied to their prompts' as the mixed kinds' are). Both
engines answer greedily with the same settings, so their answers must be the same (`same_answers`);
every program each runs is compiled and run once first (`Answerer.warm_up`), so the timed runs hold
no compilation. Prints one JSON object: per engine seconds (and this process's CPU seconds: the
steadier figure on a shared machine), answer tokens and tokens/s, the answers' lengths, and the
speed-ups.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags

from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io.assets import load_mtbench_questions
from dflash_jax.io.target_loader import load_target
from dflash_jax.training.continuous import CHUNK_STEPS
from dflash_jax.training.generate import Answerer, ChatFormat, bucketed_batches
from dflash_jax.training.prompt_templates import TOPICS
from infer import cli, report

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "Target that answers (as generate_data).")
flags.DEFINE_enum(
    "dtype", "auto", ["auto", "float32", "bfloat16"],
    "Dtype of the target: auto is bfloat16 on GPU/TPU, float32 on CPU.",
)  # fmt: skip
flags.DEFINE_enum(
    "prompts", "mixed", ["mixed", "mtbench"],
    "The prompt set: mixed (KINDS: one word to an essay, a quarter each; a kind's prompts have "
    "similar lengths, so fixed batches sorted by prompt length hold one kind each) or mtbench "
    "(the first turns of the MT-Bench questions, in order: real chat prompts, whose answer "
    "lengths do not follow their prompts' lengths).",
)  # fmt: skip
flags.DEFINE_integer("num_prompts", 64, "Prompts answered by each engine.", lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "Rows decoding together (both engines).", lower_bound=1)
flags.DEFINE_integer(
    "fixed_batch_size", None,
    "The fixed batches' rows, when not --batch_size: each engine at the row count it runs "
    "fastest at on this machine (fixed batches idle more as they grow, the slots do not).",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer("max_new_tokens", 256, "Longest answer in tokens.", lower_bound=1)
flags.DEFINE_integer(
    "chunk_steps", CHUNK_STEPS,
    "Slot engine: the most loop steps between host visits (a chunk also ends when a row stops).",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_string("output", None, "Also write the JSON object here.")

KINDS = (
    "Reply with one word only: is {t} a good topic for a school project?",
    "What is {t}? Keep it short.",
    "Explain {t} to a beginner.",
    "Write a long, detailed essay about {t}, with several sections.",
)


def mixed_prompts(n: int) -> list[str]:
    """`n` prompts cycling through KINDS (one-word to essay answers), each its own topic."""
    return [KINDS[i % len(KINDS)].format(t=TOPICS[i % len(TOPICS)]) for i in range(n)]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    dtype = FLAGS.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    target = load_target(FLAGS.target, dtype=dtype)
    chat = ChatFormat(target.tokenizer, target.chat_template)
    if FLAGS.prompts == "mtbench":
        texts = [q["turns"][0] for q in load_mtbench_questions()][: FLAGS.num_prompts]
    else:
        texts = mixed_prompts(FLAGS.num_prompts)
    prompts = [chat.prompt_ids(p) for p in texts]
    cfg = DecodeConfig(
        max_new_tokens=FLAGS.max_new_tokens,
        stop_token_ids=tuple(sorted(set(target.config.eos_token_ids))),
    )
    fixed_rows = FLAGS.fixed_batch_size or FLAGS.batch_size
    result = {
        "target": FLAGS.target, "dtype": dtype, "device": jax.devices()[0].device_kind,
        "prompts": FLAGS.prompts, "num_prompts": len(prompts), "batch_size": FLAGS.batch_size,
        "fixed_batch_size": fixed_rows,
        "max_new_tokens": FLAGS.max_new_tokens, "engines": {},
    }  # fmt: skip
    answers = {}
    for engine in ("fixed", "slots"):
        n_rows = fixed_rows if engine == "fixed" else FLAGS.batch_size
        answerer = Answerer(
            target, cfg, engine=engine, batch_size=n_rows, bucket=32,
            max_prompt_tokens=max(map(len, prompts)), chunk_steps=FLAGS.chunk_steps,
        )  # fmt: skip
        answerer.warm_up(prompts)
        t0, c0 = time.perf_counter(), time.process_time()
        answers[engine] = answerer(prompts, jax.random.key(0))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(a) for a in answers[engine])
        if engine == "slots":
            steps = {str(rows): n for rows, n in answerer.slot_steps().items()}
        else:  # each batch runs until its longest answer ends (the prefill gave token 1)
            batches = bucketed_batches([len(x) for x in prompts], n_rows)
            longest = [max(len(answers[engine][i]) for i in batch) for batch in batches]
            steps = {str(n_rows): sum(n - 1 for n in longest)}
        result["engines"][engine] = {
            "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "answer_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2),
            "tokens_per_cpu_s": round(tokens / cpu, 2),
            "loop_steps_by_rows": steps,
        }
    lengths = np.asarray([len(a) for a in answers["slots"]])
    result["answer_lengths"] = {
        "min": int(lengths.min()),
        "median": float(np.median(lengths)),
        "max": int(lengths.max()),
        "at_max_new_tokens": int((lengths >= FLAGS.max_new_tokens).sum()),
    }
    result["same_answers"] = answers["fixed"] == answers["slots"]
    engines = result["engines"]
    result["speedup"] = round(
        engines["slots"]["tokens_per_s"] / engines["fixed"]["tokens_per_s"], 3
    )
    # On a shared machine wall time counts other work: the CPU time this process spent is the
    # steadier comparison there (all threads' time summed).
    result["speedup_cpu"] = round(
        engines["slots"]["tokens_per_cpu_s"] / engines["fixed"]["tokens_per_cpu_s"], 3
    )
    report.emit_json(result, FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
