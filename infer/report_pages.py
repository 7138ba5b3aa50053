"""Writes the figures on the project's pages from the files in results/: one source for each.

    python -m infer.report_pages           # rewrite every generated block
    python -m infer.report_pages --check   # exit 1, naming each block that differs from its files

A generated block of a page lies between `<!-- report_pages:NAME -->` and
`<!-- /report_pages:NAME -->`; everything else on the page is written by hand.
`tests/test_report_pages.py` fails when a page's block differs from what its files give.

The blocks: README.md's quickstart summary (`quickstart`) and results table (`results`), and
the machines every figure names (`machines`, in README.md and docs/results.md). To add a row to
the README's table, add one `Row` to `RESULTS_ROWS` (an `infer.benchmark` JSON needs only
`benchmark_row`), name its machine in `MACHINES`, then run this module
(docs/development.md#figures).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"

# Every machine a figure was measured on, described once (`lscpu`'s model name and the flags
# that decide this workload's speed: AVX-512, bf16 dot units, AMX).
MACHINES = {
    "epyc": "AMD EPYC VM, 2 cores, no AVX-512 or AMX (as the notes of 2026-11-30 to 12-02 "
    "record it; lscpu flags not kept)",
    "epyc-bf16": "AMD EPYC VM, 2 cores, lscpu flags avx2 avx512f avx512_bf16, no AMX",
    "xeon-amx": "Intel Xeon VM, 2 cores, lscpu flags avx2 avx512f avx512_bf16 avx512_fp16 "
    "amx_bf16 amx_tile",
    "plan": "no run: a plan computed on the CPU (XLA:CPU memory analysis, buffer arithmetic)",
}


def load(name: str) -> dict:
    """results/NAME as JSON."""
    return json.loads((RESULTS / name).read_text())


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of README.md's results table. figure: the figure cell, computed from the files
    (`load`); files: the results files the figures come from (the first is linked unless
    `link` names a docs/results.md section instead)."""

    measurement: str
    figure: Callable[[], str]
    machine: str  # a key of MACHINES
    conditions: str  # what else ran, as the file records it ("" if it does not)
    date: str
    files: tuple[str, ...]
    link: str = ""  # a docs/results.md anchor to link instead of the first file

    def cells(self) -> list[str]:
        if self.link:
            where = f"[results](docs/results.md#{self.link})"
        else:
            where = ", ".join(f"[{f}](results/{f})" for f in self.files)
        machine = f"{MACHINE_SHORT[self.machine]}" + (
            f", {self.conditions}" if self.conditions else ""
        )
        return [self.measurement, self.figure(), machine, self.date, where]


MACHINE_SHORT = {
    "epyc": "AMD EPYC",
    "epyc-bf16": "AMD EPYC (avx512_bf16)",
    "xeon-amx": "Intel Xeon (AMX)",
    "plan": "CPU plan",
}


def identical(ok: bool) -> str:
    return "identical" if ok else "**NOT identical**"


def benchmark_figure(name: str) -> str:
    """τ, DFlash and target-alone speed, speedup and equality of an `infer.benchmark` JSON."""
    a = load(name)["aggregate"]
    return (
        f"τ {a['tau_mean']:.2f}, {a['dflash_tokens_per_s']:.1f} against "
        f"{a['ar_tokens_per_s']:.1f} tok/s for the target alone: **{a['speedup']:.2f}×**, "
        f"{identical(a['outputs_identical'])}"
    )


def benchmark_row(
    name: str, measurement: str, machine: str, date: str, conditions: str = ""
) -> Row:
    """A row for an `infer.benchmark --output=results/NAME` file."""
    return Row(measurement, lambda: benchmark_figure(name), machine, conditions, date, (name,))


def _main_command() -> str:
    """The README's first command's own summary lines (`infer.generate --compare_ar`)."""
    rows = dict(re.match(r"  (\S.*?)\s{2,}(.+)$", line).groups() for line in _summary()[1:])
    return (
        f"τ {rows['tau'].split()[0]}, {rows['DFlash']} against {rows['target alone']} for the "
        f"target alone (bf16 under the row rule, as chosen): **{rows['speedup']}**; "
        f"{rows['steps by kind']}; {rows['outputs']}"
    )


