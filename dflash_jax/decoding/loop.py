"""`speculative_decode` and `autoregressive_decode`: one jitted function each, prefill plus a
single `jax.lax.while_loop` that never leaves the device.

Per-row bookkeeping (style.md letters, B batch, T = block size, W generated-token buffer):
  n_gen[b]   generated tokens committed so far; gen[b, n_gen-1] is the pending anchor
  start[b]   = prompt_len[b] + n_gen[b] - 1: the anchor's position = the target cache length
  drf_len[b] drafter context-cache length; reaches `start` after each append
Rollback is lowering a length: cache slots past it are masked and later overwritten. Writes
go through scatter with mode="drop" (dynamic_update_slice would clamp and clobber).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sharding
from dflash_jax.config import ConfigError, DecodeConfig, DrafterConfig, TargetConfig
from dflash_jax.decoding import adaptive, lookup
from dflash_jax.decoding.sampling import (
    accept_greedy_choices,
    accept_rejection,
    pick,
    process_logits,
    row_keys,
    sample,
)
from dflash_jax.models.drafter import Drafter, check_fits, embed_block, finish_logits
from dflash_jax.models.target import (
    Head,
    KVCache,
    Transformer,
    decoding_head,
    init_cache,
    write_rows,
)
from dflash_jax.ops.reductions import argmax_last


@flax.struct.dataclass
class DecodeOutput:
    """tokens [B, max_new_tokens]: generated tokens only (stop token included), 0-padded;
    lengths [B]; num_steps [B]: loop steps run for the row (the prefill token is not a step);
    acceptance_lengths [B, max_steps]: tokens committed per step incl. the bonus (tau), 0 after;
    block_sizes [B, max_steps]: the step kind each step ran (its block size; 1 = a plain target
    step of the adaptive mode, -b = a prompt-lookup step of block size b), 0 where the row ran
    no step."""

    tokens: jax.Array
    lengths: jax.Array
    num_steps: jax.Array
    acceptance_lengths: jax.Array
    block_sizes: jax.Array


@flax.struct.dataclass
class _State:
    gen: jax.Array  # [B, W] int32
    n_gen: jax.Array  # [B]
    done: jax.Array  # [B] bool
    step: jax.Array  # []
    num_steps: jax.Array  # [B]
    acc: jax.Array  # [B, max_steps]
    kinds: jax.Array  # [B, max_steps] block size of each step
    cache: KVCache
    ctx_k: tuple | None = None  # L x [B, Kv, S, H] drafter context cache
    ctx_v: tuple | None = None
    drf_len: jax.Array | None = None  # [B], = start after every step
    alpha: jax.Array | None = None  # [B, T-1] adaptive: per-position acceptance estimates
    plain_run: jax.Array | None = None  # [] adaptive: plain steps in a row
    probe_wait: jax.Array | None = None  # [] adaptive: plain steps before the next probe
    lookup_alpha: jax.Array | None = None  # [B, T-1] adaptive: the same for prompt lookup


# Logical axes of the carry (sharding.py maps them onto a mesh): rows split with the batch,
# caches also over kv heads; the step counters are replicated.
_CARRY_AXES = {
    "gen": ("batch", "length"),
    "n_gen": ("batch",),
    "done": ("batch",),
    "step": (),
    "num_steps": ("batch",),
    "acc": ("batch", None),
    "kinds": ("batch", None),
    "cache": sharding.KV_CACHE_AXES,
    "ctx_k": sharding.KV_CACHE_AXES,
    "ctx_v": sharding.KV_CACHE_AXES,
    "drf_len": ("batch",),
    "alpha": ("batch", None),
    "plain_run": (),
    "probe_wait": (),
    "lookup_alpha": ("batch", None),
}


def carry_shardings(state: _State, mesh) -> _State:
    """The loop state's NamedShardings on `mesh` (a _State of them), from `_CARRY_AXES`."""
    return state.replace(
        **{
            name: jax.tree.map(
                lambda x, axes=axes: sharding.logical_sharding(axes, x.shape, mesh),
                getattr(state, name),
            )
            for name, axes in _CARRY_AXES.items()
        }
    )


def _constrain(state: _State, mesh) -> _State:
    """Pins every carry buffer to its sharding on `mesh`, so XLA keeps the loop state in place
    from one iteration to the next; without a mesh the state is returned untouched."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, carry_shardings(state, mesh))


def max_steps(cfg: DecodeConfig) -> int:
    """Loop steps a decode may take: every token after the prefill's in its own step."""
    return max(cfg.max_new_tokens - 1, 1)


def _step_key(rng, step):
    """Per-step key; the prefill draws with step = max_steps (never a loop step)."""
    return jax.random.fold_in(rng, step)


