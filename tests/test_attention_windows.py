"""The XLA attention forms the decode loop uses equal the dense reference: attending to the old
cache plus the new block (`append_attention`), cutting the cache to its live width
(`dispatch.live_window`), at window boundaries and with ragged rows, and a sliding layer's block
drafted over its window's slots only (`dispatch.window_slice`), and a prefill chunk scored in
key blocks (`blocked_append_attention`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models.target import write_rows
from dflash_jax.ops import attention as xla
from dflash_jax.ops import dispatch


def _qkv(key, b, t, n, kh, s, h=8):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, t, n, h))
    k, v = (jax.random.normal(x, (b, kh, s, h)) for x in ks[1:3])
    k_new, v_new = (jax.random.normal(x, (b, kh, t, h)) for x in ks[3:5])
    return q, k, v, k_new, v_new


@pytest.mark.parametrize(  # by default one verify of 3 rows with 3 query heads per kv head
    "t,n,kh",
    [
        pytest.param(1, 4, 2, marks=pytest.mark.slow),
        (3, 6, 2),
        pytest.param(5, 4, 4, marks=pytest.mark.slow),
    ],
)
def test_append_attention_equals_attention_over_the_written_cache(t, n, kh):
    q, k, v, k_new, v_new = _qkv(jax.random.key(t), 3, t, n, kh, 40)
    lengths = jnp.array([0, 17, 40 - t])
    written_k, written_v = write_rows(k, k_new, lengths), write_rows(v, v_new, lengths)
    want = xla.attention(q, written_k, written_v, xla.causal_cache_mask(lengths, t, 40))
    got = xla.append_attention(q, k, v, k_new, v_new, lengths)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_prefill_chunk_scores_the_cache_in_blocks_to_the_same_result(monkeypatch):
    """`cached_attention` routes a prefill chunk (`PREFILL_QUERIES` queries or more, here 4) over
    a cache longer than a key block (here 16 slots) to `blocked_append_attention` (T x block
    scores, not T x S), which equals `append_attention`: rows with an empty cache, a length on a
    block boundary and one inside the last block, shifted back to fit the buffer (40 slots);
    and with a bf16 cache (read as bits on a CPU)."""
    monkeypatch.setattr(dispatch, "PREFILL_QUERIES", 4)
    monkeypatch.setattr(xla, "PREFILL_KEY_BLOCK", 16)
    rng = np.random.default_rng(3)
    q, k, v, k_new, v_new = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in [(3, 5, 4, 8), *[(3, 2, 40, 8)] * 2, *[(3, 2, 5, 8)] * 2]
    )
    lengths = jnp.array([0, 16, 37])
    assert dispatch.prefill_blocked(q, k) and not dispatch.prefill_blocked(q[:, :3], k)

    @jax.jit
    def pairs(q, k, v, k_new, v_new, lengths):  # (got, want) pairs, one program
        bf = lambda x: x.astype(jnp.bfloat16)
        routed = dispatch.cached_attention(q, (k, v), None, (k_new, v_new), lengths, impl="xla")
        return (
            (routed, xla.append_attention(q, k, v, k_new, v_new, lengths)),
            (
                xla.blocked_append_attention(q, bf(k), bf(v), k_new, v_new, lengths),
                xla.append_attention(q, bf(k), bf(v), k_new, v_new, lengths),
            ),
        )

    for (got, want), atol in zip(pairs(q, k, v, k_new, v_new, lengths), (1e-5, 2e-2), strict=True):
        np.testing.assert_allclose(got, want, atol=atol)


def test_a_prefill_chunk_of_a_sliding_family_scores_in_blocks_to_the_same_result(monkeypatch):
    """The blocked prefill attention with the sliding families' options equals
    `append_attention`, routed there by `cached_attention`: gpt-oss's sinks and scale over a
    flat cache (a full layer) and Gemma's window and softcap over a ring of 40 slots holding
    positions up to 57 (a sliding layer's cache, rows past the ring's length)."""
    monkeypatch.setattr(dispatch, "PREFILL_QUERIES", 4)
    monkeypatch.setattr(xla, "PREFILL_KEY_BLOCK", 16)
    rng = np.random.default_rng(4)
    q, k, v, k_new, v_new = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in [(3, 5, 4, 8), *[(3, 2, 40, 8)] * 2, *[(3, 2, 5, 8)] * 2]
    )
    sinks = jnp.asarray(rng.standard_normal(4) * 2, jnp.float32)
    cases = [(jnp.array([0, 16, 35]), dict(sinks=sinks, scale=0.3)),
             (jnp.array([0, 21, 57]), dict(window=24, softcap=2.0, scale=0.5))]  # fmt: skip
    for lengths, mods in cases:
        routed = dispatch.cached_attention(
            q, (k, v), None, (k_new, v_new), lengths, impl="xla", **mods
        )
        want = xla.append_attention(q, k, v, k_new, v_new, lengths, **mods)
        np.testing.assert_allclose(routed, want, atol=1e-5, err_msg=str(mods))


@pytest.mark.slow
@pytest.mark.parametrize("longest", [1, 63, 64, 65, 200, 296])
def test_live_window_cuts_the_cache_without_changing_the_result(longest):
    s, t = 300, 4
    q, k, v, k_new, v_new = _qkv(jax.random.key(longest), 2, t, 4, 2, s)
    lengths = jnp.array([longest, longest // 2])
    cut = jax.jit(
        lambda *a: dispatch.cached_attention(
            a[0], (a[1], a[2]), (a[1], a[2]), (a[3], a[4]), a[5], impl="xla"
        )
    )
    got = cut(q, k, v, k_new, v_new, lengths)
    np.testing.assert_allclose(got, xla.append_attention(q, k, v, k_new, v_new, lengths), atol=1e-5)
    # The draft/training form: blocks over a context cache whose rows end early.
    b, nb, j = 2, 3, 4
    anchors = jnp.array([[1, 9, longest], [0, 5, longest // 2]])
    ctx_len = jnp.array([longest, longest // 2])
    qd = jax.random.normal(jax.random.key(7), (b, nb * j, 4, 8))
    blk_k, blk_v = (jax.random.normal(jax.random.key(i), (b, 2, nb * j, 8)) for i in (8, 9))
    got = dispatch.block_attention(
        qd, k, v, blk_k, blk_v, ctx_len, anchors, block_size=j, impl="xla"
    )
    want = xla.block_attention(
        qd, k, v, blk_k, blk_v, xla.context_mask(ctx_len, anchors, j, s), xla.block_mask(j)
    )
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("from_anchor", [False, True])
def test_a_windowed_block_drafts_over_its_window_alone(from_anchor):
    """One block per row (drafting) of a sliding layer, window 6 over a 40-slot cache: the
    attention over the window's slots cut from the cache equals the dense `drafter_mask` over
    the whole cache, for rows whose anchor is past, inside and at the start of the window; the
    two windows (from each query, from the anchor) differ."""
    b, s, j, window = 3, 40, 4, 6
    q, k, v, blk_k, blk_v = _qkv(jax.random.key(3), b, j, 4, 2, s)
    lengths = jnp.array([30, 5, 40])
    anchors = lengths[:, None]
    mask = xla.drafter_mask(lengths, anchors, j, s, causal=True, window=window,
                            from_anchor=from_anchor)  # fmt: skip
    dense = xla.attention(q, jnp.concatenate([k, blk_k], 2), jnp.concatenate([v, blk_v], 2), mask)
    attend = jax.jit(
        lambda *a: dispatch.block_attention(
            *a,
            lengths,
            anchors,
            block_size=j,
            causal=True,
            window=window,
            window_from_anchor=from_anchor,
            impl="xla",
        )  # fmt: skip
    )
    got = attend(q, k, v, blk_k, blk_v)
    np.testing.assert_allclose(got, dense, atol=1e-5)
    other = xla.drafter_mask(lengths, anchors, j, s, True, window, not from_anchor)
    assert not jnp.array_equal(mask, other)


def test_a_bounded_draft_context_sees_its_sinks_and_window():
    """`sinks_and_window` (2 sinks, window 6) on a full-attention layer drafting one block per
    row over a 40-slot cache equals the dense mask 'before the anchor, and among the first 2
    slots or the 6 before the anchor', for anchors far past, just past and inside the bound."""
    b, s, j = 4, 40, 4
    q, k, v, blk_k, blk_v = _qkv(jax.random.key(5), b, j, 4, 2, s)
    lengths = jnp.array([30, 9, 5, 40])
    anchors = lengths[:, None]
    ctx = xla.context_mask(lengths, anchors, j, s)
    pos = jnp.arange(s)[None, None, :]
    ctx &= (pos < 2) | (pos >= anchors[:, :, None] - 6)
    blk = jnp.ones((b, j, j), bool)
    mask = jnp.concatenate([ctx, blk], axis=-1)
    dense = xla.attention(q, jnp.concatenate([k, blk_k], 2), jnp.concatenate([v, blk_v], 2), mask)
    attend = jax.jit(
        lambda *a: dispatch.block_attention(
            *a, lengths, anchors, block_size=j, sinks_and_window=(2, 6), impl="xla"
        )
    )
    got = attend(q, k, v, blk_k, blk_v)
    np.testing.assert_allclose(got, dense, atol=1e-5)


