"""The end-of-run summaries of infer.generate and infer.benchmark: a title line, then aligned
`label  value` lines; and the measuring scripts' one JSON object (`emit_json`). No flags are
defined here, so that any CLI can import it."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(result: dict, output: str | None) -> None:
    """A measuring script's result: printed as indented JSON and, with `output`, written there
    too (its directory made if missing)."""
    text = json.dumps(result, indent=1)
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")


def kind_words(label: str) -> str:
    """A step kind's label (`settings.kind_label`: "1", "8", "-8", "corpus8", "tree16") in
    words: "plain", "block 8", "copy 8" (a block copied from the text by prompt lookup),
    "corpus copy 8" (copied from the corpus table), "tree 16"."""
    if label == "1":
        return "plain"
    if label.startswith("tree"):
        return f"tree {label[4:]}"
    if label.startswith("corpus"):
        return f"corpus copy {label[6:]}"
    if label.startswith("-"):
        return f"copy {label[1:]}"
    return f"block {label}"


def kind_mix(mix: dict[str, float], share: bool = False) -> str:
    """{kind label: steps} (or, with `share`, {label: fraction of steps}) as one line, the most
    taken kind first: "35 plain, 30 copy 8, 2 block 4" or "70% plain, 23% copy 8"."""
    ranked = sorted(mix.items(), key=lambda kv: -kv[1])
    count = (lambda v: f"{100 * v:.0f}%" if v >= 0.005 else "<1%") if share else str
    return ", ".join(f"{count(v)} {kind_words(k)}" for k, v in ranked)


def proposer_shares(tokens: dict[str, int]) -> str:
    """{proposer: committed tokens} as one line of shares, the largest first: "61% corpus
    copy, 30% text copy, 6% plain, 3% drafted"."""
    total = max(sum(tokens.values()), 1)
    ranked = sorted(((v, k) for k, v in tokens.items() if v), reverse=True)
    words = lambda k: k.replace("_", " ")
    return ", ".join(f"{100 * v / total:.1f}% {words(k)}" for v, k in ranked)


def block(title: str, rows: list[tuple[str, str]]) -> str:
    """The title, then one `  label  value` line per row, the values in one column."""
    width = max(len(label) for label, _ in rows)
    return "\n".join([title] + [f"  {label:<{width}}  {value}" for label, value in rows])


def identical(same: bool, to: str = "the target alone") -> str:
    return f"identical to {to}" if same else f"DIFFERENT from {to}"


def generate_summary(result: dict) -> str:
    """A few aligned lines: what ran, tau and steps by kind, the speed (with --compare_ar the
    target alone's, the speedup and whether the outputs are identical), dtype, set-up times."""
    tau = f"{result['tau_mean']:.2f}" if result["tau_mean"] is not None else "n/a"
    rows = [("tau", f"{tau} tokens per step")]
    if "step_kind_mix" in result:
        rows.append(("steps by kind", kind_mix(result["step_kind_mix"])))
    if "tokens_by_proposer" in result:
        rows.append(("tokens from", proposer_shares(result["tokens_by_proposer"])))
    speed = "speed" if result["mode"] == "autoregressive" else "DFlash"
    rows.append((speed, f"{result['tokens_per_s']:.1f} tok/s"))
    if "speedup" in result:
        rows += [
            ("target alone", f"{result['ar_tokens_per_s']:.1f} tok/s"),
            ("speedup", f"{result['speedup']:.2f}x"),
            ("outputs", identical(result["outputs_identical"])),
        ]
    invariant = ", batch-invariant" if result["batch_invariant"] else ""
    if result["dtype_choice"] == "--dtype":
        rows.append(("dtype", f"{result['dtype']}{invariant}, as --dtype asked"))
    else:
        rows.append(("dtype", f"{result['dtype']}{invariant}, chosen by --dtype=auto"))
        rows.append(("because", result["dtype_choice"]))
    compile_s = result["compile_s"] + result.get("ar_compile_s", 0.0)
    rows.append(("load, compile", f"{result['load_s']:.1f} s, {compile_s:.1f} s (not timed)"))
    title = (
        f"{result['mode']}, block {result['block_size']}: {result['new_tokens']} tokens in "
        f"{result['steps']} steps"
    )
    return block(title, rows)


def benchmark_summary(result: dict, output: str) -> str:
    """The end of a run in a few aligned lines: tau (and prompt lookup's), the step kinds taken,
    both speeds and the speedups, a step's cost in AR steps, identity, dtype."""
    agg, env = result["aggregate"], result["environment"]
    fastest = agg["fastest_ar"]
    invariant = ", batch-invariant" if env["batch_invariant"] else ""
    auto = env.get("dtype_choice", "--dtype") != "--dtype"
    rows = [
        ("tau", f"{agg['tau_mean']:.2f} tokens per step"),
        ("lookup tau", f"{agg['prompt_lookup_tau_mean']:.2f} (prompt lookup alone, offline)"),
        ("steps by kind", kind_mix(agg["step_kind_mix"], share=True)),
        *(
            [("copies from", f"the text, else the target's answers ({corpus:,} n-grams)")]
            if (corpus := env.get("corpus_ngrams"))
            else []
        ),
        *(
            [("tau by kind", ", ".join(f"{kind_words(k)} {v:.2f}" for k, v in tau.items()))]
            if (tau := agg.get("tau_by_kind"))
            else []
        ),
        ("target alone", f"{agg['ar_tokens_per_s']:.1f} tok/s"),
        ("DFlash", f"{agg['dflash_tokens_per_s']:.1f} tok/s"),
        ("speedup", f"{agg['speedup']:.2f}x (mean TPOT of the target alone / DFlash's)"),
        (
            "vs fastest AR",
            f"{agg['speedup_vs_fastest_ar']:.2f}x ({fastest['dtype']}, "
            f"{fastest['tokens_per_s']:.1f} tok/s)",
        ),
        *(
            [("tokens from", proposer_shares(tokens))]
            if (tokens := agg.get("tokens_by_proposer"))
            else []
        ),
        *(
            [
                (
                    "drafter alone",
                    f"{solo['speedup_vs_fastest_ar']:.2f}x the fastest AR, tau "
                    f"{solo['tau_mean']:.2f} (the lookups off; "
                    f"{identical(solo['outputs_identical'])})",
                )
            ]
            if (solo := agg.get("drafter_alone"))
            else []
        ),  # fmt: skip
        ("one DFlash step", f"{agg['step_cost_ratio']:.2f} AR steps"),
        ("outputs", identical(agg["outputs_identical"])),
        ("dtype", env["dtype"] + invariant + (", chosen by --dtype=auto" if auto else "")),
        *([("because", env["dtype_choice"])] if auto else []),
        ("written to", output),
    ]
    mode = "adaptive, " if env["adaptive"] else ""
    title = f"{result['dataset']}, {mode}block {env['block_size']}: {agg['turns']} turns"
    return block(title, rows)
