"""`speculative_decode`: DFlash in one jitted `while_loop`. Each step drafts a block (the
drafter, or a copy of the text so far), verifies it with the target in one pass, commits the
longest valid prefix plus one target token and appends the committed tokens' context for the
next draft. In adaptive mode the step's kind is chosen on device (`proposers.choose_kind`) among
the kinds the proposers' registry offers (`decoding.proposers`), run by a `lax.switch` built from
it: one compiled verify per block size (shared by a drafted and a copied block) and one branch per
proposer with a step of its own (the tree).

A step is two halves: `_propose` writes no carried buffer (it returns a `Proposal`), `_apply`
writes it (one in-place scatter per buffer, outside any branch). The halves of the decode,
`start_speculative` / `advance_speculative`, are what `decoding.runner` runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import adaptive, cut, grammar, proposers, tree
from dflash_jax.decoding.phases import init_speculative
from dflash_jax.decoding.plan import make_plan
from dflash_jax.decoding.programs import (
    check_prompt,
    jit_decoder,
    run,
    step_limit_array,
    typed_key,
)
from dflash_jax.decoding.settings import DecodeConfig, tree_kind
from dflash_jax.decoding.state import (
    DecodeOutput,
    LoopState,
    commit,
    constrain,
    finish,
    keep_going,
    step_sampling,
)
from dflash_jax.decoding.step import Proposal, verify
from dflash_jax.models.target import Head, commit_states, decoding_head
from dflash_jax.ops import ngrams
from dflash_jax.ops.caches import write_rows


@dataclasses.dataclass(frozen=True)
class _StepContext:
    """What every step of one decode reads and never changes (closed over by the step)."""

    tcfg: TargetConfig
    dcfg: DrafterConfig
    cfg: DecodeConfig
    target_params: dict
    drafter_params: dict
    head: Head
    rng: jax.Array
    prompt_lengths: jax.Array  # [B]
    prompt: jax.Array | None = None  # [B, P]
    corpus: dict | None = None  # the drafter's corpus table (`decoding.corpus`), or None


def _propose(
    s: LoopState,
    view=None,
    source=None,
    *,
    bs: int,
    width: int,
    ctx: _StepContext,
    sources=(proposers.REGISTRY[1],),
) -> Proposal:
    """The part of one loop step with block size `bs` that writes no carried buffer: draft bs-1
    tokens, verify them (the target's K/V rows returned, not written), accept, and the drafter
    context rows of the verified tokens. Row outputs are padded to `width` (the largest kind),
    so the adaptive `lax.switch` over kinds has one output shape, and since no branch writes a
    cache, XLA:CPU copies none into or out of the branches (it copied all 66 SmolLM2 cache
    buffers per step when the branches wrote them, ~1.2 ms of a 12 ms plain step). bs == 1 is a
    plain target step (no drafting; its taps still feed the context, so drafting can resume at
    any step). `sources`: the proposers (`proposers.Entry`) whose drafts this verify checks,
    the drafter's by default; with several, the traced `source` (an index into them) picks
    one, so a drafted and a copied block of one size share one compiled verify. `view`: what
    the proposers saw before the step (`proposers.look`)."""
    cfg = ctx.cfg
    draw, k_draft, k_accept = step_sampling(s, cfg, ctx.rng)
    start_b = ctx.prompt_lengths + s.n_gen - 1
    anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
    cut = cfg.confidence_cut > 0
    kept_b = drafts_bg = draft_logp_bgv = None
    if bs > 1:
        fns = [
            functools.partial(e.drafts, s, view, bs, ctx, draw, k_draft, anchor_b1, start_b, cut)
            for e in sources
        ]
        if len(fns) == 1:
            proposal = fns[0]()
        elif len(fns) == 2:  # a two-way switch as a cond, as before the registry
            proposal = jax.lax.cond(source == 1, fns[1], fns[0])
        else:
            proposal = jax.lax.switch(source, fns)
        drafts_bg, draft_logp_bgv = proposal[:2]
        if cut:
            kept_b = proposal[2]
    kinds = [e.kind_at(bs) for e in sources]
    kind = jnp.asarray(kinds, jnp.int32)[source] if len(kinds) > 1 else jnp.int32(kinds[0])
    return verify(s, ctx, draw, k_accept, drafts_bg, draft_logp_bgv, kept_b, bs, width, kind)


def _apply(s: LoopState, out: Proposal, cfg: DecodeConfig, prompt_lengths) -> LoopState:
    """Writes what `_propose` returned: commits the accepted tokens, the target's K/V rows at
    the anchor's slot and the committed tokens' drafter context rows (one in-place scatter per
    buffer, outside any branch); in adaptive mode the controller then learns from the step."""
    start_b = prompt_lengths + s.n_gen - 1
    active_b = ~s.done
    # Commit; the target cache length is implied by n_gen (rollback = lower length).
    kind = out.kind if out.record is None else out.record
    s, produced_b = commit(s, out.new, out.accepted + 1, cfg, kind, out.logprobs)
    cache = s.cache.written(out.k, out.v, start_b)
    ctx_k = tuple(write_rows(c, r, s.drf_len) for c, r in zip(s.ctx_k, out.ctx_k, strict=True))
    ctx_v = tuple(write_rows(c, r, s.drf_len) for c, r in zip(s.ctx_v, out.ctx_v, strict=True))
    if out.state is not None:  # recurrent state rolls back by re-running the accepted prefix
        cache = cache.replace(state=commit_states(s.cache.state, out.state, produced_b))
    s = s.replace(cache=cache, ctx_k=ctx_k, ctx_v=ctx_v, drf_len=s.drf_len + produced_b)
    if cfg.adaptive:
        s = s.replace(control=proposers.learn(s.control, out, produced_b, active_b, out.view, cfg))
    return s


def _start_speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    max_new=None,
    constraint=None,
    *,
    target_config,
    drafter_config,
    decode_config,
    mesh=None,
) -> LoopState:
    """The speculative decode's prefill and prompt context: its loop state before any step.
    max_new: a traced token budget up to max_new_tokens (`phases.prefill`; None: that);
    constraint: a grammar and each row's start state (`phases.prefill`)."""
    head = decoding_head(target_params, target_config)
    state = init_speculative(
        target_params,
        drafter_params,
        head,
        target_config,
        drafter_config,
        decode_config,
        prompt,
        prompt_lengths,
        rng,
        max_new=max_new,
        control=proposers.init_control(decode_config, prompt.shape[0]),
        constraint=constraint,
    )
    return constrain(state, mesh)


def _advance_speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    step_costs,
    forced_kind,
    step_limit,
    state: LoopState,
    *,
    target_config,
    drafter_config,
    decode_config,
    mesh=None,
) -> LoopState:
    """Runs the speculative loop on `state` until `step_limit` steps or every row is done."""
    cfg = decode_config
    ctx = _StepContext(
        tcfg=target_config,
        # DecodeConfig.draft_window: full-attention draft layers see sinks + a window
        dcfg=dataclasses.replace(
            drafter_config, draft_window=cfg.draft_window, draft_sinks=cfg.draft_sinks
        ),
        cfg=cfg,
        target_params=target_params,
        drafter_params=drafter_params,
        head=decoding_head(target_params, target_config),
        rng=rng,
        prompt_lengths=prompt_lengths,
        prompt=prompt,
        corpus=ngrams.table_of(drafter_params),
    )
    width = cfg.block_size
    if cfg.tree_nodes and state.grammar is not None:
        raise ValueError(grammar.TREE_REFUSED)
    if cfg.tree_nodes and not cfg.adaptive:  # every step a tree, applied as a block
        tree_k = jnp.int32(tree_kind(cfg.tree_nodes))
        propose = lambda s: Proposal(kind=tree_k, **tree.propose(s, ctx, width))
    elif cfg.confidence_cut and not cfg.adaptive:  # drafts the block, verifies up to the cut
        propose = functools.partial(cut.propose, bs=cfg.block_size, ctx=ctx)
    elif not cfg.adaptive:
        propose = functools.partial(_propose, bs=cfg.block_size, width=width, ctx=ctx)
    else:  # one branch per verify width and per proposer with a step of its own
        variants = proposers.branches(cfg)
        branches = [
            functools.partial(
                _propose, bs=w, width=width, ctx=ctx,
                sources=tuple(proposers.REGISTRY[i] for i in entries),
            ) if w else (lambda s, view, _, i=entries[0]: Proposal(
                kind=jnp.int32(cfg.all_kinds[proposers.entry_of_kinds(cfg).index(i)]),
                **proposers.REGISTRY[i].step(s, view, width, ctx)))
            for w, entries in variants
        ]  # fmt: skip
        # kind index (cfg.all_kinds order) -> its branch, and its source there
        branch_of, source_of = (
            jnp.asarray(x, jnp.int32) for x in zip(*proposers.branch_of_kinds(cfg), strict=True)
        )

        def propose(s: LoopState) -> Proposal:
            view = proposers.look(s, ctx)
            k = proposers.choose_kind(s.control, ~s.done, step_costs, forced_kind, cfg, view)
            out = jax.lax.switch(branch_of[k], branches, s, view, source_of[k])
            record = proposers.record(out.kind, view, cfg, s.done.shape[0])
            return out.replace(view=view, record=record)

    def body(s: LoopState) -> LoopState:
        return constrain(_apply(s, propose(s), cfg, prompt_lengths), mesh)

    return jax.lax.while_loop(keep_going(cfg, step_limit), body, state)


