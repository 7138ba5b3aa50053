"""Writing rows into a kv-head-major cache buffer: the one scatter the target's layers and the
decode loop go through (into a flat buffer, slot = position, or a sliding layer's ring, slot =
position mod its length); and the few cache tiles new rows fall in, written apart from the cache
(`patched_tiles`), for the attention kernels that read a cache before it is written."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.ops import platform


def bits16(dtype) -> bool:
    """Whether `dtype` is a 16-bit float (bf16, f16), which XLA:CPU widens to f32 for a
    scatter, or for products, as a whole buffer."""
    return jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


# Slots of a TPU memory tile of a 16-bit cache ((16, 128): 16 slots of a head's 128 lanes):
# a decode's caches are whole tiles long (`tile_slots`).
WRITE_TILE = 16


def write_rows(
    buf_bksh: jax.Array,
    new_bkth: jax.Array,
    start_b: jax.Array,
    ring: bool = False,
    end_b: jax.Array | None = None,
) -> jax.Array:
    """Writes new[b, :, t] at buf[b, :, start[b] + t]; writes past the end are dropped, never
    clamped (dynamic_update_slice would clamp and overwrite committed slots).

    ring: buf is a ring of S slots (a sliding layer's cache, `ring_positions`): position p
    lives at slot p mod S, and only the rows whose positions fall in the last S before end[b]
    (default start[b] + T) are written, so no two rows meet in a slot (a prefill longer than
    the ring keeps its last S rows; rows at or past end[b], a right-padded prompt's padding,
    are dropped)."""
    b, k, t, s = *new_bkth.shape[:3], buf_bksh.shape[2]
    slots_bt = start_b[:, None] + jnp.arange(t)[None, :]
    if ring:
        end_b = start_b + t if end_b is None else end_b
        keep_bt = (slots_bt >= end_b[:, None] - s) & (slots_bt < end_b[:, None])
        slots_bt = jnp.where(keep_bt, jnp.mod(slots_bt, s), s)  # s: dropped
    # Every leading dim indexed, the head dim H the one update window: a TPU lays such a
    # scatter's buffer out as it is, [B,K,S,H] row-major, as the attention kernels read it. A
    # window of (K, H) with S indexed between them had XLA:TPU keep each cache S-major
    # ([B,S,K,H]) in the decode loop and transpose all of it for every kernel call, each step.
    rows_bkt = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, k, t))
    heads_bkt = jnp.broadcast_to(jnp.arange(k)[None, :, None], (b, k, t))
    slots_bkt = jnp.broadcast_to(slots_bt[:, None, :], (b, k, t))
    update_bkth = new_bkth.astype(buf_bksh.dtype)
    if platform.xla_cpu_codegen() and bits16(buf_bksh.dtype):
        # A 16-bit float cache is scattered as its bits: XLA:CPU widens a bf16 scatter's whole
        # operand to f32 and narrows it back (two converts of the full cache per layer, K and
        # V, every step: ~9 ms of a 26 ms bf16 SmolLM2 step at one row, 2026-12-04); an
        # integer scatter writes the same bits in place.
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
        out = bits(buf_bksh).at[rows_bkt, heads_bkt, slots_bkt].set(bits(update_bkth), mode="drop")
        return jax.lax.bitcast_convert_type(out, buf_bksh.dtype)
    return buf_bksh.at[rows_bkt, heads_bkt, slots_bkt].set(update_bkth, mode="drop")


def ring_positions(lengths_b: jax.Array, num_slots: int) -> jax.Array:
    """The position each slot of a ring of `num_slots` slots holds (`write_rows(ring=True)`)
    when positions < lengths[b] are written: the latest p < length with p = s mod num_slots,
    negative where none is (so, for a ring no shorter than the length, slot s holds position s
    below the length and none from it). -> [B, num_slots] int32."""
    last_b1 = lengths_b[:, None] - 1
    return (last_b1 - jnp.mod(last_b1 - jnp.arange(num_slots)[None, :], num_slots)).astype(
        jnp.int32
    )


def patched_tiles(
    buf_bksh: jax.Array, new_bkth: jax.Array, start_b: jax.Array, tile: int
) -> tuple[jax.Array, jax.Array]:
    """The `tile`-slot tiles of the cache that rows written at start[b] + t would fall in, as
    the written cache would hold them, without writing the cache: a kernel reads these in place
    of those tiles and so scores the same key tiles in the same order as on the written cache
    (the result is bitwise the same), while the cache keeps one writer, its owner.

    buf [B,K,S,H]; new [B,K,T,H]; start [B]. -> (patch [B,K,P*tile,H] holding cache slots
    first[b]*tile .. (first[b]+P)*tile with the new rows written, slots past S zero; first [B]
    int32, each row's first patched tile), P = the most tiles T rows can touch."""
    t = new_bkth.shape[2]
    num_tiles = (t + tile - 2) // tile + 1
    first_b = (start_b // tile).astype(jnp.int32)
    slots_bp = first_b[:, None] * tile + jnp.arange(num_tiles * tile)[None, :]
    # Indexed on every leading dim, as `write_rows` writes (a TPU keeps the cache row-major).
    b, k = buf_bksh.shape[:2]
    rows_b11 = jnp.arange(b)[:, None, None]
    heads_1k1 = jnp.arange(k)[None, :, None]
    patch = buf_bksh.at[rows_b11, heads_1k1, slots_bp[:, None, :]].get(mode="fill", fill_value=0)
    return write_rows(patch, new_bkth, start_b - first_b * tile), first_b


def tile_slots(cache_len: int, tile: int = WRITE_TILE) -> int:
    """`cache_len` rounded up to whole tiles of `tile` slots, as a decode allocates its caches
    (the speculative and AR loops' own; a shared prefix's cache keeps the length it fills).
    With WRITE_TILE (16), XLA:TPU lays a bf16 [B,K,S,H] buffer out row-major, as the attention
    kernels read it; with S not a multiple (Qwen3-8B's AR cache of 1024 + 256 + 2 slots) it
    took the S-major layout that needs no padding, and the compiled loop transposed every cache
    for every kernel call, each step. The slots past a row's length are masked, as before."""
    return -(-cache_len // tile) * tile
