r"""Predicted decode speed on an accelerator, from a roofline of one decode step.

  python -m infer.roofline --device=h200 --config=configs/qwen3_8b_b16.py
  python -m infer.roofline --device=v5p-1 --config=configs/qwen3_8b_b16.py --tau=6.55 \
      --compiled=results/lower_v5p-8_qwen3_8b_2026-12-07.jsonl

One step's time is max(flops / the device's dense bf16 peak, bytes / its HBM bandwidth)
(`infer.devices`: the vendor's figures), for an autoregressive step (the target on 1 token per
row) and a speculative step (the drafter on a block of B per row, then the target verifying
the block), each at batch 1 and at the batch that fills the device (the largest multiple of 8
whose KV caches of --max_len positions fit beside the weights in 90% of its memory). The
predicted speedup at acceptance length tau (tokens committed per step, the bonus included) is
tau x t_AR / t_spec. One JSON line per (batch, tau), saying which bound wins each step.

The counts are analytic, from the params' shapes (`jax.eval_shape`, no weight read) and the
target's attention layout: flops = 2 x tokens x the matmul weights each token uses (a MoE's
experts by top-k / E; the embedding table is a lookup) + 4 x tokens x heads x head dim x the
keys attended (--context, a sliding layer's window at most); bytes = every weight read once
per step (a MoE's expected touched experts, E x (1 - (1 - k/E)^tokens)) + the KV caches read
up to --context + the rows written. The drafter reads its own layers, its `fc` over the taps,
and the target's LM head over its block. What the model leaves out: launch and host overhead
per step (large at batch 1 on a GPU: the reference's PyTorch backend launches per layer), the
kernels' efficiency below peak, the step's bookkeeping (acceptance, sampling, cache rollback),
GPU/TPU collectives and any cache copies the compiled loop makes (`infer.lower --device`:
`cache_copies_in_loop`). XLA's GPU executables report no cost analysis, so the predictions are
analytic; --compiled adds the roofline of `infer.lower --device`'s compiled advance programs
(their loop body's flops and bytes per device: a TPU's cost_analysis, on a GPU XLA's cost model
over the compiled HLO, whose bytes run 2.7-3x the analytic ones, docs/results.md).

The default --tau is the reference's reported figures for the target (Qwen3-8B: the DFlash
paper's transformers backend, batch 1, block 16, temperature 0, on H200/B200), printed beside
the prediction with their speedups.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from infer import aot, cli, devices

# The reference's reported Qwen3-8B figures (DFlash paper, transformers backend, batch 1,
# block 16, temperature 0, H200/B200): (benchmark, tau, speedup over autoregressive).
REPORTED = {
    "Qwen/Qwen3-8B": (
        ("GSM8K", 6.55, 5.20), ("MATH-500", 7.87, 6.17), ("HumanEval", 6.55, 5.20),
        ("MT-Bench", 4.25, 2.79),
    ),
}  # fmt: skip
FILL = 0.9  # the share of a device's memory the filling batch may take

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Training config (configs/*.py): the target and the drafter."
)
flags.DEFINE_enum("device", "h200", list(devices.DEVICES), "The accelerator (infer.devices).")
flags.DEFINE_list(
    "tau", [],
    "Acceptance lengths to predict at (tokens per step, bonus included). Empty: the reference's "
    "reported figures for the target (Qwen3-8B), else 6.55.",
)  # fmt: skip
flags.DEFINE_integer("block_size", 0, "Block size B (0: the config's).", lower_bound=0)
flags.DEFINE_integer(
    "context", 1024, "Keys each query attends (prompt + generated so far, on average).",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "max_len", 2048, "KV cache positions per row, for the batch that fills the device.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_list(
    "batch", ["1", "fill"], "Batches to predict at: numbers, or 'fill' (fills the device)."
)
flags.DEFINE_string(
    "compiled", "",
    "An `infer.lower --device` JSONL of the same target: adds the roofline of its compiled "
    "advance programs (flops and bytes per device of one loop body: a TPU's cost_analysis, on a "
    "GPU XLA's cost model over the compiled HLO) at its batch.",
)  # fmt: skip


def _leaves(tree) -> list[tuple[str, int]]:
    return [
        (jax.tree_util.keystr(path), math.prod(x.shape))
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def weights(tree, tied: bool = False) -> dict:
    """Param counts of a params tree: `matmul` (every weight a token multiplies, the embedding
    table left out unless it is also the LM head), `experts` (a MoE's expert weights),
    `head` (the LM head) and `read` (what a step reads besides the experts)."""
    out = {"matmul": 0, "experts": 0, "head": 0, "read": 0}
    for path, size in _leaves(tree):
        embed = "embed_tokens" in path
        if "experts" in path:
            out["experts"] += size
            continue
        if "lm_head" in path or (embed and tied):
            out["head"] += size
        if not embed or tied:
            out["matmul"] += size
            out["read"] += size
    return out


def attention_layers(tcfg) -> list[int]:
    """Per attention layer of the target, the window it attends (0: every key); a hybrid
    target's linear-attention layers have none (their state is small and fixed)."""
    kinds = tcfg.layer_types or ("full_attention",) * tcfg.num_layers
    window = getattr(tcfg, "sliding_window", 0) or 0
    return [window if k == "sliding_attention" else 0 for k in kinds if "attention" in k
            and k != "linear_attention"]  # fmt: skip


def forward(w: dict, layers: list[int], heads: tuple, rows: int, tokens: int, context: int,
            experts: tuple = (0, 0), dtype_bytes: int = 2) -> tuple[float, float]:  # fmt: skip
    """(flops, bytes) of one forward of `tokens` per row over `rows` rows attending `context`
    keys: weights `w` (`weights`), attention `layers` (windows), heads (query heads, KV heads,
    head dim), experts (E, top-k)."""
    n_q, n_kv, h = heads
    n = rows * tokens
    e, k = experts
    share = k / e if e else 0.0
    touched = e * (1 - (1 - share) ** n) / e if e else 0.0
    flops = 2.0 * n * (w["matmul"] + w["experts"] * share)
    nbytes = dtype_bytes * (w["read"] + w["experts"] * touched)
    for window in layers:
        span = min(context, window) if window else context
        flops += 4.0 * n * n_q * h * span
        nbytes += dtype_bytes * 2 * n_kv * h * (rows * span + n)  # read the cache, write rows
    return flops, nbytes


def _roof(flops: float, nbytes: float, device: devices.Device) -> dict:
    t_flops = flops / (device.peak_flops * device.chips)
    t_bytes = nbytes / (device.bandwidth * device.chips)
    return {"flops": flops, "bytes": nbytes, "seconds": max(t_flops, t_bytes),
            "bound": "compute" if t_flops > t_bytes else "memory"}  # fmt: skip


def predict(cfg, device: devices.Device, block: int, context: int, max_len: int, batches):
    """-> [{batch, ar, spec (each {flops, bytes, seconds, bound}), ...}] for each of
    `batches` (ints, or "fill")."""
    from dflash_jax.models.drafter import init_drafter_params
    from dflash_jax.models.target import init_params
    from dflash_jax.training.trainer import drafter_config_for

    tcfg = aot.target_config(cfg.target, "bfloat16")
    dcfg = drafter_config_for(cfg, tcfg)
    target = weights(jax.eval_shape(lambda: init_params(tcfg, jax.random.key(0))),
                     tcfg.tie_word_embeddings)  # fmt: skip
    drafter = weights(jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0))))
    drafter = {**drafter, "matmul": drafter["matmul"] + target["head"],
               "read": drafter["read"] + target["head"]}  # fmt: skip
    t_layers = attention_layers(tcfg)
    t_heads = (tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim)
    d_heads = (dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim)
    moe = (tcfg.num_experts, tcfg.num_experts_per_tok)
    weight_bytes = 2 * (target["read"] + target["experts"] + drafter["read"])
    row_bytes = (
        2
        * 2
        * max_len
        * (
            tcfg.num_kv_heads * tcfg.head_dim * len(t_layers)
            + dcfg.num_kv_heads * dcfg.head_dim * dcfg.num_layers
        )
    )
    fill = int((FILL * device.memory_bytes * device.chips - weight_bytes) // row_bytes) // 8 * 8
    out = []
    for batch in batches:
        rows = fill if batch == "fill" else int(batch)
        ar = forward(target, t_layers, t_heads, rows, 1, context, moe)
        verify = forward(target, t_layers, t_heads, rows, block, context, moe)
        draft = forward(drafter, [0] * dcfg.num_layers, d_heads, rows, block, context)
        spec = _roof(verify[0] + draft[0], verify[1] + draft[1], device)
        out.append({
            "batch": rows, "fills_device": batch == "fill", "ar": _roof(*ar, device),
            "spec": spec, "verify_only": _roof(*verify, device), "draft": _roof(*draft, device),
        })  # fmt: skip
    return out


def compiled_roofline(path: str, device: devices.Device) -> dict | None:
    """The roofline of the compiled advance programs in an `infer.lower --device` JSONL (flops
    and bytes per device of one loop body), or None when it has no cost for them."""
    lines = {}
    with open(path) as f:
        for text in f:
            line = json.loads(text)
            lines[line["program"]] = line
    try:
        ar, spec = lines["advance_autoregressive"], lines["advance_speculative"]
    except KeyError:
        return None
    if not (ar.get("flops") and spec.get("flops")):
        return None
    chip = dataclasses.replace(devices.DEVICES[ar["device"]], chips=1)  # figures per device
    return {
        "file": path, "device": ar["device"], "mesh": ar["mesh"], "shape": ar.get("shape"),
        "cost_source": ar.get("cost_source"),
        "ar": _roof(ar["flops"], ar["bytes_accessed"], chip),
        "spec": _roof(spec["flops"], spec["bytes_accessed"], chip),
    }  # fmt: skip


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.config is None:  # checked here, not by absl: the tests import this module
        raise app.UsageError("--config is required, e.g. --config=configs/qwen3_8b_b16.py")
    jax.config.update("jax_platforms", "cpu")  # shapes only
    cfg = FLAGS.config
    device = devices.DEVICES[FLAGS.device]
    block = FLAGS.block_size or cfg.block_size
    reported = REPORTED.get(cfg.target, ())
    try:
        taus = [("--tau", float(t), None) for t in FLAGS.tau] or list(reported)
    except ValueError as e:
        raise app.UsageError(f"--tau takes numbers: {e}") from e
    taus = taus or [("--tau", 6.55, None)]
    bad = [b for b in FLAGS.batch if b != "fill" and not b.isdigit()]
    if bad:
        raise app.UsageError(f"--batch takes numbers or 'fill', not {bad}")
    compiled = compiled_roofline(FLAGS.compiled, device) if FLAGS.compiled else None
    for row in predict(cfg, device, block, FLAGS.context, FLAGS.max_len, FLAGS.batch):
        ratio = row["ar"]["seconds"] / row["spec"]["seconds"]
        for name, tau, speedup in taus:
            line = {"device": device.name, "target": cfg.target, "block_size": block,
                    "context": FLAGS.context, "benchmark": name, "tau": tau, **row,
                    "predicted_speedup": round(tau * ratio, 2),
                    "reported_speedup": speedup if row["batch"] == 1 else None}  # fmt: skip
            if compiled:
                c = compiled["ar"]["seconds"] / compiled["spec"]["seconds"]
                line["compiled"] = {**compiled, "predicted_speedup": round(tau * c, 2)}
            print(json.dumps(line, default=lambda x: float(np.asarray(x))), flush=True)


if __name__ == "__main__":
    cli.run(main)