def _prefill(
    target_params, head, tcfg, cfg, prompt_bp, prompt_lengths_b, rng, cache_len, tap_layers
):
    """Target on the whole (right-padded) prompt; the first token comes from each row's last
    prompt position. Returns (state without drafter fields, prompt taps or None)."""
    b, p = prompt_bp.shape
    cache = init_cache(tcfg, b, cache_len)
    positions_bp = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden_b1d, taps_bpf, cache = Transformer(tcfg).apply(
        {"params": target_params},
        prompt_bp,
        positions_bp,
        cache,
        None,  # an empty cache: written from slot 0
        tap_layers,
        (prompt_lengths_b - 1)[:, None],
        method="hidden",
    )
    first_b = _pick(head, hidden_b1d[:, 0], _step_key(rng, max_steps(cfg)), cfg)
    width = cfg.max_new_tokens + cfg.block_size + 1
    gen_bw = jnp.zeros((b, width), jnp.int32).at[:, 0].set(first_b)
    done_b = (
        jnp.isin(first_b, jnp.asarray(cfg.stop_token_ids, jnp.int32))
        if cfg.stop_token_ids
        else jnp.zeros((b,), bool)
    )
    done_b = done_b | (cfg.max_new_tokens <= 1)
    state = _State(
        gen=gen_bw,
        n_gen=jnp.ones((b,), jnp.int32),
        done=done_b,
        step=jnp.int32(0),
        num_steps=jnp.zeros((b,), jnp.int32),
        acc=jnp.zeros((b, max_steps(cfg)), jnp.int32),
        kinds=jnp.zeros((b, max_steps(cfg)), jnp.int32),
        cache=cache,
    )
    return state, taps_bpf


# The phases of one speculative step, each a pure function (the loop body chains them;
# `decoding.breakdown` times each one apart at real shapes).


def context_rows(drafter_params, dcfg, drf_len_b, taps_btf):
    """The drafter's context K/V rows for taps [B,T,F] placed at each row's drf_len.
    -> (ks, vs): per drafter layer [B,Kv,T,H]."""
    t = taps_btf.shape[1]
    positions_bt = drf_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return Drafter(dcfg).apply(
        {"params": drafter_params}, taps_btf, positions_bt, method="context_kv"
    )


def append_context(drafter_params, dcfg, ctx_k, ctx_v, drf_len_b, taps_btf, count_b):
    """Appends the context K/V of taps [B,T,F] (the committed tokens' target taps) at each
    row's drf_len; rows past `count` are written too, then masked and overwritten later.
    -> (ctx_k, ctx_v, drf_len + count)."""
    ks, vs = context_rows(drafter_params, dcfg, drf_len_b, taps_btf)
    ctx_k = tuple(write_rows(c, k, drf_len_b) for c, k in zip(ctx_k, ks, strict=True))
    ctx_v = tuple(write_rows(c, v, drf_len_b) for c, v in zip(ctx_v, vs, strict=True))
    return ctx_k, ctx_v, drf_len_b + count_b


def draft_hidden(
    drafter_params, target_params, tcfg, dcfg, anchor_b1, ctx_k, ctx_v, drf_len_b, start_b, bs
):
    """The drafter over [anchor, MASK x (bs-1)] at positions start.., non-causally over the
    context cache (block K/V are not cached). -> final-normed hidden of the bs-1 draft slots
    [B,bs-1,D]."""
    b = anchor_b1.shape[0]
    mask_bg = jnp.full((b, bs - 1), dcfg.mask_token_id, jnp.int32)
    x_btd = embed_block(target_params, tcfg, dcfg, jnp.concatenate([anchor_b1, mask_bg], 1))
    hidden_btd = Drafter(dcfg).apply(
        {"params": drafter_params}, x_btd, ctx_k, ctx_v, drf_len_b, start_b[:, None], bs
    )
    return hidden_btd[:, 1:]


def draft_tokens(head: Head, tcfg, dcfg, cfg, hidden_bgd, key):
    """The target's frozen head on the draft slots, then argmax or a sample per slot.
    -> (drafts [B,G] int32, draft log-probs [B,G,V] when sampling, else None)."""
    hidden_bgd = hidden_bgd.astype(jnp.dtype(tcfg.dtype))
    if cfg.greedy and not dcfg.final_logit_softcapping:  # a positive multiplier keeps the argmax
        return head.argmax(hidden_bgd), None
    logits_bgv = finish_logits(dcfg, head.logits(hidden_bgd))
    if cfg.greedy:
        return argmax_last(logits_bgv), None
    draft_logp_bgv = process_logits(logits_bgv, cfg)
    return sample(row_keys(key, hidden_bgd.shape[0]), draft_logp_bgv), draft_logp_bgv