def _dspark() -> str:
    tau = {
        (d, arm): load(f"dspark_compare_{d}_{arm}.json")["results"]["chain16"]["tau_mean"]
        for d in ("dev", "humaneval", "mtbench")
        for arm in ("dspark", "base")
    }
    speed = {arm: load(f"dspark_bench_dev_{arm}.json")["aggregate"] for arm in ("dspark", "dflash")}
    same = all(a["outputs_identical"] for a in speed.values())
    names = {"dev": "dev", "humaneval": "HumanEval", "mtbench": "MT-Bench"}
    taus = ", ".join(f"{names[d]} {tau[d, 'dspark']:.3f} / {tau[d, 'base']:.3f}" for d in names)
    return (
        f"τ {taus}; batch-1 dev speed at block 16 {speed['dspark']['speedup']:.2f}× / "
        f"{speed['dflash']['speedup']:.2f}×; {identical(same)}"
    )


def _fixed_b16() -> str:
    a = load("dev_b16.json")["aggregate"]
    return (
        f"τ {a['tau_mean']:.2f}, {a['speedup']:.2f}× (a 16-token step costs "
        f"{a['step_cost_ratio']:.1f} AR steps on a CPU)"
    )


def _tree() -> str:
    r = load("tree_dev24_tau.json")["results"]
    return (
        f"τ {r['32']['tau_mean']:.2f} against {r['0']['tau_mean']:.2f} for the chain, "
        f"{r['32']['rows_identical']}/{load('tree_dev24_tau.json')['n_prompts']} identical"
    )


BF16_EQUALITY = (
    "bf16_dev24_256_equality_v2.json",
    "bf16_humaneval16_256_equality.json",
    "bf16_mtbench8_256_equality.json",
)


def _bf16_equality() -> str:
    files = [load(f) for f in BF16_EQUALITY]
    rows = sum(f["num_prompts"] for f in files)
    every = all(
        r["outputs_identical"] == f["num_prompts"] for f in files for r in f["results"].values()
    )
    kinds = sorted({k for f in files for k in f["results"]})
    return (
        f"{'identical in every row' if every else '**rows differ**'} of {rows} prompts, "
        f"{' and '.join(kinds)}"
    )


def _fixed_tile() -> str:
    f = load("acceptance_dev24_bf16_fixed_tile.json")
    r = f["results"]
    every = all(v["outputs_identical"] == f["num_prompts"] for v in r.values())
    order = ("chain16", "tree16", "tree32", "default")
    taus = ", ".join(f"{r[k]['tau_mean']:.2f}" for k in order)
    return (
        f"{'identical in every row' if every else '**rows differ**'}: chain, trees of 16 and "
        f"32, default (τ {taus})"
    )


QUANT = ("fp32", "int8", "int4", "fp8")


def _quant_tau() -> str:
    files = [load(f"issue42_dev24_{q}_tau.json") for q in QUANT]
    taus = " / ".join(f"{f['results']['chain16']['tau_mean']:.2f}" for f in files)
    every = all(f["results"]["chain16"]["outputs_identical"] == f["num_prompts"] for f in files)
    return f"{taus}, {'every row identical' if every else 'rows differ'} to that target's AR"


def _quant_speed() -> str:
    runs = load("issue42_quant_speed.json")["runs"]
    names = {
        "float32": "fp32",
        "bfloat16": "bf16",
        "int8 (float32)": "int8",
        "int4 (float32)": "int4",
    }
    speeds = ", ".join(
        f"{short} {runs[f'{key}, target alone']['tokens_per_s_median']:.1f}"
        for key, short in names.items()
    )
    return f"{speeds} tok/s: XLA:CPU does not fuse the dequantization, so no gain here"


