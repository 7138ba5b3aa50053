"""Tree verification (decoding/tree.py) on tiny random models (fp32, CPU): the best-first tree,
the tree attention mask, greedy tree decoding == autoregressive token for token, and sampled
tree decoding distributed as the target (with a broken sibling rule detected); the tree as a
kind of the adaptive controller (its estimates, its choice, greedy == AR with the kinds
switching inside a row, sampling still lossless)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import LENS, PROMPT, assert_greedy_equals_ar, make_pair, run_both, two_token_tv

from dflash_jax.config import ConfigError
from dflash_jax.decoding import adaptive, autoregressive_decode, proposers, speculative_decode, tree
from dflash_jax.decoding.settings import DecodeConfig, kind_label, tree_kind
from dflash_jax.decoding.speculative import Proposal
from dflash_jax.ops import attention, dispatch
from dflash_jax.ops.invariance import RowRule


def _peaked_drafter(tp, dp, dcfg, strength):
    """The drafter made to give every slot one fixed distribution, softmax(strength * W^T w0)
    (W the target's head, w0 its column 0): its layers add nothing (o_proj and down_proj
    zeroed), so each slot's hidden is the mask token's embedding, which the final norm's scale
    turns into w0. Token 0 leads and the other tokens follow by their likeness to it, so the
    tree holds deep paths and siblings."""
    for name in dp:
        if name.startswith("layers_"):
            attn, mlp = dp[name]["self_attn"], dp[name]["mlp"]
            attn["o_proj"]["kernel"] = jnp.zeros_like(attn["o_proj"]["kernel"])
            mlp["down_proj"]["kernel"] = jnp.zeros_like(mlp["down_proj"]["kernel"])
    e = tp["embed_tokens"]["embedding"][dcfg.mask_token_id]
    e_hat = e / jnp.sqrt(jnp.mean(e**2) + dcfg.rms_norm_eps)
    dp["norm"]["scale"] = strength * tp["lm_head"]["kernel"][:, 0] / e_hat
    return dp


def test_grow_tree_takes_the_most_probable_prefixes():
    """Against brute force over every prefix of the top candidates: the tree's nodes are the
    N - 1 best-scoring prefixes, each a child of its one-shorter prefix, parents first."""
    rng = np.random.default_rng(0)
    b, g, v, n = 2, 3, 7, 9
    logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, g, v)) * 2, jnp.float32), -1)
    t = jax.tree.map(np.asarray, tree.grow_tree(jnp.array([5, 6]), logp, n))
    for row in range(b):
        lp = np.asarray(logp[row], np.float64)
        prefixes = [
            p for d in range(1, g + 1) for p in itertools.product(range(v), repeat=d)
        ]  # token tuples
        score = {p: sum(lp[i, tok] for i, tok in enumerate(p)) for p in prefixes}
        best = sorted(prefixes, key=lambda p: -score[p])[: n - 1]
        paths = {0: ()}
        for i in range(1, n):
            assert t.valid[row, i] and t.parent[row, i] < i
            paths[i] = paths[t.parent[row, i]] + (t.tokens[row, i],)
            assert len(paths[i]) == t.depth[row, i]
        assert sorted(paths[i] for i in range(1, n)) == sorted(best)
        assert t.tokens[row, 0] == 5 + row and t.depth[row, 0] == 0
    # Fewer prefixes than nodes (a top-k restricted draft: 2 tokens per depth, 6 prefixes for
    # 8 nodes): all of them are taken, the rest are invalid leaves of the root.
    keep = jnp.arange(v) < 2
    t = jax.tree.map(
        np.asarray, tree.grow_tree(jnp.array([5, 6]), jnp.where(keep, logp, -jnp.inf)[:, :2], n)
    )
    assert t.valid.sum(axis=1).tolist() == [7, 7]  # the root and 6 prefixes
    assert (t.parent[~t.valid] == 0).all() and set(t.tokens[t.valid & (t.depth > 0)]) <= {0, 1}


def test_tree_mask_and_attention():
    """tree_attention_mask marks ancestors; append_attention and the batch-invariant
    tiled_attention under it equal the dense reference over [cache ; tree]."""
    parent = jnp.array([[0, 0, 0, 1, 1, 3], [0, 0, 1, 2, 0, 4]], jnp.int32)
    mask = np.asarray(attention.tree_attention_mask(parent))
    expect = np.zeros((6, 6), bool)
    for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 1, 3, 5]]):
        expect[i, anc] = True
    np.testing.assert_array_equal(mask[0], expect)
    assert mask[1, 3].tolist() == [True, True, True, True, False, False]

    rng = np.random.default_rng(1)
    b, t, n, kh, h, s = 2, 6, 4, 2, 8, 64
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(b, kh, s, h)), jnp.float32) for _ in "kv")
    k_new, v_new = (jnp.asarray(rng.normal(size=(b, kh, t, h)), jnp.float32) for _ in "kv")
    lengths = jnp.array([9, 30], jnp.int32)
    # Dense reference: the tree written at slots length.., each query seeing cache + ancestors.
    k_all, v_all = (
        jnp.concatenate([c, x], axis=2) for c, x in ((k_cache, k_new), (v_cache, v_new))
    )
    cache_vis = jnp.arange(s)[None, None, :] < lengths[:, None, None]
    dense = jnp.concatenate([jnp.broadcast_to(cache_vis, (b, t, s)), jnp.asarray(mask)], -1)
    ref = attention.attention(q, k_all, v_all, dense)
    got = attention.append_attention(q, k_cache, v_cache, k_new, v_new, lengths, jnp.asarray(mask))
    np.testing.assert_allclose(got, ref, atol=2e-6)
    tiled = attention.tiled_attention(
        q, (k_cache, v_cache), (k_new, v_new), lengths, RowRule(1, 4), 16, tree_mask=mask
    )
    np.testing.assert_allclose(tiled, ref, atol=2e-6)


@pytest.mark.parametrize(
    "arch,nodes",
    [
        ("qwen3", 16),
        pytest.param("qwen3", 5, marks=pytest.mark.slow),
        pytest.param("llama", 12, marks=pytest.mark.slow),
    ],
)
def test_greedy_tree_equals_autoregressive(arch, nodes):
    """Rows of different lengths, each accepting its own paths (deep ones included): the tokens
    are the target's own greedy tokens, in fewer steps than a chain of the same block."""
    tcfg, tp, dcfg, dp = make_pair(arch)
    dp = _peaked_drafter(tp, dp, dcfg, 0.03)
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, tree_nodes=nodes)
    ar, sp = assert_greedy_equals_ar(tcfg, tp, dcfg, dp, cfg)
    acc = sp.acceptance_lengths
    assert acc.max() >= 3 and (acc[acc > 0] == 1).any()
    np.testing.assert_array_equal(1 + acc.sum(axis=1), sp.lengths)
    assert set(np.unique(sp.block_sizes)) == {0, tree_kind(nodes)}  # every step a tree