def verify_hidden(target_params, tcfg, dcfg, verify_bt, start_b, cache, defer_write=False):
    """The target on [anchor, drafts] at positions start.., writing its K/V at start.
    -> (final-normed hidden [B,T,D], taps [B,T,F], cache); defer_write: the cache is left
    as it was and the new K/V rows take its place (`Transformer.hidden`)."""
    positions_bt = start_b[:, None] + jnp.arange(verify_bt.shape[1], dtype=jnp.int32)[None, :]
    return Transformer(tcfg).apply(
        {"params": target_params},
        verify_bt,
        positions_bt,
        cache,
        start_b,
        dcfg.target_layer_ids,
        None,
        defer_write,
        method="hidden",
    )


def verify_accept(head: Head, cfg, hidden_btd, drafts_bg, draft_logp_bgv, key):
    """The target's head on the verified block, then the longest valid prefix plus one target
    token. -> (accepted drafts a [B], committed tokens [B,T]: a drafts, then the bonus)."""
    if cfg.greedy:
        return accept_greedy_choices(drafts_bg, head.argmax(hidden_btd))
    return accept_rejection(drafts_bg, draft_logp_bgv, head.logits(hidden_btd), key, cfg)


def _pick(head: Head, hidden_bd, key, cfg: DecodeConfig) -> jax.Array:
    """The next target token per row: the greedy argmax (`Head.argmax`, the one function every
    greedy target token goes through) or a sample (`sampling.pick`)."""
    if cfg.greedy:
        return head.argmax(hidden_bd)
    return pick(head.logits(hidden_bd), key, cfg)


def _commit(
    state: _State, new_bt, produced_b, cfg: DecodeConfig, block_size: int = 1
) -> tuple[_State, jax.Array]:
    """Commits new[:, :produced] per row, capped by max_new_tokens and cut after the first
    stop token inside the new span only; records the step's block size. Done rows commit
    nothing. Returns (state, produced)."""
    b, t = new_bt.shape
    active_b = ~state.done
    produced_b = jnp.minimum(produced_b, cfg.max_new_tokens - state.n_gen)
    idx_t = jnp.arange(t)
    in_span_bt = idx_t[None, :] < produced_b[:, None]
    if cfg.stop_token_ids:
        stop_bt = jnp.isin(new_bt, jnp.asarray(cfg.stop_token_ids, jnp.int32)) & in_span_bt
        has_stop_b = jnp.any(stop_bt, axis=-1)
        produced_b = jnp.where(has_stop_b, jnp.argmax(stop_bt, axis=-1) + 1, produced_b)
    else:
        has_stop_b = jnp.zeros((b,), bool)
    produced_b = jnp.where(active_b, produced_b, 0)
    width = state.gen.shape[1]
    write_bt = jnp.where(idx_t[None, :] < produced_b[:, None], state.n_gen[:, None] + idx_t, width)
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    gen = state.gen.at[rows_bt, write_bt].set(new_bt, mode="drop")
    n_gen = state.n_gen + produced_b
    done = state.done | (active_b & (has_stop_b | (n_gen >= cfg.max_new_tokens)))
    acc = state.acc.at[jnp.arange(b), state.step].set(produced_b, mode="drop")
    kind_b = jnp.where(active_b, block_size, 0).astype(jnp.int32)
    kinds = state.kinds.at[jnp.arange(b), state.step].set(kind_b, mode="drop")
    state = state.replace(
        gen=gen,
        n_gen=n_gen,
        done=done,
        step=state.step + 1,
        num_steps=state.num_steps + active_b.astype(jnp.int32),
        acc=acc,
        kinds=kinds,
    )
    return state, produced_b


def finish(state: _State, cfg: DecodeConfig) -> DecodeOutput:
    """The loop state -> the decode's output (inside jit, or eagerly after a chunked run)."""
    n = cfg.max_new_tokens
    valid_bn = jnp.arange(n)[None, :] < state.n_gen[:, None]
    return DecodeOutput(
        tokens=jnp.where(valid_bn, state.gen[:, :n], 0),
        lengths=state.n_gen,
        num_steps=state.num_steps,
        acceptance_lengths=state.acc,
        block_sizes=state.kinds,
    )


def _cond(cfg, step_limit):
    """Loop while steps are left (below `step_limit`, an input, and the config's maximum) and a
    row still decodes."""
    limit = jnp.minimum(jnp.asarray(step_limit, jnp.int32), max_steps(cfg))
    return lambda s: (s.step < limit) & ~jnp.all(s.done)


def _start_autoregressive(
    target_params, prompt, prompt_lengths, rng, *, target_config, decode_config, mesh=None
) -> _State:
    """The AR decode's prefill: its loop state, the first token committed."""
    tcfg, cfg = target_config, decode_config
    cache_len = prompt.shape[1] + cfg.max_new_tokens + 2
    head = decoding_head(target_params, tcfg)
    state, _ = _prefill(target_params, head, tcfg, cfg, prompt, prompt_lengths, rng, cache_len, ())
    return _constrain(state, mesh)