def test_a_plan_for_a_tpu_scatters_a_bf16_cache_as_bits(monkeypatch):
    """A TPU program compiled by XLA:CPU for `infer.memory_plan` (`platform.CPU_COMPILES`)
    writes a bf16 cache as its bits, as the CPU decode does (XLA:CPU widens a bf16 scatter's
    whole buffer to f32: Qwen3-8B at 32K, 5.2 GiB of its loop program's temporaries); a TPU
    program traced to run on one keeps its bf16 scatter."""
    from dflash_jax.ops import platform

    buf = jnp.zeros((1, 2, 8, 4), jnp.bfloat16)
    new = jnp.ones((1, 2, 3, 4), jnp.bfloat16)
    # a new function each time: a traced function is cached by its inputs, not by the flags
    traced = lambda: str(jax.make_jaxpr(lambda *a: write_rows(*a))(buf, new, jnp.array([2])))
    monkeypatch.setattr(platform, "TARGET", "tpu")
    assert "bitcast_convert_type" not in traced()
    monkeypatch.setattr(platform, "CPU_COMPILES", True)
    assert "bitcast_convert_type" in traced()


def test_cache_writes_and_patches_index_every_leading_dim():
    """`write_rows` and `patched_tiles` index a [B,K,S,H] cache on B, K and S, the head dim H
    their one window: XLA:TPU then keeps the cache row-major in the decode loop, as the kernels
    read it (a (K, H) window with S indexed between had it carried S-major and transposed for
    every kernel call: 82 copies a step in Qwen3-8B's compiled v5p loop, docs/pods.md)."""
    from dflash_jax.ops.caches import patched_tiles

    buf = jnp.zeros((1, 2, 8, 4), jnp.float32)
    new, start = jnp.ones((1, 2, 3, 4), jnp.float32), jnp.array([2])
    written = jax.jit(write_rows).lower(buf, new, start).as_text()
    patch = jax.jit(lambda *a: patched_tiles(*a, 4)[0]).lower(buf, new, start).as_text()
    assert re.findall(r"update_window_dims = \[[^\]]*\]", written) == ["update_window_dims = [3]"]
    assert re.findall(r"offset_dims = \[[^\]]*\]", patch) == ["offset_dims = [3]"]