def _speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    step_costs,
    forced_kind,
    step_limit,
    constraint=None,
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
    params = (target_params, drafter_params, prompt, prompt_lengths, rng)
    state = _start_speculative(*params, None, constraint, **statics)
    state = _advance_speculative(*params, step_costs, forced_kind, step_limit, state, **statics)
    return finish(state, decode_config)


_STATICS = ("target_config", "drafter_config", "decode_config", "mesh")
# The whole decode as one program, and its two halves (`decoding.programs`).
speculative_jit = jit_decoder(_speculative, _STATICS, num_params=2)
start_speculative = jit_decoder(_start_speculative, _STATICS, num_params=2, gives_state=True)
advance_speculative = jit_decoder(
    _advance_speculative, _STATICS, num_params=2, takes_state=True, gives_state=True
)


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
    constraint=None,
) -> DecodeOutput:
    """DFlash speculative decoding; output distributed exactly as the target's own (greedy:
    identical tokens). Same inputs and output as `autoregressive_decode` (`step_limit` too).

    With `decode_config.adaptive`, each step's block size is chosen on device (see
    `decoding/adaptive.py`); `step_costs` [num_kinds] are the kinds' costs in AR steps
    (`calibration.calibrate_step_costs` measures them; an array, so new costs never recompile).
    `mesh` and `constraint` (structured output) as in `autoregressive_decode`.
    """
    plan = make_plan(target_config, drafter_config, decode_config, mesh)
    prompt, prompt_lengths = jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
    check_prompt(prompt, prompt_lengths, target_config, decode_config)
    args = (
        target_params,
        drafter_params,
        prompt,
        prompt_lengths,
        typed_key(rng),
        step_cost_array(decode_config, step_costs),
        jnp.int32(-1),
        step_limit_array(decode_config, step_limit),
        constraint,
    )
    return run(speculative_jit, args, plan.statics, mesh)
