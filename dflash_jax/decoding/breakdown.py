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

Phases of one step, each the same function the loop body runs (`loop.py`), jitted alone:
drafter layers, drafter head (+ argmax), target verify body, verify head + accept, commit, and
appending the committed tokens' context K/V for the next draft. Their sum against the
measured in-loop step shows what the loop itself adds.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DecodeConfig, DrafterConfig, TargetConfig
from dflash_jax.decoding import loop
from dflash_jax.models.target import unembedding_matrix

PHASES = (
    "drafter_layers",
    "drafter_head",
    "verify_body",
    "verify_head_accept",
    "commit",
    "append_context",
)


def _median_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


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


def gemm_floor_fns(target_params, tcfg: TargetConfig, drafter_params, rows: int):
    """-> (fn, args) pairs {"ar": ..., "step": ...} whose timed calls are the two floors
    (`rows` = the block size for the step floor)."""
    head_dv = jax.jit(unembedding_matrix, static_argnums=1)(target_params, tcfg)
    t_layers = [_layer_matrices(target_params[f"layers_{i}"]) for i in range(tcfg.num_layers)]
    d = tcfg.hidden_size
    dtype = jnp.dtype(tcfg.dtype)

    @jax.jit
    def ar(t_layers, head_dv, x_1d):
        x_1d, sink = _through(x_1d, t_layers)
        return jnp.max(x_1d @ head_dv) + sink

    fns = {"ar": (ar, (t_layers, head_dv, jnp.full((1, d), 0.01, dtype)))}
    if drafter_params is not None:
        n_draft = sum(1 for k in drafter_params if k.startswith("layers_"))
        d_layers = [_layer_matrices(drafter_params[f"layers_{i}"]) for i in range(n_draft)]
        fc_fd = drafter_params["fc"]["kernel"]

        @jax.jit
        def step(t_layers, d_layers, fc_fd, head_dv, x_td, taps_tf):
            verify_td, sink_t = _through(x_td, t_layers)
            ctx_td = taps_tf @ fc_fd
            draft_td, sink_d = _through(x_td + ctx_td, d_layers)
            logits = jnp.max(verify_td @ head_dv) + jnp.max(draft_td[1:] @ head_dv)
            return logits + sink_t + sink_d

        x_td = jnp.full((rows, d), 0.01, dtype)
        taps_tf = jnp.full((rows, fc_fd.shape[0]), 0.01, fc_fd.dtype)
        fns["step"] = (step, (t_layers, d_layers, fc_fd, head_dv, x_td, taps_tf))
    return fns


def gemm_floors(target_params, tcfg, drafter_params, rows: int, repeats: int = 20) -> dict:
    """{"gemm_floor_ar_s", "gemm_floor_step_s"} in seconds (median of `repeats` calls)."""
    fns = gemm_floor_fns(target_params, tcfg, drafter_params, rows)
    return {f"gemm_floor_{name}_s": _median_time(f, a, repeats) for name, (f, a) in fns.items()}


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
    """The phases of one speculative step as separately jitted functions with their inputs, at
    the shapes of a real decode of `prompt` (cache buffers as `speculative_decode` allocates
    them) with every row's caches `live_length` slots long. -> {phase: (fn, args)}."""
    bs = cfg.block_size
    rng = jax.random.key(0)

    @jax.jit
    def init(target_params, drafter_params, prompt, prompt_lengths):
        head_dv = unembedding_matrix(target_params, tcfg)
        state = loop._init_speculative(
            target_params, drafter_params, head_dv, tcfg, dcfg, cfg, prompt, prompt_lengths, rng
        )
        return state, head_dv

    state, head_dv = init(target_params, drafter_params, prompt, prompt_lengths)
    b = prompt.shape[0]
    live_b = jnp.full((b,), live_length, jnp.int32)
    n_gen_b = live_b - jnp.asarray(prompt_lengths) + 1
    state = state.replace(drf_len=live_b, n_gen=n_gen_b)
    anchor_b1 = jnp.ones((b, 1), jnp.int32)
    key = jax.random.key(1)

    append = jax.jit(
        lambda dp, s, taps, n: loop.append_context(dp, dcfg, s.ctx_k, s.ctx_v, s.drf_len, taps, n)
    )
    layers = jax.jit(
        lambda dp, tp, a, s: loop.draft_hidden(
            dp, tp, tcfg, dcfg, a, s.ctx_k, s.ctx_v, s.drf_len, s.drf_len, bs
        )
    )
    head = jax.jit(lambda h, hidden, k: loop.draft_tokens(h, tcfg, dcfg, cfg, hidden, k))
    verify = jax.jit(lambda tp, v, s: loop.verify_hidden(tp, tcfg, dcfg, v, s.drf_len, s.cache))
    accept = jax.jit(lambda h, vh, d, dl, k: loop.verify_accept(h, cfg, vh, d, dl, k))
    commit = jax.jit(lambda s, new, a: loop._commit(s, new, a + 1, cfg, bs))

    hidden = layers(drafter_params, target_params, anchor_b1, state)
    drafts, draft_logp = head(head_dv, hidden, key)
    verify_bt = jnp.concatenate([anchor_b1, drafts], axis=1)
    vhidden, taps, _ = verify(target_params, verify_bt, state)
    a_b, new_bt = accept(head_dv, vhidden, drafts, draft_logp, key)
    return {
        "append_context": (append, (drafter_params, state, taps, a_b + 1)),
        "drafter_layers": (layers, (drafter_params, target_params, anchor_b1, state)),
        "drafter_head": (head, (head_dv, hidden, key)),
        "verify_body": (verify, (target_params, verify_bt, state)),
        "verify_head_accept": (accept, (head_dv, vhidden, drafts, draft_logp, key)),
        "commit": (commit, (state, new_bt, a_b)),
    }


def phase_times(*args, repeats: int = 20, **kwargs) -> dict:
    """{"phase_<name>_s": seconds} for every phase in PHASES (median of `repeats` calls); the
    arguments are `phase_fns`'."""
    fns = phase_fns(*args, **kwargs)
    return {f"phase_{name}_s": _median_time(*fns[name], repeats) for name in PHASES}


def breakdown(
    target, drafter, prompt, prompt_lengths, cfg: DecodeConfig, live_length: int, repeats=20
) -> dict:
    """Floors and phase times for one benchmark configuration (batch = prompt rows), plus the
    break-even tau. Greedy decoding is timed whatever `cfg` says (the phases differ only in the
    sampling arithmetic)."""
    cfg = dataclasses.replace(cfg, temperature=0.0)
    out = gemm_floors(target.params, target.config, drafter.params, cfg.block_size, repeats)
    out.update(
        phase_times(
            target.params,
            drafter.params,
            jnp.asarray(prompt),
            jnp.asarray(prompt_lengths),
            target.config,
            drafter.config,
            cfg,
            live_length,
            repeats=repeats,
        )
    )
    out["phases_sum_s"] = sum(out[f"phase_{p}_s"] for p in PHASES)
    out["break_even_tau"] = out["gemm_floor_step_s"] / out["gemm_floor_ar_s"]
    return out
