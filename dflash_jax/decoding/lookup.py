"""Prompt lookup: a proposer that copies, as a step kind of the adaptive loop and as the free
baseline every drafter is compared with (`infer.benchmark`).

It finds the longest suffix (up to `max_ngram` tokens) of the text so far (prompt + answer)
that occurred earlier, and proposes what followed its latest earlier occurrence. A proposal that
runs into the end of the text continues periodically (the span between the match and the end
repeats), which is what a loop of repeated lines does next. `proposal` is the host version
(the benchmark's offline baseline on the target's own greedy answer), `device_proposal` the
jitted one the loop drafts with (`DecodeConfig.lookup_kinds`); both follow the same rule. The
jitted one also copies from a corpus of the target's answers where the text has no match of two
or more tokens, when the drafter ships one (`decoding.corpus`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from dflash_jax.decoding import corpus


def proposal(context: Sequence[int], length: int, max_ngram: int) -> list[int]:
    """`length` proposed tokens after `context`, or [] when no suffix occurred before."""
    context = list(context)
    end = len(context) - 1
    for n in range(min(max_ngram, end), 0, -1):
        suffix = context[-n:]
        for last in range(end - 1, n - 2, -1):  # the candidate occurrence ends at `last`
            if context[last - n + 1 : last + 1] == suffix:
                period = end - last
                return [context[last + 1 + m % period] for m in range(length)]
    return []


def prompt_lookup_taus(
    prompt: Sequence[int], answer: Sequence[int], block_size: int, max_ngram: int = 3
) -> list[int]:
    """Tokens committed per step (bonus included) when a prompt-lookup proposer drafts
    `block_size - 1` tokens a step and `answer` is what the target decodes greedily after
    `prompt`. The first answer token comes from the prefill, as in `speculative_decode`."""
    context = list(prompt) + list(answer[:1])
    done, taus = 1, []
    while done < len(answer):
        accepted = 0
        for token in proposal(context, block_size - 1, max_ngram):
            if done + accepted < len(answer) and token == answer[done + accepted]:
                accepted += 1
            else:
                break
        step = min(accepted + 1, len(answer) - done)
        context += answer[done : done + step]
        done += step
        taus.append(step)
    return taus


def device_proposal(
    prompt_bp, prompt_len_b, gen_bw, n_gen_b, length: int, max_ngram: int, corpus_table=None
):
    """`proposal` for every row on device. The text of row b is prompt[b, :prompt_len] then
    gen[b, :n_gen]. -> (proposal [B, length] int32, found [B] bool; rows without a match
    propose zeros; corpus [B] bool: the proposal is the corpus's). With a `corpus_table`
    (`decoding.corpus`), a row whose text matches nowhere or only on its last token copies
    from the corpus instead, where the corpus holds one of its last tokens (found then too)."""
    b, p = prompt_bp.shape
    n = p + gen_bw.shape[1]
    i_n = jnp.arange(n, dtype=jnp.int32)
    from_gen_bn = i_n[None, :] - prompt_len_b[:, None]
    text_bn = jnp.where(
        from_gen_bn < 0,
        jnp.pad(prompt_bp, ((0, 0), (0, n - p))),
        jnp.take_along_axis(gen_bw, jnp.clip(from_gen_bn, 0, gen_bw.shape[1] - 1), 1),
    )
    end_b = prompt_len_b + n_gen_b - 1  # index of the last token (the anchor)
    # run[b, i]: how many of the last max_ngram tokens match the ones ending at i (consecutive).
    run_bn = jnp.zeros((b, n), jnp.int32)
    still_bn = jnp.ones((b, n), bool)
    for k in range(max_ngram):
        tail_b = jnp.take_along_axis(text_bn, jnp.maximum(end_b - k, 0)[:, None], 1)
        shifted_bn = jnp.pad(text_bn, ((0, 0), (k, 0)))[:, :n]  # token at i - k
        ok_bn = (shifted_bn == tail_b) & (i_n[None, :] >= k) & (end_b[:, None] - k >= 1)
        still_bn &= ok_bn
        run_bn += still_bn.astype(jnp.int32)
    valid_bn = (i_n[None, :] < end_b[:, None]) & (run_bn > 0)
    score_bn = jnp.where(valid_bn, run_bn * n + i_n[None, :], -1)  # longest, then latest
    last_b = jnp.argmax(score_bn, axis=1).astype(jnp.int32)
    found_b = jnp.max(score_bn, axis=1) >= 0
    period_b = jnp.maximum(end_b - last_b, 1)
    m_l = jnp.arange(length, dtype=jnp.int32)
    idx_bl = last_b[:, None] + 1 + m_l[None, :] % period_b[:, None]
    prop_bl = jnp.take_along_axis(text_bn, jnp.clip(idx_bl, 0, n - 1), 1)
    prop_bl = jnp.where(found_b[:, None], prop_bl, 0).astype(jnp.int32)
    if corpus_table is None:
        return prop_bl, found_b, jnp.zeros_like(found_b)
    # The text's own match when it spans 2+ tokens (copies of a repeated span are the surest),
    # else the corpus's, else the one-token match.
    run_b = jnp.where(found_b, jnp.take_along_axis(run_bn, last_b[:, None], 1)[:, 0], 0)
    corpus_bl, corpus_n_b = corpus.device_proposal(corpus_table, text_bn, end_b, length)
    use_b = (corpus_n_b > 0) & (run_b < 2)
    return jnp.where(use_b[:, None], corpus_bl, prop_bl), found_b | (corpus_n_b > 0), use_b


def one_hot_logp(proposal_bg: jax.Array, vocab: int) -> jax.Array:
    """The log-probabilities of a deterministic proposal (0 at the token, -inf elsewhere): with
    them, rejection sampling accepts a copied token with probability p(token) and draws the
    bonus from p without it, so sampling stays exact."""
    hit = proposal_bg[..., None] == jnp.arange(vocab, dtype=jnp.int32)
    return jnp.where(hit, 0.0, -jnp.inf).astype(jnp.float32)