def _advance_autoregressive(
    target_params,
    prompt,
    prompt_lengths,
    rng,
    step_limit,
    state: _State,
    *,
    target_config,
    decode_config,
    mesh=None,
) -> _State:
    """Runs the AR loop on `state` until `step_limit` steps (counted from the prefill) or done."""
    del prompt  # the state holds what the loop needs; kept so every program takes one layout
    tcfg, cfg = target_config, decode_config
    head = decoding_head(target_params, tcfg)
    model = Transformer(tcfg)

    def body(s: _State) -> _State:
        last_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        start_b = prompt_lengths + s.n_gen - 1
        hidden_b1d, _, cache = model.apply(
            {"params": target_params}, last_b1, start_b[:, None], s.cache, start_b, method="hidden"
        )
        next_b = _pick(head, hidden_b1d[:, 0], _step_key(rng, s.step), cfg)
        s, _ = _commit(s.replace(cache=cache), next_b[:, None], jnp.ones_like(start_b), cfg)
        return _constrain(s, mesh)

    return jax.lax.while_loop(_cond(cfg, step_limit), body, state)


def _autoregressive(
    target_params,
    prompt,
    prompt_lengths,
    rng,
    step_limit,
    *,
    target_config,
    decode_config,
    mesh=None,
) -> DecodeOutput:
    statics = dict(target_config=target_config, decode_config=decode_config, mesh=mesh)
    state = _start_autoregressive(target_params, prompt, prompt_lengths, rng, **statics)
    state = _advance_autoregressive(
        target_params, prompt, prompt_lengths, rng, step_limit, state, **statics
    )
    return finish(state, decode_config)


# XLA:CPU's default copy insertion copies every loop-carried cache buffer that a step both
# reads and updates (twice per buffer and step: ~4 ms of a 15 ms SmolLM2 AR step at batch 1);
# region analysis proves the read comes first and updates in place. Other backends ignore it.
LOOP_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def _init_speculative(
    target_params, drafter_params, head, tcfg, dcfg, cfg, prompt, prompt_lengths, rng
) -> _State:
    """Prefill, then the prompt's drafter context K/V (block-independent: all appended now)."""
    bs = cfg.block_size
    b, p = prompt.shape
    cache_len = p + cfg.max_new_tokens + 2 * bs
    state, taps_bpf = _prefill(
        target_params,
        head,
        tcfg,
        cfg,
        prompt,
        prompt_lengths,
        rng,
        cache_len,
        dcfg.target_layer_ids,
    )
    ctx_shape = (b, dcfg.num_kv_heads, cache_len, dcfg.head_dim)
    dtype = jnp.dtype(dcfg.dtype)
    empty = tuple(jnp.zeros(ctx_shape, dtype) for _ in range(dcfg.num_layers))
    zero_b = jnp.zeros((b,), jnp.int32)
    ctx_k, ctx_v, drf_len_b = append_context(
        drafter_params, dcfg, empty, empty, zero_b, taps_bpf, prompt_lengths
    )
    return state.replace(
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        drf_len=drf_len_b,
        alpha=jnp.full((b, max(bs - 1, 1)), cfg.adaptive_prior, jnp.float32),
        plain_run=jnp.int32(0),
        probe_wait=jnp.int32(cfg.probe_every),
        lookup_alpha=jnp.full((b, max(bs - 1, 1)), cfg.adaptive_prior, jnp.float32),
    )


