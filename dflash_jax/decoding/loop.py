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
from dflash_jax.models.drafter import Drafter, check_fits, draft_logits
from dflash_jax.models.target import KVCache, Transformer, init_cache, write_rows


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


def _prefill(target_params, tcfg, cfg, prompt_bp, prompt_lengths_b, rng, cache_len, tap_layers):
    """Target on the whole (right-padded) prompt; the first token comes from each row's last
    prompt position. Returns (state without drafter fields, prompt taps or None)."""
    b, p = prompt_bp.shape
    cache = init_cache(tcfg, b, cache_len)
    positions_bp = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits_b1v, taps_bpf, cache = Transformer(tcfg).apply(
        {"params": target_params},
        prompt_bp,
        positions_bp,
        cache,
        jnp.zeros((b,), jnp.int32),
        tap_layers,
        (prompt_lengths_b - 1)[:, None],
    )
    first_b = pick(logits_b1v[:, 0], _step_key(rng, _max_steps(cfg)), cfg)
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
    state, _ = _prefill(target_params, tcfg, cfg, prompt, prompt_lengths, rng, cache_len, ())
    model = Transformer(tcfg)

    def body(s: _State) -> _State:
        last_b = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        start_b = prompt_lengths + s.n_gen - 1
        logits_b1v, _, cache = model.apply(
            {"params": target_params}, last_b, start_b[:, None], s.cache, start_b
        )
        next_b = pick(logits_b1v[:, 0], _step_key(rng, s.step), cfg)
        s, _ = _commit(s.replace(cache=cache), next_b[:, None], jnp.ones_like(start_b), cfg)
        return s

    return _finish(jax.lax.while_loop(_cond(cfg), body, state), cfg)


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
    b, p = prompt.shape
    cache_len = p + cfg.max_new_tokens + 2 * bs
    state, taps_bpf = _prefill(
        target_params, tcfg, cfg, prompt, prompt_lengths, rng, cache_len, dcfg.target_layer_ids
    )
    drafter = Drafter(dcfg)
    dparams = {"params": drafter_params}
    # The prompt's context K/V are block-independent: append them all at prefill.
    positions_bp = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    ks, vs = drafter.apply(dparams, taps_bpf, positions_bp, method="context_kv")
    zero_b = jnp.zeros((b,), jnp.int32)
    ctx_shape = (b, dcfg.num_kv_heads, cache_len, dcfg.head_dim)
    ctx_k = tuple(write_rows(jnp.zeros(ctx_shape, k.dtype), k, zero_b) for k in ks)
    ctx_v = tuple(write_rows(jnp.zeros(ctx_shape, v.dtype), v, zero_b) for v in vs)
    state = state.replace(
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        drf_len=prompt_lengths,
        pending=jnp.zeros((b, bs, taps_bpf.shape[-1]), taps_bpf.dtype),
        n_pending=zero_b,
    )
    target = Transformer(tcfg)
    offsets_t = jnp.arange(bs, dtype=jnp.int32)

    def body(s: _State) -> _State:
        key = _step_key(rng, s.step)
        k_draft, k_accept = jax.random.split(key)
        # 1. Append the pending context rows (taps of last step's committed tokens).
        ks, vs = drafter.apply(
            dparams, s.pending, s.drf_len[:, None] + offsets_t, method="context_kv"
        )
        ctx_k = tuple(write_rows(c, k, s.drf_len) for c, k in zip(s.ctx_k, ks, strict=True))
        ctx_v = tuple(write_rows(c, v, s.drf_len) for c, v in zip(s.ctx_v, vs, strict=True))
        drf_len_b = s.drf_len + s.n_pending
        # 2. Draft [anchor, MASK x (T-1)] non-causally over the context; block K/V not cached.
        start_b = prompt_lengths + s.n_gen - 1
        anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        block_bt = jnp.concatenate(
            [anchor_b1, jnp.full((b, bs - 1), dcfg.mask_token_id, jnp.int32)], axis=1
        )
        logits_bgv = draft_logits(
            drafter_params,
            target_params,
            tcfg,
            dcfg,
            block_bt,
            ctx_k,
            ctx_v,
            drf_len_b,
            start_b[:, None],
            bs,
        )[:, 0]
        if cfg.greedy:
            drafts_bg = jnp.argmax(logits_bgv, axis=-1).astype(jnp.int32)
        else:
            draft_logp_bgv = process_logits(logits_bgv, cfg)
            drafts_bg = sample(row_keys(k_draft, b), draft_logp_bgv)
        # 3. Verify the block with the target, writing its K/V at start.
        verify_bt = jnp.concatenate([anchor_b1, drafts_bg], axis=1)
        tlogits_btv, taps_btf, cache = target.apply(
            {"params": target_params},
            verify_bt,
            start_b[:, None] + offsets_t,
            s.cache,
            start_b,
            dcfg.target_layer_ids,
        )
        # 4. Accept the longest valid prefix plus one target token.
        if cfg.greedy:
            a_b, new_bt = accept_greedy(drafts_bg, tlogits_btv)
        else:
            a_b, new_bt = accept_rejection(drafts_bg, draft_logp_bgv, tlogits_btv, k_accept, cfg)
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