@pytest.mark.slow
def test_tree_takes_fewer_steps_than_chain():
    tcfg, tp, dcfg, dp = make_pair()
    dp = _peaked_drafter(tp, dp, dcfg, 0.03)
    cfg = DecodeConfig(max_new_tokens=24, block_size=8)
    ar, chain = run_both(tcfg, tp, dcfg, dp, cfg)
    _, sp = run_both(tcfg, tp, dcfg, dp, DecodeConfig(**{**cfg.__dict__, "tree_nodes": 16}))
    np.testing.assert_array_equal(chain.tokens, ar.tokens)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    assert sp.num_steps.sum() < chain.num_steps.sum()


@pytest.mark.slow
def test_greedy_tree_with_stop_and_cap():
    """A stop token inside an accepted path, and rows capped by max_new_tokens, as a chain."""
    tcfg, tp, dcfg, dp = make_pair()
    dp = _peaked_drafter(tp, dp, dcfg, 0.03)
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, tree_nodes=10)
    ar, sp = run_both(tcfg, tp, dcfg, dp, cfg)
    stop = int(ar.tokens[0, 5])  # the first row stops at or before its sixth token
    cfg = DecodeConfig(**{**cfg.__dict__, "stop_token_ids": (stop,)})
    ar, sp = assert_greedy_equals_ar(tcfg, tp, dcfg, dp, cfg)
    assert sp.lengths[0] <= 6 and sp.tokens[0, sp.lengths[0] - 1] == stop


