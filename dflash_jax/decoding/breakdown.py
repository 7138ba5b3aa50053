"""Where a decode step's time goes: each phase of the speculative step timed apart at real shapes,
and the GEMM floors every step is judged against (`decoding.floors`, re-exported here), for
`infer.benchmark --breakdown`.

Phases of one step, each the same function the loop body runs (`phases.py`), jitted alone:
drafter layers, drafter head (+ argmax), target verify body, verify head + accept, commit, and
appending the committed tokens' context K/V for the next draft. A DFlash2 drafter's head phase
is the head and its top-k candidates, and its selector's walk over them is one more phase,
`drafter_select` (`phase_names`). Their sum against the
measured in-loop step shows what the loop itself adds.

With a tree (`DecodeConfig.tree_nodes` = N, `decoding/tree.py`) a tree step is timed too, its
phases named `TREE_PHASES`: the drafter layers (the chain's), `tree_build` (the drafter head's
per-depth distributions and the best-first growth of the N-token tree), `tree_verify` (the
target over the N nodes under the tree mask, the cache read, not written), `tree_accept_move`
(the target head, acceptance down the tree, and the accepted path's K/V rows gathered and
written into the cache at the anchor's slot), then the chain's commit and context append (a
tree step commits a path as a chain step commits a block). `gemm_floor_tree_step_s` is its
floor: N rows through the target and the head, a block through the drafter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import phases, programs, selector, tree
from dflash_jax.decoding.floors import (
    bracket_floors,
    compile_options,
    floor_fns,
    floors_by_dtype,
    gemm_floors,
    loop_time,
    tie,
)
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.state import commit as commit_tokens
from dflash_jax.models.target import decoding_head

# The floors are `decoding.floors`'; the benchmark and the tests reach them from here too.
__all__ = [
    "DFLASH2_PHASES",
    "PHASES",
    "TREE_PHASES",
    "bracket_floors",
    "breakdown",
    "floor_fns",
    "floors_by_dtype",
    "gemm_floors",
    "phase_fns",
    "phase_names",
    "phase_times",
]

PHASES = (
    "drafter_layers",
    "drafter_head",
    "verify_body",
    "verify_head_accept",
    "commit",
    "append_context",
)


DFLASH2_PHASES = (*PHASES[:2], "drafter_select", *PHASES[2:])

# A tree step's phases in step order (module docstring); the first and the last two are the
# chain step's own.
TREE_PHASES = (
    "drafter_layers",
    "tree_build",
    "tree_verify",
    "tree_accept_move",
    "commit",
    "append_context",
)


def phase_names(dcfg: DrafterConfig) -> tuple[str, ...]:
    """The phases of a step with this drafter, in step order."""
    return DFLASH2_PHASES if dcfg.is_dflash2 else PHASES


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
    allocates them) with every row's caches `live_length` slots long; with `cfg.tree_nodes`
    also a tree step's own phases (`TREE_PHASES`).
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
    # its arguments; see `loop_time` and `tie`.
    def drafter_layers(c, tp, dp, head):
        s, anchor, sink = c
        h = phases.draft_hidden(
            dp, tp, tcfg, dcfg, anchor, s.ctx_k, s.ctx_v, s.drf_len, start_b, bs
        )
        # The block's anchor carries the dependency (the same token every call).
        return s, tie(anchor.astype(jnp.float32), h).astype(jnp.int32), sink

    def drafter_head(c, tp, dp, head):
        h, sink = c
        if dcfg.is_dflash2:  # the head and the candidates; the walk is `drafter_select`
            return tie(h, selector.candidates(head, tcfg, dcfg, h)), sink
        d, _ = phases.draft_tokens(head, tcfg, dcfg, cfg, h, key, dp, anchor_b1)
        return tie(h, d), sink

    def drafter_select(c, tp, dp, head):
        h, unary, cand, sink = c
        d, _ = selector.walk(
            dp["candidate_selector"], dcfg, cfg, h, unary, cand, anchor_b1[:, 0], key
        )
        return tie(h, d), unary, cand, sink

    def verify_body(c, tp, dp, head):
        cache, tokens_bt, sink = c
        vh, taps_btf, cache = phases.verify_hidden(tp, tcfg, dcfg, tokens_bt, start_b, cache)
        # The tokens carry the dependency too, or XLA hoists layer 0's projections.
        tokens_bt = tie(tokens_bt.astype(jnp.float32), (vh, taps_btf)).astype(jnp.int32)
        return cache, tokens_bt, sink

    def verify_head_accept(c, tp, dp, head):
        vh, sink = c
        a, new = phases.verify_accept(head, cfg, vh, drafts, draft_logp, key)
        return tie(vh, (a, new)), sink

    def commit(c, tp, dp, head):
        s, sink = c
        s, produced = commit_tokens(s, new_bt, a_b + 1, cfg, bs)
        return s, tie(sink, produced)

    def append_context(c, tp, dp, head):
        ctx_k, ctx_v, taps_btf = c
        ctx_k, ctx_v, _ = phases.append_context(dp, dcfg, ctx_k, ctx_v, live_b, taps_btf, a_b + 1)
        # The taps carry the dependency, or XLA hoists their K/V out of the loop.
        return ctx_k, ctx_v, tie(taps_btf, (ctx_k[0][:, :, 0], ctx_v[0][:, :, 0]))

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
    names = phase_names(dcfg)
    if cfg.tree_nodes:
        fns.update(_tree_phase_fns(state, hidden, head, start_b, key, tcfg, dcfg, cfg, weights))
        names += tuple(n for n in TREE_PHASES if n not in names)
    return {name: fns[name] for name in names}


def _tree_phase_fns(state, hidden_bgd, head, start_b, key, tcfg, dcfg, cfg, weights) -> dict:
    """A tree step's own phases (`TREE_PHASES` less the chain's), as `phase_fns` gives them,
    from the drafter's hidden states `hidden_bgd` of the chain's phases."""
    b = hidden_bgd.shape[0]
    anchor_b = jnp.ones((b,), jnp.int32)
    t = jax.jit(lambda h, dp, x: tree.build(h, tcfg, dcfg, cfg, dp, x, anchor_b))(
        head, weights[1], hidden_bgd
    )
    tp = weights[0]
    vh, taps, kv_rows, anc = jax.jit(lambda tp, c: tree.verify(tp, tcfg, dcfg, t, start_b, c))(
        tp, state.cache
    )

    def tree_build(c, tp, dp, head):
        h, sink = c
        return tie(h, tree.build(head, tcfg, dcfg, cfg, dp, h, anchor_b)), sink

    def tree_verify(c, tp, dp, head):
        cache, tokens_bn, sink = c
        vh, taps_bnf, rows, _ = tree.verify(
            tp, tcfg, dcfg, t.replace(tokens=tokens_bn), start_b, cache
        )
        # The tokens carry the dependency (the cache is only read).
        tokens_bn = tie(tokens_bn.astype(jnp.float32), (vh, taps_bnf, rows)).astype(jnp.int32)
        return cache, tokens_bn, sink

    def tree_accept_move(c, tp, dp, head):
        cache, vh, sink = c
        out = tree.accept_path(head, cfg, t, anc, vh, taps, kv_rows, key, cfg.block_size)
        cache = cache.written(out["k"], out["v"], start_b)
        return cache, tie(vh, (out["new"], out["accepted"], out["taps"])), sink

    zero = jnp.float32(0.0)
    return {
        "tree_build": (tree_build, (hidden_bgd, zero), weights),
        "tree_verify": (tree_verify, (state.cache, t.tokens, zero), weights),
        "tree_accept_move": (tree_accept_move, (state.cache, vh, zero), weights),
    }


def phase_times(*args, repeats: int = 20, compiler_options=None, **kwargs) -> dict:
    """{"phase_<name>_s": seconds per call} for every phase `phase_fns` gives (`phase_names`,
    and with a tree `TREE_PHASES`) (`loop_time` over `repeats` calls, compiled with
    `compiler_options`); the other arguments are `phase_fns`'."""
    fns = phase_fns(*args, **kwargs)
    return {
        f"phase_{name}_s": loop_time(*fn, repeats, compiler_options) for name, fn in fns.items()
    }


