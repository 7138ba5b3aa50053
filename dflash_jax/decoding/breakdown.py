"""Where a decode step's time goes: each phase of the speculative step timed apart at real shapes,
and the GEMM floors every step is judged against (`infer.benchmark --breakdown`).

GEMM floor: the time to multiply a batch of rows through every weight matrix of a model, the
lm_head included, with nothing else (no attention, norms, RoPE, caches or sampling): what the
hardware needs for the weights alone.
  * `gemm_floor_ar_s`: 1 row through the target;
  * `gemm_floor_step_s`: T rows through the target (the verify) plus T rows through the
    drafter's layers and `fc` (the draft and the context append), plus the head for the T-1
    draft rows.
Their ratio is the physical break-even: DFlash wins only when tau exceeds it.

Phases of one step, each the same function the loop body runs (`phases.py`), jitted alone:
drafter layers, drafter head (+ argmax), target verify body, verify head + accept, commit, and
appending the committed tokens' context K/V for the next draft. A DFlash2 drafter's head phase
is the head and its top-k candidates, and its selector's walk over them is one more phase,
`drafter_select` (`phase_names`). Their sum against the
measured in-loop step shows what the loop itself adds.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DecodeConfig, DrafterConfig, TargetConfig
from dflash_jax.decoding import phases, programs, selector
from dflash_jax.decoding.programs import LOOP_COMPILER_OPTIONS
from dflash_jax.decoding.state import commit as commit_tokens
from dflash_jax.models.target import decoding_head, unembedding_matrix

PHASES = (
    "drafter_layers",
    "drafter_head",
    "verify_body",
    "verify_head_accept",
    "commit",
    "append_context",
)


DFLASH2_PHASES = (*PHASES[:2], "drafter_select", *PHASES[2:])


def phase_names(dcfg: DrafterConfig) -> tuple[str, ...]:
    """The phases of a step with this drafter, in step order."""
    return DFLASH2_PHASES if dcfg.is_dflash2 else PHASES


def _loop_time(step, carry, weights, repeats: int) -> float:
    """Seconds per call of `step` (carry, *weights -> carry), run `repeats` times inside one
    jitted `fori_loop` compiled as the decode loop is: no per-call dispatch, buffers the step
    updates are updated in place, and the weights are arguments of the jitted function, as the
    decode's params are. (Closed over, they would be constants of the executable, which XLA:CPU
    multiplies faster: 16 rows through SmolLM2's matrices took ~9% less time that way, a floor
    no decode can reach.) Median of 3 timed runs, after a compiling one."""
    run = jax.jit(
        lambda c, w: jax.lax.fori_loop(0, repeats, lambda i, c: step(c, *w), c),
        donate_argnums=0,
        compiler_options=LOOP_COMPILER_OPTIONS,
    )
    # Own copies: the loop donates its carry, and phases share their inputs.
    carry = jax.tree.map(lambda x: jnp.array(x, copy=True), carry)
    carry = jax.block_until_ready(run(carry, weights))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(carry, weights))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / repeats


def _tie(x: jax.Array, out) -> jax.Array:
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


def _through(x_rd: jax.Array, layers: list[list[jax.Array]]) -> tuple[jax.Array, jax.Array]:
    """Rows through each layer's matrices in their real order (q,k,v from the input, o after q;
    gate/up, then down), so every product has its real shape. -> (rows out, a checksum of the
    k/v products, which would otherwise be dead code)."""
    sink = jnp.zeros((), x_rd.dtype)
    for q, k, v, o, gate, up, down in layers:
        sink += jnp.sum(x_rd @ k) + jnp.sum(x_rd @ v)
        x_rd = x_rd + (x_rd @ q) @ o
        x_rd = x_rd + ((x_rd @ gate) * (x_rd @ up)) @ down
    return x_rd, sink


def floor_fns(
    target_params, tcfg: TargetConfig, drafter_params, rows: int, ar_rows: int = 1
) -> dict:
    """The two GEMM floors as loop steps: {"gemm_floor_ar_s": `ar_rows` rows (1, or the row
    rule's minimum that a batch-invariant AR step pads its row to) through the target's
    matrices and its head, "gemm_floor_step_s": `rows` rows through the target's, the
    drafter's (`fc` included) and the head for rows - 1 draft rows}, each
    (step, carry, weights) with step(carry, *weights) -> carry, as `phase_fns`."""
    head_dv = jax.jit(unembedding_matrix, static_argnums=1)(target_params, tcfg)
    t_layers = [_layer_matrices(target_params[f"layers_{i}"]) for i in range(tcfg.num_layers)]
    d = tcfg.hidden_size
    dtype = jnp.dtype(tcfg.dtype)

    def ar(carry, t_layers, head_dv):
        x_1d, sink = carry
        y_1d, s = _through(x_1d, t_layers)
        out = jnp.max(y_1d @ head_dv) + s
        return _tie(x_1d, out), sink + out

    n_draft = sum(1 for k in drafter_params if k.startswith("layers_"))
    d_layers = [_layer_matrices(drafter_params[f"layers_{i}"]) for i in range(n_draft)]
    fc_fd = drafter_params["fc"]["kernel"]

    def step(carry, t_layers, d_layers, fc_fd, head_dv):
        x_td, taps_tf, sink = carry
        verify_td, s_t = _through(x_td, t_layers)
        draft_td, s_d = _through(x_td + taps_tf @ fc_fd, d_layers)
        out = jnp.max(verify_td @ head_dv) + jnp.max(draft_td[1:] @ head_dv) + s_t + s_d
        return _tie(x_td, out), _tie(taps_tf, out), sink + out

    step_init = (
        jnp.full((rows, d), 0.01, dtype),
        jnp.full((rows, fc_fd.shape[0]), 0.01, fc_fd.dtype),
        0.0,
    )
    return {
        "gemm_floor_ar_s": (
            ar,
            (jnp.full((ar_rows, d), 0.01, dtype), 0.0),
            (t_layers, head_dv),
        ),
        "gemm_floor_step_s": (step, step_init, (t_layers, d_layers, fc_fd, head_dv)),
    }


def gemm_floors(
    target_params, tcfg: TargetConfig, drafter_params, rows: int, repeats=20, ar_rows: int = 1
) -> dict:
    """{"gemm_floor_ar_s", "gemm_floor_step_s"} (`floor_fns`), timed like the phases
    (`_loop_time`, weights as arguments)."""
    fns = floor_fns(target_params, tcfg, drafter_params, rows, ar_rows)
    return {name: _loop_time(*fn, repeats) for name, fn in fns.items()}


def floors_by_dtype(
    target_params,
    tcfg: TargetConfig,
    drafter_params,
    rows: int,
    repeats=20,
    dtypes=("float32", "bfloat16"),
) -> dict:
    """The GEMM floors with the weights cast to each of `dtypes`, each AR floor at the rows a
    default decode in that dtype runs (one row, or the row rule's minimum when the dtype decodes
    batch-invariant by default, `programs.run_target_config`) and also at one row:
    {dtype: {"gemm_floor_ar_s", "gemm_floor_ar_1row_s", "gemm_floor_step_s", "ar_rows",
    "break_even_tau"}}. What `--dtype=auto` compares, and the README's step-cost table."""
    out = {}
    for dtype in dtypes:
        cast = lambda tree, dt=dtype: jax.tree.map(lambda w: w.astype(dt), tree)
        cfg = programs.run_target_config(
            dataclasses.replace(tcfg, dtype=dtype, invariant_rows=None), DecodeConfig()
        )
        ar_rows = cfg.invariant_rows[0] if cfg.invariant_rows else 1
        tp, dp = cast(target_params), cast(drafter_params)
        floors = gemm_floors(tp, cfg, dp, rows, repeats, ar_rows=ar_rows)
        one_row = floors if ar_rows == 1 else gemm_floors(tp, cfg, dp, rows, repeats)
        out[dtype] = {
            **floors,
            "gemm_floor_ar_1row_s": one_row["gemm_floor_ar_s"],
            "ar_rows": ar_rows,
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


def phase_fns(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    cfg: DecodeConfig,
    live_length: int,
):
    """The phases of one speculative step, each as a loop step (carry -> carry) with its initial
    carry, at the shapes of a real decode of `prompt` (cache buffers as `speculative_decode`
    allocates them) with every row's caches `live_length` slots long.
    -> {phase: (step, carry, weights)}: step(carry, *weights) -> carry."""
    bs = cfg.block_size
    rng = jax.random.key(0)

    @jax.jit
    def init(target_params, drafter_params, prompt, prompt_lengths):
        head = decoding_head(target_params, tcfg)
        state = phases.init_speculative(
            target_params, drafter_params, head, tcfg, dcfg, cfg, prompt, prompt_lengths, rng
        )
        return state, head

    state, head = init(target_params, drafter_params, prompt, prompt_lengths)
    b = prompt.shape[0]
    live_b = jnp.full((b,), live_length, jnp.int32)
    n_gen_b = live_b - jnp.asarray(prompt_lengths) + 1
    state = state.replace(drf_len=live_b, n_gen=n_gen_b)
    anchor_b1 = jnp.ones((b, 1), jnp.int32)
    key = jax.random.key(1)

    prompt_lengths = jnp.asarray(prompt_lengths)
    start_b = live_b
    hidden = jax.jit(
        lambda dp, tp, s: phases.draft_hidden(
            dp, tp, tcfg, dcfg, anchor_b1, s.ctx_k, s.ctx_v, s.drf_len, start_b, bs
        )
    )(drafter_params, target_params, state)
    drafts, draft_logp = jax.jit(
        lambda h, x, dp: phases.draft_tokens(h, tcfg, dcfg, cfg, x, key, dp, anchor_b1)
    )(head, hidden, drafter_params)
    verify_bt = jnp.concatenate([anchor_b1, drafts], axis=1)
    vhidden, taps, _ = jax.jit(
        lambda tp, s: phases.verify_hidden(tp, tcfg, dcfg, verify_bt, start_b, s.cache)
    )(target_params, state)
    a_b, new_bt = jax.jit(lambda h, vh: phases.verify_accept(h, cfg, vh, drafts, draft_logp, key))(
        head, vhidden
    )

    # Each phase as a step of a loop carry, the weights (target params, drafter params, head)
    # its arguments; see `_loop_time` and `_tie`.
    def drafter_layers(c, tp, dp, head):
        s, anchor, sink = c
        h = phases.draft_hidden(
            dp, tp, tcfg, dcfg, anchor, s.ctx_k, s.ctx_v, s.drf_len, start_b, bs
        )
        # The block's anchor carries the dependency (the same token every call).
        return s, _tie(anchor.astype(jnp.float32), h).astype(jnp.int32), sink

    def drafter_head(c, tp, dp, head):
        h, sink = c
        if dcfg.is_dflash2:  # the head and the candidates; the walk is `drafter_select`
            return _tie(h, selector.candidates(head, tcfg, dcfg, h)), sink
        d, _ = phases.draft_tokens(head, tcfg, dcfg, cfg, h, key)
        return _tie(h, d), sink

    def drafter_select(c, tp, dp, head):
        h, unary, cand, sink = c
        d, _ = selector.walk(
            dp["candidate_selector"], dcfg, cfg, h, unary, cand, anchor_b1[:, 0], key
        )
        return _tie(h, d), unary, cand, sink

    def verify_body(c, tp, dp, head):
        cache, tokens_bt, sink = c
        vh, taps_btf, cache = phases.verify_hidden(tp, tcfg, dcfg, tokens_bt, start_b, cache)
        # The tokens carry the dependency too, or XLA hoists layer 0's projections.
        tokens_bt = _tie(tokens_bt.astype(jnp.float32), (vh, taps_btf)).astype(jnp.int32)
        return cache, tokens_bt, sink

    def verify_head_accept(c, tp, dp, head):
        vh, sink = c
        a, new = phases.verify_accept(head, cfg, vh, drafts, draft_logp, key)
        return _tie(vh, (a, new)), sink

    def commit(c, tp, dp, head):
        s, sink = c
        s, produced = commit_tokens(s, new_bt, a_b + 1, cfg, bs)
        return s, _tie(sink, produced)

    def append_context(c, tp, dp, head):
        ctx_k, ctx_v, taps_btf = c
        ctx_k, ctx_v, _ = phases.append_context(dp, dcfg, ctx_k, ctx_v, live_b, taps_btf, a_b + 1)
        # The taps carry the dependency, or XLA hoists their K/V out of the loop.
        return ctx_k, ctx_v, _tie(taps_btf, (ctx_k[0][:, :, 0], ctx_v[0][:, :, 0]))

    zero = jnp.float32(0.0)
    weights = (target_params, drafter_params, head)
    fns = {
        "drafter_layers": (drafter_layers, (state, anchor_b1, zero), weights),
        "drafter_head": (drafter_head, (hidden, zero), weights),
        "verify_body": (verify_body, (state.cache, verify_bt, zero), weights),
        "verify_head_accept": (verify_head_accept, (vhidden, zero), weights),
        "commit": (commit, (state, zero), weights),
        "append_context": (append_context, (state.ctx_k, state.ctx_v, taps), weights),
    }
    if dcfg.is_dflash2:
        unary, cand = jax.jit(lambda h, x: selector.candidates(h, tcfg, dcfg, x))(head, hidden)
        fns["drafter_select"] = (drafter_select, (hidden, unary, cand, zero), weights)
    return {name: fns[name] for name in phase_names(dcfg)}


def phase_times(*args, repeats: int = 20, **kwargs) -> dict:
    """{"phase_<name>_s": seconds per call} for every phase of `phase_names` (`_loop_time`
    over `repeats` calls); the arguments are `phase_fns`'."""
    fns = phase_fns(*args, **kwargs)
    return {f"phase_{name}_s": _loop_time(*fn, repeats) for name, fn in fns.items()}


def breakdown(
    target, drafter, prompt, prompt_lengths, cfg: DecodeConfig, live_length: int, repeats=20
) -> dict:
    """Floors and phase times for one benchmark configuration (batch = prompt rows), plus the
    break-even tau. Greedy decoding is timed whatever `cfg` says (the phases differ only in the
    sampling arithmetic)."""
    cfg = dataclasses.replace(cfg, temperature=0.0)
    run_cfg = programs.run_target_config(target.config, cfg)  # as the decode compiles it
    ar_rows = run_cfg.invariant_rows[0] if run_cfg.invariant_rows else 1
    out = gemm_floors(
        target.params, target.config, drafter.params, cfg.block_size, repeats, ar_rows=ar_rows
    )
    out.update(
        phase_times(
            target.params,
            drafter.params,
            jnp.asarray(prompt),
            jnp.asarray(prompt_lengths),
            run_cfg,
            drafter.config,
            cfg,
            live_length,
            repeats=repeats,
        )
    )
    out["phases_sum_s"] = sum(out[f"phase_{p}_s"] for p in phase_names(drafter.config))
    out["break_even_tau"] = out["gemm_floor_step_s"] / out["gemm_floor_ar_s"]
    return out
