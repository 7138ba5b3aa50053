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

from dflash_jax.config import ConfigError, DecodeConfig, DrafterConfig, TargetConfig
from dflash_jax.decoding.sampling import (
    accept_greedy,
    accept_rejection,
    pick,
    process_logits,
    row_keys,
    sample,
)
from dflash_jax.models.drafter import Drafter, check_fits, embed_block, finish_logits
from dflash_jax.models.target import (
    KVCache,
    Transformer,
    apply_head,
    init_cache,
    unembedding_matrix,
    write_rows,
)
from dflash_jax.ops.reductions import argmax_last


@flax.struct.dataclass
class DecodeOutput:
    """tokens [B, max_new_tokens]: generated tokens only (stop token included), 0-padded;
    lengths [B]; num_steps [B]: loop steps run for the row (the prefill token is not a step);
    acceptance_lengths [B, max_steps]: tokens committed per step incl. the bonus (tau), 0 after."""

    tokens: jax.Array
    lengths: jax.Array
    num_steps: jax.Array
    acceptance_lengths: jax.Array


@flax.struct.dataclass
class _State:
    gen: jax.Array  # [B, W] int32
    n_gen: jax.Array  # [B]
    done: jax.Array  # [B] bool
    step: jax.Array  # []
    num_steps: jax.Array  # [B]
    acc: jax.Array  # [B, max_steps]
    cache: KVCache
    ctx_k: tuple | None = None  # L x [B, Kv, S, H] drafter context cache
    ctx_v: tuple | None = None
    drf_len: jax.Array | None = None  # [B]
    pending: jax.Array | None = None  # [B, T, taps*D] taps not yet appended
    n_pending: jax.Array | None = None  # [B]


def _max_steps(cfg: DecodeConfig) -> int:
    return max(cfg.max_new_tokens - 1, 1)


def _step_key(rng, step):
    """Per-step key; the prefill draws with step = max_steps (never a loop step)."""
    return jax.random.fold_in(rng, step)


def _prefill(
    target_params, head_dv, tcfg, cfg, prompt_bp, prompt_lengths_b, rng, cache_len, tap_layers
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
        jnp.zeros((b,), jnp.int32),
        tap_layers,
        (prompt_lengths_b - 1)[:, None],
        method="hidden",
    )
    logits_bv = apply_head(head_dv, hidden_b1d[:, 0])
    first_b = pick(logits_bv, _step_key(rng, _max_steps(cfg)), cfg)
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
        acc=jnp.zeros((b, _max_steps(cfg)), jnp.int32),
        cache=cache,
    )
    return state, taps_bpf


# The phases of one speculative step, each a pure function (the loop body chains them;
# `decoding.breakdown` times each one apart at real shapes).


def append_context(drafter_params, dcfg, ctx_k, ctx_v, drf_len_b, pending_btf, n_pending_b):
    """Appends the context K/V of the pending taps [B,T,F] at each row's drf_len (rows past
    n_pending are written too, then masked and overwritten later).
    -> (ctx_k, ctx_v, drf_len + n_pending)."""
    t = pending_btf.shape[1]
    positions_bt = drf_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    ks, vs = Drafter(dcfg).apply(
        {"params": drafter_params}, pending_btf, positions_bt, method="context_kv"
    )
    ctx_k = tuple(write_rows(c, k, drf_len_b) for c, k in zip(ctx_k, ks, strict=True))
    ctx_v = tuple(write_rows(c, v, drf_len_b) for c, v in zip(ctx_v, vs, strict=True))
    return ctx_k, ctx_v, drf_len_b + n_pending_b


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


def draft_tokens(head_dv, tcfg, dcfg, cfg, hidden_bgd, key):
    """The target's frozen head on the draft slots, then argmax or a sample per slot.
    -> (drafts [B,G] int32, draft log-probs [B,G,V] when sampling, else None)."""
    logits_bgv = finish_logits(dcfg, apply_head(head_dv, hidden_bgd.astype(jnp.dtype(tcfg.dtype))))
    if cfg.greedy:
        return argmax_last(logits_bgv), None
    draft_logp_bgv = process_logits(logits_bgv, cfg)
    return sample(row_keys(key, hidden_bgd.shape[0]), draft_logp_bgv), draft_logp_bgv


