"""Structured output: the device automaton against outlines-core's own walk, the constrained
speculative decode against the constrained target alone (greedy token for token, sampled by
its exact two-token law), rows without a grammar untouched, and a new grammar of the same
buckets run by the programs already compiled."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import LENS, PROMPT, make_pair

from dflash_jax.decoding import autoregressive_decode, grammar, speculative_decode, step
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import grammar as grammar_io
from dflash_jax.models.target import Transformer

STOP = 2
# A 64-token vocabulary of byte strings (the tiny pair's): single characters, a few longer
# pieces, specials (None) at 1, 2 (the stop token) and 63 (the drafter's mask).
_CHARS = list('{}":, abcxyz0123456789-.[]') + ['{"', '":', '", "', "ab", "abc", "12", "yes", "no"]
PIECES = [b"0"] + [None, None] + [c.encode() for c in _CHARS]
PIECES += [f"w{i}".encode() for i in range(63 - len(PIECES))] + [None]
assert len(PIECES) == 64
REGEX = r'\{"a": [0-9]{1,4}, "b": "[abcxyz]{1,12}"\}'


def _table(regex=REGEX):
    spec = grammar_io.GrammarSpec("regex", regex)
    return grammar_io.compile_grammar(spec, PIECES, 64, [STOP])


def _text(tokens, n):
    return b"".join(PIECES[t] or b"" for t in tokens[:n] if t != STOP).decode()


def test_device_automaton_walks_as_outlines_core():
    from outlines_core import Index, Vocabulary

    by_bytes = {}
    for i, piece in enumerate(PIECES):
        if piece and i != STOP:
            by_bytes.setdefault(piece, []).append(i)
    index = Index(REGEX, Vocabulary(STOP, by_bytes))
    g = grammar.device_table(*_table())
    allowed = jax.jit(grammar.allowed)
    advance = jax.jit(grammar.advance)
    rng = np.random.default_rng(0)
    for _ in range(20):  # random token strings: mostly allowed tokens, sometimes any token
        ours, theirs = jnp.int32(0), index.get_initial_state()
        for _ in range(30):
            want = set(index.get_allowed_tokens(theirs))
            got = set(np.flatnonzero(np.asarray(allowed(g, ours))).tolist())
            assert got == want, (sorted(got), sorted(want))
            assert (STOP in got) == index.is_final_state(theirs)
            tok = int(rng.choice(sorted(want))) if rng.random() < 0.9 else int(rng.integers(64))
            nxt = int(advance(g, ours, tok))
            if tok not in want:
                assert nxt == grammar.DEAD
                break
            if tok == STOP:
                assert not bool(g.live[nxt])  # a stop token ends the text
                break
            ours, theirs = jnp.int32(nxt), index.get_next_state(theirs, tok)


def _constrained(g, rows=None, batch=3):
    return grammar.constraint(g, batch, rows)


@pytest.mark.parametrize(
    "mode",
    [
        # slow: the adaptive case runs a block-8 drafting kind too; this guards the
        # fixed-block loop alone
        pytest.param(dict(block_size=8), marks=pytest.mark.slow),
        dict(block_size=8, adaptive=True, lookup_kinds=(4,)),
    ],
    ids=["block", "adaptive-lookup"],
)
def test_constrained_greedy_equals_constrained_ar(mode):
    tcfg, tp, dcfg, dp = make_pair()
    cfg = DecodeConfig(max_new_tokens=40, stop_token_ids=(STOP,), **mode)
    g = grammar.device_table(*_table())
    rows = np.array([True, False, True])  # the middle row without a grammar
    key = jax.random.key(0)
    ar = autoregressive_decode(
        tp, PROMPT, LENS, key, target_config=tcfg, decode_config=cfg,
        constraint=_constrained(g, rows),
    )  # fmt: skip
    sp = speculative_decode(
        tp, dp, PROMPT, LENS, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        constraint=_constrained(g, rows),
    )  # fmt: skip
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    np.testing.assert_array_equal(sp.lengths, ar.lengths)
    free = autoregressive_decode(tp, PROMPT, LENS, key, target_config=tcfg, decode_config=cfg)
    np.testing.assert_array_equal(sp.tokens[1], free.tokens[1])  # the row without is untouched
    for b in (0, 2):  # each constrained row: the regex's text, ended by the stop token
        n = int(sp.lengths[b])
        assert int(sp.tokens[b, n - 1]) == STOP, sp.tokens[b]
        assert re.fullmatch(REGEX, _text(np.asarray(sp.tokens[b]), n)), _text(sp.tokens[b], n)
    assert np.asarray(sp.acceptance_lengths).max() > 1  # drafts (or forced runs) accepted


def _exact_constrained_two_tokens(tcfg, tp, prompt, g):
    """p(t1, t2 | prompt) of the target masked by the grammar, for the whole vocabulary."""
    v, n = tcfg.vocab_size, len(prompt)
    seqs = np.array([list(prompt) + [t] for t in range(v)], np.int32)
    pos = np.broadcast_to(np.arange(n + 1), seqs.shape)
    logits = np.asarray(Transformer(tcfg).apply({"params": tp}, seqs, pos)[0], np.float64)
    ok1 = np.asarray(grammar.allowed(g, jnp.int32(0)))
    s1 = np.asarray(grammar.advance(g, jnp.zeros(v, jnp.int32), jnp.arange(v)))
    ok2 = np.asarray(grammar.allowed(g, jnp.asarray(s1)))  # [v, v]

    def law(x, ok):
        x = np.where(ok, x, -np.inf)
        p = np.exp(x - x.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    p1 = law(logits[0, n - 1], ok1)
    return p1[:, None] * law(logits[:, n], ok2)


@pytest.mark.parametrize(
    # slow: the broken rule guards that the check can fail, not a claim of the decode
    "broken",
    [False, pytest.param(True, marks=pytest.mark.slow)],
)
def test_constrained_sampling_follows_the_constrained_target(broken, monkeypatch):
    """Sampled tokens follow the masked target's law (total variation of the first two tokens
    over 6000 rows); broken: the verify unmasked (the prefill's first token still masked)
    draws the second token outside the grammar's law, which the check catches."""
    tcfg, tp, dcfg, dp = make_pair(zero_boost=1.0)
    g = grammar.device_table(*_table(r"[0-9abc]{1,3}(x|yz)"))
    if broken:
        shim = types.SimpleNamespace(walk=grammar.walk, masked_head=lambda h, g, s: h)
        monkeypatch.setattr(step, "grammar", shim)
        jax.clear_caches()
    prompt, n = np.array([3, 1, 4], np.int32), 6000
    cfg = DecodeConfig(max_new_tokens=2, block_size=4, temperature=1.0, stop_token_ids=(STOP,))
    out = speculative_decode(
        tp, dp, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(5),
        target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        constraint=grammar.constraint(g, n),
    )  # fmt: skip
    if broken:
        jax.clear_caches()
    toks = np.asarray(out.tokens)
    emp = np.zeros((64, 64))
    np.add.at(emp, (toks[:, 0], toks[:, 1]), 1)
    tv = 0.5 * np.abs(emp / n - _exact_constrained_two_tokens(tcfg, tp, prompt, g)).sum()
    if broken:
        assert tv > 0.15, tv
    else:
        assert tv < 0.09, tv


def test_a_new_grammar_in_the_same_buckets_does_not_recompile():
    tcfg, tp, dcfg, dp = make_pair()
    cfg = DecodeConfig(max_new_tokens=12, block_size=4, stop_token_ids=(STOP,))
    first = grammar.device_table(*_table())
    second = grammar.device_table(*_table(r"(ab|xyz|c)[0-9]{2,5}"))
    assert first.trans.shape == second.trans.shape  # one bucket
    run = lambda g: speculative_decode(
        tp, dp, PROMPT, LENS, jax.random.key(0), target_config=tcfg, drafter_config=dcfg,
        decode_config=cfg, constraint=_constrained(g),
    )  # fmt: skip
    jax.block_until_ready(run(first))
    size = speculative_decode.__globals__["speculative_jit"]._cache_size()
    out = run(second)
    assert speculative_decode.__globals__["speculative_jit"]._cache_size() == size
    for b in range(3):
        n = int(out.lengths[b])
        text = _text(np.asarray(out.tokens[b]), n)
        assert re.fullmatch(r"(ab|xyz|c)[0-9]{2,5}", text) or n == 12, text


def test_a_schema_the_compiler_cannot_take_is_refused_by_name():
    with pytest.raises(grammar_io.GrammarError, match="json_schema is not valid JSON"):
        grammar_io.spec_of(json_schema="{not json").regex()
    with pytest.raises(grammar_io.GrammarError, match="outlines-core cannot build"):
        _table(r"(?<=a)b")  # a lookbehind
    with pytest.raises(grammar_io.GrammarError, match="give one of"):
        grammar_io.spec_of(regex="a", choices=["a"])


def test_a_forced_run_is_the_one_spelling_the_grammar_leaves():
    """w5 and w7 are tokens, w alone is not: "w5w7" has one spelling, then the stop token."""
    g = grammar.device_table(*_table("w5w7"))
    w5, w7 = PIECES.index(b"w5"), PIECES.index(b"w7")
    run, n = grammar.forced_run(g, jnp.asarray([0, grammar.NONE], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(n), [3, 0])
    np.testing.assert_array_equal(np.asarray(run[0]), [w5, w7, STOP, 0])
    assert grammar.forced_share(g, np.asarray([[w5, w7, STOP]]), np.asarray([3])) == (3, 3)