def _propose(
    s: _State, copy_bg=None, copy_flag=None, *, bs: int, width: int, ctx: dict, sources=("draft",)
) -> dict:
    """The part of one loop step with block size `bs` that writes no carried buffer: draft bs-1
    tokens, verify them (the target's K/V rows returned, not written), accept, and the drafter
    context rows of the verified tokens. Row outputs are padded to `width` (the largest kind),
    so the adaptive `lax.switch` over kinds has one output shape, and since no branch writes a
    cache, XLA:CPU copies none into or out of the branches (it copied all 66 SmolLM2 cache
    buffers per step when the branches wrote them, ~1.2 ms of a 12 ms plain step). bs == 1 is a
    plain target step (no drafting; its taps still feed the context, so drafting can resume at
    any step). `sources`: where the drafts come from, "draft" (the drafter) and/or "copy" (a
    prompt-lookup step: copy_bg's first bs-1 tokens); with both, the traced `copy_flag` picks
    one, so a drafting kind and a lookup kind of one block size share one compiled verify."""
    tcfg, dcfg, cfg = ctx["tcfg"], ctx["dcfg"], ctx["cfg"]
    tparams, dparams, head = ctx["target_params"], ctx["drafter_params"], ctx["head"]
    k_draft, k_accept = jax.random.split(_step_key(ctx["rng"], s.step))
    start_b = ctx["prompt_lengths"] + s.n_gen - 1
    anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
    if sources == ("copy",):
        copy_flag = jnp.bool_(True)
    elif sources == ("draft",):
        copy_flag = jnp.bool_(False)

    def copied():
        drafts_bg = copy_bg[:, : bs - 1]
        return drafts_bg, None if cfg.greedy else lookup.one_hot_logp(drafts_bg, tcfg.vocab_size)

    def drafted():
        # Draft [anchor, MASK x (bs-1)] non-causally over the context (which ends at start).
        hidden_bgd = draft_hidden(
            dparams, tparams, tcfg, dcfg, anchor_b1, s.ctx_k, s.ctx_v, s.drf_len, start_b, bs
        )
        return draft_tokens(head, tcfg, dcfg, cfg, hidden_bgd, k_draft)

    if bs > 1:
        if sources == ("copy",):
            drafts_bg, draft_logp_bgv = copied()
        elif sources == ("draft",):
            drafts_bg, draft_logp_bgv = drafted()
        else:
            drafts_bg, draft_logp_bgv = jax.lax.cond(copy_flag, copied, drafted)
        verify_bt = jnp.concatenate([anchor_b1, drafts_bg], axis=1)
    else:
        verify_bt = anchor_b1
    # Verify with the target; its K/V rows for slots start.. come back unwritten.
    vhidden_btd, taps_btf, kv_rows = verify_hidden(
        tparams, tcfg, dcfg, verify_bt, start_b, s.cache, defer_write=True
    )
    # Accept the longest valid prefix plus one target token.
    if bs > 1:
        a_b, new_bt = verify_accept(head, cfg, vhidden_btd, drafts_bg, draft_logp_bgv, k_accept)
    else:
        new_bt = _pick(head, vhidden_btd[:, 0], k_accept, cfg)[:, None]
        a_b = jnp.zeros_like(start_b)
    ctx_ks, ctx_vs = context_rows(dparams, dcfg, s.drf_len, taps_btf)

    def pad(x, axis):  # rows of this kind -> `width` rows (the tail is never read)
        extra = [(0, 0)] * x.ndim
        extra[axis] = (0, width - x.shape[axis])
        return jnp.pad(x, extra)

    out = dict(
        new=pad(new_bt, 1),
        accepted=a_b,
        k=tuple(pad(r, 2) for r in kv_rows.k),
        v=tuple(pad(r, 2) for r in kv_rows.v),
        ctx_k=tuple(pad(r, 2) for r in ctx_ks),
        ctx_v=tuple(pad(r, 2) for r in ctx_vs),
        kind=jnp.where(copy_flag, -bs, bs).astype(jnp.int32),
    )
    if cfg.adaptive:
        alpha = s.alpha
        if bs > 1 and "draft" in sources:  # move on what a drafting step tried
            tried_b = jnp.where(s.done, 0, a_b + 1)
            moved = adaptive.update_estimates(alpha, a_b, tried_b, bs, cfg.adaptive_rate)
            alpha = jnp.where(copy_flag, alpha, moved)
        out["alpha"] = alpha
    return out


def _apply(s: _State, out: dict, cfg: DecodeConfig, prompt_lengths) -> _State:
    """Writes what `_propose` returned: commits the accepted tokens, the target's K/V rows at
    the anchor's slot and the committed tokens' drafter context rows (one in-place scatter per
    buffer, outside any branch)."""
    start_b = prompt_lengths + s.n_gen - 1
    active_b = ~s.done
    kind = out["kind"]
    # Commit; the target cache length is implied by n_gen (rollback = lower length).
    s, produced_b = _commit(s, out["new"], out["accepted"] + 1, cfg, kind)
    cache = KVCache(
        k=tuple(write_rows(c, r, start_b) for c, r in zip(s.cache.k, out["k"], strict=True)),
        v=tuple(write_rows(c, r, start_b) for c, r in zip(s.cache.v, out["v"], strict=True)),
    )
    ctx_k = tuple(write_rows(c, r, s.drf_len) for c, r in zip(s.ctx_k, out["ctx_k"], strict=True))
    ctx_v = tuple(write_rows(c, r, s.drf_len) for c, r in zip(s.ctx_v, out["ctx_v"], strict=True))
    s = s.replace(cache=cache, ctx_k=ctx_k, ctx_v=ctx_v, drf_len=s.drf_len + produced_b)
    if cfg.adaptive:
        drafted = jnp.maximum(kind, 1)  # the probe clock counts a lookup step as plain
        wait = adaptive.next_probe_wait(s.probe_wait, drafted, out["accepted"], active_b, cfg)
        s = s.replace(
            alpha=out["alpha"],
            plain_run=jnp.where(drafted == 1, s.plain_run + 1, 0),
            probe_wait=wait,
        )
    if cfg.lookup_kinds:
        lookup_alpha = adaptive.update_lookup_estimates(
            s.lookup_alpha, out["copy"], out["new"], produced_b, out["found"], cfg.adaptive_rate
        )
        s = s.replace(lookup_alpha=lookup_alpha)
    return s