def verify_hidden(target_params, tcfg, dcfg, verify_bt, start_b, cache):
    """The target on [anchor, drafts] at positions start.., writing its K/V at start.
    -> (final-normed hidden [B,T,D], taps [B,T,F], cache)."""
    positions_bt = start_b[:, None] + jnp.arange(verify_bt.shape[1], dtype=jnp.int32)[None, :]
    return Transformer(tcfg).apply(
        {"params": target_params},
        verify_bt,
        positions_bt,
        cache,
        start_b,
        dcfg.target_layer_ids,
        method="hidden",
    )


def verify_accept(head_dv, cfg, hidden_btd, drafts_bg, draft_logp_bgv, key):
    """The target's head on the verified block, then the longest valid prefix plus one target
    token. -> (accepted drafts a [B], committed tokens [B,T]: a drafts, then the bonus)."""
    tlogits_btv = apply_head(head_dv, hidden_btd)
    if cfg.greedy:
        return accept_greedy(drafts_bg, tlogits_btv)
    return accept_rejection(drafts_bg, draft_logp_bgv, tlogits_btv, key, cfg)


def _commit(state: _State, new_bt, produced_b, cfg: DecodeConfig) -> tuple[_State, jax.Array]:
    """Commits new[:, :produced] per row, capped by max_new_tokens and cut after the first
    stop token inside the new span only. Done rows commit nothing. Returns (state, produced)."""
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
    state = state.replace(
        gen=gen,
        n_gen=n_gen,
        done=done,
        step=state.step + 1,
        num_steps=state.num_steps + active_b.astype(jnp.int32),
        acc=acc,
    )
    return state, produced_b


def _finish(state: _State, cfg: DecodeConfig) -> DecodeOutput:
    n = cfg.max_new_tokens
    valid_bn = jnp.arange(n)[None, :] < state.n_gen[:, None]
    return DecodeOutput(
        tokens=jnp.where(valid_bn, state.gen[:, :n], 0),
        lengths=state.n_gen,
        num_steps=state.num_steps,
        acceptance_lengths=state.acc,
    )


def _cond(cfg):
    return lambda s: (s.step < _max_steps(cfg)) & ~jnp.all(s.done)


@functools.partial(jax.jit, static_argnames=("target_config", "decode_config"))
def _autoregressive_jit(
    target_params, prompt, prompt_lengths, rng, *, target_config, decode_config
):
    tcfg, cfg = target_config, decode_config
    cache_len = prompt.shape[1] + cfg.max_new_tokens + 2
    head_dv = unembedding_matrix(target_params, tcfg)
    state, _ = _prefill(
        target_params, head_dv, tcfg, cfg, prompt, prompt_lengths, rng, cache_len, ()
    )
    model = Transformer(tcfg)

    def body(s: _State) -> _State:
        last_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        start_b = prompt_lengths + s.n_gen - 1
        hidden_b1d, _, cache = model.apply(
            {"params": target_params}, last_b1, start_b[:, None], s.cache, start_b, method="hidden"
        )
        next_b = pick(apply_head(head_dv, hidden_b1d[:, 0]), _step_key(rng, s.step), cfg)
        s, _ = _commit(s.replace(cache=cache), next_b[:, None], jnp.ones_like(start_b), cfg)
        return s

    return _finish(jax.lax.while_loop(_cond(cfg), body, state), cfg)


def _init_speculative(
    target_params, drafter_params, head_dv, tcfg, dcfg, cfg, prompt, prompt_lengths, rng
) -> _State:
    """Prefill, then the prompt's drafter context K/V (block-independent: all appended now)."""
    bs = cfg.block_size
    b, p = prompt.shape
    cache_len = p + cfg.max_new_tokens + 2 * bs
    state, taps_bpf = _prefill(
        target_params,
        head_dv,
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
        pending=jnp.zeros((b, bs, taps_bpf.shape[-1]), taps_bpf.dtype),
        n_pending=zero_b,
    )


