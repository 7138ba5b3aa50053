r"""τ, step cost and draft cost against the context length, with and without bounded drafting.

  python -m infer.bench.draft_context --contexts=512,1024,2048,5120,6144 --draft_window=1024 \
      --max_new_tokens=48 --output=results/draft_context.json

For each context length L the prompt is the first L tokens (SmolLM2's tokenizer) of this
repository's README.md and docs/*.md, one row, exactly L long (no bucket). Then, greedy, stop
tokens ignored (every run makes --max_new_tokens tokens), the drafter's trained block fixed
(--block_size, no adaptive steps, no lookup): the target alone (AR), and the speculative decode
with full drafting and, where L exceeds the window, with `--draft_window` (each full-attention
draft layer sees `draft_sinks` rows and the window before the anchor). Each decode is compiled
first (not timed), then run once: its start half (the prefill, and the drafter's prompt
context) and its loop are timed apart (`api.timed_decode`); a step's time is the loop's over
its steps. The drafter alone (`phases.draft_hidden`, one block at the context's end, over
context caches of the decode's shape) is timed over --repeats calls, median. τ is the mean
acceptance length (committed tokens per step, the bonus included); every speculative output is
compared with AR's token for token. Prints (and writes with --output) one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding import phases
from dflash_jax.decoding.runner import timed_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.ops import caches
from infer import cli
from infer.logs import quiet_library_logs

ROOT = Path(__file__).resolve().parents[2]

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model (as infer.generate).")
flags.DEFINE_string("drafter", "default", "Drafter (as infer.generate; default: the shipped one).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_list("contexts", ["512", "2048", "6144"], "Prompt lengths in tokens.")
flags.DEFINE_integer("draft_window", 1024, "The bounded drafting's window.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 48, "Tokens each decode makes.", lower_bound=2)
flags.DEFINE_integer("block_size", 0, "Verify block (0: the drafter's trained block).")
flags.DEFINE_integer("repeats", 20, "Timed calls of the drafter alone (median).", lower_bound=1)
flags.DEFINE_string("output", None, "Write the JSON object to this file as well.")


def corpus_ids(tokenizer, n: int) -> np.ndarray:
    """The first n tokens of README.md and docs/*.md (sorted), as one [1, n] prompt."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text() for f in files)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"the docs hold {len(ids)} tokens, fewer than the context {n}")
    return np.asarray(ids[:n], np.int32)[None]


def decode(target, drafter, prompt, cfg: DecodeConfig) -> dict:
    lengths = np.asarray([prompt.shape[1]], np.int32)
    run = timed_decode(target, drafter, prompt, lengths, 0, cfg)
    steps = int(np.asarray(run.output.num_steps)[0])
    acc = np.asarray(run.output.acceptance_lengths)[0, :steps]
    return {
        "tokens": np.asarray(run.output.tokens)[0].tolist(),
        "compile_s": run.compile_s,
        "prefill_s": run.start_s,
        "steps": steps,
        "step_s": (run.run_s - run.start_s) / steps,
        "tau": float(acc.mean()) if drafter is not None else 1.0,
    }


def draft_time(target, drafter, cfg: DecodeConfig, length: int, window: int) -> float:
    """Median seconds of one drafted block (the drafter's layers over its context cache at
    `length` rows) with `window` (0: full)."""
    dcfg = dataclasses.replace(
        drafter.config, draft_window=window, draft_sinks=cfg.draft_sinks if window else 0
    )
    bs = cfg.block_size
    cache_len = caches.tile_slots(length + cfg.max_new_tokens + 2 * bs)  # as `init_speculative`
    shape = (1, dcfg.num_kv_heads, cache_len, dcfg.head_dim)
    keys = jax.random.split(jax.random.key(0), 2 * dcfg.num_layers)
    ctx = [jax.random.normal(k, shape, jnp.dtype(dcfg.dtype)) for k in keys]
    ctx_k, ctx_v = tuple(ctx[: dcfg.num_layers]), tuple(ctx[dcfg.num_layers :])
    at_b = jnp.full((1,), length, jnp.int32)
    anchor_b1 = jnp.ones((1, 1), jnp.int32)
    fn = jax.jit(
        lambda dp, tp, k, v: phases.draft_hidden(
            dp, tp, target.config, dcfg, anchor_b1, k, v, at_b, at_b, bs
        )
    )
    args = (drafter.params, target.params, ctx_k, ctx_v)
    fn(*args).block_until_ready()
    times = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_library_logs()
    target, drafter = api.load_pair(FLAGS.target, FLAGS.drafter, dtype=FLAGS.dtype)
    block = FLAGS.block_size or drafter.config.block_size
    cfg = DecodeConfig(max_new_tokens=FLAGS.max_new_tokens, block_size=block)
    window = FLAGS.draft_window
    out = {
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        "dtype": FLAGS.dtype,
        "block_size": block,
        "max_new_tokens": FLAGS.max_new_tokens,
        "draft_window": window,
        "draft_sinks": cfg.draft_sinks,
        "contexts": {},
    }
    for length in (int(c) for c in FLAGS.contexts):
        prompt = corpus_ids(target.tokenizer, length)
        ar = decode(target, None, prompt, dataclasses.replace(cfg, block_size=1))
        row = {"ar": {k: v for k, v in ar.items() if k not in ("tokens", "tau")}}
        for name, w in (("full", 0), ("window", window)):
            if w and length <= window + cfg.draft_sinks:
                continue  # the window holds the whole context: the full decode's numbers
            sp = decode(target, drafter, prompt, dataclasses.replace(cfg, draft_window=w))
            sp["identical_to_ar"] = sp.pop("tokens") == ar["tokens"]
            sp["draft_s"] = draft_time(target, drafter, cfg, length, w)
            sp["step_over_ar_step"] = sp["step_s"] / ar["step_s"]
            sp["draft_over_step"] = sp["draft_s"] / sp["step_s"]
            row[name] = sp
        if "window" in row:
            row["window_draft_over_full_draft"] = row["window"]["draft_s"] / row["full"]["draft_s"]
        out["contexts"][str(length)] = row
        print(json.dumps({str(length): row}), flush=True)
    if FLAGS.output:
        Path(FLAGS.output).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    cli.run(main)
