"""DSpark's confidence cut in a fixed-block decode (`DecodeConfig.confidence_cut`): the walk
drafts the whole block and predicts each draft's acceptance (`markov.propose`); the drafts are
kept while the running product stays at or above the cut, and the target verifies at the
narrowest of a few compiled widths (`cut_widths`, one `lax.switch` branch each) that holds
every active row's kept drafts. A row's drafts past its cut are not offered
(`sampling.past_the_cut`), so output stays the target's, greedy or sampled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.phases import draft_hidden, draft_tokens
from dflash_jax.decoding.state import LoopState, step_sampling
from dflash_jax.decoding.step import Proposal, verify


def cut_widths(block_size: int) -> tuple[int, ...]:
    """The verify widths a confidence-cut decode compiles: 1 (every draft cut: a plain step),
    4, 8 and the block size (those below it)."""
    return tuple(sorted({w for w in (1, 4, 8) if w < block_size} | {block_size}))


def propose(s: LoopState, *, bs: int, ctx) -> Proposal:
    """A fixed-block step of a DSpark drafter with a confidence cut: the walk drafts the whole
    block, each row keeps its drafts up to the cut (`markov.propose`), and the verify runs at
    the narrowest compiled width (`cut_widths`) that holds every active row's kept drafts
    (`lax.switch`), so a cut block costs a narrower target pass. -> its `Proposal` (`step.verify`),
    recorded as the width's kind."""
    tcfg, dcfg = ctx.tcfg, ctx.dcfg
    draw, k_draft, k_accept = step_sampling(s, ctx.cfg, ctx.rng)
    start_b = ctx.prompt_lengths + s.n_gen - 1
    anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
    hidden_bgd = draft_hidden(
        ctx.drafter_params, ctx.target_params, tcfg, dcfg, anchor_b1, s.ctx_k, s.ctx_v,
        s.drf_len, start_b, bs,
    )  # fmt: skip
    drafts_bg, logp_bgv, kept_b = draft_tokens(
        ctx.head, tcfg, dcfg, draw, hidden_bgd, k_draft, ctx.drafter_params, anchor_b1, kept=True
    )
    widths = cut_widths(bs)
    need = jnp.max(jnp.where(s.done, 0, kept_b)) + 1  # the widest active row's verify
    branch = jnp.sum(jnp.asarray(widths) < need).astype(jnp.int32)

    def at(w):
        def step(s):
            drafts = None if w == 1 else drafts_bg[:, : w - 1]
            logp = None if w == 1 or logp_bgv is None else logp_bgv[:, : w - 1]
            kept = None if w == 1 else jnp.minimum(kept_b, w - 1)
            kind = jnp.int32(w)
            return verify(s, ctx, draw, k_accept, drafts, logp, kept, w, bs, kind)

        return step

    return jax.lax.switch(branch, [at(w) for w in widths], s)
