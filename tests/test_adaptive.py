"""Adaptive draft length: the controller's arithmetic, losslessness with kinds switching inside a
row (greedy and sampled), and a probe that brings drafting back once the drafter succeeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import LENS, PROMPT, make_pair, run_both

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.decoding import adaptive, autoregressive_decode, proposers, speculative_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import Transformer, init_params


def test_config_kinds_and_validation():
    assert DecodeConfig(block_size=16, adaptive=True).step_kinds == (1, 4, 8, 16)
    assert DecodeConfig(block_size=8, adaptive=True).step_kinds == (1, 4, 8)
    assert DecodeConfig(block_size=16).step_kinds == ()  # fixed block size
    assert DecodeConfig(block_size=8, adaptive=True, step_kinds=(8, 2)).step_kinds == (2, 8)
    with pytest.raises(ConfigError, match="largest equal to block_size"):
        DecodeConfig(block_size=8, adaptive=True, step_kinds=(1, 4))
    with pytest.raises(ConfigError, match="probe_every"):
        DecodeConfig(adaptive=True, probe_every=0)
    with pytest.raises(ConfigError, match="probe_backoff"):
        DecodeConfig(adaptive=True, probe_backoff=0)


def choose(alpha, active, plain_run, costs, forced, cfg, probe_wait=None):
    """proposers.choose_kind with the chain's estimates `alpha` and its probe clock."""
    control = list(proposers.init_control(cfg, alpha.shape[0]))
    wait = cfg.probe_every if probe_wait is None else probe_wait
    control[1] = {"alpha": alpha, "plain_run": jnp.int32(plain_run), "probe_wait": wait}
    return proposers.choose_kind(tuple(control), active, costs, forced, cfg, {})


def test_expected_tokens_and_choice():
    alpha = jnp.array([[0.9, 0.8, 0.5, 0.5, 0.5, 0.5, 0.5], [0.1] * 7])
    e = np.asarray(adaptive.expected_tokens(alpha, (1, 4, 8)))
    np.testing.assert_allclose(e[0, :2], [1.0, 1 + 0.9 + 0.72 + 0.36], rtol=1e-6)
    cfg = DecodeConfig(block_size=8, adaptive=True, probe_every=3)
    costs = jnp.array([1.0, 2.2, 3.0])
    both = jnp.array([True, True])
    # Row 0 alone would draft at 4; with row 1 (hopeless) in the batch the mean favours plain.
    only0 = jnp.array([True, False])
    assert int(choose(alpha, only0, 0, costs, -1, cfg)) == 1
    assert int(choose(alpha, both, 0, costs, -1, cfg)) == 0
    assert int(choose(alpha, both, 3, costs, -1, cfg)) == 1  # probe
    assert int(choose(alpha, both, 0, costs, 2, cfg)) == 2  # forced
    # Tried positions move toward hit/miss; untried and finished rows keep their estimates.
    new = adaptive.update_estimates(alpha, jnp.array([1, 0]), jnp.array([2, 0]), 4, 0.5)
    np.testing.assert_allclose(new[0, :4], [0.95, 0.4, 0.5, 0.5])
    np.testing.assert_allclose(new[1], alpha[1])


@pytest.mark.parametrize(
    "costs",  # slow: the other cost mixes (the first switches kinds too)
    [(1.0, 1.2, 1.4)]
    + [pytest.param(c, marks=pytest.mark.slow) for c in [(1.0, 3.0, 5.0), (1.0, 1.05, 3.0)]],
)
def test_adaptive_greedy_equals_autoregressive(costs):
    tcfg, tp, dcfg, dp = make_pair("qwen3")
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, adaptive=True, probe_every=2)
    key = jax.random.key(0)
    ar = autoregressive_decode(tp, PROMPT, LENS, key, target_config=tcfg, decode_config=cfg)
    sp = speculative_decode(
        tp, dp, PROMPT, LENS, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        step_costs=costs,
    )  # fmt: skip
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    np.testing.assert_array_equal(sp.lengths, ar.lengths)
    kinds, acc = np.asarray(sp.block_sizes), np.asarray(sp.acceptance_lengths)
    assert set(np.unique(kinds)) <= {0, 1, 4, 8}
    assert np.all(acc <= np.maximum(kinds, 1)) and np.all((kinds > 0) == (acc > 0))
    # Fixed-size mode still records its block size.
    _, fixed = run_both(tcfg, tp, dcfg, dp, DecodeConfig(max_new_tokens=24, block_size=8))
    assert set(np.unique(fixed.block_sizes)) <= {0, 8}


