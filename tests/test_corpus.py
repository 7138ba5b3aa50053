"""Corpus lookup (`decoding.corpus`, `io.corpus_table`): the table counts what it should, the
jitted lookup follows the host rule, the copy steps take the corpus only where the text has no
match of two tokens, counting in chunks and shards gives the same table, a table travels beside
its drafter's params (saved beside an export, never in its params), bad tables are refused
with the fix, and a decode that copies from the corpus is still the target's own greedy output,
in fewer steps, its corpus copies recorded apart from text copies."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import LENS, PROMPT, make_pair

from dflash_jax.config import ConfigError
from dflash_jax.decoding import corpus, lookup
from dflash_jax.decoding.settings import CORPUS_KIND_BASE, DecodeConfig
from dflash_jax.io import corpus_table
from dflash_jax.io.drafter_io import read_drafter, restore_drafter, save_drafter
from dflash_jax.io.hf import CheckpointError
from dflash_jax.ops.ngrams import CORPUS_FILE, PARAMS_KEY, with_table

VOCAB = 16


def _records():
    # Answers (mask 1) after a 2-token prompt (mask 0): "3 4 5 6" twice, "3 4 9 9" once.
    r = lambda toks: (np.array([1, 2, *toks]), np.array([0, 0] + [1] * len(toks)))
    return [r([3, 4, 5, 6, 7]), r([3, 4, 5, 6, 7]), r([3, 4, 9, 9, 9])]


def _host_rule(table: corpus_table.CorpusTable, text: list[int], length: int) -> list[int]:
    """What the corpus proposes after `text`: the longest last n-gram's continuation, then the
    same from the proposal's own tail; [] when nothing matches at first."""
    rows = dict(zip(table.keys.tolist(), table.next.tolist(), strict=True))
    out, tail = [], list(text)
    while len(out) < length:
        hit = None
        for n in range(1, table.max_ngram + 1):
            if len(tail) >= n:
                h = int(corpus_table.ngram_hash(np.array(tail[-n:]), n))
                hit = rows.get(h, hit)
        if hit is None:
            return out + [0] * (length - len(out)) if out else []
        out += hit
        tail += hit
    return out[:length]


def test_table_counts_the_most_frequent_continuation_of_answer_tokens(tmp_path):
    table = corpus_table.build_table(_records(), VOCAB, max_ngram=2, continuation=2)
    rows = dict(zip(table.keys.tolist(), table.next.tolist(), strict=True))
    get = lambda *ngram: rows.get(int(corpus_table.ngram_hash(np.array(ngram), len(ngram))))
    assert get(2) == [3, 4]  # the prompt's last token leads into the answers
    assert get(4) == [5, 6]  # 2 of 3 (the tie-free majority)
    assert get(3, 4) == [5, 6] and get(4, 9) == [9, 9]
    assert get(1) is None  # followed by a prompt token, never counted
    assert get(6, 7) is None  # no 2 tokens after it inside the record
    path = tmp_path / CORPUS_FILE
    corpus_table.save_table(table, path)
    back = corpus_table.load_table(path)
    np.testing.assert_array_equal(back.keys, table.keys)
    np.testing.assert_array_equal(back.next, table.next)
    assert (back.vocab_size, back.max_ngram) == (VOCAB, 2)
    # min_count drops the n-grams seen once; one that drops them all is refused.
    rare = corpus_table.build_table(_records(), VOCAB, 2, 2, min_count=2)
    assert rare.keys.size < table.keys.size
    with pytest.raises(ConfigError, match="empty; lower --min_count"):
        corpus_table.build_table(_records(), VOCAB, 2, 2, min_count=9)


def test_counting_in_chunks_and_shards_gives_the_same_table():
    rng = np.random.default_rng(1)
    records = [(rng.integers(0, 5, 30), rng.integers(0, 2, 30)) for _ in range(20)]
    whole = corpus_table.build_table(records, VOCAB, 3, 3)
    parts = corpus_table.build_table(records, VOCAB, 3, 3, chunk_rows=7, shards=3)
    for field in ("keys", "next", "counts"):
        np.testing.assert_array_equal(getattr(parts, field), getattr(whole, field))


