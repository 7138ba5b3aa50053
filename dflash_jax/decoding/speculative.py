"""`speculative_decode`: DFlash in one jitted `while_loop`. Each step drafts a block (the
drafter, or a copy of the text so far), verifies it with the target in one pass, commits the
longest valid prefix plus one target token and appends the committed tokens' context for the
next draft. In adaptive mode the step's kind is chosen on device (`adaptive.choose_kind`) among
one compiled variant per block size and, with `tree_nodes`, a tree step (`lax.switch`).

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
from dflash_jax.decoding import adaptive, cut, lookup, tree
from dflash_jax.decoding.phases import (
    draft_hidden,
    draft_tokens,
    init_speculative,
)
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


def _propose(
    s: LoopState,
    copy_bg=None,
    copy_flag=None,
    *,
    bs: int,
    width: int,
    ctx: _StepContext,
    sources=("draft",),
) -> Proposal:
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
    tcfg, dcfg, cfg = ctx.tcfg, ctx.dcfg, ctx.cfg
    tparams, dparams, head = ctx.target_params, ctx.drafter_params, ctx.head
    draw, k_draft, k_accept = step_sampling(s, cfg, ctx.rng)
    start_b = ctx.prompt_lengths + s.n_gen - 1
    anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
    if sources == ("copy",):
        copy_flag = jnp.bool_(True)
    elif sources == ("draft",):
        copy_flag = jnp.bool_(False)

    cut = cfg.confidence_cut > 0

    def copied():
        drafts_bg = copy_bg[:, : bs - 1]
        logp = None if draw.greedy else lookup.one_hot_logp(drafts_bg, tcfg.vocab_size)
        return (drafts_bg, logp) + ((jnp.full_like(start_b, bs - 1),) if cut else ())

    def drafted():
        # Draft [anchor, MASK x (bs-1)] non-causally over the context (which ends at start).
        hidden_bgd = draft_hidden(
            dparams, tparams, tcfg, dcfg, anchor_b1, s.ctx_k, s.ctx_v, s.drf_len, start_b, bs
        )
        return draft_tokens(
            head, tcfg, dcfg, draw, hidden_bgd, k_draft, dparams, anchor_b1, kept=cut
        )

    kept_b = drafts_bg = draft_logp_bgv = None
    if bs > 1:
        if sources == ("copy",):
            proposal = copied()
        elif sources == ("draft",):
            proposal = drafted()
        else:
            proposal = jax.lax.cond(copy_flag, copied, drafted)
        drafts_bg, draft_logp_bgv = proposal[:2]
        if cut:
            kept_b = proposal[2]
    kind = jnp.where(copy_flag, -bs, bs).astype(jnp.int32)
    return verify(s, ctx, draw, k_accept, drafts_bg, draft_logp_bgv, kept_b, bs, width, kind)


def _apply(s: LoopState, out: Proposal, cfg: DecodeConfig, prompt_lengths) -> LoopState:
    """Writes what `_propose` returned: commits the accepted tokens, the target's K/V rows at
    the anchor's slot and the committed tokens' drafter context rows (one in-place scatter per
    buffer, outside any branch); in adaptive mode the controller then learns from the step."""
    start_b = prompt_lengths + s.n_gen - 1
    active_b = ~s.done
    # Commit; the target cache length is implied by n_gen (rollback = lower length).
    s, produced_b = commit(s, out.new, out.accepted + 1, cfg, out.kind, out.logprobs)
    cache = s.cache.written(out.k, out.v, start_b)
    ctx_k = tuple(write_rows(c, r, s.drf_len) for c, r in zip(s.ctx_k, out.ctx_k, strict=True))
    ctx_v = tuple(write_rows(c, r, s.drf_len) for c, r in zip(s.ctx_v, out.ctx_v, strict=True))
    if out.state is not None:  # recurrent state rolls back by re-running the accepted prefix
        cache = cache.replace(state=commit_states(s.cache.state, out.state, produced_b))
    s = s.replace(cache=cache, ctx_k=ctx_k, ctx_v=ctx_v, drf_len=s.drf_len + produced_b)
    if cfg.adaptive:
        s = adaptive.update(s, out, produced_b, active_b, cfg)
    return s


def _start_speculative(
    target_params,
    drafter_params,
    prompt,
    prompt_lengths,
    rng,
    max_new=None,
    *,
    target_config,
    drafter_config,
    decode_config,
    mesh=None,
) -> LoopState:
    """The speculative decode's prefill and prompt context: its loop state before any step.
    max_new: a traced token budget up to max_new_tokens (`phases.prefill`; None: that)."""
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
    )
    return constrain(state, mesh)


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
    )
    width = cfg.block_size
    tree_k = jnp.int32(tree_kind(cfg.tree_nodes))  # a tree's accepted path is applied as a block
    tree_step = lambda s, *_: Proposal(kind=tree_k, **tree.propose(s, ctx, width))
    if cfg.tree_nodes and not cfg.adaptive:  # every step a tree
        propose = tree_step
    elif cfg.confidence_cut and not cfg.adaptive:  # drafts the block, verifies up to the cut
        propose = functools.partial(cut.propose, bs=cfg.block_size, ctx=ctx)
    elif not cfg.adaptive:
        propose = functools.partial(_propose, bs=cfg.block_size, width=width, ctx=ctx)
    else:
        variants = step_branches(cfg)
        branches = [
            functools.partial(_propose, bs=b, width=width, ctx=ctx, sources=src)
            for b, src in variants
        ]
        sizes = [b for b, _ in variants]
        branches += [tree_step] * bool(cfg.tree_nodes)  # the tree kind (last): one branch more
        # kind index (cfg.all_kinds order) -> its compiled variant (or the tree's); if it copies
        branch_of = [sizes.index(abs(b)) if abs(b) in sizes else len(sizes) for b in cfg.all_kinds]
        branch_of = jnp.asarray(branch_of, jnp.int32)
        copies = jnp.asarray([b < 0 for b in cfg.all_kinds])

        def propose(s: LoopState) -> Proposal:
            copy_bg = found_b = None
            if cfg.lookup_kinds:  # what a copy would propose now (cheap: token compares)
                copy_bg, found_b = lookup.device_proposal(
                    prompt, prompt_lengths, s.gen, s.n_gen, width - 1, cfg.lookup_ngram,
                    ngrams.table_of(drafter_params),
                )  # fmt: skip
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
                s.tree_alpha,
            )
            out = jax.lax.switch(branch_of[k], branches, s, copy_bg, copies[k])
            return out.replace(copy=copy_bg, found=found_b)

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
    state = _start_speculative(*params, **statics)
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
) -> DecodeOutput:
    """DFlash speculative decoding; output distributed exactly as the target's own (greedy:
    identical tokens). Same inputs and output as `autoregressive_decode` (`step_limit` too).

    With `decode_config.adaptive`, each step's block size is chosen on device (see
    `decoding/adaptive.py`); `step_costs` [num_kinds] are the kinds' costs in AR steps
    (`calibration.calibrate_step_costs` measures them; an array, so new costs never recompile).
    `mesh` as in `autoregressive_decode`.
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
    )
    return run(speculative_jit, args, plan.statics, mesh)