@functools.partial(jax.jit, static_argnames=("target_config", "drafter_config", "decode_config"))
def _speculative_jit(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    *,
    target_config,
    drafter_config,
    decode_config,
):
    tcfg, dcfg, cfg = target_config, drafter_config, decode_config
    bs = cfg.block_size
    head_dv = unembedding_matrix(target_params, tcfg)
    state = _init_speculative(
        target_params, drafter_params, head_dv, tcfg, dcfg, cfg, prompt, prompt_lengths, rng
    )

    def body(s: _State) -> _State:
        k_draft, k_accept = jax.random.split(_step_key(rng, s.step))
        # 1. Append the pending context rows (taps of last step's committed tokens).
        ctx_k, ctx_v, drf_len_b = append_context(
            drafter_params, dcfg, s.ctx_k, s.ctx_v, s.drf_len, s.pending, s.n_pending
        )
        # 2. Draft [anchor, MASK x (bs-1)] non-causally over the context.
        start_b = prompt_lengths + s.n_gen - 1
        anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        hidden_bgd = draft_hidden(
            drafter_params, target_params, tcfg, dcfg, anchor_b1, ctx_k, ctx_v, drf_len_b,
            start_b, bs,
        )  # fmt: skip
        drafts_bg, draft_logp_bgv = draft_tokens(head_dv, tcfg, dcfg, cfg, hidden_bgd, k_draft)
        # 3. Verify the block with the target, writing its K/V at start.
        verify_bt = jnp.concatenate([anchor_b1, drafts_bg], axis=1)
        vhidden_btd, taps_btf, cache = verify_hidden(
            target_params, tcfg, dcfg, verify_bt, start_b, s.cache
        )
        # 4. Accept the longest valid prefix plus one target token.
        a_b, new_bt = verify_accept(head_dv, cfg, vhidden_btd, drafts_bg, draft_logp_bgv, k_accept)
        # 5. Commit; the target cache length is implied by n_gen (rollback = lower length).
        s, produced_b = _commit(s.replace(cache=cache), new_bt, a_b + 1, cfg)
        return s.replace(
            ctx_k=ctx_k, ctx_v=ctx_v, drf_len=drf_len_b, pending=taps_btf, n_pending=produced_b
        )

    return _finish(jax.lax.while_loop(_cond(cfg), body, state), cfg)


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


def autoregressive_config(cfg: DecodeConfig) -> DecodeConfig:
    """The block size means nothing without a drafter: fix it at 1 so one compiled AR loop
    serves every block size."""
    return dataclasses.replace(cfg, block_size=1)


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
) -> DecodeOutput:
    """The target decoding alone, one token per step: the baseline and the lossless reference.

    prompt: int32 [B, P] right-padded; prompt_lengths: int32 [B]; rng: a PRNG key.
    """
    prompt, prompt_lengths = jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
    check_prompt(prompt, prompt_lengths, target_config, decode_config)
    decode_config = autoregressive_config(decode_config)
    return _autoregressive_jit(
        target_params,
        prompt,
        prompt_lengths,
        rng,
        target_config=target_config,
        decode_config=decode_config,
    )


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
) -> DecodeOutput:
    """DFlash speculative decoding; output distributed exactly as the target's own (greedy:
    identical tokens). Same inputs and output as `autoregressive_decode`."""
    check_decode_inputs(target_config, drafter_config, decode_config)
    prompt, prompt_lengths = jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
    check_prompt(prompt, prompt_lengths, target_config, decode_config)
    return _speculative_jit(
        target_params,
        drafter_params,
        prompt,
        prompt_lengths,
        rng,
        target_config=target_config,
        drafter_config=drafter_config,
        decode_config=decode_config,
    )
