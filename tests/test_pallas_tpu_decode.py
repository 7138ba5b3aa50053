"""The Pallas TPU decode kernels (ops/pallas_tpu_decode.py) vs the XLA reference (ops/attention.py),
in Pallas' TPU interpret mode on CPU, and the dispatch routing the decode shapes to them on a
faked "tpu" backend.

Caches hold S = 1100 slots: three 512-slot blocks (a grid step's keys), the last one partial
(the interpreter fills its tail past the array with NaN). The rows of one batch have different
live lengths: 1 (or the T queries), exactly one block, the full buffer, one in between, and
none (drafting only). Every whole block a row's mask leaves empty is filled with NaN in the
kernel's inputs (the reference gets the clean arrays): a kernel that used such a block would
return NaN. Values match to 1e-5
in fp32; bf16 is compared with the fp32 reference on the same bf16 inputs.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import assert_greedy_speculative_equals_ar

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.models.target import write_rows
from dflash_jax.ops import attention as xla
from dflash_jax.ops import dispatch, pallas_tpu_decode

S = 1100
BLOCK = pallas_tpu_decode.BLOCK
KV_HEADS = 2
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _poison_unseen_tiles(x_bksh, seen_bs):
    """NaN in every block outside [block of the first seen slot, block of the last] of each row
    (all of them when the row sees nothing)."""
    x = np.array(x_bksh.astype(jnp.float32))
    for b, seen_s in enumerate(np.asarray(seen_bs)):
        slots = np.flatnonzero(seen_s)
        tile_s = np.arange(x.shape[2]) // BLOCK
        dead = np.ones_like(tile_s, bool)
        if slots.size:
            dead = (tile_s < slots[0] // BLOCK) | (tile_s > slots[-1] // BLOCK)
        x[b, :, dead] = np.nan
    return jnp.asarray(x, x_bksh.dtype)


def _check(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize(
    "t,groups,h,dtype,heads",
    [  # one by default (suite budget), the other shapes slow: CI runs them
        pytest.param(1, 1, 64, jnp.float32, 2, marks=pytest.mark.slow),
        # One KV head per grid step (a budget of one fp32 block): guards only the head groups.
        pytest.param(16, 3, 128, jnp.float32, 1, marks=pytest.mark.slow),
        (16, 4, 64, jnp.bfloat16, 2),
    ],
)
def test_verify_kernel_matches_xla(t, groups, h, dtype, heads, monkeypatch):
    """Both KV heads in one grid step (the default budget at these shapes), or one per step."""
    budget = heads * pallas_tpu_decode.BLOCK * h * jnp.dtype(dtype).itemsize
    monkeypatch.setattr(pallas_tpu_decode, "BLOCK_BYTES", budget)
    assert pallas_tpu_decode.heads_per_step(KV_HEADS, h, dtype) == heads
    rng = np.random.default_rng(t * 10 + groups)
    b = 4
    q = _normal(rng, (b, t, KV_HEADS * groups, h), dtype)
    k, v = (_normal(rng, (b, KV_HEADS, S, h), dtype) for _ in range(2))
    # Live lengths offsets + t: t (1 when t = 1), one block, the whole buffer, in between.
    offsets = jnp.array([0, BLOCK - t, S - t, 600], jnp.int32)
    mask = xla.causal_cache_mask(offsets, t, S)
    f32 = lambda x: x.astype(jnp.float32)
    want = xla.attention(f32(q), f32(k), f32(v), mask)
    seen = mask.any(axis=1)
    kernel = jax.jit(
        lambda q, k, v, offsets: pallas_tpu_decode.causal_attention(
            q, k, v, xla.causal_cache_bounds(offsets, t), interpret=pallas_tpu_decode.INTERPRET
        )
    )
    got = kernel(q, _poison_unseen_tiles(k, seen), _poison_unseen_tiles(v, seen), offsets)
    assert got.dtype == dtype
    _check(got, want, dtype)


@pytest.mark.parametrize(
    "blocks,j,groups,h,dtype,causal,window",
    [
        # one by default (suite budget), the others slow: CI runs them
        pytest.param(1, 16, 1, 64, jnp.float32, False, None, marks=pytest.mark.slow),
        (1, 16, 3, 128, jnp.float32, True, 40),
        pytest.param(2, 8, 4, 64, jnp.bfloat16, False, 40, marks=pytest.mark.slow),
    ],
)
def test_draft_kernel_matches_xla(blocks, j, groups, h, dtype, causal, window):
    rng = np.random.default_rng(blocks * 100 + groups)
    b, q_len = 5, blocks * j
    q = _normal(rng, (b, q_len, KV_HEADS * groups, h), dtype)
    ctx_k, ctx_v = (_normal(rng, (b, KV_HEADS, S, h), dtype) for _ in range(2))
    blk_k, blk_v = (_normal(rng, (b, KV_HEADS, q_len, h), dtype) for _ in range(2))
    # Context lengths: 1, one block, the whole buffer, an anchor inside the context, none.
    lengths = jnp.array([1, BLOCK, S, 700, 0], jnp.int32)
    last = jnp.array([1, BLOCK, S, 650, 0], jnp.int32)
    anchors = jnp.stack([last // 2, last], axis=1)[:, -blocks:]
    ctx_mask = xla.context_mask(lengths, anchors, j, S, window)
    blk_mask = xla.block_mask(j, causal, window)
    f32 = lambda x: x.astype(jnp.float32)
    want = xla.block_attention(*map(f32, (q, ctx_k, ctx_v, blk_k, blk_v)), ctx_mask, blk_mask)
    seen = ctx_mask.any(axis=1)

    @jax.jit
    def kernel(q, ctx_k, ctx_v, blk_k, blk_v, lengths, anchors):
        lo, hi = xla.context_bounds(lengths, anchors, j, window)
        return pallas_tpu_decode.block_attention(
            q, ctx_k, ctx_v, blk_k, blk_v, lo, hi, block_size=j, causal=causal, window=window,
            interpret=pallas_tpu_decode.INTERPRET,
        )  # fmt: skip

    poisoned = [_poison_unseen_tiles(x, seen) for x in (ctx_k, ctx_v)]
    got = kernel(q, *poisoned, blk_k, blk_v, lengths, anchors)
    assert got.dtype == dtype
    _check(got, want, dtype)


def test_each_row_fetches_and_computes_only_its_live_tiles():
    """The schedule behind the kernels' K/V index_maps and `pl.when` (the NaN tests above cannot
    tell a skipped DMA from a skipped compute): over the grid's tile steps, a row's tile indices
    are exactly the tiles its mask touches, in order (the pipeline fetches a block only when its
    index changes), and the steps that compute are those tiles. A row that sees nothing repeats
    one index (the pipeline always fetches a block) and computes nothing."""
    t = 16
    lengths = jnp.array([1, BLOCK, S, 700, 0], jnp.int32)
    anchors = jnp.array([[1], [BLOCK], [S], [650], [0]], jnp.int32)
    offsets = jnp.array([0, BLOCK - t, S - t, 600, 0], jnp.int32)
    cases = [
        (*xla.context_bounds(lengths, anchors, t, None), xla.context_mask(lengths, anchors, t, S)),
        (*xla.context_bounds(lengths, anchors, t, 40), xla.context_mask(lengths, anchors, t, S, 40)),
        (jnp.zeros((5, t), jnp.int32), xla.causal_cache_bounds(offsets, t), xla.causal_cache_mask(offsets, t, S)),
    ]  # fmt: skip
    steps = np.arange(-(-S // BLOCK) + 1)  # the draft grid's last step is the block keys'
    for lo, hi, mask in cases:
        first, last = map(np.asarray, pallas_tpu_decode._live_tiles(lo, hi, S))
        for b, seen_s in enumerate(np.asarray(mask.any(axis=1))):
            live = sorted({int(x) for x in np.flatnonzero(seen_s) // BLOCK})
            tiles = [int(pallas_tpu_decode._tile_index(c, first[b], last[b])) for c in steps]
            assert tiles == sorted(tiles), (b, tiles)
            assert sorted(set(tiles)) == (live or [first[b]]), (b, tiles, live)
            computed = steps[(steps >= first[b]) & (steps <= last[b])]
            assert computed.tolist() == live, (b, computed, live)


def _random_tree(rng, b, t):
    """Each token's parent among the earlier ones (token 0 the root) -> tree_mask [B,T,T]."""
    parents = np.stack([[0] + [int(rng.integers(0, i)) for i in range(1, t)] for _ in range(b)])
    return xla.tree_attention_mask(jnp.asarray(parents, jnp.int32))


