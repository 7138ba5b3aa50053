"""Writing rows into a kv-head-major cache buffer: the one scatter the target's layers, the
decode loop and the attention kernels' deferred writes all go through."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_rows(buf_bksh: jax.Array, new_bkth: jax.Array, start_b: jax.Array) -> jax.Array:
    """Writes new[b, :, t] at buf[b, :, start[b] + t]; writes past the end are dropped, never
    clamped (dynamic_update_slice would clamp and overwrite committed slots)."""
    b, t = new_bkth.shape[0], new_bkth.shape[2]
    slots_bt = start_b[:, None] + jnp.arange(t)[None, :]
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    # Advanced indices split by a slice put their dims first: the update is [B,T,K,H].
    update_btkh = jnp.swapaxes(new_bkth, 1, 2).astype(buf_bksh.dtype)
    return buf_bksh.at[rows_bt, :, slots_bt].set(update_btkh, mode="drop")
