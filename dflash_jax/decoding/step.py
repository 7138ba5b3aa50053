"""The half of a loop step that follows its drafts: the target's verify, the accept rule and
the drafter context rows of the verified tokens, returned as a `Proposal` that writes nothing
(`speculative._apply` writes it). `speculative._propose` (drafted or copied blocks) and
`cut.propose` (a confidence cut's widths) end here.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.decoding import grammar
from dflash_jax.decoding.phases import context_rows, next_token, verify_accept, verify_hidden
from dflash_jax.decoding.sampling import token_logprobs


@flax.struct.dataclass
class Proposal:
    """What one step proposes before anything is written, rows padded to the widest kind W:
    new [B,W]: the tokens to commit (accepted drafts, then the bonus); accepted [B]: drafts
    accepted; kind []: the step's recorded kind (bs, -bs for a copy, 1 plain, `tree_kind(N)` a
    tree); k, v: the target's K/V rows per layer [B,Kv,W,H] for the anchor's slot on; ctx_k,
    ctx_v: the drafter's context rows of the verified tokens, likewise; view: what the
    proposers saw before the step (adaptive mode: `proposers.look`, e.g. the copy a copy kind
    would propose, which the controller learns from; else None); record [B]: what each row
    records for the step (`proposers.record`; None: the kind); state: a hybrid target's
    per-linear-layer `LinearRows` [B,W,...] (else None), from which `_apply` commits each
    row's recurrent state at its accepted length; logprobs: with `DecodeConfig.logprobs`,
    `sampling.token_logprobs` of new ([B,W], [B,W,K], [B,W,K]), else None."""

    new: jax.Array
    accepted: jax.Array
    kind: jax.Array
    k: tuple
    v: tuple
    ctx_k: tuple
    ctx_v: tuple
    view: dict | None = None
    record: jax.Array | None = None
    state: tuple | None = None
    logprobs: tuple | None = None


def verify(s, ctx, draw, k_accept, drafts_bg, draft_logp_bgv, kept_b, bs, width, kind):
    """The rest of a step of block size `bs` once its drafts [B,bs-1] are known (None when
    bs == 1, a plain target step): the target's verify (its K/V rows for slots start..
    returned, not written), the longest valid prefix (of the first `kept_b` drafts, when
    given) plus one target token, and the drafter context rows of the verified tokens, rows
    padded to `width`. -> the step's `Proposal`, recorded as `kind`."""
    tcfg, dcfg = ctx.tcfg, ctx.dcfg
    tparams, dparams, head = ctx.target_params, ctx.drafter_params, ctx.head
    start_b = ctx.prompt_lengths + s.n_gen - 1
    anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
    if bs > 1:
        verify_bt = jnp.concatenate([anchor_b1, drafts_bg], axis=1)
    else:
        verify_bt = anchor_b1
    # With a grammar, each position's distribution masked by the state its proposed prefix
    # reaches (a refused draft is rejected: the masked target gives it no probability).
    states_bt = None
    if s.grammar is not None:
        states_bt = grammar.walk(s.grammar, s.gstate, verify_bt[:, 1:])  # [B,T]
    vhead = grammar.masked_head(head, s.grammar, states_bt)
    vhidden_btd, taps_btf, kv_rows = verify_hidden(
        tparams, tcfg, dcfg, verify_bt, start_b, s.cache, defer_write=True
    )
    if bs > 1:
        a_b, new_bt = verify_accept(
            vhead, draw, vhidden_btd, drafts_bg, draft_logp_bgv, k_accept, kept_b
        )
    else:
        head_b = grammar.masked_head(head, s.grammar, None if s.grammar is None else s.gstate)
        new_bt = next_token(head_b, vhidden_btd[:, 0], k_accept, draw)[:, None]
        a_b = jnp.zeros_like(start_b)
    ctx_ks, ctx_vs = context_rows(dparams, dcfg, s.drf_len, taps_btf)
    logprobs = None
    if ctx.cfg.logprobs:  # at each verified position: the distribution its token came from
        asked_b = s.rows.logprobs & ~s.done
        logprobs = token_logprobs(
            lambda: vhead.logits(vhidden_btd[:, : new_bt.shape[1]]), new_bt, s.rows,
            ctx.cfg.logprobs, asked_b,
        )  # fmt: skip

    def pad(x, axis):  # rows of this kind -> `width` rows (the tail is never read)
        extra = [(0, 0)] * x.ndim
        extra[axis] = (0, width - x.shape[axis])
        return jnp.pad(x, extra)

    return Proposal(
        new=pad(new_bt, 1),
        accepted=a_b,
        kind=kind,
        k=tuple(pad(r, 2) for r in kv_rows.k),
        v=tuple(pad(r, 2) for r in kv_rows.v),
        ctx_k=tuple(pad(r, 2) for r in ctx_ks),
        ctx_v=tuple(pad(r, 2) for r in ctx_vs),
        state=None if kv_rows.state is None else jax.tree.map(lambda r: pad(r, 1), kv_rows.state),
        logprobs=None if logprobs is None else tuple(pad(x, 1) for x in logprobs),
    )