def test_tree_verify_kernel_matches_xla():
    """A token tree's verify through the kernel (each query's ancestors as a bitmask over the
    new rows): the XLA tree attention's values, rows whose new tokens start inside a tile,
    across a tile edge and at the buffer's end, with every tile past them poisoned."""
    rng = np.random.default_rng(5)
    b, t, groups, h, dtype = 4, 8, 3, 64, jnp.float32
    q = _normal(rng, (b, t, KV_HEADS * groups, h), dtype)
    k, v = (_normal(rng, (b, KV_HEADS, S, h), dtype) for _ in range(2))
    new_k, new_v = (_normal(rng, (b, KV_HEADS, t, h), dtype) for _ in range(2))
    lengths = jnp.array([0, BLOCK - 3, S - t, 600], jnp.int32)
    tree_mask = _random_tree(rng, b, t)
    assert not np.asarray(tree_mask == jnp.tril(jnp.ones((t, t), bool))).all()  # not a chain
    want = xla.append_attention(q, k, v, new_k, new_v, lengths, tree_mask)
    seen = jnp.arange(S)[None, :] < lengths[:, None] + t
    kernel = jax.jit(
        lambda *a: pallas_tpu_decode.appended_attention(*a, interpret=pallas_tpu_decode.INTERPRET)
    )
    poisoned = [_poison_unseen_tiles(x, seen) for x in (k, v)]
    got = kernel(q, *poisoned, new_k, new_v, lengths, tree_mask)
    _check(got, want, dtype)


