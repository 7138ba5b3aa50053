"""The GEMM floors a decode step is judged against (`decoding.breakdown`, `infer.benchmark
--breakdown`, `api.fastest_dtype`), and the in-loop timing both they and the step's phases use.

GEMM floor: the time to multiply a batch of rows through every weight matrix of a model, the
lm_head included, with nothing else (no attention, norms, RoPE, caches or sampling): what the
hardware needs for the weights alone. Each product is computed as the model computes it for the
config it runs (`programs.run_target_config`): in its dtype, by the dot policy (`ops.dots`: fp32
accumulation, one cast), under the row rule when the run is batch-invariant (rows padded to the
rule's minimum and cut into its tiles, each GEMM isolated: `ops.invariance.dot_general`), the
head as `models.target.Head` runs it, compiled with the decode's compiler options. (Plain
`x @ w` products in bf16 measured a path no decode runs: on XLA:CPU an fp32 dot of widened
operands, 2-8x slower than the model's bf16 GEMMs on a CPU with bf16 units.)
  * `gemm_floor_ar_s`: 1 row through the target;
  * `gemm_floor_step_s`: T rows through the target (the verify) plus T rows through the
    drafter's layers and `fc` (the draft and the context append), plus the head for the T-1
    draft rows;
  * `gemm_floor_tree_step_s` (with a tree of N tokens): the step with N rows through the target.
Their ratio is the physical break-even: DFlash wins only when tau exceeds it.
`served_step_floor` is not a GEMM floor: a server's plain step over its busy slots, attention
included, which is what `api.fastest_dtype` compares for `infer.serve`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.decoding import programs
from dflash_jax.decoding.programs import LOOP_COMPILER_OPTIONS
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models.target import Transformer, decoding_head, init_cache, row_rule
from dflash_jax.ops import dots, invariance

# Part of the key of the floors kept on disk (`api.fastest_dtype`): 2 computes every product as
# the model does (1 timed plain `x @ w` products, in bf16 a path no decode runs).
FLOORS_VERSION = 2


def loop_time(step, carry, weights, repeats: int, compiler_options=None) -> float:
    """Seconds per call of `step` (carry, *weights -> carry), run `repeats` times inside one
    jitted `fori_loop` compiled as the decode loop is: no per-call dispatch, buffers the step
    updates are updated in place, and the weights are arguments of the jitted function, as the
    decode's params are. (Closed over, they would be constants of the executable, which XLA:CPU
    multiplies faster: 16 rows through SmolLM2's matrices took ~9% less time that way, a floor
    no decode can reach.) compiler_options: the decode executable's
    (`programs.executable_options`; None: `LOOP_COMPILER_OPTIONS`). Median of 3 timed runs,
    after a compiling one."""
    run = jax.jit(
        lambda c, w: jax.lax.fori_loop(0, repeats, lambda i, c: step(c, *w), c), donate_argnums=0
    )
    options = LOOP_COMPILER_OPTIONS if compiler_options is None else compiler_options
    # Own copies: the loop donates its carry, and phases share their inputs.
    carry = jax.tree.map(lambda x: jnp.array(x, copy=True), carry)
    run = run.lower(carry, weights).compile(compiler_options=options)
    carry = jax.block_until_ready(run(carry, weights))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(carry, weights))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / repeats


def compile_options(tcfg: TargetConfig) -> dict:
    """The compiler options of the decode executables for `tcfg` as it runs
    (`programs.executable_options`: on a CPU a plain fp32 decode is compiled without YNNPACK
    fusions, and its floors and phases are timed so too)."""
    return programs.executable_options(tcfg)


def tie(x: jax.Array, out) -> jax.Array:
    """x, made to depend on `out` (x + 0 * sum): the loop cannot hoist a step whose inputs are
    otherwise loop-invariant, and XLA does not fold a float multiplied by zero."""
    leaves = [jnp.sum(y.astype(jnp.float32)) for y in jax.tree.leaves(out)]
    return x + (0.0 * sum(leaves)).astype(x.dtype)


def _layer_matrices(layer: dict) -> list[jax.Array]:
    """A decoder layer's projection kernels as 2-D [in, out] matrices."""
    attn, mlp = layer["self_attn"], layer["mlp"]
    q, k, v, o = (attn[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    d = q.shape[0]
    return [
        q.reshape(d, -1),
        k.reshape(d, -1),
        v.reshape(d, -1),
        o.reshape(-1, d),
        mlp["gate_proj"]["kernel"],
        mlp["up_proj"]["kernel"],
        mlp["down_proj"]["kernel"],
    ]


def _through(x_rd, layers: list[list[jax.Array]], rule=None) -> tuple[jax.Array, jax.Array]:
    """Rows through each layer's matrices in their real order (q,k,v from the input, o after q;
    gate/up, then down), so every product has its real shape, each as the model's Dense layers
    compute it (`ops.invariance.dot_general(rule)`: the dot policy, under `rule` when given).
    -> (rows out, a checksum of the k/v products, which would otherwise be dead code)."""
    dot_general = invariance.dot_general(rule)
    mm = lambda x, w: dot_general(x, w, (((1,), (0,)), ((), ())))
    sink = jnp.zeros((), jnp.float32)
    for q, k, v, o, gate, up, down in layers:
        sink += jnp.sum(mm(x_rd, k).astype(jnp.float32)) + jnp.sum(mm(x_rd, v).astype(jnp.float32))
        x_rd = x_rd + mm(mm(x_rd, q), o)
        x_rd = x_rd + mm(mm(x_rd, gate) * mm(x_rd, up), down)
    return x_rd, sink


def _head_max(head, x_rd) -> jax.Array:
    """The head's product for rows [R, D] as the decode runs it (`Head.logits`: under the row
    rule the tied embedding contracted as stored, else the [D,V] matrix by the dot policy),
    reduced to its max (a GEMM + max, as a greedy step's)."""
    return jnp.max(head.logits(x_rd).astype(jnp.float32))


def floor_fns(
    target_params,
    tcfg: TargetConfig,
    drafter_params,
    rows: int,
    ar_rows: int = 1,
    tree_rows: int = 0,
) -> dict:
    """The two GEMM floors as loop steps: {"gemm_floor_ar_s": `ar_rows` rows (1, or the row
    rule's minimum that a batch-invariant AR step pads its row to) through the target's
    matrices and its head, "gemm_floor_step_s": `rows` rows through the target's, the
    drafter's (`fc` included) and the head for rows - 1 draft rows}, each
    (step, carry, weights) with step(carry, *weights) -> carry, as `phase_fns`. tree_rows > 0
    adds "gemm_floor_tree_step_s": the step with `tree_rows` rows through the target (a tree's
    nodes) and `rows` through the drafter. `tcfg`: the target config as the decode runs it
    (`programs.run_target_config`): its dtype, and its row rule (`invariant_rows`), which the
    target's products and the head keep to (a rule pads one AR row to its minimum itself); the
    drafter's products run by the dot policy, as the drafter's Dense layers do."""
    head = jax.jit(decoding_head, static_argnums=1)(target_params, tcfg)
    t_layers = [_layer_matrices(target_params[f"layers_{i}"]) for i in range(tcfg.num_layers)]
    d = tcfg.hidden_size
    dtype = jnp.dtype(tcfg.dtype)
    rule = row_rule(tcfg)

    def ar(carry, t_layers, head):
        x_1d, sink = carry
        y_1d, s = _through(x_1d, t_layers, rule)
        out = _head_max(head, y_1d) + s
        return tie(x_1d, out), sink + out

    n_draft = sum(1 for k in drafter_params if k.startswith("layers_"))
    d_layers = [_layer_matrices(drafter_params[f"layers_{i}"]) for i in range(n_draft)]
    fc_fd = drafter_params["fc"]["kernel"]

    def draft(x_td, taps_tf, d_layers, fc_fd, head):
        draft_td, s_d = _through(x_td + dots.matmul(taps_tf, fc_fd), d_layers)
        return _head_max(head, draft_td[1:].astype(dtype)) + s_d

    def step(carry, t_layers, d_layers, fc_fd, head):
        x_td, taps_tf, sink = carry
        verify_td, s_t = _through(x_td, t_layers, rule)
        out = _head_max(head, verify_td) + s_t + draft(x_td, taps_tf, d_layers, fc_fd, head)
        return tie(x_td, out), tie(taps_tf, out), sink + out

    def tree_step(carry, t_layers, d_layers, fc_fd, head):
        x_nd, x_td, taps_tf, sink = carry
        verify_nd, s_t = _through(x_nd, t_layers, rule)
        out = _head_max(head, verify_nd) + s_t + draft(x_td, taps_tf, d_layers, fc_fd, head)
        return tie(x_nd, out), tie(x_td, out), tie(taps_tf, out), sink + out

    step_init = (
        jnp.full((rows, d), 0.01, dtype),
        jnp.full((rows, fc_fd.shape[0]), 0.01, fc_fd.dtype),
        jnp.zeros((), jnp.float32),
    )
    step_weights = (t_layers, d_layers, fc_fd, head)
    fns = {
        "gemm_floor_ar_s": (
            ar,
            (jnp.full((ar_rows, d), 0.01, dtype), jnp.zeros((), jnp.float32)),
            (t_layers, head),
        ),
        "gemm_floor_step_s": (step, step_init, step_weights),
    }
    if tree_rows:
        tree_init = (jnp.full((tree_rows, d), 0.01, dtype), *step_init)
        fns["gemm_floor_tree_step_s"] = (tree_step, tree_init, step_weights)
    return fns


def gemm_floors(
    target_params,
    tcfg: TargetConfig,
    drafter_params,
    rows: int,
    repeats=20,
    ar_rows: int = 1,
    tree_rows: int = 0,
    only: tuple[str, ...] = (),
) -> dict:
    """{"gemm_floor_ar_s", "gemm_floor_step_s"} (and "gemm_floor_tree_step_s" with tree_rows)
    (`floor_fns`; `tcfg` as the decode runs it), timed like the phases (`loop_time`, weights as
    arguments, the decode's compiler options); `only` these names when given."""
    fns = floor_fns(target_params, tcfg, drafter_params, rows, ar_rows, tree_rows)
    options = compile_options(tcfg)
    return {
        name: loop_time(*fn, repeats, options)
        for name, fn in fns.items()
        if not only or name in only
    }


def setting_name(tcfg: TargetConfig) -> str:
    """A run setting in words: "bfloat16 batch-invariant", "float32 plain"."""
    return f"{tcfg.dtype} {'plain' if tcfg.invariant_rows is None else 'batch-invariant'}"


def run_config(
    tcfg: TargetConfig, dtype: str, batch_invariant: bool | None, row_tile: int = 0
) -> TargetConfig:
    """`tcfg` as a decode in `dtype` with `DecodeConfig.batch_invariant` and `row_tile` runs it
    (None: the dtype's default; `programs.run_target_config`)."""
    plain = dataclasses.replace(tcfg, dtype=dtype, invariant_rows=None)
    cfg = DecodeConfig(batch_invariant=batch_invariant, row_tile=row_tile)
    return programs.run_target_config(plain, cfg)


def floors_by_dtype(
    target_params,
    tcfg: TargetConfig,
    drafter_params,
    rows: int,
    repeats=20,
    dtypes=("float32", "bfloat16"),
    invariance=(False, True),
) -> dict:
    """The GEMM floors with the weights cast to each of `dtypes`, under each setting of
    `invariance` (`DecodeConfig.batch_invariant` values; None: the dtype's default), computed
    as the model computes them in that setting (`floor_fns`):
    {"<dtype> plain" | "<dtype> batch-invariant": {"dtype", "batch_invariant", "row_rule",
    "ar_rows", "gemm_floor_ar_s", "gemm_floor_step_s", "break_even_tau"}}, the AR floor at the
    rows such an AR step runs (1, or the rule's minimum). What docs/results.md's step-cost
    table and `infer.benchmark --breakdown` show; `--dtype=auto` compares two of them
    (`api.fastest_dtype`)."""
    out = {}
    for dtype in dtypes:
        cast = lambda tree, dt=dtype: jax.tree.map(lambda w: _float_to(w, dt), tree)
        tp, dp = cast(target_params), cast(drafter_params)
        for batch_invariant in invariance:
            cfg = run_config(tcfg, dtype, batch_invariant)
            name = setting_name(cfg)
            if name in out:  # None: the same setting as an explicit one
                continue
            floors = gemm_floors(tp, cfg, dp, rows, repeats)
            out[name] = {
                **floors,
                "dtype": dtype,
                "batch_invariant": cfg.invariant_rows is not None,
                "row_rule": list(cfg.invariant_rows) if cfg.invariant_rows else None,
                "ar_rows": cfg.invariant_rows[0] if cfg.invariant_rows else 1,
                "break_even_tau": floors["gemm_floor_step_s"] / floors["gemm_floor_ar_s"],
            }
    return out


def bracket_floors(before: dict, after: dict) -> dict:
    """The floors as the mean of their timings before and after the prompts (the AR and DFlash
    steps they are compared with were timed in between), each timing kept, their after/before
    ratio as `gemm_floor_drift`, and the break-even tau from the means."""
    out = {}
    for name in ("gemm_floor_ar_s", "gemm_floor_step_s"):
        out[f"{name[:-2]}_before_s"] = before[name]
        out[f"{name[:-2]}_after_s"] = after[name]
        out[name] = (before[name] + after[name]) / 2
    out["gemm_floor_drift"] = {
        "ar": after["gemm_floor_ar_s"] / before["gemm_floor_ar_s"],
        "step": after["gemm_floor_step_s"] / before["gemm_floor_step_s"],
    }
    out["break_even_tau"] = out["gemm_floor_step_s"] / out["gemm_floor_ar_s"]
    return out


def _float_to(w, dtype):
    """A weight cast to `dtype`; integer leaves (a draft vocabulary's target ids) kept."""
    return w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w


# Part of the key of a served floor kept on disk (`api.fastest_dtype`): 2 since a bf16 cache is
# no longer widened whole (a bf16 served step got ~20% cheaper; 1 was measured before).
SERVED_VERSION = 2
# The shapes `served_step_floor` times a busy server's plain step at: `infer.serve`'s default
# prompt buffer (512) and new tokens (128) with a block past them, rows this far in.
SERVED_CACHE_LEN, SERVED_LIVE = 704, 160


def served_step_floor(
    target_params,
    tcfg: TargetConfig,
    slots: int,
    repeats: int = 5,
    cache_len: int = SERVED_CACHE_LEN,
    live: int = SERVED_LIVE,
) -> float:
    """Seconds of a server's plain step with `slots` busy rows (`decoding.slots`): one token per
    row through the target's whole forward as the decode runs it (`tcfg` from
    `run_target_config`: its dtype, row rule and attention over `live` of a row's `cache_len`
    cached slots, norms, RoPE, the cache write), then the head's greedy token. Not a GEMM floor:
    with many rows attention is a large part of a step (at 8 slots on a 2-core CPU, the bf16
    row rule's attention cost ~2.5x fp32's, more than its GEMMs save), and the server's steps
    are mostly plain ones. Timed as `loop_time` times the floors."""
    head = jax.jit(decoding_head, static_argnums=1)(target_params, tcfg)
    lengths_b = jnp.full((slots,), live, jnp.int32)
    positions_b1 = lengths_b[:, None]

    def step(carry, params, head):
        tokens_b1, cache, sink = carry
        hidden, _, cache = Transformer(tcfg).apply(
            {"params": params}, tokens_b1, positions_b1, cache, lengths_b, method="hidden"
        )
        token_b = head.argmax(hidden[:, 0])
        return jnp.minimum(token_b[:, None], 0) + tokens_b1, cache, sink + token_b.sum()

    cache = init_cache(tcfg, slots, cache_len, verify=1)
    carry = (jnp.ones((slots, 1), jnp.int32), cache, jnp.int32(0))
    return loop_time(step, carry, (target_params, head), repeats, compile_options(tcfg))
