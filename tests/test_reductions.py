"""The CPU-friendly reductions: `argmax_last` and the logits-free greedy head `head_argmax`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops.reductions import argmax_last, head_argmax, head_argmax_applies


def test_argmax_last_matches_jnp_argmax_with_ties():
    x = jax.random.normal(jax.random.key(0), (3, 5, 1000))
    x = x.at[1, 2, 7].set(9.0).at[1, 2, 900].set(9.0)  # a tie: the first index wins
    np.testing.assert_array_equal(argmax_last(x), jnp.argmax(x, axis=-1))
    assert int(argmax_last(x)[1, 2]) == 7


def test_a_nan_row_gives_the_last_id():
    """A row holding a NaN has no maximum: argmax_last (and head_argmax) give V - 1, an id in
    range, whatever the rest of the row holds; the other rows are untouched."""
    x = jax.random.normal(jax.random.key(0), (3, 256))
    x = x.at[0, 5].set(jnp.nan).at[2].set(jnp.nan)
    got = np.asarray(jax.jit(argmax_last)(x))
    assert got[0] == got[2] == 255 and got[1] == int(jnp.argmax(x[1]))
    head_vd = jax.random.normal(jax.random.key(1), (256, 8))
    hidden = jnp.ones((2, 8)).at[0, 3].set(jnp.nan)
    got = np.asarray(head_argmax(hidden, head_vd.T, head_vd, chunk=128))
    assert got[0] == 255 and got[1] == int(jnp.argmax(hidden[1] @ head_vd.T))


@pytest.mark.parametrize("lead", [(1,), (16,), (2, 15)])
def test_head_argmax_equals_argmax_of_the_logits(lead):
    d, v = 64, 1024
    head_vd = jax.random.normal(jax.random.key(1), (v, d))
    hidden = jax.random.normal(jax.random.key(2), (*lead, d))
    want = jnp.argmax(hidden @ head_vd.T, axis=-1)
    got = jax.jit(head_argmax, static_argnames="chunk")(hidden, head_vd.T, head_vd, chunk=128)
    assert got.shape == lead and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


def test_head_argmax_ties_across_chunks_take_the_first():
    d, v = 8, 512
    head_vd = jnp.zeros((v, d)).at[300, 0].set(1.0).at[40, 0].set(1.0).at[41, 0].set(0.5)
    hidden = jnp.ones((2, d))
    got = head_argmax(hidden, head_vd.T, head_vd, chunk=128)
    np.testing.assert_array_equal(got, [40, 40])


def test_head_argmax_applies_only_with_rows_and_whole_chunks():
    rows = jnp.zeros((256, 4))
    assert not head_argmax_applies(None, 256)
    assert not head_argmax_applies(rows, 250)
    assert head_argmax_applies(rows, 256) == (jax.default_backend() == "cpu")


def test_head_argmax_is_not_the_bf16_path():
    """In bf16 the greedy head is `argmax_last` over one GEMM's logits (the faster there)."""
    assert not head_argmax_applies(jnp.zeros((256, 4), jnp.bfloat16), 256)