def test_kernels_lower_to_mosaic_for_tpu():
    """The Pallas TPU lowering (block shapes, scalar prefetch, the body's ops) accepts the
    kernels for both head dims and dtypes, and Qwen3-8B's AR step and verify (8 KV heads, 4 per
    grid step in bf16, 512 keys a step: 16 steps a layer at 4k context where 128-key steps per
    head took 256); Mosaic's own compilation needs a TPU."""
    sd = jax.ShapeDtypeStruct
    assert pallas_tpu_decode.BLOCK >= 512
    assert pallas_tpu_decode.heads_per_step(8, 128, jnp.bfloat16) == 4
    assert pallas_tpu_decode.heads_per_step(8, 128, jnp.float32) == 2
    # AR step and verify; the verify also with the device check's timing variants' steps.
    for t, steps in ((1, None), (16, None), (16, (128, 1)), (16, (1024, 4))):
        q, cache = sd((1, t, 32, 128), jnp.bfloat16), sd((1, 8, 4096, 128), jnp.bfloat16)
        new, vec = sd((1, 8, t, 128), jnp.bfloat16), sd((1,), jnp.int32)
        fn = jax.jit(functools.partial(pallas_tpu_decode.appended_attention, steps=steps))
        text = fn.trace(q, cache, cache, new, new, vec).lower(lowering_platforms=("tpu",))
        assert text.as_text().count("tpu_custom_call") == 1
    b, t, groups = 2, 16, 4

    def verify(q, k, v, offsets):
        return pallas_tpu_decode.causal_attention(q, k, v, xla.causal_cache_bounds(offsets, t))

    def appended(q, k, v, bk, bv, lengths):
        return pallas_tpu_decode.appended_attention(q, k, v, bk, bv, lengths)

    def tree(q, k, v, bk, bv, lengths):
        parents = jnp.broadcast_to(jnp.maximum(jnp.arange(t) - 2, 0), (b, t)).astype(jnp.int32)
        tree_mask = xla.tree_attention_mask(parents)
        return pallas_tpu_decode.appended_attention(q, k, v, bk, bv, lengths, tree_mask)

    def draft(q, k, v, bk, bv, lengths, anchors):
        lo, hi = xla.context_bounds(lengths, anchors, t, 40)
        return pallas_tpu_decode.block_attention(
            q, k, v, bk, bv, lo, hi, block_size=t, causal=True, window=40
        )

    for h in pallas_tpu_decode.HEAD_DIMS:
        for dtype in (jnp.float32, jnp.bfloat16):
            q = sd((b, t, KV_HEADS * groups, h), dtype)
            cache, block = sd((b, KV_HEADS, 1000, h), dtype), sd((b, KV_HEADS, t, h), dtype)
            vec, col = sd((b,), jnp.int32), sd((b, 1), jnp.int32)
            for fn, args in (
                (verify, (q, cache, cache, vec)),
                (appended, (q, cache, cache, block, block, vec)),
                (tree, (q, cache, cache, block, block, vec)),
                (draft, (q, cache, cache, block, block, vec, col)),
            ):
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
                assert text.count("tpu_custom_call") == 1, (fn.__name__, h, dtype)