def _start_speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    *,
    target_config,
    drafter_config,
    decode_config,
    mesh=None,
) -> _State:
    """The speculative decode's prefill and prompt context: its loop state before any step."""
    head = decoding_head(target_params, target_config)
    state = _init_speculative(
        target_params,
        drafter_params,
        head,
        target_config,
        drafter_config,
        decode_config,
        prompt,
        prompt_lengths,
        rng,
    )
    return _constrain(state, mesh)


def step_branches(cfg: DecodeConfig) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """The compiled step variants of an adaptive decode: one per block size among its kinds,
    (block size, draft sources), a drafting and a lookup kind of one size sharing one (one
    target verify compiled per block size, not per kind)."""
    sizes = sorted(set(cfg.step_kinds) | set(cfg.lookup_kinds))
    return tuple(
        (b, tuple(src for src, kinds in (("draft", cfg.step_kinds), ("copy", cfg.lookup_kinds))
                  if b in kinds))
        for b in sizes
    )  # fmt: skip


def _advance_speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    step_costs,
    forced_kind,
    step_limit,
    state: _State,
    *,
    target_config,
    drafter_config,
    decode_config,
    mesh=None,
) -> _State:
    """Runs the speculative loop on `state` until `step_limit` steps or every row is done."""
    tcfg, dcfg, cfg = target_config, drafter_config, decode_config
    head = decoding_head(target_params, tcfg)
    ctx = dict(
        tcfg=tcfg,
        dcfg=dcfg,
        cfg=cfg,
        target_params=target_params,
        drafter_params=drafter_params,
        head=head,
        rng=rng,
        prompt_lengths=prompt_lengths,
    )
    width = cfg.block_size
    if not cfg.adaptive:
        propose = functools.partial(_propose, bs=cfg.block_size, width=width, ctx=ctx)
    else:
        variants = step_branches(cfg)
        branches = [
            functools.partial(_propose, bs=b, width=width, ctx=ctx, sources=src)
            for b, src in variants
        ]
        sizes = [b for b, _ in variants]
        # kind index (cfg.all_kinds order) -> its compiled variant, and whether it copies
        branch_of = jnp.asarray([sizes.index(abs(b)) for b in cfg.all_kinds], jnp.int32)
        copies = jnp.asarray([b < 0 for b in cfg.all_kinds])

        def propose(s: _State) -> dict:
            copy_bg = found_b = None
            if cfg.lookup_kinds:  # what a copy would propose now (cheap: token compares)
                copy_bg, found_b = lookup.device_proposal(
                    prompt, prompt_lengths, s.gen, s.n_gen, width - 1, cfg.lookup_ngram
                )
            k = adaptive.choose_kind(
                s.alpha,
                ~s.done,
                s.plain_run,
                step_costs,
                forced_kind,
                cfg,
                s.probe_wait,
                s.lookup_alpha,
                found_b,
            )
            out = jax.lax.switch(branch_of[k], branches, s, copy_bg, copies[k])
            if cfg.lookup_kinds:
                out = dict(out, copy=copy_bg, found=found_b)
            return out

    def body(s: _State) -> _State:
        return _constrain(_apply(s, propose(s), cfg, prompt_lengths), mesh)

    return jax.lax.while_loop(_cond(cfg, step_limit), body, state)


def _speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    step_costs,
    forced_kind,
    step_limit,
    *,
    target_config,
    drafter_config,
    decode_config,
    mesh=None,
) -> DecodeOutput:
    statics = dict(
        target_config=target_config,
        drafter_config=drafter_config,
        decode_config=decode_config,
        mesh=mesh,
    )
    state = _start_speculative(
        target_params, drafter_params, prompt, prompt_lengths, rng, **statics
    )
    state = _advance_speculative(
        target_params,
        drafter_params,
        prompt,
        prompt_lengths,
        rng,
        step_costs,
        forced_kind,
        step_limit,
        state,
        **statics,
    )
    return finish(state, decode_config)


_AR_STATICS = ("target_config", "decode_config", "mesh")
_SPEC_STATICS = ("target_config", "drafter_config", "decode_config", "mesh")


def _jit(fn, statics, donate=()):
    return jax.jit(
        fn,
        static_argnames=statics,
        donate_argnames=donate,
        compiler_options=LOOP_COMPILER_OPTIONS,
    )


