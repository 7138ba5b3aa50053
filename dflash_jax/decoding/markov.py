"""A DSpark drafter's proposal: the drafter's slots, then the Markov head's walk over them
(`models/dspark.py`), each draft biased by the token drafted before it.

Verify width T, drafts at anchor+1..anchor+T-1 (G = T-1 of them). With `sample_from_anchor` the
drafter runs the T-1 slots [anchor, MASK...] and slot j drafts anchor+j+1; without, it runs T
slots and slot j >= 1 drafts anchor+j, slot 0 drafting nothing but advancing the rnn state
(its previous token: the anchor), as `dspark.previous_tokens` lays the teacher-forced blocks out.

The base logits of every draft slot come from one head call; a `lax.scan` over the draft slots
then carries the token before (the anchor for the first draft) and the rnn state, adds the
slot's Markov bias over the drafter's own vocabulary (before a draft vocabulary's ids are
mapped to target ids) and takes the argmax or one sample. Sampling records each slot's
processed log-probs: the drafter's exact distribution given the drafts before it, which the
rejection step (`sampling.accept_rejection`) compares with the target's, so decoding stays
lossless.

With `DecodeConfig.confidence_cut` the walk also runs the confidence head on each draft slot
(its hidden and, `confidence_head_with_markov`, the Markov embedding of the token before) and
keeps the drafts while the running product of sigmoid(confidence) stays at or above the cut:
`propose` then returns how many drafts each row keeps, and the accept step offers only those
to the target (`sampling.accept_rejection`'s `kept_b`).

Letters: B batch, S drafter slots, G drafts, D model dim, R Markov rank, U the drafter's
vocabulary (V, or its draft vocabulary), V the target's vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding.sampling import process_logits, row_keys, sample
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models.drafter import draft_vocab_logits, finish_logits, on_target_vocab
from dflash_jax.models.dspark import ConfidenceHead, MarkovHead
from dflash_jax.models.target import Head
from dflash_jax.ops.reductions import argmax_last


def drafter_slots(dcfg: DrafterConfig, bs: int) -> int:
    """The drafter slots run for a verify of width `bs` (bs - 1 drafts)."""
    return bs - 1 if dcfg.sample_from_anchor else bs


def base_logits(head: Head, tcfg: TargetConfig, dcfg: DrafterConfig, dparams, hidden_bgd):
    """The draft slots' logits without the bias, over the drafter's vocabulary: fp32 [B,G,U]."""
    hidden_bgd = hidden_bgd.astype(jnp.dtype(tcfg.dtype))
    if dcfg.draft_vocab_size:
        return draft_vocab_logits(dcfg, dparams, hidden_bgd)
    return finish_logits(dcfg, head.uncapped().logits(hidden_bgd))


def propose(
    head: Head,
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    cfg: DecodeConfig,
    dparams,
    hidden_bsd: jax.Array,
    anchor_b: jax.Array,
    key: jax.Array,
):
    """Drafts of a DSpark block from the drafter's final-normed hidden of every slot [B,S,D]
    and the anchor [B]. -> (drafts [B,G] int32 target ids, draft log-probs [B,G,V] when
    sampling (-inf off its support), else None, the drafts each row keeps [B] int32 under
    `cfg.confidence_cut`, else None)."""
    first = 0 if dcfg.sample_from_anchor else 1
    draft_bgd = hidden_bsd[:, first:]
    base_bgu = base_logits(head, tcfg, dcfg, dparams, draft_bgd)
    b = anchor_b.shape[0]
    anchor_b = anchor_b.astype(jnp.int32)
    markov = MarkovHead(dcfg)
    variables = {"params": dparams.get("markov_head")}
    dtype = jnp.dtype(dcfg.dtype)

    cut = cfg.confidence_cut > 0
    confidence = ConfidenceHead(dcfg)
    log_cut = jnp.log(jnp.float32(cfg.confidence_cut)) if cut else None

    def embed(prev_b):
        return markov.apply(variables, prev_b, method="embed") if dcfg.markov_rank else None

    def bias(state_br, e_br, h_bd):  # -> (state after the slot, its bias [B,U] or 0)
        if not dcfg.markov_rank:
            return state_br, 0.0
        return markov.apply(variables, state_br, e_br, h_bd, method="walk_step")

    state_br = jnp.zeros((b, max(dcfg.markov_rank, 1)), dtype)
    if not dcfg.sample_from_anchor and dcfg.markov_head_type == "rnn" and dcfg.markov_rank:
        state_br, _ = bias(state_br, embed(anchor_b), hidden_bsd[:, 0])  # slot 0: the state only

    def step(carry, xs):
        prev_b, state_br, log_conf_b = carry
        g, h_bd, base_bu = xs
        e_br = embed(prev_b)
        state_br, bias_bu = bias(state_br, e_br, h_bd)
        if cut:  # the running log-product of the drafts' predicted acceptance
            c_b = confidence.apply({"params": dparams["confidence_head"]}, h_bd, e_br)
            log_conf_b = log_conf_b + jax.nn.log_sigmoid(c_b)
        logits_bu = base_bu + bias_bu
        if cfg.greedy:
            token_b = argmax_last(logits_bu)
            if dcfg.draft_vocab_size:
                token_b = jnp.take(dparams["draft_to_target"], token_b)
            token_b, logp_bv = token_b.astype(jnp.int32), None
        else:
            if dcfg.draft_vocab_size:
                logits_bu = on_target_vocab(dparams, logits_bu, tcfg.vocab_size)
            logp_bv = process_logits(logits_bu, cfg)
            token_b = sample(row_keys(jax.random.fold_in(key, g), b), logp_bv)
        return (token_b, state_br, log_conf_b), (token_b, logp_bv, log_conf_b)

    first_axis = lambda x: jnp.moveaxis(x, 1, 0)  # scan over the slot axis
    xs = (jnp.arange(draft_bgd.shape[1]), first_axis(draft_bgd), first_axis(base_bgu))
    carry = (anchor_b, state_br, jnp.zeros((b,), jnp.float32))
    _, (drafts_gb, logp_gbv, log_conf_gb) = jax.lax.scan(step, carry, xs)
    drafts_bg = jnp.moveaxis(drafts_gb, 0, 1)
    # The running product only falls, so the drafts at or above the cut are a prefix.
    kept_b = jnp.sum(log_conf_gb >= log_cut, axis=0, dtype=jnp.int32) if cut else None
    return drafts_bg, None if cfg.greedy else jnp.moveaxis(logp_gbv, 0, 1), kept_b