# --- dispatch on a faked TPU -----------------------------------------------------------------


@pytest.fixture
def fake_tpu(monkeypatch):
    """dispatch sees a "tpu" backend and runs the TPU kernels in interpret mode; -> the calls
    made to the decode kernels, by name."""
    monkeypatch.setattr(dispatch, "_backend", lambda: "tpu")
    monkeypatch.setattr(dispatch, "TPU_INTERPRET", pallas_tpu_decode.INTERPRET)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    calls = []
    for name in ("block_attention", "causal_attention", "appended_attention"):
        kernel = getattr(pallas_tpu_decode, name)
        spy = lambda *a, _name=name, _kernel=kernel, **kw: calls.append(_name) or _kernel(*a, **kw)
        monkeypatch.setattr(pallas_tpu_decode, name, spy)
    return calls


@pytest.mark.slow
def test_dispatch_routes_decode_shapes_to_the_tpu_kernels(fake_tpu):
    rng = np.random.default_rng(3)
    b, j, t, n, h, s = 2, 16, 4, 4, 64, 130
    dtype = jnp.float32
    cache = [_normal(rng, (b, KV_HEADS, s, h), dtype) for _ in range(2)]
    new_kv = [_normal(rng, (b, KV_HEADS, t, h), dtype) for _ in range(2)]
    lengths = jnp.array([5, s - t], jnp.int32)

    # Drafting: one block over the context cache.
    q = _normal(rng, (b, j, n, h), dtype)
    blk = [_normal(rng, (b, KV_HEADS, j, h), dtype) for _ in range(2)]
    draft = lambda impl: jax.jit(
        lambda *a: dispatch.block_attention(*a, block_size=j, window=64, impl=impl)
    )(q, *cache, *blk, lengths, lengths[:, None])
    _check(draft("pallas"), draft("xla"), dtype)
    assert fake_tpu == ["block_attention"]

    # Verifying: T new rows appended to the target cache, written or not yet; the kernel reads
    # the old cache and the new rows apart, never a cache written for it.
    q = _normal(rng, (b, t, n, h), dtype)
    written = [write_rows(c, new, lengths) for c, new in zip(cache, new_kv, strict=True)]
    verify = lambda new_cache, impl: jax.jit(
        lambda q, cache, new_cache, new_kv, lengths: dispatch.cached_attention(
            q, cache, new_cache, new_kv, lengths, impl=impl
        )
    )(q, cache, new_cache, new_kv, lengths)
    want = verify(written, "xla")
    _check(verify(None, "pallas"), want, dtype)  # a deferred write
    causal = jax.jit(lambda *a: dispatch.causal_attention(*a, impl="auto"))
    _check(causal(q, *written, lengths), want, dtype)
    _check(verify(written, "pallas"), want, dtype)
    calls = ["block_attention", "appended_attention", "causal_attention", "appended_attention"]
    assert fake_tpu == calls


