"""DFlash2's draft: the unary logits' top-k candidates per slot, then the candidate selector's walk
over the block (`models/dflash2.py` scores a candidate after its predecessor).

The walk is a `lax.scan` over the block's draft slots, carrying the token chosen at the slot
before (the anchor for the first). Greedy: the candidate of highest selector score. Sampling:
one draw from q = softmax(scores / temperature) over the candidates, as the reference does; q,
scattered onto the vocabulary (zero off the candidates), is the draft distribution that the
rejection step (`sampling.accept_rejection`) compares with the target's, which keeps the
decode lossless: each slot's q is the drafter's exact distribution given the drafts before it.

Letters: B batch, G draft slots, K candidates, R selector rank, D model dim, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding.sampling import row_keys, sample
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models.dflash2 import CandidateSelector
from dflash_jax.models.drafter import finish_logits
from dflash_jax.models.target import Head
from dflash_jax.ops.reductions import argmax_last


def candidates(head: Head, tcfg: TargetConfig, dcfg: DrafterConfig, hidden_bgd: jax.Array):
    """The frozen head on the draft slots [B,G,D], then each slot's top-k.
    -> (unary logits [B,G,K] fp32, candidate ids [B,G,K] int32)."""
    hidden_bgd = hidden_bgd.astype(jnp.dtype(tcfg.dtype))
    logits_bgv = finish_logits(dcfg, head.uncapped().logits(hidden_bgd))
    unary_bgk, cand_bgk = jax.lax.top_k(logits_bgv, dcfg.selector_top_k)
    return unary_bgk, cand_bgk.astype(jnp.int32)


def walk(
    selector_params,
    dcfg: DrafterConfig,
    cfg: DecodeConfig,
    hidden_bgd: jax.Array,
    unary_bgk: jax.Array,
    cand_bgk: jax.Array,
    anchor_b: jax.Array,
    key: jax.Array,
):
    """The selector's walk from the anchor [B] over the G slots.
    -> (drafts [B,G] int32, draft log-probs [B,G,V] when sampling (-inf off the candidates),
    else None)."""
    selector = CandidateSelector(dcfg)
    variables = {"params": selector_params}
    h_bgr = selector.apply(variables, hidden_bgd, method="project")
    b = anchor_b.shape[0]

    def step(prev_b, xs):
        g, h_br, unary_bk, cand_bk = xs
        scores_bk = unary_bk + selector.apply(variables, h_br, prev_b, cand_bk, method="transition")
        if cfg.greedy:
            logq_bk = scores_bk  # unused
            pick_b = argmax_last(scores_bk)
        else:
            logq_bk = jax.nn.log_softmax(scores_bk / cfg.temperature, axis=-1)
            pick_b = sample(row_keys(jax.random.fold_in(key, g), b), logq_bk)
        token_b = jnp.take_along_axis(cand_bk, pick_b[:, None], 1)[:, 0]
        return token_b, (token_b, logq_bk)

    first = lambda x: jnp.moveaxis(x, 1, 0)  # scan over the slot axis
    xs = (jnp.arange(unary_bgk.shape[1]), first(h_bgr), first(unary_bgk), first(cand_bgk))
    _, (drafts_gb, logq_gbk) = jax.lax.scan(step, anchor_b.astype(jnp.int32), xs)
    drafts_bg = jnp.moveaxis(drafts_gb, 0, 1)
    if cfg.greedy:
        return drafts_bg, None
    logq_bgk = jnp.moveaxis(logq_gbk, 0, 1)
    g = drafts_bg.shape[1]
    bi, gi = jnp.arange(b)[:, None, None], jnp.arange(g)[None, :, None]
    draft_logp_bgv = jnp.full((b, g, dcfg.vocab_size), -jnp.inf, jnp.float32)
    return drafts_bg, draft_logp_bgv.at[bi, gi, cand_bgk].set(logq_bgk)


def propose(
    head: Head,
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    cfg: DecodeConfig,
    selector_params,
    hidden_bgd: jax.Array,
    anchor_b: jax.Array,
    key: jax.Array,
):
    """A DFlash2 block's drafts from the drafter's final-normed hidden [B,G,D] and the anchor
    [B]: `candidates`, then `walk`. -> as `phases.draft_tokens`."""
    unary_bgk, cand_bgk = candidates(head, tcfg, dcfg, hidden_bgd)
    return walk(selector_params, dcfg, cfg, hidden_bgd, unary_bgk, cand_bgk, anchor_b, key)