# Each decode as one jitted function (prefill and the whole loop: `speculative_decode`), and as
# the same two halves apart: start (prefill -> loop state) and advance (state, step limit ->
# state, donated so the caches stay in place). The halves are what the CLIs, the benchmark and
# the calibration run: they stream by advancing a few steps at a time with no host callback
# inside (which would keep JAX's persistent cache from storing them), and a step limit is an
# input, so short calibration runs and whole decodes share one executable.
_autoregressive_jit = _jit(_autoregressive, _AR_STATICS)
start_autoregressive = _jit(_start_autoregressive, _AR_STATICS)
advance_autoregressive = _jit(_advance_autoregressive, _AR_STATICS, ("state",))
_speculative_jit = _jit(_speculative, _SPEC_STATICS)
start_speculative = _jit(_start_speculative, _SPEC_STATICS)
advance_speculative = _jit(_advance_speculative, _SPEC_STATICS, ("state",))

# jitted decoder -> (its function, how many param trees lead its arguments, whether its last
# argument is a loop state, whether it returns one)
_DECODERS = {
    _autoregressive_jit: (_autoregressive, 1, False, False),
    start_autoregressive: (_start_autoregressive, 1, False, True),
    advance_autoregressive: (_advance_autoregressive, 1, True, True),
    _speculative_jit: (_speculative, 2, False, False),
    start_speculative: (_start_speculative, 2, False, True),
    advance_speculative: (_advance_speculative, 2, True, True),
}
_ON_MESH: dict = {}


def on_mesh(jitted, mesh, args: tuple, statics: dict):
    """`jitted` (one of the decode functions above) for a run on `mesh`. -> (its function
    jitted for `mesh` with in/out shardings from the logical table and the statics bound, args
    placed on those shardings, {} for the statics). In: params as `sharding.param_shardings`
    places them (heads, MLP and vocab over `tensor`, model dim over `fsdp`), prompt [B,P] and
    lengths [B] split over the batch axes, a loop state as `carry_shardings` places it, the rest
    replicated; params already there (`load_target(..., mesh=mesh)`) are not moved. Out: a loop
    state where it came from, an output replicated, so that every process can read the tokens."""
    fn, num_params, takes_state, gives_state = _DECODERS[jitted]
    params = args[:num_params]
    rest = args[num_params + 2 : len(args) - int(takes_state)]
    in_shardings = (
        *(sharding.param_shardings(p, mesh) for p in params),
        *sharding.batch_shardings(args[num_params : num_params + 2], mesh),
        *(sharding.replicated(mesh),) * len(rest),
        *((carry_shardings(args[-1], mesh),) if takes_state else ()),
    )
    leaves, treedef = jax.tree.flatten(in_shardings)
    key = (fn, mesh, treedef, tuple(leaves), tuple(sorted(statics.items())))
    if key not in _ON_MESH:
        bound = functools.partial(fn, **statics, mesh=mesh)
        if takes_state:
            out_shardings = in_shardings[-1]
        elif gives_state:
            out_shardings = carry_shardings(jax.eval_shape(bound, *args), mesh)
        else:
            out_shardings = sharding.replicated(mesh)
        # jit takes no keyword arguments beside in_shardings: the statics are bound here.
        _ON_MESH[key] = jax.jit(
            bound,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=(len(args) - 1,) if takes_state else (),
            compiler_options=LOOP_COMPILER_OPTIONS,
        )
    return _ON_MESH[key], sharding.put(args, in_shardings), {}


def check_prompt(prompt, prompt_lengths, tcfg: TargetConfig, cfg: DecodeConfig):
    if prompt.ndim != 2:
        raise ValueError(f"prompt must be int32 [batch, length], got shape {prompt.shape}")
    if prompt_lengths.shape != prompt.shape[:1]:
        raise ValueError(
            f"prompt_lengths must have shape [{prompt.shape[0]}], got {prompt_lengths.shape}"
        )
    if prompt.shape[1] == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    total = prompt.shape[1] + cfg.max_new_tokens
    if total > tcfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {prompt.shape[1]} + max_new_tokens {cfg.max_new_tokens} = {total} "
            f"exceeds the target's context of {tcfg.max_position_embeddings} tokens"
        )
    if not isinstance(prompt_lengths, jax.core.Tracer):
        lengths = np.asarray(prompt_lengths)
        if lengths.min() < 1:
            raise ValueError("prompt is empty: every row needs at least one token")
        if lengths.max() > prompt.shape[1]:
            raise ValueError(
                f"prompt_lengths {lengths.max()} exceeds the prompt buffer width {prompt.shape[1]}"
            )


# What only a drafting decode reads: the AR loop resets them (block_size to 1), so one compiled
# AR loop serves every block size and mode; every other field (sampling, stops, lengths) is kept.
_DRAFTING_FIELDS = (
    "block_size",
    "adaptive",
    "step_kinds",
    "adaptive_rate",
    "adaptive_prior",
    "probe_every",
    "probe_backoff",
    "lookup_kinds",
    "lookup_ngram",
)