@pytest.mark.parametrize("broken", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.slow  # moved out of the default suite for its budget (2026-12-06); CI's slow step runs it
def test_sampled_tree_is_lossless(broken, monkeypatch):
    """The joint law of the first two generated tokens (the second from the tree's sibling
    walk: 11 candidates of a 12-token vocabulary) matches the target's exact law; a sibling
    rule that forgets the rejected siblings' mass (accepting x with p(x), not p(x) / (1 - p of
    the siblings before it)) is detected."""
    vocab, temperature = 12, 2.0
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, zero_boost=1.0, seed=4)
    dp["norm"]["scale"] = jnp.full_like(dp["norm"]["scale"], 0.5)
    if broken:
        monkeypatch.setattr(tree, "sibling_accepts", lambda u, p, p_before: u < p)
    jax.clear_caches()
    prompt, n = np.array([3, 1, 4], np.int32), 6000
    cfg = DecodeConfig(max_new_tokens=2, block_size=2, temperature=temperature, tree_nodes=12)
    out = speculative_decode(
        tp,
        dp,
        np.tile(prompt, (n, 1)),
        np.full((n,), 3, np.int32),
        jax.random.key(11),
        target_config=tcfg,
        drafter_config=dcfg,
        decode_config=cfg,
    )
    jax.clear_caches()
    tv = two_token_tv(tcfg, tp, prompt, temperature, out.tokens)
    # Sampling noise of the TV distance here is about 0.03; the broken rule gives ~0.25.
    if broken:
        assert tv > 0.15, tv
    else:
        assert tv < 0.08, tv


def test_tree_config_is_checked():
    with pytest.raises(ConfigError, match="tree_nodes"):
        DecodeConfig(tree_nodes=1)
    with pytest.raises(ConfigError, match="tree_nodes"):
        DecodeConfig(tree_nodes=8, block_size=1)
    assert DecodeConfig(tree_nodes=0) == DecodeConfig()
    # Adaptive: the tree is one more kind, last, beside every chain and copy.
    cfg = DecodeConfig(block_size=8, adaptive=True, lookup_kinds=(8,), tree_nodes=12)
    assert cfg.all_kinds == (1, 4, 8, -8, tree_kind(12))
    assert [kind_label(k) for k in cfg.all_kinds] == ["1", "4", "8", "-8", "tree12"]
    assert DecodeConfig(block_size=8, tree_nodes=12).all_kinds == ()  # fixed mode: no kinds


