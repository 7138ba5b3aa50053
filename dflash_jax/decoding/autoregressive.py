"""`autoregressive_decode`: the target alone, one token per step, in one jitted
`while_loop`; the baseline every drafting decode is measured against and its lossless
reference. Its halves `start_autoregressive` / `advance_autoregressive` are what
`decoding.runner` runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.decoding import grammar
from dflash_jax.decoding.phases import next_token, prefill
from dflash_jax.decoding.plan import make_plan
from dflash_jax.decoding.programs import (
    check_prompt,
    jit_decoder,
    run,
    step_limit_array,
    typed_key,
)
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.settings import autoregressive_config as autoregressive_config
from dflash_jax.decoding.state import (
    DecodeOutput,
    LoopState,
    commit,
    constrain,
    finish,
    keep_going,
    step_key,
)
from dflash_jax.models.target import Transformer, decoding_head
from dflash_jax.ops.caches import tile_slots


def _start_autoregressive(
    target_params,
    prompt,
    prompt_lengths,
    rng,
    max_new=None,
    constraint=None,
    *,
    target_config,
    decode_config,
    mesh=None,
) -> LoopState:
    """The AR decode's prefill: its loop state, the first token committed. max_new: a traced
    token budget up to max_new_tokens (`phases.prefill`; None: that); constraint: a grammar
    and each row's start state (`phases.prefill`)."""
    tcfg, cfg = target_config, decode_config
    cache_len = tile_slots(prompt.shape[1] + cfg.max_new_tokens + 2)
    head = decoding_head(target_params, tcfg)
    args = (target_params, head, tcfg, cfg, prompt, prompt_lengths, rng, cache_len, ())
    state, _ = prefill(*args, max_new=max_new, constraint=constraint)
    return constrain(state, mesh)


def _advance_autoregressive(
    target_params,
    prompt,
    prompt_lengths,
    rng,
    step_limit,
    state: LoopState,
    *,
    target_config,
    decode_config,
    mesh=None,
) -> LoopState:
    """Runs the AR loop on `state` until `step_limit` steps (counted from the prefill) or done."""
    del prompt  # the state holds what the loop needs; kept so every program takes one layout
    tcfg, cfg = target_config, decode_config
    head = decoding_head(target_params, tcfg)
    model = Transformer(tcfg)

    def body(s: LoopState) -> LoopState:
        last_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        start_b = prompt_lengths + s.n_gen - 1
        hidden_b1d, _, cache = model.apply(
            {"params": target_params}, last_b1, start_b[:, None], s.cache, start_b, method="hidden"
        )
        vhead = grammar.masked_head(head, s.grammar, s.gstate)
        next_b = next_token(vhead, hidden_b1d[:, 0], step_key(rng, s.step), cfg)
        s, _ = commit(s.replace(cache=cache), next_b[:, None], jnp.ones_like(start_b), cfg)
        return constrain(s, mesh)

    return jax.lax.while_loop(keep_going(cfg, step_limit), body, state)


def _autoregressive(
    target_params,
    prompt,
    prompt_lengths,
    rng,
    step_limit,
    constraint=None,
    *,
    target_config,
    decode_config,
    mesh=None,
) -> DecodeOutput:
    statics = dict(target_config=target_config, decode_config=decode_config, mesh=mesh)
    state = _start_autoregressive(
        target_params, prompt, prompt_lengths, rng, None, constraint, **statics
    )
    state = _advance_autoregressive(
        target_params, prompt, prompt_lengths, rng, step_limit, state, **statics
    )
    return finish(state, decode_config)


_STATICS = ("target_config", "decode_config", "mesh")
# The whole decode as one program, and its two halves (`decoding.programs`).
autoregressive_jit = jit_decoder(_autoregressive, _STATICS, num_params=1)
start_autoregressive = jit_decoder(_start_autoregressive, _STATICS, num_params=1, gives_state=True)
advance_autoregressive = jit_decoder(
    _advance_autoregressive, _STATICS, num_params=1, takes_state=True, gives_state=True
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
    constraint=None,
) -> DecodeOutput:
    """The target decoding alone, one token per step: the baseline and the lossless reference.

    prompt: int32 [B, P] right-padded; prompt_lengths: int32 [B]; rng: a PRNG key, typed
    (`jax.random.key`) or classic (`jax.random.PRNGKey`): the same seed gives the same draws.
    mesh: a `jax.sharding.Mesh` (axes data/fsdp/tensor, `sharding.make_mesh`) to run on, else the
    one set by `jax.set_mesh`, else one device; the tokens are the same (see `on_mesh`).
    step_limit: stop after this many loop steps (None: `max_steps`); an input, so a new limit
    never recompiles. constraint: structured output, (a `grammar.Grammar`, each row's start
    state [B]: 0, or grammar.NONE for a row without; `grammar.constraint` builds it).
    """
    prompt, prompt_lengths = jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
    check_prompt(prompt, prompt_lengths, target_config, decode_config)
    plan = make_plan(target_config, None, decode_config, mesh)
    limit = step_limit_array(decode_config, step_limit)
    args = (target_params, prompt, prompt_lengths, typed_key(rng), limit, constraint)
    return run(autoregressive_jit, args, plan.statics, mesh)