def autoregressive_config(cfg: DecodeConfig) -> DecodeConfig:
    """`cfg` for the target alone: the drafting fields at their defaults, block size 1."""
    defaults = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}
    reset = {name: defaults[name] for name in _DRAFTING_FIELDS}
    return dataclasses.replace(cfg, **{**reset, "block_size": 1})


def check_decode_inputs(tcfg: TargetConfig, dcfg: DrafterConfig, cfg: DecodeConfig) -> None:
    """Refuses a drafter that does not fit the target, or a block size it was not trained for."""
    check_fits(dcfg, tcfg)
    if cfg.block_size > dcfg.block_size:
        raise ConfigError(
            f"block_size={cfg.block_size} exceeds the drafter's trained block size "
            f"{dcfg.block_size}"
        )


def autoregressive_decode(
    target_params,
    prompt,
    prompt_lengths,
    rng,
    *,
    target_config: TargetConfig,
    decode_config: DecodeConfig,
    mesh=None,
    step_limit: int | None = None,
) -> DecodeOutput:
    """The target decoding alone, one token per step: the baseline and the lossless reference.

    prompt: int32 [B, P] right-padded; prompt_lengths: int32 [B]; rng: a PRNG key.
    mesh: a `jax.sharding.Mesh` (axes data/fsdp/tensor, `sharding.make_mesh`) to run on, else the
    one set by `jax.set_mesh`, else one device; the tokens are the same (see `on_mesh`).
    step_limit: stop after this many loop steps (None: `max_steps`); an input, so a new limit
    never recompiles.
    """
    prompt, prompt_lengths = jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
    check_prompt(prompt, prompt_lengths, target_config, decode_config)
    limit = _step_limit(decode_config, step_limit)
    args = (target_params, prompt, prompt_lengths, rng, limit)
    statics = dict(target_config=target_config, decode_config=autoregressive_config(decode_config))
    return _run(_autoregressive_jit, args, statics, mesh)


def _step_limit(cfg: DecodeConfig, step_limit: int | None) -> jax.Array:
    if step_limit is None:
        return jnp.int32(max_steps(cfg))
    if step_limit < 0:
        raise ValueError(f"step_limit={step_limit} must be >= 0")
    return jnp.int32(min(step_limit, max_steps(cfg)))


def _run(jitted, args: tuple, statics: dict, mesh) -> DecodeOutput:
    mesh = mesh if mesh is not None else sharding.current_mesh()
    if mesh is None:
        return jitted(*args, **statics)
    fn, args, statics = on_mesh(jitted, mesh, args, statics)
    return fn(*args, **statics)


def step_cost_array(cfg: DecodeConfig, step_costs=None) -> jax.Array:
    """The adaptive controller's costs [num_kinds] (AR-step units) as a jit input; defaults from
    `adaptive.default_step_costs`. A placeholder [1] when the mode is off."""
    if not cfg.adaptive:
        return jnp.ones((1,), jnp.float32)
    if step_costs is None:
        step_costs = adaptive.default_step_costs(cfg.all_kinds)
    step_costs = jnp.asarray(step_costs, jnp.float32)
    if step_costs.shape != (len(cfg.all_kinds),):
        raise ValueError(
            f"step_costs has shape {step_costs.shape}; expected one cost per step kind "
            f"{cfg.all_kinds}"
        )
    return step_costs


def speculative_decode(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    *,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    decode_config: DecodeConfig,
    step_costs=None,
    mesh=None,
    step_limit: int | None = None,
) -> DecodeOutput:
    """DFlash speculative decoding; output distributed exactly as the target's own (greedy:
    identical tokens). Same inputs and output as `autoregressive_decode` (`step_limit` too).

    With `decode_config.adaptive`, each step's block size is chosen on device (see
    `decoding/adaptive.py`); `step_costs` [num_kinds] are the kinds' costs in AR steps
    (`calibration.calibrate_step_costs` measures them; an array, so new costs never recompile).
    `mesh` as in `autoregressive_decode`.
    """
    check_decode_inputs(target_config, drafter_config, decode_config)
    prompt, prompt_lengths = jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
    check_prompt(prompt, prompt_lengths, target_config, decode_config)
    args = (
        target_params,
        drafter_params,
        prompt,
        prompt_lengths,
        rng,
        step_cost_array(decode_config, step_costs),
        jnp.int32(-1),
        _step_limit(decode_config, step_limit),
    )
    statics = dict(
        target_config=target_config, drafter_config=drafter_config, decode_config=decode_config
    )
    return _run(_speculative_jit, args, statics, mesh)