def _memory_plan() -> str:
    f = load("issue42_memory_plan_qwen3_8b_int8_8k.json")
    gib = f["gib_per_device"]["total less the CPU-only copies"]
    chip = f["device_gb"] * 1e9 / 2**30
    fits = f["fits"]["total less the CPU-only copies"]
    return f"{gib:.2f} GiB: {'fits' if fits else 'does not fit'} a {chip:.0f} GiB v5e chip"


def _first_answer() -> str:
    runs = load("first_answer_2026-12-04b.json")["runs"]
    cached = runs[1:3]
    compile_s = sorted(r["compile_s"] for r in cached)
    return (
        f"{runs[0]['wall_s']:.1f} s, then {cached[0]['wall_s']:.1f} s and "
        f"{cached[1]['wall_s']:.1f} s (cached: load {cached[0]['load_s']:.1f} s, compile "
        f"{compile_s[0]:.1f}-{compile_s[-1]:.1f} s)"
    )


def _first_answer_phases() -> str:
    f = load("first_answer_phases_2026-12-05.json")
    first, second = f["first_run"], f["second_run"]
    decodes = second["dflash_decode_s"] + second["target_alone_decode_s"]
    return (
        f"{first['total_s']:.1f} s, then {second['total_s']:.1f} s: the two decodes "
        f"{decodes:.1f} s of it (the target alone {second['target_alone_decode_s']:.1f} s), "
        f"programs {second['programs_s']:.1f} s, warm-up {second['warm_up_s']:.1f} s"
    )


SERVE = ("serve_load_2026-12-04e.json", "serve_load_2026-12-04f.json")


