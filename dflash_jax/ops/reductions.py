"""Reductions XLA:CPU runs poorly in their stock form."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax_last(x: jax.Array) -> jax.Array:
    """argmax over the last axis (first index on ties, as `jnp.argmax`) -> int32 [...].

    Two plain reductions (the max, then the lowest index that reaches it) instead of
    `jnp.argmax`'s (value, index) pair reduction, which XLA:CPU does not vectorise: over
    15 x 49152 logits 0.47 ms instead of 1.75 ms. Rows holding NaN give index V (out of range).
    """
    max_x1 = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == max_x1, iota, x.shape[-1]), axis=-1)