def breakdown(
    target, drafter, prompt, prompt_lengths, cfg: DecodeConfig, live_length: int, repeats=20
) -> dict:
    """Floors and phase times for one benchmark configuration (batch = prompt rows), plus the
    break-even tau; with `cfg.tree_nodes` also a tree step's phases, their sum
    (`tree_phases_sum_s`), its floor and break-even tau. Greedy decoding is timed whatever `cfg`
    says (the phases differ only in the sampling arithmetic)."""
    cfg = dataclasses.replace(cfg, temperature=0.0)
    run_cfg = programs.run_target_config(target.config, cfg)  # as the decode compiles it
    ar_rows = run_cfg.invariant_rows[0] if run_cfg.invariant_rows else 1
    out = gemm_floors(
        target.params,
        run_cfg,
        drafter.params,
        cfg.block_size,
        repeats,
        ar_rows=ar_rows,
        tree_rows=cfg.tree_nodes,
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
            compiler_options=compile_options(run_cfg),
        )
    )
    out["phases_sum_s"] = sum(out[f"phase_{p}_s"] for p in phase_names(drafter.config))
    out["break_even_tau"] = out["gemm_floor_step_s"] / out["gemm_floor_ar_s"]
    if cfg.tree_nodes:
        out["tree_nodes"] = cfg.tree_nodes
        out["tree_phases_sum_s"] = sum(out[f"phase_{p}_s"] for p in TREE_PHASES)
        out["break_even_tau_tree"] = out["gemm_floor_tree_step_s"] / out["gemm_floor_ar_s"]
    return out