def test_controller_values_and_learns_the_tree_kind():
    """The tree's expected tokens over the depths it reaches, floored by the chain's estimates
    in greedy decoding only; it is chosen by value per cost; a tree step moves the tree's
    estimates (tried depths only) and not the chain's, a chain step the reverse."""
    cfg = DecodeConfig(block_size=8, adaptive=True, step_kinds=(1, 8), tree_nodes=4)
    assert adaptive.tree_reach(cfg) == 3  # 3 drafted nodes: at most depth 3
    alpha = jnp.full((1, 7), 0.9)
    tree_alpha = jnp.full((1, 7), 0.5)
    e = float(adaptive.tree_expected_tokens(tree_alpha, alpha, cfg)[0])
    np.testing.assert_allclose(e, 1 + 0.9 + 0.81 + 0.729, rtol=1e-6)  # the chain's floor
    sampled = DecodeConfig(**{**cfg.__dict__, "temperature": 1.0})
    e = float(adaptive.tree_expected_tokens(tree_alpha, alpha, sampled)[0])
    np.testing.assert_allclose(e, 1 + 0.5 + 0.25 + 0.125, rtol=1e-6)  # its own only
    one = jnp.array([True])

    # chain 8: E = 5.70; tree: E = 3.44 -> the tree wins only where the chain costs > 1.66x it.
    def control(chain, tree_bg):  # the chain's and the tree's estimates in the loop state
        c = list(proposers.init_control(cfg, 1))
        c[1], c[3] = {**c[1], "alpha": chain}, {"alpha": tree_bg}
        return tuple(c)

    choose = lambda costs, c=None: int(proposers.choose_kind(
        c or control(alpha, tree_alpha), one, jnp.array(costs), -1, cfg, {}
    ))  # fmt: skip
    assert choose([1.0, 1.5, 1.0]) == 1 and choose([1.0, 1.8, 1.0]) == 2
    assert choose([1.0, 3.0, 5.0]) == 1
    low = jnp.full((1, 7), 0.1)
    assert choose([1.0, 1.5, 1.5], control(low, low)) == 0
    step = lambda kind, a: Proposal(
        new=None, accepted=jnp.array([a]), kind=jnp.int32(kind), k=(), v=(), ctx_k=(), ctx_v=()
    )
    learn = lambda kind, a, produced: proposers.learn(
        control(alpha, tree_alpha), step(kind, a), jnp.array([produced]), one, {}, cfg
    )
    after = learn(tree_kind(4), 2, 3)
    np.testing.assert_array_equal(after[1]["alpha"], alpha)
    r = cfg.adaptive_rate
    hit, miss = 0.5 + r * 0.5, 0.5 - r * 0.5
    np.testing.assert_allclose(after[3]["alpha"][0], [hit, hit, miss, 0.5, 0.5, 0.5, 0.5])
    assert int(after[1]["plain_run"]) == 0  # a tree step is a drafting step for the probe clock
    after = learn(8, 1, 2)
    np.testing.assert_array_equal(after[3]["alpha"], tree_alpha)
    assert float(after[1]["alpha"][0, 0]) > 0.9 and float(after[1]["alpha"][0, 1]) < 0.9
    # Default costs: a tree of N is costed as the chain of N rows it verifies.
    costs = adaptive.default_step_costs((1, 8, tree_kind(12)), platform="cpu")
    np.testing.assert_allclose(costs, [1.0, 1.84, 2.32], rtol=1e-6)


@pytest.mark.slow  # adaptive x tree: each is checked alone by default
def test_adaptive_tree_greedy_equals_autoregressive():
    """Adaptive with a tree kind, rows of different lengths: the tokens are the target's own
    greedy ones whatever the costs, and the costs decide what runs. A cheap tree is taken at
    every step; an expensive one never; at equal costs the kinds alternate inside a row (the
    chain's estimates fall below the untried tree's, then the tree's own take over). One
    compiled loop: the costs are an input."""
    tcfg, tp, dcfg, dp = make_pair()
    dp = _peaked_drafter(tp, dp, dcfg, 0.03)
    cfg = DecodeConfig(
        max_new_tokens=24, block_size=8, adaptive=True, step_kinds=(1, 8), tree_nodes=12
    )
    tree_k = tree_kind(12)
    key = jax.random.key(0)
    ar = autoregressive_decode(tp, PROMPT, LENS, key, target_config=tcfg, decode_config=cfg)
    ar = jax.tree.map(np.asarray, ar)
    runs = {}
    for name, costs in [("cheap", (1.0, 3.0, 1.2)), ("dear", (1.0, 1.2, 50.0)),
                        ("equal", (1.0, 1.2, 1.2))]:  # fmt: skip
        sp = speculative_decode(
            tp, dp, PROMPT, LENS, key, target_config=tcfg, drafter_config=dcfg,
            decode_config=cfg, step_costs=costs,
        )  # fmt: skip
        sp = runs[name] = jax.tree.map(np.asarray, sp)
        np.testing.assert_array_equal(sp.tokens, ar.tokens, err_msg=name)
        np.testing.assert_array_equal(sp.lengths, ar.lengths, err_msg=name)
        np.testing.assert_array_equal(1 + sp.acceptance_lengths.sum(axis=1), sp.lengths)
        assert set(np.unique(sp.block_sizes)) <= {0, 1, 8, tree_k}
    ran = lambda sp: [sp.block_sizes[r, : sp.num_steps[r]] for r in range(len(LENS))]
    assert all((kinds == tree_k).all() for kinds in ran(runs["cheap"]))
    assert runs["cheap"].acceptance_lengths.max() >= 3  # deep paths accepted
    assert not any((kinds == tree_k).any() for kinds in ran(runs["dear"]))
    assert all({8, tree_k} <= set(kinds.tolist()) for kinds in ran(runs["equal"]))
    # The tree's extra candidates pay: a row needs fewer steps than with the chain alone.
    assert runs["cheap"].num_steps.sum() < runs["dear"].num_steps.sum()