def _attached(params, table, directory: Path) -> dict:
    """The params a decode takes from a drafter whose directory holds `table` (as
    `LoadedDrafter.decode_params` gives them)."""
    directory.mkdir(exist_ok=True)
    corpus_table.save_table(table, directory / CORPUS_FILE)
    back = corpus_table.read(directory, table.vocab_size, table.vocab_hash)
    return with_table(params, corpus_table.device_arrays(back))


def test_device_lookup_follows_the_host_rule_and_defers_to_longer_text_matches(tmp_path):
    rng = np.random.default_rng(0)
    records = [(rng.integers(0, 6, 40), np.ones(40, int)) for _ in range(8)]
    table = corpus_table.build_table(records, VOCAB, max_ngram=3, continuation=2)
    arrays = _attached({}, table, tmp_path)[PARAMS_KEY]
    texts = [rng.integers(0, 8, int(rng.integers(1, 12))).tolist() for _ in range(24)]
    n = 12
    text_bn = jnp.array([t + [0] * (n - len(t)) for t in texts])
    end_b = jnp.array([len(t) - 1 for t in texts])
    prop, matched = jax.jit(corpus.device_proposal, static_argnums=3)(arrays, text_bn, end_b, 5)
    for b, t in enumerate(texts):
        want = _host_rule(table, t, 5)
        assert bool(matched[b]) == bool(want)
        if want:
            assert np.asarray(prop[b]).tolist() == want, (t, want)
    # In the copy steps' proposer: a text whose last 2 tokens occurred before copies itself; one
    # with a one-token match or none copies from the corpus (and counts as found).
    plen = jnp.array([4, 4, 4])
    prompts = jnp.array([[3, 4, 5, 6], [3, 11, 12, 13], [10, 11, 12, 13]])
    gens = jnp.array([[3, 4, 0], [3, 0, 0], [14, 0, 0]])
    n_gen = jnp.array([2, 1, 1])
    copy, found, corpus_b = lookup.device_proposal(prompts, plen, gens, n_gen, 2, 3, arrays)
    assert np.asarray(copy[0]).tolist() == [5, 6]  # the text's own 2-token match
    assert np.asarray(copy[1]).tolist() == _host_rule(table, [3, 11, 12, 13, 3], 2)
    assert bool(found[1])
    plain_copy, plain_found, _ = lookup.device_proposal(prompts, plen, gens, n_gen, 2, 3)
    assert not bool(plain_found[2]) and bool(found[2]) == bool(
        _host_rule(table, [10, 11, 12, 13, 14], 2)
    )
    assert np.asarray(plain_copy[0]).tolist() == [5, 6]


def test_bad_tables_are_refused_with_the_fix(tmp_path):
    table = corpus_table.build_table(_records(), VOCAB, 2, 2, vocab_hash="aaaa")
    corpus_table.save_table(table, tmp_path / CORPUS_FILE)
    assert corpus_table.read(tmp_path, VOCAB, "aaaa").keys.size == table.keys.size
    # Another tokenizer: of another size, or of this size with other ids (its hash).
    with pytest.raises(ConfigError, match="another tokenizer.*build_corpus"):
        corpus_table.read(tmp_path, VOCAB + 1)
    with pytest.raises(ConfigError, match="vocabulary aaaa of 16 tokens.*bbbb of 16"):
        corpus_table.read(tmp_path, VOCAB, "bbbb")
    empty = corpus_table.CorpusTable(
        keys=np.zeros(0, np.uint32), next=np.zeros((0, 2), np.int32),
        counts=np.zeros(0, np.int32), vocab_size=VOCAB, max_ngram=2,
    )  # fmt: skip
    corpus_table.save_table(empty, tmp_path / CORPUS_FILE)
    with pytest.raises(CheckpointError, match="is empty: rebuild it"):
        corpus_table.read(tmp_path, VOCAB)
    (tmp_path / CORPUS_FILE).write_bytes(b"not a table")
    with pytest.raises(CheckpointError, match="cannot read the corpus table.*build_corpus"):
        corpus_table.read(tmp_path, VOCAB)
    assert corpus_table.read(tmp_path / "none", VOCAB) is None  # no table