def _span(values, fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"


def _serve() -> str:
    runs = [load(f) for f in SERVE]
    served = [r["served"] for r in runs]
    same = all(r["greedy_identical"] == runs[0]["greedy_identical"] for r in runs)
    return (
        f"**{_span([r['throughput_ratio'] for r in runs], '.2f')}×** the throughput in "
        f"{len(runs)} runs ({_span([s['tokens_per_s'] for s in served], '.1f')} against "
        f"{_span([r['one_by_one']['tokens_per_s'] for r in runs], '.1f')} tok/s; "
        f"`--dtype=auto` serves {runs[0]['dtype'].replace('float', 'fp')} at "
        f"{runs[0]['slots']} slots), greedy "
        f"{runs[0]['greedy_identical'] if same else 'differs'} identical, TTFT p50 "
        f"{_span([s['ttft_s_streamed']['p50'] for s in served], '.2f')} s, p95 latency "
        f"{_span([s['latency_s']['p95'] for s in served], '.1f')} s"
    )


def _kernel_memory() -> str:
    m = load("kernel_memory_cpu.json")["memory"]
    mib = 2**20
    return (
        f"Pallas kernel {m['pallas']['temp_bytes'] / mib:,.0f} MiB, XLA "
        f"{m['xla']['temp_bytes'] / mib:,.0f} MiB"
    )


DEFAULT_VS_FASTEST_AR = (
    "benchmark_dev24_epyc_proposers_2026-12-07.json",
    "benchmark_humaneval24_epyc_corpus_2026-12-06.json",
    "benchmark_mtbench12_epyc_corpus_2026-12-06.json",
)


def _by_proposer(a: dict) -> str:
    """A benchmark aggregate's drafter-alone figure and its shares of tokens by proposer, where
    the file has them (runs before issue 69 do not): ", drafter alone 0.85× (τ 1.31); tokens:
    62% corpus copy, ..."."""
    out = ""
    if solo := a.get("drafter_alone"):
        out += (
            f"; drafter alone (lookups off) {solo['speedup_vs_fastest_ar']:.2f}× "
            f"(τ {solo['tau_mean']:.2f})"
        )
    if tokens := a.get("tokens_by_proposer"):
        total = max(sum(tokens.values()), 1)
        shares = sorted(((v, k) for k, v in tokens.items() if v), reverse=True)
        out += "; tokens: " + ", ".join(
            f"{100 * v / total:.1f}% {k.replace('_', ' ')}" for v, k in shares
        )
    return out


def _default_vs_fastest_ar(files=DEFAULT_VS_FASTEST_AR, names=None) -> str:
    names = names or ("dev 24", "HumanEval 24", "MT-Bench 12")
    aggs = [load(f)["aggregate"] for f in files]
    figures = ", ".join(
        f"{n} **{a['speedup_vs_fastest_ar']:.2f}×** (τ {a['tau_mean']:.2f}{_by_proposer(a)})"
        for n, a in zip(names, aggs, strict=True)
    )
    same = all(a["outputs_identical"] for a in aggs)
    same &= all(a.get("drafter_alone", {}).get("outputs_identical", True) for a in aggs)
    return f"{figures} against plain bf16 AR in the same run; {identical(same)}"


QUICKSTART_FILE = "main_command_2026-12-06b.txt"


# README.md's results table, in order. Adding a row: one entry here (see the module docstring).
RESULTS_ROWS = (
    Row(
        "the default decode (`--dtype=auto`: bf16 at row tile 4 chosen; copies from the text and "
        "the target's answers) against the fastest AR (`infer.benchmark`; dev 256 new tokens, with "
        "the tokens by proposer and the drafter alone; HumanEval and MT-Bench 128, before both)",
        _default_vs_fastest_ar, "epyc-bf16", "nothing else running", "2026-12-07 (dev), 12-06",
        DEFAULT_VS_FASTEST_AR, link="the-default-decode-against-the-fastest-ar-issue-55",
    ),
    Row(
        "the README's first command (128 tokens, one prompt whose answer is code)",
        _main_command, "epyc-bf16", "nothing else running", "2026-12-06", (QUICKSTART_FILE,),
    ),
    Row(
        "DSpark against DFlash, both continued from the shipped drafter for 10 CPU-minutes",
        _dspark, "epyc-bf16", "", "2026-12-04",
        tuple(f"dspark_compare_{d}_{a}.json" for d in ("dev", "humaneval", "mtbench")
              for a in ("dspark", "base"))
        + ("dspark_bench_dev_dspark.json", "dspark_bench_dev_dflash.json"),
        link="dspark-against-dflash-at-equal-cpu-time",
    ),
    Row(
        "dev set, fixed block 16", _fixed_b16, "epyc", "other jobs paused", "2026-12-02",
        ("dev_b16.json",),
    ),
    Row(
        "dev set, tree of 32 nodes, greedy fp32", _tree, "epyc", "", "2026-12-02",
        ("tree_dev24_tau.json",),
    ),
    Row(
        "bf16 greedy against bf16 AR, 256 tokens, dev, HumanEval and MT-Bench", _bf16_equality,
        "epyc-bf16", "", "2026-12-03", BF16_EQUALITY,
    ),
    Row(
        "bf16 greedy trees against bf16 AR, dev 24, 256 tokens, every pass at one fixed row tile",
        _fixed_tile, "xeon-amx", "", "2026-12-05", ("acceptance_dev24_bf16_fixed_tile.json",),
    ),
    Row(
        "τ against fp32 / int8 / int4 / fp8 targets, dev 24, chain 16 "
        "(`infer.acceptance --quantize=...`)",
        _quant_tau, "epyc-bf16", "", "2026-12-04",
        tuple(f"issue42_dev24_{q}_tau.json" for q in QUANT), link="quantized-targets-issue-42",
    ),
    Row(
        "quantized targets on this CPU, target alone, 64 tokens (`infer.bench.quant_speed`)",
        _quant_speed, "epyc-bf16", "loaded", "2026-12-04", ("issue42_quant_speed.json",),
    ),
    Row(
        "Qwen3-8B int8 decode, 8K context, one device (`infer.memory_plan --quantize=int8`)",
        _memory_plan, "plan", "", "2026-12-04", ("issue42_memory_plan_qwen3_8b_int8_8k.json",),
    ),
    Row(
        "time to a first answer, fresh clone and empty `HOME` (the `infer.generate` part)",
        _first_answer, "epyc-bf16", "", "2026-12-04", ("first_answer_2026-12-04b.json",),
    ),
    Row(
        "time to a first answer, empty `HOME`, phase by phase (`infer.bench.first_answer`)",
        _first_answer_phases, "xeon-amx", "", "2026-12-05",
        ("first_answer_phases_2026-12-05.json",),
    ),
    Row(
        "`infer.serve`, 32 requests from 8 clients against one by one (`infer.bench.serve_load`)",
        _serve, "epyc-bf16", "nothing else running", "2026-12-04", SERVE,
    ),
    Row(
        "training attention memory, Qwen3-8B drafter shapes", _kernel_memory, "plan", "",
        "2026-12-01", ("kernel_memory_cpu.json",),
    ),
)  # fmt: skip


def _summary() -> list[str]:
    """The last summary `infer.generate` printed in QUICKSTART_FILE: its head line ("...: N
    tokens in M steps") and its indented "  name   value" lines."""
    lines = (RESULTS / QUICKSTART_FILE).read_text().splitlines()
    start = max(i for i, line in enumerate(lines) if re.match(r"\S.*: \d+ tokens in", line))
    end = start + 1
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    return lines[start:end]


def quickstart() -> str:
    """The README's quickstart summary: the last summary printed in QUICKSTART_FILE."""
    lines = _summary()
    summary = "\n".join(lines)
    steps = int(re.search(r"tokens in (\d+) steps", lines[0]).group(1))
    kinds = next(line for line in lines if "steps by kind" in line)
    copied = sum(int(n) for n in re.findall(r"(\d+) copy \d+", kinds))
    return (
        f"It streams the answer, then prints a summary (this one from a first run with an empty "
        f"`HOME` on an {MACHINE_SHORT['epyc-bf16']},\n"
        f"[`results/{QUICKSTART_FILE}`](results/{QUICKSTART_FILE})):\n\n"
        f"```text\n{summary}\n```\n\n"
        f"On this prompt {copied} of the {steps} steps were copy steps (a block proposed from the "
        f"text so far or the target's past answers, verified like a draft), and the speedup is "
        f"against the target alone in "
        f"the same setting (bf16 at the chosen row tile). Over prompt sets the default decode's "
        f"speed against the fastest AR of either dtype is in the [results](#results) table's "
        f"first row."
    )


def results_table() -> str:
    head = ["measurement", "figure", "machine", "date", "file"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row.cells()) + " |" for row in RESULTS_ROWS]
    return "\n".join(out)


