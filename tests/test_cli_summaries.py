"""The terminal summaries of infer.generate and infer.benchmark, from results these CLIs wrote:
a title, then one aligned `label  value` line per figure (no JAX computation runs)."""

from __future__ import annotations

import json
from pathlib import Path

from infer import report

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _rows(text: str) -> dict[str, str]:
    """The summary's rows as {label: value}, checking every value starts in one column."""
    title, *lines = text.splitlines()
    assert title and not title.startswith(" ") and lines
    starts = set()
    rows = {}
    for line in lines:
        assert line.startswith("  ") and len(line) <= 100, line
        label, value = line[2:].split("  ", 1)
        starts.add(len(line) - len(value.lstrip()))
        rows[label.strip()] = value.strip()
    assert len(starts) == 1, text
    return rows


def test_summaries_are_aligned_lines_of_each_figure():
    run = json.loads((RESULTS / "main_command_run1.json").read_text())  # its --json output
    run.update(dtype="float32", dtype_choice="--dtype", batch_invariant=False)
    rows = _rows(report.generate_summary(run))
    assert rows["tau"] == "3.27 tokens per step"
    assert rows["steps by kind"] == "35 plain, 30 copy 8, 11 copy 16, 2 block 4"
    assert (rows["DFlash"], rows["target alone"], rows["speedup"]) == (
        "32.2 tok/s", "23.7 tok/s", "1.36x",
    )  # fmt: skip
    assert rows["outputs"] == "identical to the target alone"
    assert rows["dtype"] == "float32, as --dtype asked"
    assert rows["load, compile"] == "2.4 s, 106.4 s (not timed)"

    bench = json.loads((RESULTS / "tree_bench_dev24_fixed_t32.json").read_text())
    bench["aggregate"]["outputs_identical"] = False
    bench["aggregate"]["tau_by_kind"] = {"-4": 1.468, "4": 1.58}
    rows = _rows(report.benchmark_summary(bench, "out.json"))
    assert rows["steps by kind"] == "100% tree 32"
    assert rows["tau by kind"] == "copy 4 1.47, block 4 1.58"
    assert rows["speedup"].startswith("0.15x") and rows["one DFlash step"] == "12.92 AR steps"
    assert rows["outputs"] == "DIFFERENT from the target alone"
    bench["aggregate"]["tokens_by_proposer"] = {"corpus_copy": 60, "drafted": 1, "plain": 39}
    bench["aggregate"]["drafter_alone"] = {
        "speedup_vs_fastest_ar": 0.81, "tau_mean": 1.2, "outputs_identical": True
    }  # fmt: skip
    rows = _rows(report.benchmark_summary(bench, "out.json"))
    assert rows["tokens from"] == "60.0% corpus copy, 39.0% plain, 1.0% drafted"
    assert rows["drafter alone"].startswith("0.81x the fastest AR, tau 1.20")
    assert report.kind_mix({"1": 0.7, "-8": 0.297, "16": 0.003}, share=True) == (
        "70% plain, 30% copy 8, <1% block 16"
    )
    # --dtype=auto: its choice and the floors it compared, on one line.
    assert rows["dtype"] == "float32, chosen by --dtype=auto"
    assert rows["because"] == bench["environment"]["dtype_choice"]
