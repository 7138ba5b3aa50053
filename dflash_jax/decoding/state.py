"""The decode loop's state and output, and what every loop does with them: commit a step's
tokens, stop, finish.

Per-row bookkeeping (style.md letters, B batch, T = block size, W generated-token buffer):
  n_gen[b]   generated tokens committed so far; gen[b, n_gen-1] is the pending anchor
  start[b]   = prompt_len[b] + n_gen[b] - 1: the anchor's position = the target cache length
  drf_len[b] drafter context-cache length; reaches `start` after each append
Rollback is lowering a length: cache slots past it are masked and later overwritten. Writes
go through scatter with mode="drop" (dynamic_update_slice would clamp and clobber).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.decoding import grammar
from dflash_jax.decoding.sampling import split_key
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models.target import KVCache


@flax.struct.dataclass
class DecodeOutput:
    """tokens [B, max_new_tokens]: generated tokens only (stop token included), 0-padded;
    lengths [B]; num_steps [B]: loop steps run for the row (the prefill token is not a step);
    acceptance_lengths [B, max_steps]: tokens committed per step incl. the bonus (tau), 0 after;
    block_sizes [B, max_steps]: the step kind each step ran (its block size; 1 = a plain target
    step of the adaptive mode, -b = a prompt-lookup step of block size b, `settings.tree_kind(N)`
    = a tree step of N tokens, named by `settings.kind_label`), 0 where the row ran no step."""

    tokens: jax.Array
    lengths: jax.Array
    num_steps: jax.Array
    acceptance_lengths: jax.Array
    block_sizes: jax.Array


@flax.struct.dataclass
class LoopState:
    """The carry of the decode's `while_loop` (the autoregressive loop leaves the drafter and
    controller fields None)."""

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
    # Adaptive: the controller's state, one share per proposer (`proposers.REGISTRY` order,
    # None where an entry keeps none): per-row arrays [B, ...], scalars shared by the rows.
    control: tuple | None = None
    rows: object | None = None  # `sampling.RowSettings` [B] with `DecodeConfig.row_settings`
    # [B] each row's token limit when the start half was given one (a traced budget up to
    # max_new_tokens, the buffer's length: `phases.prefill`); None: max_new_tokens itself.
    limit: jax.Array | None = None
    # With `DecodeConfig.logprobs` (K): each committed token's log-probability [B, W] and its
    # step's K likeliest tokens [B, W, K] with theirs, beside `gen` (`sampling.token_logprobs`).
    logp: jax.Array | None = None
    top_logp: jax.Array | None = None
    top_ids: jax.Array | None = None
    # Structured output (`decoding.grammar`): the compiled grammar (a `Grammar`, the same at
    # every step) and each row's automaton state [B] (grammar.NONE: a row without one).
    grammar: object | None = None
    gstate: jax.Array | None = None


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
    "control": ("batch",),  # a scalar leaf (shared by the rows) is replicated
    "rows": ("batch",),  # each field [B] or [B, 2] (a key's data)
    "limit": ("batch",),
    "logp": ("batch", "length"),
    "top_logp": ("batch", "length"),
    "top_ids": ("batch", "length"),
    "grammar": (),  # each table replicated
    "gstate": ("batch",),
}


def carry_shardings(state: LoopState, mesh) -> LoopState:
    """The loop state's NamedShardings on `mesh` (a LoopState of them), from `_CARRY_AXES`."""
    state = state.replace(
        **{
            name: jax.tree.map(
                lambda x, axes=axes: sharding.logical_sharding(
                    (*axes, *(None,) * (x.ndim - len(axes)))[: x.ndim], x.shape, mesh
                ),
                getattr(state, name),
            )
            for name, axes in _CARRY_AXES.items()
            if name != "cache"
        }
    )
    return state.replace(cache=sharding.cache_shardings(state.cache, mesh))


def constrain(state: LoopState, mesh) -> LoopState:
    """Pins every carry buffer to its sharding on `mesh`, so XLA keeps the loop state in place
    from one iteration to the next; without a mesh the state is returned untouched."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, carry_shardings(state, mesh))


def max_steps(cfg: DecodeConfig) -> int:
    """Loop steps a decode may take: every token after the prefill's in its own step."""
    return max(cfg.max_new_tokens - 1, 1)