@pytest.mark.slow
def test_calibration_times_the_tree_kind(monkeypatch, tmp_path):
    """The calibration times every kind, the tree's included: its forced index runs tree steps
    (and only them), and its cost is cached under a key that names the tree's size."""
    import dataclasses
    import types

    from dflash_jax.decoding import calibration

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    tcfg, tp, dcfg, dp = make_pair()
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp, source="tiny")
    cfg = DecodeConfig(
        max_new_tokens=12, block_size=8, adaptive=True, step_kinds=(1, 8), tree_nodes=12
    )
    runs, real = [], calibration.timed_decode

    def spy(*args, **kwargs):
        run = real(*args, **kwargs)
        runs.append((kwargs.get("forced_kind"), np.asarray(run.output.block_sizes)))
        return run

    monkeypatch.setattr(calibration, "timed_decode", spy)
    costs = calibration.calibrate_step_costs(target, drafter, PROMPT, LENS, cfg, repeats=1, steps=4)
    assert costs.shape == (3,) and np.all(costs > 0)
    tree_runs = [kinds for forced, kinds in runs if forced == 2]
    assert tree_runs
    for kinds in tree_runs:
        assert set(np.unique(kinds)) == {0, tree_kind(12)}
    key = lambda c: calibration.calibration_key(target, drafter, PROMPT.shape, c)
    assert key(cfg) != key(dataclasses.replace(cfg, tree_nodes=16))


@pytest.mark.slow
def test_adaptive_sampling_through_a_tree_step_is_lossless():
    """Sampled, adaptive, the tree the cheapest kind: the second token comes from the tree's
    sibling walk inside the adaptive loop, and the joint law of the first two tokens matches
    the target's exact one."""
    vocab, temperature = 12, 2.0
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, zero_boost=1.0, seed=4)
    dp["norm"]["scale"] = jnp.full_like(dp["norm"]["scale"], 0.5)
    prompt, n = np.array([3, 1, 4], np.int32), 6000
    cfg = DecodeConfig(
        max_new_tokens=2, block_size=2, temperature=temperature, adaptive=True,
        step_kinds=(1, 2), tree_nodes=12,
    )  # fmt: skip
    out = speculative_decode(
        tp, dp, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(11),
        target_config=tcfg, drafter_config=dcfg, decode_config=cfg, step_costs=(5.0, 5.0, 1.0),
    )  # fmt: skip
    jax.clear_caches()
    assert (np.asarray(out.block_sizes)[:, 0] == tree_kind(12)).all()
    tv = two_token_tv(tcfg, tp, prompt, temperature, out.tokens)
    assert tv < 0.08, tv  # sampling noise ~0.03 (test_sampled_tree_is_lossless)


def test_a_tree_verify_runs_the_kernel_and_is_refused_under_invariance():
    """Through the dispatch a tree verify runs the target's attention kernel (here the GPU
    kernels in interpret mode) with its ancestor bits: XLA's tree values. Under a row rule,
    where the AR step and chains run that kernel too, it is refused, naming the ways out: the
    kernel reads a node's ancestors where the tree holds them, not at the depths the AR step
    reads them, so it would round apart from the AR step."""
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, cache, new = normal(1, 4, 4, 64), normal(1, 2, 64, 64), normal(1, 2, 4, 64)
    mask = attention.tree_attention_mask(jnp.array([[0, 0, 0, 1]], jnp.int32))
    lengths = jnp.array([8], jnp.int32)
    args = (q, (cache, cache), None, (new, new), lengths)
    with pytest.raises(ConfigError, match="attention_impl=xla"):
        dispatch.cached_attention(*args, impl="pallas", rows=RowRule(2, 32), tree_mask=mask)
    got = dispatch.cached_attention(*args, impl="pallas", tree_mask=mask)
    want = attention.append_attention(q, cache, cache, new, new, lengths, mask)
    np.testing.assert_allclose(got, want, atol=1e-5)