def test_dispatch_keeps_long_prefill_on_xla_with_one_log_line(fake_tpu, caplog):
    rng = np.random.default_rng(4)
    t = pallas_tpu_decode.MAX_QUERIES
    q = _normal(rng, (1, t, 2, 64), jnp.float32)
    k, v = (_normal(rng, (1, 1, t, 64), jnp.float32) for _ in range(2))
    zeros = jnp.zeros((1,), jnp.int32)
    with caplog.at_level(logging.WARNING):
        got = dispatch.causal_attention(q, k, v, zeros, impl="pallas")
        dispatch.causal_attention(q, k, v, zeros, impl="pallas")
    assert fake_tpu == []
    assert len([r for r in caplog.records if "(prefill) uses xla" in r.getMessage()]) == 1
    _check(got, xla.attention(q, k, v, xla.causal_cache_mask(zeros, t, t)), jnp.float32)


def test_unsupported_head_dim_refused_under_pallas_and_logged_under_auto(fake_tpu, caplog):
    rng = np.random.default_rng(5)
    q = _normal(rng, (1, 4, 2, 32), jnp.float32)
    k, v = (_normal(rng, (1, 1, 6, 32), jnp.float32) for _ in range(2))
    offsets = jnp.array([2], jnp.int32)
    with pytest.raises(ConfigError, match="head_dim=32"):
        dispatch.causal_attention(q, k, v, offsets, impl="pallas")
    blk = [_normal(rng, (1, 1, 4, 32), jnp.float32) for _ in range(2)]
    with pytest.raises(ConfigError, match="drafter attention with head_dim=32"):
        dispatch.block_attention(
            q, k, v, *blk, offsets, offsets[:, None], block_size=4, impl="pallas"
        )
    with caplog.at_level(logging.WARNING):
        got = dispatch.causal_attention(q, k, v, offsets, impl="auto")
        dispatch.causal_attention(q, k, v, offsets, impl="auto")
    assert [r.getMessage() for r in caplog.records if "head_dim=32" in r.getMessage()] == [
        "attention_impl=auto: target attention uses xla (head_dim=32 (the Pallas TPU decode "
        f"kernels take {pallas_tpu_decode.HEAD_DIMS}))"
    ]
    assert fake_tpu == []
    want = xla.attention(q, k, v, xla.causal_cache_mask(offsets, 4, 6))
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_greedy_speculative_decode_through_the_tpu_kernels_gives_the_ar_tokens(fake_tpu):
    """The whole decode loop on a faked TPU: prefill, verify and AR steps through the verify
    kernel, drafting through the draft kernel (head_dim 64, which the kernels take); the tokens
    are the XLA autoregressive decode's."""

    def pair(impl):
        tcfg = TargetConfig(
            arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
            num_heads=2, num_kv_heads=1, head_dim=64, max_position_embeddings=256,
            attention_impl=impl,
        )  # fmt: skip
        dcfg = DrafterConfig(
            hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=64, vocab_size=64, mask_token_id=63, target_layer_ids=(0, 1),
            num_target_layers=2, block_size=4, attention_impl=impl,
        )  # fmt: skip
        return tcfg, dcfg

    tcfg, dcfg = pair("pallas")
    assert_greedy_speculative_equals_ar(tcfg, dcfg, pair("xla")[0], max_new_tokens=10)
    assert {"block_attention", "causal_attention"} <= set(fake_tpu)
