"""Acceptance (tau) of several decode shapes on a prompt set, all prompts decoded in one batch.

tau does not depend on the hardware, so it can be measured where speed cannot: every prompt of
the set is decoded at once (rows of different lengths, greedy) by `speculative_decode` for each
shape asked for, a chain of --block_size and a tree of each --trees size, and every row is
compared token for token with the target's own greedy output (`autoregressive_decode`). tau is
reported as infer.benchmark reports it (the mean over prompts of each prompt's mean accepted
tokens per step, bonus included), so a chain's figure equals the benchmark's on the same set.
Speed is not measured here (use infer.benchmark): rows of one batch share their steps.

    python -m infer.acceptance --dataset=humaneval --num_prompts=24 --max_new_tokens=128 \\
        --block_size=16 --trees=16,32,64 --output=results/tree_humaneval24_tau.json

--dataset, --num_prompts and --output are infer.benchmark's; MT-Bench: each question's first
turn. --default_mode adds the decode infer.generate runs by default ("default": adaptive, with
lookup kinds), checked against AR the same way.

A long run keeps what it has done: the AR reference and each shape's result go to
`<--output>.partial` as they finish, and the same command run again skips them (a run with other
settings starts over, and says so); the partial file is removed when the report is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding import (
    autoregressive_decode,
    calibration,
    programs,
    proposers,
    speculative_decode,
)
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.ops.invariance import machine_name, row_tile_for, software_name
from infer import benchmark, cli, common, keep

FLAGS = flags.FLAGS
# --dataset, --num_prompts and --output are infer.benchmark's (one definition, the same sets).
flags.adopt_module_key_flags(common)
flags.adopt_module_key_flags(benchmark)
flags.DEFINE_list(
    "trees",
    ["16", "32", "64"],
    f"Tree sizes (tree_nodes) to measure beside the chain, each 2 to {common.MAX_TREE_NODES}.",
)
flags.DEFINE_bool(
    "chain", True, "Measure the chain of --block_size (the reference of tau_vs_chain)."
)
flags.DEFINE_list(
    "confidence_cuts",
    [],
    "DSpark drafters with a confidence head: also measure the chain with each of these "
    "confidence cuts (DecodeConfig.confidence_cut, each in (0, 1)), run 'cut<c>'. A row's "
    "tau does not depend on the batch, but the verify width does (the widest row's), so the "
    "cost a cut saves is measured by infer.benchmark at batch 1, not here.",
)
flags.DEFINE_bool(
    "default_mode",
    False,
    "Also decode as infer.generate does by default (its block size, adaptive with the "
    "prompt-lookup kinds, step costs calibrated for this batch) and compare it with AR too.",
)


def prompt_tau(acceptance_bs: np.ndarray, steps_b: np.ndarray) -> np.ndarray:
    """Each row's mean accepted tokens per step over its own `steps_b[b]` steps -> [B]."""
    return np.array([acceptance_bs[b, : max(int(n), 1)].mean() for b, n in enumerate(steps_b)])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    try:
        trees = [int(t) for t in FLAGS.trees]
    except ValueError as e:
        raise app.UsageError(f"--trees={','.join(FLAGS.trees)}: sizes must be integers") from e
    try:
        cuts = [float(c) for c in FLAGS.confidence_cuts]
    except ValueError as e:
        raise app.UsageError(
            f"--confidence_cuts={','.join(FLAGS.confidence_cuts)}: cuts must be numbers"
        ) from e
    if any(not 0.0 < c < 1.0 for c in cuts):
        raise app.UsageError(f"--confidence_cuts={cuts}: each cut must be in (0, 1)")
    if any(not 2 <= t <= common.MAX_TREE_NODES for t in trees):
        raise app.UsageError(
            f"--trees={','.join(FLAGS.trees)}: a tree has 2 to {common.MAX_TREE_NODES} nodes"
        )
    with common.usage_errors():
        target, drafter, dtype, _ = common.load_models(choose_tile=False)
        if drafter is None:
            raise app.UsageError("--drafter=none: tau needs a drafter")
        block = FLAGS.block_size or api.default_block_size(target, drafter)
        convs = benchmark.load_conversations(FLAGS.dataset, FLAGS.num_prompts)
        prompt, lengths = api.pad_prompts(
            [api.render_prompt(target.tokenizer, c[0], True) for c in convs]
        )
        stops = api.stop_token_ids(target)
        # Every pass of the run (AR reference included) at one row tile, unless --row_tile the
        # one that holds the batch's widest verify (`row_tile_for`, at most 128; 24 rows x a
        # tree of 32 run as 6 tiles of 128 instead of 24 of 32): a position's bits are then the
        # same in all of them, by construction.
        tile = FLAGS.row_tile or row_tile_for(len(convs) * max([block, *trees]))
        base = DecodeConfig(
            max_new_tokens=FLAGS.max_new_tokens,
            block_size=block,
            stop_token_ids=stops,
            row_tile=tile,
        )
        api.check_inputs(target, drafter, prompt, lengths, base)
    # The chain is `base` (the AR reference's config at --block_size); a tree adds its nodes;
    # the default mode is what `api.generate` (so infer.generate) runs without decoding flags.
    runs = [(f"chain{block}", base)] if FLAGS.chain else []
    runs += [(f"tree{nodes}", dataclasses.replace(base, tree_nodes=nodes)) for nodes in trees]
    runs += [(f"cut{c:g}", dataclasses.replace(base, confidence_cut=c)) for c in cuts]
    if FLAGS.default_mode:
        runs.append(
            (
                "default",
                api.generate_config(
                    target, drafter, max_new_tokens=FLAGS.max_new_tokens, row_tile=tile
                ),
            )
        )
    if not runs:
        raise app.UsageError("nothing to measure: --nochain, --trees= and no --default_mode")
    key = jax.random.key(0)
    kw = dict(target_config=target.config)
    t0 = time.perf_counter()
    # Everything the kept results depend on (the code, jax and the CPU included: a row's bits
    # do): a rerun with any of it changed starts over.
    names = ("dataset", "num_prompts", "max_new_tokens", "quantize", "target", "drafter")
    settings = {
        "flags": {n: FLAGS[n].value for n in (*names, "attention_impl")},
        "code": keep.code_digest(),
        "software": software_name(),
        "machine": machine_name(),
        "dtype": dtype,
        "runs": {name: repr(cfg) for name, cfg in runs},
        "prompt": np.asarray(prompt).tolist(),
    }
    partial = FLAGS.output + ".partial"
    kept = keep.load(partial, settings)
    if "ar" in kept:
        ar_tokens = np.asarray(kept["ar"]["tokens"])
        ar_lengths = np.asarray(kept["ar"]["lengths"])
        print(f"AR reference and {len(kept['results'])} result(s) kept in {partial}", flush=True)
    else:
        ar = autoregressive_decode(target.params, prompt, lengths, key, **kw, decode_config=base)
        ar_tokens, ar_lengths = np.asarray(ar.tokens), np.asarray(ar.lengths)
        kept = {
            "settings": settings,
            "ar": {
                "tokens": ar_tokens.tolist(),
                "lengths": ar_lengths.tolist(),
                "seconds": time.perf_counter() - t0,
            },
            "results": {},
        }
        keep.save(partial, kept)
        print(f"AR reference: {kept['ar']['seconds']:.0f} s", flush=True)
    results = kept["results"]
    for name, cfg in runs:
        if name in results:
            continue
        t_run = time.perf_counter()
        extra = {}
        if cfg.adaptive:
            extra["step_costs"] = calibration.calibrate_step_costs(
                target, drafter, prompt, lengths, cfg
            )
        out = speculative_decode(
            target.params, drafter.decode_params, prompt, lengths, key, **kw,
            drafter_config=drafter.config, decode_config=cfg, **extra,
        )  # fmt: skip
        toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        same = [
            bool(lens[b] == ar_lengths[b] and np.array_equal(toks[b], ar_tokens[b]))
            for b in range(len(convs))
        ]
        tau_b = prompt_tau(np.asarray(out.acceptance_lengths), np.asarray(out.num_steps))
        kinds, counts = np.unique(np.asarray(out.block_sizes), return_counts=True)
        results[name] = {
            "tree_nodes": cfg.tree_nodes,
            "confidence_cut": cfg.confidence_cut,
            "block_size": cfg.block_size,
            "adaptive": cfg.adaptive,
            "lookup_kinds": list(cfg.lookup_kinds),
            "tau_mean": float(tau_b.mean()),
            "tau_per_prompt": tau_b.round(4).tolist(),
            "tokens_per_step": float(lens.sum() / np.asarray(out.num_steps).sum()),
            "outputs_identical": int(sum(same)),
            # row-steps by recorded kind (a cut run: the batch's verify width)
            "steps_by_kind": {int(k): int(c) for k, c in zip(kinds, counts, strict=True) if k},
            # steps and committed tokens by proposer, and the drafted blocks' own tau
            **proposers.report(out.block_sizes, out.acceptance_lengths),
            "seconds": time.perf_counter() - t_run,  # compile and calibration included
        }
        keep.save(partial, kept)
        print(
            f"{name}: {results[name]['seconds']:.0f} s, tau {tau_b.mean():.3f}, "
            f"identical {sum(same)}/{len(same)}",
            flush=True,
        )
    results = {name: results[name] for name, _ in runs}  # the order asked for
    chain = results.get(f"chain{block}", {}).get("tau_mean", float("nan"))
    report = {
        "dataset": FLAGS.dataset,
        "num_prompts": len(convs),
        "max_new_tokens": FLAGS.max_new_tokens,
        "block_size": block,
        "dtype": dtype,
        # the row rule every target pass ran under (None: not batch-invariant)
        "invariant_rows": programs.run_target_config(target.config, base).invariant_rows,
        "quantize": FLAGS.quantize,
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        "results": results,
        "tau_vs_chain": {k: v["tau_mean"] / chain for k, v in results.items()}
        if FLAGS.chain
        else {},
        # AR and every shape, summed over the runs that made them (a resumed run included)
        "seconds": kept["ar"]["seconds"] + sum(r["seconds"] for r in results.values()),
    }
    with open(FLAGS.output, "w") as f:
        json.dump(report, f, indent=1)
    os.remove(partial)
    for name, r in results.items():
        print(
            f"{FLAGS.dataset} {name}: tau {r['tau_mean']:.2f} "
            + (f"({r['tau_mean'] / chain:.2f}x the chain), " if FLAGS.chain else "")
            + f"outputs identical {r['outputs_identical']}/{len(convs)}"
        )


if __name__ == "__main__":
    cli.run(main)
