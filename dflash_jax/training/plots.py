"""A training run's metrics as one figure: loss, acceptance length (implied by the logged
per-position accuracy, measured by speculative decoding on held-out prompts, and teacher-forced
on the held-out records) and the per-position accuracy of the last logged window."""

from __future__ import annotations

import json
import os

import numpy as np

from dflash_jax.io import paths


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a run's metrics.jsonl (local or a URL)."""
    lines = paths.path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def tau_projection(points: list[tuple[float, float]], goal: float) -> dict | None:
    """A power law tau - 1 = c * x**p fitted (least squares in log-log) to measured (x, tau)
    points, x being blocks trained, and the x where it reaches `goal`. None with fewer than two
    points above tau = 1 or a curve that does not rise. An extrapolation from a short curve,
    whose learning rate also decays: a rough budget, not a promise.
    -> {"c", "p", "x_goal"}"""
    pts = [(x, t) for x, t in points if x > 0 and t > 1]
    if len({x for x, _ in pts}) < 2:
        return None
    lx = np.log([x for x, _ in pts])
    ly = np.log([t - 1 for _, t in pts])
    p, log_c = np.polyfit(lx, ly, 1)
    if p <= 1e-6:
        return None
    c = float(np.exp(log_c))
    return {"c": c, "p": float(p), "x_goal": float(((goal - 1) / c) ** (1 / p))}


def plot(records: list[dict], output: str | os.PathLike, title: str) -> None:
    """Writes the figure to `output` (local or a URL; the format follows its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "tau_eval" in r]
    if not train:
        raise ValueError("no training lines in the metrics file")
    fig, (ax_loss, ax_tau, ax_acc) = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    ax_loss.plot(steps, [r["loss"] for r in train])
    ax_loss.set(xlabel="step", ylabel="weighted CE", title="training loss")
    # Real tau against the training signal seen: anchor blocks, when the metrics log them.
    by_blocks = all("blocks" in r for r in train + evals)
    x_of = (lambda r: r["blocks"]) if by_blocks else (lambda r: r["step"])
    x_label = "anchor blocks trained (block_size - 1 labels each)" if by_blocks else "step"
    curves = (  # (records, key, style, label)
        (train, "tau_implied", "-", "implied by accuracy"),
        (evals, "tau_eval", "o-", "measured (speculative_decode, held-out prompts)"),
        (evals, "heldout_tau_forced", "s--", "teacher-forced, held-out records (full vocabulary)"),
    )
    for rows, key, style, label in curves:
        points = [r for r in rows if r.get(key) is not None]
        if points:
            ax_tau.plot([x_of(r) for r in points], [r[key] for r in points], style, label=label)
    if evals:
        measured = [(x_of(r), r["tau_eval"]) for r in evals]
        fit = tau_projection(measured, goal=3.0) if by_blocks else None
        if fit:
            xs = np.geomspace(min(x_of(r) for r in evals), fit["x_goal"], 50)
            ax_tau.plot(
                xs,
                1 + fit["c"] * xs ** fit["p"],
                ":",
                label=f"power-law fit to measured: tau 3 at {fit['x_goal']:.3g} blocks",
            )
            ax_tau.set_xscale("log")
    ax_tau.set(xlabel=x_label, ylabel="τ (tokens per verify)", title="learning curve")
    ax_tau.legend()
    last = train[-1]
    ax_acc.bar(range(1, len(last["accuracy"]) + 1), last["accuracy"])
    ax_acc.set(
        xlabel="block position k",
        ylabel="top-1 accuracy",
        title=f"per-position accuracy at step {last['step']}",
    )
    fig.suptitle(title)
    fig.tight_layout()
    output = paths.path(output)
    with paths.written_locally(output) as file:
        fig.savefig(file, dpi=110, format=output.suffix.lstrip(".") or None)
    plt.close(fig)
