"""The phases of a decode, each a pure function: the prefill (and the speculative decode's
prompt context), the drafter's context rows, the draft, the verify, the acceptance and the
next target token. The loops (`autoregressive.py`, `speculative.py`) chain them;
`decoding.breakdown` times each one apart at real shapes.

Letters: B batch, T verified block, G = T - 1 drafts, D model width, F taps, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.decoding import grammar, markov, selector
from dflash_jax.decoding.sampling import (
    RowSettings,
    accept_greedy_choices,
    accept_rejection,
    pick,
    process_logits,
    row_keys,
    sample,
    token_logprobs,
)
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.state import LoopState, max_steps, step_key
from dflash_jax.models import sliding
from dflash_jax.models.drafter import (
    Drafter,
    draft_vocab_argmax,
    drafter_logits,
    embed_block,
    finish_logits,
)
from dflash_jax.models.target import Head, Transformer, init_cache
from dflash_jax.ops.attention import KEY_TILE
from dflash_jax.ops.caches import tile_slots, write_rows
from dflash_jax.ops.invariance import prefill_rows
from dflash_jax.ops.reductions import argmax_last


def prefill(
    target_params,
    head,
    tcfg,
    cfg,
    prompt_bp,
    prompt_lengths_b,
    rng,
    cache_len,
    tap_layers,
    rows: RowSettings | None = None,
    max_new=None,
    sink=None,
    prefix=None,
    constraint=None,
) -> tuple[LoopState, jax.Array | None]:
    """Target on the whole (right-padded) prompt; the first token comes from each row's last
    prompt position. rows: each row's own settings (`DecodeConfig.row_settings`; their keys
    replace `rng`). max_new: a traced token budget (at most `cfg.max_new_tokens`, which sizes
    the buffers) kept in the state as every row's limit, so one program serves every budget
    up to the buffer's; None: `cfg.max_new_tokens`; with `rows`, each row's own limit instead.
    sink: see `prompt_pass`. constraint: `grammar.constraint`'s (the first token masked).
    prefix: None, or the cache (one row of C slots) of C tokens every prompt begins with,
    which `prompt_bp` leaves out and `prompt_lengths_b` count: each row's cache starts from it
    and the pass runs over the rest (a plain target's, without taps).
    -> (state without drafter fields, prompt taps [B,P,F] or None; with a sink, its result
    instead of the taps)."""
    b, p = prompt_bp.shape
    if tcfg.invariant_rows is not None:  # whole key tiles (`ops.attention.tiled_attention`)
        cache_len = tile_slots(cache_len, KEY_TILE)
    # A sliding layer keeps a ring of its window + the widest verify (`sliding.cache_slots`).
    cache = init_cache(tcfg, b, cache_len, verify=max(cfg.block_size, cfg.tree_nodes, 1))
    offset = 0
    if prefix is not None:
        if tap_layers or sink is not None or tcfg.sliding or tcfg.layered:
            raise ValueError("a shared prefix serves a plain target's prefill without taps")
        offset, cache = prefix.k[0].shape[2], cache.with_prefix(prefix)
    # Under a row rule, at a tile as wide as the buffer allows (`prefill_rows`): every decode
    # of this prompt runs this same prefill, the target alone's too.
    rule = prefill_rows(tcfg.invariant_rows, p)
    ptcfg = tcfg if rule == tcfg.invariant_rows else dataclasses.replace(tcfg, invariant_rows=rule)
    hidden_b1d, taps_bpf, cache = prompt_pass(
        target_params,
        ptcfg,
        prompt_bp,
        cache,
        tap_layers,
        prompt_lengths_b - offset - 1,
        cfg.prefill_chunk,
        sink,
        offset,
    )
    budget_b = None if max_new is None or rows is not None else jnp.full((b,), max_new, jnp.int32)
    head = grammar.masked_head(head, *(constraint or (None, None)))
    if rows is None:
        first_b = next_token(head, hidden_b1d[:, 0], step_key(rng, max_steps(cfg)), cfg)
        limit_b = jnp.full((b,), cfg.max_new_tokens, jnp.int32) if budget_b is None else budget_b
    else:
        first_b = next_token(head, hidden_b1d[:, 0], step_key(rows.keys(), max_steps(cfg)), rows)
        limit_b = rows.max_new
    width = cfg.max_new_tokens + cfg.block_size + 1
    gen_bw = jnp.zeros((b, width), jnp.int32).at[:, 0].set(first_b)
    stops = jnp.asarray(cfg.stop_token_ids or (-1,), jnp.int32)  # -1: no token stops
    kept, ended_b = grammar.started(constraint, first_b)  # a grammar's state after first
    done_b = jnp.isin(first_b, stops) | (limit_b <= 1) | ended_b
    if cfg.logprobs:  # the first token's, at slot 0 of each buffer beside gen
        lp_b1, top_b1k, ids_b1k = token_logprobs(
            lambda: head.logits(hidden_b1d), first_b[:, None], rows, cfg.logprobs, rows.logprobs
        )
        room = lambda x: jnp.zeros((b, width) + x.shape[2:], x.dtype).at[:, :1].set(x)
        kept.update(logp=room(lp_b1), top_logp=room(top_b1k), top_ids=room(ids_b1k))
    state = LoopState(
        gen=gen_bw,
        n_gen=jnp.ones((b,), jnp.int32),
        done=done_b,
        step=jnp.int32(0),
        num_steps=jnp.zeros((b,), jnp.int32),
        acc=jnp.zeros((b, max_steps(cfg)), jnp.int32),
        kinds=jnp.zeros((b, max_steps(cfg)), jnp.int32),
        cache=cache,
        rows=rows,
        limit=budget_b,
        **kept,
    )
    return state, taps_bpf


def prompt_pass(
    target_params, tcfg, prompt_bp, cache, tap_layers, last_b, chunk: int, sink=None, offset=0
):
    """The target over the right-padded prompt [B,P], its K/V written into the empty `cache`
    from slot 0 (offset: from slot `offset`, the cache holding the K/V of the `offset` tokens
    before the prompt, which it attends to). -> (final-normed hidden at each row's `last_b`
    position of the prompt [B,1,D], taps [B,P,F] or None, cache). A prompt longer than `chunk`
    tokens (the hybrid families excepted) runs as a loop over chunks (`sliding.
    prompt_chunks`), each attending to the cache written before it and to itself
    (`cached_attention`, as a verify does): a layer holds chunk x P scores, not P x P. Chunks
    past every row's last position (the padding of a power-of-two buffer) never run: their
    taps are zeros and their cache rows unwritten, which nothing reads.

    sink: None, or (fn, init): the taps are folded as they come, acc = fn(acc, taps [B,C,F],
    start) from acc = init, C taps at positions start.. (a chunk, or the whole prompt at 0),
    and the result returned in place of the taps, which are then never held whole (the
    drafter's context K/V of a 32K prompt of Qwen3-8B: [P, 5 x 4096] taps were 1.25 GiB)."""
    b, p = prompt_bp.shape
    model, params = Transformer(tcfg), {"params": target_params}
    if not chunk or p <= chunk or tcfg.hybrid:  # recurrent states: one pass
        positions_bp = jnp.broadcast_to(jnp.arange(offset, offset + p, dtype=jnp.int32), (b, p))
        # cache_lengths None: an empty cache, written from slot 0
        held_b = jnp.full((b,), offset, jnp.int32) if offset else None
        args = (prompt_bp, positions_bp, cache, held_b, tap_layers, last_b[:, None])
        hidden_b1d, taps_bpf, cache = model.apply(params, *args, method="hidden")
        if sink is not None:
            taps_bpf = sink[0](sink[1], taps_bpf, jnp.int32(0))
        return hidden_b1d, taps_bpf, cache
    starts, prompt_bp, chunk_kw = sliding.prompt_chunks(tcfg, prompt_bp, chunk, offset + last_b)

    def run(cache, acc, start):
        tokens_bc = jax.lax.dynamic_slice_in_dim(prompt_bp, start, chunk, axis=1)
        at = offset + start  # the chunk's first position
        positions_bc = jnp.broadcast_to(at + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        index_b1 = jnp.clip(last_b - start, 0, chunk - 1)[:, None]
        start_b = jnp.full((b,), at, jnp.int32)
        args = (tokens_bc, positions_bc, cache, start_b, tap_layers, index_b1)
        hidden_b1d, taps_bcf, cache = model.apply(params, *args, method="hidden", **chunk_kw(at))
        if sink is not None:
            acc, taps_bcf = sink[0](acc, taps_bcf, start), None
        return hidden_b1d, taps_bcf, cache, acc

    acc = None if sink is None else sink[1]
    shapes = jax.eval_shape(run, cache, acc, starts[0])
    n = starts.shape[0]
    # The live chunks only, in a while loop: a scan with a lax.cond skipping the padding made
    # XLA:GPU copy every cache through the cond's branches per chunk (`infer.lower --device`).
    live = jnp.sum(starts <= jnp.max(last_b))
    stack = lambda x: jnp.zeros((n, *x.shape), x.dtype)

    def body(carry):
        i, cache, hidden_b1d, acc, taps_nbcf = carry
        start = starts[i]
        chunk_hidden_b1d, taps_bcf, cache, acc = run(cache, acc, start)
        mine_b = (last_b >= start) & (last_b < start + chunk)
        hidden_b1d = jnp.where(mine_b[:, None, None], chunk_hidden_b1d, hidden_b1d)
        taps_nbcf = jax.tree.map(lambda all_, one: all_.at[i].set(one), taps_nbcf, taps_bcf)
        return i + 1, cache, hidden_b1d, acc, taps_nbcf

    hidden_b1d = jnp.zeros(shapes[0].shape, shapes[0].dtype)
    carry = (jnp.int32(0), cache, hidden_b1d, acc, jax.tree.map(stack, shapes[1]))
    _, cache, hidden_b1d, acc, taps_nbcf = jax.lax.while_loop(
        lambda carry: carry[0] < live, body, carry
    )
    if sink is not None:
        return hidden_b1d, acc, cache
    if taps_nbcf is None:
        return hidden_b1d, None, cache
    head_bqf = jnp.moveaxis(taps_nbcf[:-1], 0, 1).reshape(b, (n - 1) * chunk, -1)
    cut = 0 if tcfg.sliding else n * chunk - p  # the last chunk padded, or ending at P
    taps_bpf = jnp.concatenate([head_bqf, taps_nbcf[-1][:, cut : cut + p - (n - 1) * chunk]], 1)
    return hidden_b1d, taps_bpf, cache


def context_rows(drafter_params, dcfg, drf_len_b, taps_btf):
    """The drafter's context K/V rows for taps [B,T,F] placed at each row's drf_len.
    -> (ks, vs): per drafter layer [B,Kv,T,H]."""
    t = taps_btf.shape[1]
    positions_bt = drf_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return Drafter(dcfg).apply(
        {"params": drafter_params}, taps_btf, positions_bt, method="context_kv"
    )


def append_context(drafter_params, dcfg, ctx_k, ctx_v, drf_len_b, taps_btf, count_b):
    """Appends the context K/V of taps [B,T,F] (the committed tokens' target taps) at each
    row's drf_len; rows past `count` are written too, then masked and overwritten later.
    -> (ctx_k, ctx_v, drf_len + count)."""
    ks, vs = context_rows(drafter_params, dcfg, drf_len_b, taps_btf)
    ctx_k = tuple(write_rows(c, k, drf_len_b) for c, k in zip(ctx_k, ks, strict=True))
    ctx_v = tuple(write_rows(c, v, drf_len_b) for c, v in zip(ctx_v, vs, strict=True))
    return ctx_k, ctx_v, drf_len_b + count_b


def draft_hidden(
    drafter_params, target_params, tcfg, dcfg, anchor_b1, ctx_k, ctx_v, drf_len_b, start_b, bs
):
    """The drafter over [anchor, MASK x (bs-1)] at positions start.., non-causally over the
    context cache (block K/V are not cached). -> final-normed hidden of the bs-1 draft slots
    [B,bs-1,D]; a DSpark drafter's: every slot it runs for a verify of bs
    (`markov.drafter_slots`: bs-1 with `sample_from_anchor`, the anchor's slot drafting)."""
    b = anchor_b1.shape[0]
    slots = markov.drafter_slots(dcfg, bs) if dcfg.is_dspark else bs
    mask_bg = jnp.full((b, slots - 1), dcfg.mask_token_id, jnp.int32)
    x_btd = embed_block(target_params, tcfg, dcfg, jnp.concatenate([anchor_b1, mask_bg], 1))
    hidden_btd = Drafter(dcfg).apply(
        {"params": drafter_params}, x_btd, ctx_k, ctx_v, drf_len_b, start_b[:, None], slots
    )
    return hidden_btd if dcfg.is_dspark else hidden_btd[:, 1:]


def draft_tokens(
    head: Head, tcfg, dcfg, cfg, hidden_bgd, key, drafter_params=None, anchor_b1=None, kept=False
):
    """The target's frozen head on the draft slots (a draft vocabulary's drafter: its own, its
    params needed), then argmax or a sample per slot; a DFlash2 drafter (its params and the
    anchors [B,1] needed) walks its candidates (`selector.py`), a DSpark drafter (likewise;
    hidden: `draft_hidden`'s every slot) its Markov head (`markov.py`).
    -> (drafts [B,G] int32, draft log-probs [B,G,V] when sampling, else None), and with
    `kept` a third: the drafts each row offers to the verify [B] (a DSpark confidence cut,
    `DecodeConfig.confidence_cut`) or None (all of them)."""
    if dcfg.is_dspark:
        out = markov.propose(
            head, tcfg, dcfg, cfg, drafter_params, hidden_bgd, anchor_b1[:, 0], key
        )
        return out if kept else out[:2]
    if kept:
        return (
            *draft_tokens(head, tcfg, dcfg, cfg, hidden_bgd, key, drafter_params, anchor_b1),
            None,
        )
    if dcfg.is_dflash2:
        selector_params = drafter_params["candidate_selector"]
        return selector.propose(
            head, tcfg, dcfg, cfg, selector_params, hidden_bgd, anchor_b1[:, 0], key
        )
    hidden_bgd = hidden_bgd.astype(jnp.dtype(tcfg.dtype))
    logits = lambda: drafter_logits(head, tcfg, dcfg, drafter_params, hidden_bgd)
    greedy = lambda: _greedy_drafts(head, dcfg, drafter_params, hidden_bgd, logits)
    if isinstance(cfg, RowSettings):  # greedy rows' drafts as greedy; logp read only if sampled
        no_logp_bgv = jnp.zeros((*hidden_bgd.shape[:2], tcfg.vocab_size), jnp.float32)
        if dcfg.draft_vocab_size or dcfg.final_logit_softcapping:
            drafts_bg = greedy()
        else:  # the target's head: one product for the argmax and the sampled rows' logits
            drafts_bg, raw = head.uncapped().argmax_and_logits(hidden_bgd)  # the raw head
            logits = lambda: finish_logits(dcfg, raw())
        sampled = lambda: _sampled_drafts(logits(), key, cfg)
        return cfg.where_sampled(sampled, (drafts_bg, no_logp_bgv))
    if cfg.greedy:
        return greedy(), None
    return _sampled_drafts(logits(), key, cfg)


def _greedy_drafts(head: Head, dcfg, drafter_params, hidden_bgd, logits) -> jax.Array:
    if dcfg.draft_vocab_size:
        return draft_vocab_argmax(dcfg, drafter_params, hidden_bgd)
    if dcfg.final_logit_softcapping:
        return argmax_last(logits())
    return head.argmax(hidden_bgd)  # a positive multiplier keeps the argmax


def _sampled_drafts(logits_bgv, key, cfg):
    draft_logp_bgv = process_logits(logits_bgv, cfg)
    return sample(row_keys(key, logits_bgv.shape[0]), draft_logp_bgv, cfg), draft_logp_bgv


def verify_hidden(target_params, tcfg, dcfg, verify_bt, start_b, cache, defer_write=False):
    """The target on [anchor, drafts] at positions start.., writing its K/V at start.
    -> (final-normed hidden [B,T,D], taps [B,T,F], cache); defer_write: the cache is left
    as it was and the new K/V rows take its place (`Transformer.hidden`)."""
    positions_bt = start_b[:, None] + jnp.arange(verify_bt.shape[1], dtype=jnp.int32)[None, :]
    return Transformer(tcfg).apply(
        {"params": target_params},
        verify_bt,
        positions_bt,
        cache,
        start_b,
        dcfg.target_layer_ids,
        None,
        defer_write,
        method="hidden",
    )


def verify_accept(head: Head, cfg, hidden_btd, drafts_bg, draft_logp_bgv, key, kept_b=None):
    """The target's head on the verified block, then the longest valid prefix (of the first
    `kept_b` drafts, when given) plus one target token.
    -> (accepted drafts a [B], committed tokens [B,T]: a drafts, then the bonus)."""
    if isinstance(cfg, RowSettings):  # one head product for both, where argmax reads logits
        choice_bt, logits = head.argmax_and_logits(hidden_btd)
        greedy = accept_greedy_choices(drafts_bg, choice_bt, kept_b)
        sampled = lambda: accept_rejection(
            drafts_bg, draft_logp_bgv, logits(), key, cfg, kept_b
        )  # fmt: skip
        return cfg.where_sampled(sampled, greedy)
    if cfg.greedy:
        return accept_greedy_choices(drafts_bg, head.argmax(hidden_btd), kept_b)
    return accept_rejection(drafts_bg, draft_logp_bgv, head.logits(hidden_btd), key, cfg, kept_b)


def next_token(head: Head, hidden_bd, key, cfg: DecodeConfig) -> jax.Array:
    """The next target token per row from its final-normed hidden [B,D]: the greedy argmax
    (`Head.argmax`, the one function every greedy target token goes through) or a sample
    (`sampling.pick`); with a RowSettings, each row as its own settings say. -> [B] int32."""
    if isinstance(cfg, RowSettings):
        greedy_b, logits = head.argmax_and_logits(hidden_bd)
        return cfg.where_sampled(lambda: pick(logits(), key, cfg), greedy_b)
    if cfg.greedy:
        return head.argmax(hidden_bd)
    return pick(head.logits(hidden_bd), key, cfg)


def init_speculative(
    target_params,
    drafter_params,
    head,
    tcfg,
    dcfg,
    cfg,
    prompt,
    prompt_lengths,
    rng,
    rows: RowSettings | None = None,
    cache_len: int | None = None,
    max_new=None,
    control=None,
    constraint=None,
) -> LoopState:
    """Prefill, then the prompt's drafter context K/V (block-independent: all appended now);
    `control`: the controller's state (`proposers.init_control`), carried as given.
    -> the speculative loop's state before any step (the adaptive controller at its prior).
    rows: each row's own settings (`DecodeConfig.row_settings`; None there: `cfg`'s for every
    row). cache_len: the caches' length (None: room for the prompt, the new tokens and a step).
    max_new: a traced token budget, constraint a grammar (`prefill`)."""
    bs = cfg.block_size
    b, p = prompt.shape
    if cache_len is None:
        cache_len = p + cfg.max_new_tokens + 2 * max(bs, cfg.tree_nodes)  # a tree: N verify slots
        cache_len = tile_slots(cache_len)
    if cfg.row_settings and rows is None:
        rows = RowSettings.uniform(cfg, rng, b)
    ctx_shape = (b, dcfg.num_kv_heads, cache_len, dcfg.head_dim)
    dtype = jnp.dtype(dcfg.dtype)
    empty = tuple(jnp.zeros(ctx_shape, dtype) for _ in range(dcfg.num_layers))

    def context(ctx_kv, taps_bcf, start):  # the taps' context K/V, chunk by chunk
        start_b = jnp.full((b,), start, jnp.int32)
        return append_context(drafter_params, dcfg, *ctx_kv, start_b, taps_bcf, start_b)[:2]

    state, (ctx_k, ctx_v) = prefill(
        target_params,
        head,
        tcfg,
        cfg,
        prompt,
        prompt_lengths,
        rng,
        cache_len,
        dcfg.target_layer_ids,
        rows,
        max_new,
        sink=(context, (empty, empty)),
        constraint=constraint,
    )
    return state.replace(
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        drf_len=jnp.asarray(prompt_lengths, jnp.int32),
        control=control,
    )