def step_key(rng, step):
    """The key of loop step `step` (rng folded with it); the prefill draws with
    step = max_steps (never a loop step). Per-row keys [B] (`sampling.RowSettings`) are folded
    with each row's own step (`step` [B], or one for all)."""
    if rng.ndim == 1:
        return jax.vmap(jax.random.fold_in)(rng, jnp.broadcast_to(step, rng.shape))
    return jax.random.fold_in(rng, step)


def step_sampling(s: LoopState, cfg: DecodeConfig, rng):
    """How loop step `s.step` draws: (`cfg`, or each row's `RowSettings` under row_settings;
    the step's draft key; its acceptance key). Per-row keys fold each row's own step count."""
    if s.rows is None:
        draw, key = cfg, step_key(rng, s.step)
    else:
        draw, key = s.rows, step_key(s.rows.keys(), s.num_steps)
    k_draft, k_accept = split_key(key)
    return draw, k_draft, k_accept


def token_limit(state: LoopState, cfg: DecodeConfig):
    """Each row's token limit: its request's (`state.rows`), the decode's traced budget
    (`state.limit`), else `cfg.max_new_tokens`."""
    if state.rows is not None:
        return state.rows.max_new
    return cfg.max_new_tokens if state.limit is None else state.limit


def commit(
    state: LoopState, new_bt, produced_b, cfg: DecodeConfig, block_size: int = 1, logprobs=None
) -> tuple[LoopState, jax.Array]:
    """Commits new[:, :produced] per row, capped by max_new_tokens and cut after the first
    stop token inside the new span only; records the step's block size. Done rows commit
    nothing. Each row's own limit with `state.rows` (`DecodeConfig.row_settings`); with
    `logprobs` ([B,T], [B,T,K], [B,T,K]: `sampling.token_logprobs` of new), those beside the
    tokens. Returns (state, produced)."""
    b, t = new_bt.shape
    active_b = ~state.done
    limit_b = token_limit(state, cfg)
    produced_b = jnp.minimum(produced_b, limit_b - state.n_gen)
    idx_t = jnp.arange(t)
    in_span_bt = idx_t[None, :] < produced_b[:, None]
    if cfg.stop_token_ids:
        stop_bt = jnp.isin(new_bt, jnp.asarray(cfg.stop_token_ids, jnp.int32)) & in_span_bt
        has_stop_b = jnp.any(stop_bt, axis=-1)
        produced_b = jnp.where(has_stop_b, jnp.argmax(stop_bt, axis=-1) + 1, produced_b)
    else:
        has_stop_b = jnp.zeros((b,), bool)
    produced_b = jnp.where(active_b, produced_b, 0)
    ended_b = jnp.zeros((b,), bool)
    if state.grammar is not None:  # each row's automaton moves over what it commits
        gstate, ended_b = grammar.commit_walk(state.grammar, state.gstate, new_bt, produced_b)
        state = state.replace(gstate=gstate)
    width = state.gen.shape[1]
    write_bt = jnp.where(idx_t[None, :] < produced_b[:, None], state.n_gen[:, None] + idx_t, width)
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    gen = state.gen.at[rows_bt, write_bt].set(new_bt, mode="drop")
    if logprobs is not None:
        lp_bt, top_lp_btk, top_ids_btk = logprobs
        state = state.replace(
            logp=state.logp.at[rows_bt, write_bt].set(lp_bt, mode="drop"),
            top_logp=state.top_logp.at[rows_bt, write_bt].set(top_lp_btk, mode="drop"),
            top_ids=state.top_ids.at[rows_bt, write_bt].set(top_ids_btk, mode="drop"),
        )
    n_gen = state.n_gen + produced_b
    done = state.done | (active_b & (has_stop_b | ended_b | (n_gen >= limit_b)))
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


def finish(state: LoopState, cfg: DecodeConfig) -> DecodeOutput:
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


def keep_going(cfg: DecodeConfig, step_limit):
    """The loop's condition: state -> whether steps are left (below `step_limit`, an input, and
    the config's maximum) and a row still decodes."""
    limit = jnp.minimum(jnp.asarray(step_limit, jnp.int32), max_steps(cfg))
    return lambda s: (s.step < limit) & ~jnp.all(s.done)