def _bigram_pair(chain: int, vocab: int = 32):
    """A target whose greedy next token is a function of the current one: 1 -> 2 -> ... ->
    chain -> 0 -> 0 -> ... (its layers add nothing to the residual stream), and a drafter that
    always proposes 0: every draft fails along the chain and every draft succeeds after it."""
    d = 32
    tcfg = TargetConfig("llama", vocab, d, 64, 2, 4, 2, 8, max_position_embeddings=256)
    tp = jax.tree.map(jnp.zeros_like, init_params(tcfg, jax.random.key(0)))
    tp = jax.tree.map(lambda x: x, tp)
    tp["embed_tokens"]["embedding"] = jnp.eye(vocab, d)
    tp["norm"]["scale"] = jnp.ones((d,))
    for i in range(tcfg.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tp[f"layers_{i}"][norm]["scale"] = jnp.ones((d,))
    nxt = np.zeros(vocab, np.int64)
    nxt[1:chain] = np.arange(2, chain + 1)
    head = np.zeros((d, vocab), np.float32)
    head[np.arange(vocab), nxt] = 1.0
    tp["lm_head"]["kernel"] = jnp.asarray(head)
    dcfg = DrafterConfig(32, 64, 1, 4, 2, 8, vocab, vocab - 1, (0,), 2, block_size=8)
    dp = init_drafter_params(dcfg, jax.random.key(1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])  # all-zero logits: proposes 0
    return tcfg, tp, dcfg, dp


@pytest.mark.slow
def test_probe_brings_drafting_back_once_drafts_succeed():
    tcfg, tp, dcfg, dp = _bigram_pair(chain=24)
    prompt, lens = np.array([[1]], np.int32), np.array([1], np.int32)
    cfg = DecodeConfig(
        max_new_tokens=64, block_size=8, adaptive=True, probe_every=3, adaptive_rate=0.5,
        probe_backoff=1,
    )  # fmt: skip
    key = jax.random.key(0)
    ar = autoregressive_decode(tp, prompt, lens, key, target_config=tcfg, decode_config=cfg)
    out = speculative_decode(
        tp, dp, prompt, lens, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        step_costs=(1.0, 1.5, 2.0),
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert np.asarray(ar.tokens[0, :25]).tolist() == list(range(2, 25)) + [0, 0]
    steps = int(out.num_steps[0])
    kinds = np.asarray(out.block_sizes[0, :steps])
    acc = np.asarray(out.acceptance_lengths[0, :steps])
    done = np.cumsum(acc)
    on_chain, after = done < 23, done > 30
    assert (kinds[on_chain] == 1).sum() > on_chain.sum() // 2  # mostly plain while drafts fail
    assert (kinds[on_chain] > 1).any()  # ... with probes
    assert (kinds[after] > 1).all() and (acc[after] > 1).all()  # drafting again, and accepted
    assert steps < 40  # far fewer steps than the 63 a target-only decode needs


def _exact_three_token_law(tcfg, tp, prompt):
    """p(t1, t2, t3 | prompt) from full target forwards (temperature 1)."""
    v, n = tcfg.vocab_size, len(prompt)
    model = Transformer(tcfg)

    def logp(seqs):
        pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
        logits = np.asarray(model.apply({"params": tp}, seqs, pos)[0], np.float64)
        return logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    p1 = np.exp(logp(np.array([prompt], np.int32))[0, n - 1])
    pairs = np.array([list(prompt) + [a, b] for a in range(v) for b in range(v)], np.int32)
    lp = logp(pairs)
    p2 = np.exp(lp[:, n]).reshape(v, v, v)[:, 0, :]  # p(t2 | t1): same for every t2 slot
    p3 = np.exp(lp[:, n + 1]).reshape(v, v, v)  # p(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.slow  # moved out of the default suite for its budget (2026-12-06); CI's slow step runs it
def test_adaptive_sampling_is_lossless_across_a_kind_switch():
    """Every row runs a plain step (t2) then a drafting step of block 4 (t3, by rejection
    sampling): the empirical law of (t1, t2, t3) matches the target's exact one."""
    vocab = 8
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, zero_boost=1.0, seed=4, block_size=4)
    dp["norm"]["scale"] = jnp.full_like(dp["norm"]["scale"], 0.5)
    prompt = np.array([3, 1, 4], np.int32)
    n = 30000
    # Prior 0: no draft looks worth its cost, so step 1 is plain; probe_every=1 then forces the
    # cheapest drafting kind at step 2.
    cfg = DecodeConfig(
        max_new_tokens=3, block_size=4, temperature=1.0, adaptive=True, step_kinds=(1, 4),
        adaptive_prior=0.0, probe_every=1,
    )  # fmt: skip
    out = speculative_decode(
        tp, dp, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(5),
        target_config=tcfg, drafter_config=dcfg, decode_config=cfg, step_costs=(1.0, 1.5),
    )  # fmt: skip
    kinds = np.asarray(out.block_sizes)
    assert (kinds[:, 0] == 1).all() and (kinds[:, 1] == 4).all()
    toks = np.asarray(out.tokens)
    emp = np.zeros((vocab,) * 3)
    np.add.at(emp, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    tv = 0.5 * np.abs(emp / n - _exact_three_token_law(tcfg, tp, prompt)).sum()
    # Sampling noise of the TV distance over 512 cells at n=30000 is about 0.05.
    assert tv < 0.09, tv


@pytest.mark.slow
@pytest.mark.parametrize("adaptive_mode", [False, True])
def test_streamed_tokens_are_the_output(adaptive_mode):
    """Every row's streamed tokens (the loop run a few steps at a time), in order, are exactly
    its output, and the output is the one-call jitted decode's: streaming changes nothing."""
    import types

    from dflash_jax import api

    tcfg, tp, dcfg, dp = make_pair("qwen3")
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp)
    cfg = DecodeConfig(max_new_tokens=20, block_size=8, adaptive=adaptive_mode)
    key = jax.random.key(0)
    whole = speculative_decode(
        tp, dp, PROMPT, LENS, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg
    )
    for d, reference in ((drafter, whole), (None, None)):
        stream = api.TokenStream()
        run = api.timed_decode(target, d, PROMPT, LENS, 0, cfg, on_tokens=stream, chunk_steps=3)
        if reference is not None:
            np.testing.assert_array_equal(run.output.tokens, reference.tokens)
            np.testing.assert_array_equal(
                run.output.acceptance_lengths, reference.acceptance_lengths
            )
        for row in range(PROMPT.shape[0]):
            n = int(run.output.lengths[row])
            assert stream.rows[row] == np.asarray(run.output.tokens[row, :n]).tolist()


@pytest.mark.parametrize(  # the default decode (adaptive) by default; CI runs the other
    "adaptive_mode", [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_a_step_limit_stops_the_loop_without_recompiling(adaptive_mode):
    """step_limit=k runs k loop steps: the tokens are a prefix of the whole decode's, and the
    limited and whole runs share one executable (the limit is an input)."""
    tcfg, tp, dcfg, dp = make_pair("qwen3")
    # test_adaptive_greedy_equals_autoregressive's config: its executable, compiled once.
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, adaptive=adaptive_mode, probe_every=2)
    kw = dict(target_config=tcfg, drafter_config=dcfg, decode_config=cfg)
    key = jax.random.key(0)
    from dflash_jax.decoding import speculative

    whole = speculative_decode(tp, dp, PROMPT, LENS, key, **kw)
    compiled = speculative.speculative_jit._cache_size()
    short = speculative_decode(tp, dp, PROMPT, LENS, key, step_limit=2, **kw)
    assert speculative.speculative_jit._cache_size() == compiled
    assert np.all(np.asarray(short.num_steps) <= 2) and np.any(np.asarray(short.num_steps) == 2)
    for row in range(PROMPT.shape[0]):
        n = int(short.lengths[row])
        assert n < int(whole.lengths[row])
        np.testing.assert_array_equal(short.tokens[row, :n], whole.tokens[row, :n])
    ar_short = autoregressive_decode(
        tp, PROMPT, LENS, key, target_config=tcfg, decode_config=cfg, step_limit=0
    )
    np.testing.assert_array_equal(ar_short.lengths, 1)  # the prefill's token alone
    np.testing.assert_array_equal(ar_short.tokens[:, 0], whole.tokens[:, 0])


@pytest.mark.slow  # 25 s; CI runs it
def test_calibrated_costs_are_measured_once_and_cached(monkeypatch, tmp_path):
    import types

    from dflash_jax.decoding import calibration

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    tcfg, tp, dcfg, dp = make_pair("qwen3")
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp, source="tiny")
    cfg = DecodeConfig(max_new_tokens=12, block_size=8, adaptive=True)
    costs = calibration.calibrate_step_costs(target, drafter, PROMPT, LENS, cfg)
    assert costs.shape == (3,) and np.all(costs > 0) and costs[0] >= 1.0
    calls = []
    monkeypatch.setattr(calibration, "timed_decode", lambda *a, **k: calls.append(a))
    again = calibration.calibrate_step_costs(target, drafter, PROMPT, LENS, cfg)
    np.testing.assert_allclose(again, costs, rtol=1e-3)
    assert not calls  # read from the cache
    assert (tmp_path / "step_costs.json").is_file()


def test_failed_probes_back_off_and_a_hit_resets_the_wait():
    cfg = DecodeConfig(block_size=8, adaptive=True, probe_every=3, probe_backoff=4)
    active = jnp.array([True, True])
    miss, hit = jnp.array([0, 0]), jnp.array([0, 2])
    wait = jnp.int32(3)
    waits = []
    for _ in range(4):
        wait = adaptive.next_probe_wait(wait, jnp.int32(4), miss, active, cfg)
        waits.append(int(wait))
    assert waits == [6, 12, 12, 12]  # doubled, capped at probe_every * probe_backoff
    assert int(adaptive.next_probe_wait(wait, jnp.int32(1), miss, active, cfg)) == 12  # plain
    assert int(adaptive.next_probe_wait(wait, jnp.int32(4), hit, active, cfg)) == 3
    # A finished row's count does not reset it.
    done1 = jnp.array([True, False])
    assert int(adaptive.next_probe_wait(wait, jnp.int32(4), hit, done1, cfg)) == 12
    # The choice probes only once the run of plain steps reaches the wait.
    alpha = jnp.zeros((1, 7))
    one = jnp.array([True])
    costs = jnp.array([1.0, 2.0, 3.0])
    assert int(choose(alpha, one, 11, costs, -1, cfg, jnp.int32(12))) == 0
    assert int(choose(alpha, one, 12, costs, -1, cfg, jnp.int32(12))) == 1


@pytest.mark.slow  # the back-off rule: test_failed_probes_back_off_and_a_hit_resets_the_wait
def test_hopeless_drafter_probes_less_often_with_backoff():
    tcfg, tp, dcfg, dp = _bigram_pair(chain=30)  # every draft fails on the chain
    prompt, lens = np.array([[1]], np.int32), np.array([1], np.int32)
    key = jax.random.key(0)
    probes = {}
    for backoff in (1, 4):
        cfg = DecodeConfig(
            max_new_tokens=29, block_size=8, adaptive=True, probe_every=3, probe_backoff=backoff
        )
        out = speculative_decode(
            tp, dp, prompt, lens, key, target_config=tcfg, drafter_config=dcfg,
            decode_config=cfg, step_costs=(1.0, 1.5, 2.0),
        )  # fmt: skip
        steps = int(out.num_steps[0])
        probes[backoff] = int((np.asarray(out.block_sizes[0, :steps]) > 1).sum())
    assert probes[4] < probes[1]


def test_device_lookup_proposal_equals_the_host_rule():
    """The loop's jitted copy proposer follows the host rule the benchmark's baseline uses:
    the longest earlier suffix match (latest occurrence), continued periodically."""
    from dflash_jax.decoding import lookup

    rng = np.random.default_rng(0)
    prompts, gens, plens, ngens = [], [], [], []
    for _ in range(40):
        plen, ngen = int(rng.integers(1, 12)), int(rng.integers(1, 10))
        text = rng.integers(0, 5, plen + ngen).tolist()  # a small alphabet: many matches
        prompts.append(text[:plen] + [0] * (12 - plen))
        gens.append(text[plen:] + [0] * (10 - ngen))
        plens.append(plen)
        ngens.append(ngen)
    prop, found, _ = lookup.device_proposal(
        jnp.array(prompts), jnp.array(plens), jnp.array(gens), jnp.array(ngens), 7, 3
    )
    for b in range(40):
        text = prompts[b][: plens[b]] + gens[b][: ngens[b]]
        want = lookup.proposal(text, 7, 3)
        assert bool(found[b]) == bool(want)
        if want:
            assert np.asarray(prop[b]).tolist() == want
    assert lookup.proposal([1, 2, 3, 1, 2, 3, 1], 5, 3) == [2, 3, 1, 2, 3]  # periodic
    assert lookup.proposal([4, 5, 6], 3, 3) == []


def _cycle_pair(cycle: int, vocab: int = 32):
    """`_bigram_pair`'s target, but its greedy text cycles 1 -> 2 -> ... -> cycle -> 1: a copy
    of the previous period is always right, and the drafter (always 0) is always wrong."""
    tcfg, tp, dcfg, dp = _bigram_pair(chain=2, vocab=vocab)
    d = tcfg.hidden_size
    nxt = np.zeros(vocab, np.int64)
    nxt[1:cycle] = np.arange(2, cycle + 1)
    nxt[cycle] = 1
    head = np.zeros((d, vocab), np.float32)
    head[np.arange(vocab), nxt] = 1.0
    tp["lm_head"]["kernel"] = jnp.asarray(head)
    return tcfg, tp, dcfg, dp


@pytest.mark.slow
def test_lookup_kinds_are_lossless_and_take_over_on_repeated_text():
    tcfg, tp, dcfg, dp = _cycle_pair(cycle=5)
    prompt, lens = np.array([[1]], np.int32), np.array([1], np.int32)
    key = jax.random.key(0)
    cfg = DecodeConfig(
        max_new_tokens=60, block_size=8, adaptive=True, lookup_kinds=(4, 8), probe_every=4
    )
    assert cfg.all_kinds == (1, 4, 8, -4, -8)
    ar = autoregressive_decode(tp, prompt, lens, key, target_config=tcfg, decode_config=cfg)
    out = speculative_decode(
        tp, dp, prompt, lens, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        step_costs=(1.0, 1.5, 2.0, 1.4, 1.9),
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert np.asarray(ar.tokens[0, :10]).tolist() == [2, 3, 4, 5, 1, 2, 3, 4, 5, 1]
    steps = int(out.num_steps[0])
    kinds = np.asarray(out.block_sizes[0, :steps])
    acc = np.asarray(out.acceptance_lengths[0, :steps])
    assert (kinds < 0).sum() > steps // 2 and (acc[kinds == -8] == 8).sum() >= 3
    assert steps < 25  # 59 for the target alone
    # Without lookup kinds the same controller can only fall back to plain steps.
    plain = speculative_decode(
        tp, dp, prompt, lens, key, target_config=tcfg, drafter_config=dcfg,
        decode_config=DecodeConfig(max_new_tokens=60, block_size=8, adaptive=True),
        step_costs=(1.0, 1.5, 2.0),
    )  # fmt: skip
    np.testing.assert_array_equal(plain.tokens, ar.tokens)
    assert int(plain.num_steps[0]) > 50
    with pytest.raises(ConfigError, match="lookup_kinds"):
        DecodeConfig(block_size=8, lookup_kinds=(4,))  # needs adaptive
    with pytest.raises(ConfigError, match="lookup_kinds"):
        DecodeConfig(block_size=8, adaptive=True, lookup_kinds=(16,))


def test_lookup_estimates_follow_what_any_step_committed():
    alpha = jnp.full((2, 7), 0.5)
    copy = jnp.array([[3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9]])
    new = jnp.array([[3, 4, 9, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]])
    produced, found = jnp.array([3, 1]), jnp.array([True, True])
    out = np.asarray(adaptive.update_lookup_estimates(alpha, copy, new, produced, found, 0.5))
    np.testing.assert_allclose(out[0], [0.75, 0.75, 0.25, 0.5, 0.5, 0.5, 0.5])
    # A plain step observes position 1 only; the copy matched all of it, so the positions past
    # it rise to its estimate (never fall).
    np.testing.assert_allclose(out[1], [0.75] * 7)
    none = adaptive.update_lookup_estimates(alpha, copy, new, produced, ~found, 0.5)
    np.testing.assert_allclose(np.asarray(none), np.asarray(alpha))


@pytest.mark.slow
def test_adaptive_sampling_with_copied_drafts_is_lossless():
    """Every step after the prefill is a prompt-lookup step of block 4 (a deterministic
    proposal, verified by rejection sampling): the law of (t1, t2, t3) is the target's."""
    vocab = 8
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, zero_boost=1.0, seed=4, block_size=4)
    prompt = np.array([0, 3, 7], np.int32)  # the copy's first token is right 22% of the time
    n = 30000
    cfg = DecodeConfig(
        max_new_tokens=3, block_size=4, temperature=1.0, adaptive=True, step_kinds=(1, 4),
        lookup_kinds=(4,), adaptive_prior=0.0, probe_every=100,
    )  # fmt: skip
    out = speculative_decode(
        tp, dp, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(6),
        target_config=tcfg, drafter_config=dcfg, decode_config=cfg, step_costs=(1.0, 9.0, 0.5),
    )  # fmt: skip
    kinds, acc = np.asarray(out.block_sizes), np.asarray(out.acceptance_lengths)
    assert (kinds[:, 0] == -4).all()
    assert (acc[:, 0] == 2).mean() > 0.15 and (acc[:, 0] == 1).mean() > 0.5  # both paths
    toks = np.asarray(out.tokens)
    emp = np.zeros((vocab,) * 3)
    np.add.at(emp, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    tv = 0.5 * np.abs(emp / n - _exact_three_token_law(tcfg, tp, prompt)).sum()
    assert tv < 0.09, tv


def test_decode_mode_defaults_and_overrides():
    """What `generate` and `infer.generate` decode with when the user says nothing, or part."""
    import types

    from dflash_jax import api

    drafter = types.SimpleNamespace(config=types.SimpleNamespace(block_size=16))
    cpu = jax.default_backend() == "cpu"
    assert api.decode_mode(None, drafter) == (16, cpu)  # adaptive by default on CPU only
    assert api.decode_mode(None, None) == (1, False)  # no drafter: the target alone
    assert api.decode_mode(None, None, adaptive=True) == (1, False)
    assert api.decode_mode(None, drafter, block_size=8, adaptive=False) == (8, False)
    assert api.decode_mode(None, drafter, block_size=1, adaptive=True) == (1, False)
    assert api.decode_mode(None, drafter, adaptive=True) == (16, True)


def test_reports_count_steps_and_tokens_by_proposer():
    """Every recorded kind names its proposer; the counts by proposer sum to the steps and the
    tokens they committed, and the drafted blocks' tau is theirs alone."""
    from dflash_jax.decoding.settings import kind_label

    kinds = np.array([[8, -8, -1008, 1, 1012, 0], [4, 4, -4, 1, 0, 0]])
    taus = np.array([[3, 5, 4, 1, 6, 0], [2, 1, 3, 1, 0, 0]])
    steps, tokens = proposers.by_proposer(kinds, taus)
    assert steps == {"text_copy": 2, "corpus_copy": 1, "drafted": 3, "tree": 1, "plain": 2}
    assert tokens == {"text_copy": 8, "corpus_copy": 4, "drafted": 6, "tree": 6, "plain": 2}
    assert sum(steps.values()) == (kinds != 0).sum() and sum(tokens.values()) == taus.sum()
    assert proposers.drafted_tau(kinds, taus) == 2.0
    assert [kind_label(k) for k in (-1008, -8, 1012)] == ["corpus8", "-8", "tree12"]
    assert proposers.chosen_kind(-1008) == -8 and proposers.chosen_kind(8) == 8
    np.testing.assert_array_equal(proposers.chain_drafts(kinds[0]), [7, 7, 7, 0, 0, 0])