def test_corpus_copies_keep_greedy_output(tmp_path):
    """A table counted from the target's own greedy answers: the first step, whose text has
    nothing of its own to copy, copies the corpus and has all 3 copied tokens accepted in
    every row, and the tokens are still the target's own."""
    from dflash_jax.decoding import autoregressive_decode, speculative_decode

    tcfg, tp, dcfg, dp = make_pair(vocab=64, zero_boost=1.0, seed=3, block_size=4)
    cfg = DecodeConfig(
        max_new_tokens=24, block_size=4, adaptive=True, step_kinds=(1, 4), lookup_kinds=(4,),
        stop_token_ids=(),
    )  # fmt: skip
    key = jax.random.key(0)
    ar = autoregressive_decode(tp, PROMPT, LENS, key, target_config=tcfg, decode_config=cfg)
    records = [
        (np.concatenate([PROMPT[b, : LENS[b]], np.asarray(ar.tokens[b])]),
         np.concatenate([np.zeros(LENS[b], int), np.ones(ar.tokens.shape[1], int)]))
        for b in range(len(LENS))
    ]  # fmt: skip
    table = corpus_table.build_table(records, 64, max_ngram=3, continuation=3)
    out = speculative_decode(
        tp, _attached(dp, table, tmp_path), PROMPT, LENS, key, target_config=tcfg,
        drafter_config=dcfg, decode_config=cfg, step_costs=(1.0, 5.0, 1.0),
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    np.testing.assert_array_equal(out.lengths, ar.lengths)
    # An Orbax export keeps the table beside its params (a file of its own, never a param),
    # and reading the export reads it back.
    save_drafter(tmp_path / "export", dcfg, dp, table)
    assert PARAMS_KEY not in (tmp_path / "export" / "params" / "_METADATA").read_text()
    assert PARAMS_KEY not in restore_drafter(tmp_path / "export").params
    back = read_drafter(tmp_path / "export").corpus_table
    np.testing.assert_array_equal(back.keys, table.keys)
    np.testing.assert_array_equal(back.next, table.next)
    assert (np.asarray(out.block_sizes)[:, 0] == -(CORPUS_KIND_BASE + 4)).all()  # corpus copies
    assert (np.asarray(out.acceptance_lengths)[:, 0] == 4).all()
    assert (np.asarray(out.num_steps) < np.asarray(ar.lengths) - 1).all()


@pytest.mark.slow  # guards alone that sampled corpus copies keep the target's law (~80 s)
def test_sampling_with_corpus_copies_is_lossless():
    """Sampled decoding whose second token comes from a corpus copy step (a deterministic
    proposal, accepted with the target's probability of its token) keeps the target's exact
    law of the first two tokens (`two_token_tv`, as test_decoding's check of drafted blocks)."""
    from _decode import two_token_tv

    from dflash_jax.decoding import speculative_decode

    vocab = 12
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, zero_boost=1.0, seed=4, block_size=4)
    rng = np.random.default_rng(0)
    # Token-0-heavy answers: copies of 0s the target often takes, and other tokens it rejects.
    p = np.full(vocab, 0.5 / (vocab - 1))
    p[0] = 0.5
    records = [(rng.choice(vocab, 30, p=p), np.ones(30, int)) for _ in range(40)]
    table = corpus_table.build_table(records, vocab, max_ngram=2, continuation=3)
    params = with_table(dp, corpus_table.device_arrays(table))
    prompt = np.array([3, 1, 4], np.int32)
    n = 6000
    cfg = DecodeConfig(
        max_new_tokens=2, block_size=4, temperature=1.0, adaptive=True, step_kinds=(1, 4),
        lookup_kinds=(4,),
    )  # fmt: skip
    out = speculative_decode(
        tp, params, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(11),
        target_config=tcfg, drafter_config=dcfg, decode_config=cfg, step_costs=(1.0, 5.0, 0.1),
    )  # fmt: skip
    # Every row's one step copied from the corpus (the text has no match of two tokens).
    assert (np.asarray(out.block_sizes)[:, 0] == -(CORPUS_KIND_BASE + 4)).all()
    tv = two_token_tv(tcfg, tp, prompt, 1.0, out.tokens)
    # Sampling noise of the TV distance over 144 cells at n=6000 is about 0.05.
    assert tv < 0.09, tv