def machines(used: set[str] | None = None) -> str:
    """The machines, one line each ("AMD EPYC (avx512_bf16)": its description)."""
    keys = [k for k in MACHINES if used is None or k in used]
    return "\n".join(f"* {MACHINE_SHORT[k]}: {MACHINES[k]}" for k in keys)


BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {
        "quickstart": quickstart,
        "results": results_table,
        "machines": lambda: machines({row.machine for row in RESULTS_ROWS}),
    },
    "docs/results.md": {"machines": machines},
}


def render(page: str, text: str) -> str:
    """`text` (page's contents) with every generated block written again."""
    for name, make in BLOCKS[page].items():
        pattern = re.compile(
            rf"(<!-- report_pages:{name} -->\n).*?(\n<!-- /report_pages:{name} -->)", re.S
        )
        if not pattern.search(text):
            raise ValueError(f"{page} has no <!-- report_pages:{name} --> block")
        body = make()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text


def stale() -> list[str]:
    """The pages whose generated blocks differ from their files."""
    return [
        page
        for page in BLOCKS
        if render(page, (ROOT / page).read_text()) != (ROOT / page).read_text()
    ]


def main(argv) -> None:
    del argv
    if flags.FLAGS.check:
        pages = stale()
        if pages:
            print(f"stale figures in {', '.join(pages)}: run python -m infer.report_pages")
            sys.exit(1)
        print("every generated block matches its files")
        return
    for page in BLOCKS:
        path = ROOT / page
        text = path.read_text()
        new = render(page, text)
        if new != text:
            path.write_text(new)
            print(f"wrote {page}")


if __name__ == "__main__":  # the flag is defined here: importing the module defines none
    flags.DEFINE_bool(
        "check", False, "Write nothing; exit 1 if a page's generated block differs from its files."
    )
    app.run(main)
