"""Pallas TPU (Mosaic) kernels for the decode attentions: drafting one block and verifying.

  `block_attention`   the drafter over its context cache plus its own block (`drafter_mask`),
                      for fewer than MAX_QUERIES queries (drafting: one block of <= 16).
  `causal_attention`  the target's T < MAX_QUERIES queries over its cache (`causal_cache_mask`):
                      a short prefill.
  `appended_attention`  the same over the cache with T new rows not yet written to it
                      (verifying a block, one autoregressive step), bitwise what
                      `causal_attention` gives on the written cache: the one or two cache
                      blocks the rows fall in come as a patch (`ops.caches.patched_tiles`) read
                      in their place, so the cache is written once, after acceptance.
Longer query runs (training, long prefill) are not decode shapes: see ops/dispatch.py.

One kernel serves both. The G query heads of a kv head and the T queries are folded into the
rows of one tile, m = t*G + g ([B,K,M,H], M = T*G padded to the dtype's sublane tile), so a
program's rows share one kv head (GQA without repeating K/V). Row m (query t = m // G) sees
cache/context slot s iff lo[t] <= s < hi[t] (`context_bounds`, `causal_cache_bounds`); the
bounds enter as [B,M,128] int32 copies, one per lane, and the mask compares one lane's copy
against each block's slots. The drafter's block keys (Q <= 127, padded to one 128-key tile)
are seen under the static `block_mask` rule of their own block.

Grid (B, K / heads, C [+1]): C = ceil(S / BLOCK) cache blocks of BLOCK = 512 slots, then, for
the drafter, one step for the block keys. Each step reads `heads_per_step` KV heads at once
(the most whose [heads, BLOCK, H] key block fits BLOCK_BYTES: Qwen3-8B's 8 in two groups of 4
in bf16) and runs each head's rows against them in turn: 128-slot steps per head cost ~0.35 us
of step overhead each for 64 KB moved, so a 4k-context layer at batch 1 took 256 steps where it
now takes 16 of 1 MB each. BLOCK is fixed, never taken from the buffer's length (an AR
decode's buffer and a speculative one's differ, and the block sets the softmax's accumulation
order); the head grouping does not change any head's numbers. The block axis is sequential
("arbitrary"): an online softmax in fp32 is carried in VMEM scratch per head (running max and
sum, lane-replicated [heads,M,128], and the [heads,M,H] accumulator) and the output is written
at the last step; B and the head groups are "parallel" (megacore). Only live blocks are read:
each row's live block range [first, last] comes in by scalar prefetch (SMEM), the K/V
index_maps clamp every step into it, so a dead step repeats a live block's index (the one
before it, or the first live one) and the pipeline issues no DMA for it, and `pl.when` skips
its compute. Rows of different lengths share one batch. A partial last block (S not a multiple
of BLOCK) is read past the array's end (unspecified values on TPU): those slots are masked and
their values zeroed, so no copy of the cache is padded.

Scores and softmax in fp32, matmuls in the input dtype with fp32 accumulation. A row that sees
no key returns zeros. Forward only (decoding needs no gradient).

Interpret mode: `interpret=INTERPRET` runs the kernels on CPU through Pallas' TPU interpreter
(`pltpu.InterpretParams`, jax 0.10.2 and 0.11), which simulates HBM/VMEM, the DMAs and the
scalar prefetch, and fills the part of a partial block past the array with NaN: a kernel that
let such a slot through would return NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dflash_jax.ops.attention import (
    NEG_INF,
    block_mask,
    causal_cache_bounds,
    tree_cache_bounds,
    tree_visible,
)
from dflash_jax.ops.caches import patched_tiles

TILE = 128  # one lane width: the rows' bounds and the m/l scratch are lane-replicated [M, TILE]
# Cache slots per grid step, fixed (never from the buffer's length: an AR decode's buffer and a
# speculative one's differ, and the block sets the softmax's accumulation order).
BLOCK = 512
# One key (or value) block of a step's KV heads [heads, BLOCK, H] at most this many bytes
# (`heads_per_step`): k, v and a verify's patch, double-buffered, stay well inside the 16 MiB
# of VMEM a kernel gets by default.
BLOCK_BYTES = 512 << 10
MAX_QUERIES = TILE  # queries per call: rows = queries x G in one row tile; block keys in one tile
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16")
INTERPRET = pltpu.InterpretParams()


def block_attention(
    q_bqnh: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    blk_k: jax.Array,
    blk_v: jax.Array,
    lo_bq: jax.Array,
    hi_bq: jax.Array,
    *,
    block_size: int,
    causal: bool = False,
    window: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`ops.attention.block_attention` as a kernel, for Q < MAX_QUERIES (drafting).

    q [B,Q,N,H] (Q = blocks x block_size); ctx_k/ctx_v [B,K,S,H]; blk_k/blk_v [B,K,Q,H];
    lo/hi [B,Q] int32 from `context_bounds`. -> [B,Q,N,H] in q's dtype.
    """
    q_len = q_bqnh.shape[1]
    if q_len % block_size or blk_k.shape[2] != q_len or q_len >= MAX_QUERIES:
        raise ValueError(
            f"block attention needs Q={q_len} < {MAX_QUERIES} queries = blocks x "
            f"block_size={block_size} and as many block keys, got {blk_k.shape[2]}"
        )
    # Block keys: one tile of TILE keys; each query sees its own block under `block_mask`.
    block_q = jnp.arange(q_len) // block_size
    visible_qq = (block_q[:, None] == block_q[None, :]) & jnp.tile(
        block_mask(block_size, causal, window), (q_len // block_size,) * 2
    )
    pad = ((0, 0), (0, 0), (0, TILE - q_len), (0, 0))
    block = (jnp.pad(blk_k, pad), jnp.pad(blk_v, pad), visible_qq)
    return _attend(q_bqnh, ctx_k, ctx_v, lo_bq, hi_bq, block, interpret)


def causal_attention(
    q_btnh: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    hi_bt: jax.Array,
    *,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """The target's attention over its cache as a kernel, for T < MAX_QUERIES (verify).

    q [B,T,N,H]; k/v [B,K,S,H] (the new rows already written); hi [B,T] from
    `causal_cache_bounds` (query t sees slots s < hi[b,t]). -> [B,T,N,H] in q's dtype.
    """
    if q_btnh.shape[1] >= MAX_QUERIES:
        raise ValueError(f"causal attention takes < {MAX_QUERIES} queries, got {q_btnh.shape}")
    return _attend(q_btnh, k_bksh, v_bksh, jnp.zeros_like(hi_bt), hi_bt, None, interpret)


def appended_attention(
    q_btnh: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    cache_lengths: jax.Array,
    tree_mask: jax.Array | None = None,
    *,
    interpret: bool | pltpu.InterpretParams = False,
    steps: tuple[int, int] | None = None,
) -> jax.Array:
    """`causal_attention` over the cache with the T new rows written at cache_lengths[b] + t,
    bitwise, without writing it. q [B,T,N,H]; k/v [B,K,S,H] (the cache before the write);
    new_k/new_v [B,K,T,H]; cache_lengths [B]. -> [B,T,N,H] in q's dtype. steps: (cache slots,
    KV heads) per grid step, for timing variants (`infer.bench.device_check`; slots a multiple
    of TILE, heads dividing K); None: BLOCK and `heads_per_step`, what every decode runs.

    tree_mask [B,T,T] bool (a token tree's verify, `attention.tree_attention_mask`; T <=
    MAX_TREE): query t sees new row t' iff tree_mask[b,t,t'] (its ancestors and itself)
    instead of t' <= t. It enters as each query's ancestor bitmask (bit t' of one int32),
    tested against the new rows' slots in the blocks they fall in."""
    t = q_btnh.shape[1]
    if t >= MAX_QUERIES:
        raise ValueError(f"appended attention takes < {MAX_QUERIES} queries, got {q_btnh.shape}")
    keys = steps[0] if steps else BLOCK
    patch_k, first_b = patched_tiles(k_bksh, new_k.astype(k_bksh.dtype), cache_lengths, keys)
    patch_v, _ = patched_tiles(v_bksh, new_v.astype(v_bksh.dtype), cache_lengths, keys)
    hi_bt = causal_cache_bounds(cache_lengths, t)
    patch = (patch_k, patch_v, first_b)
    tree = None
    if tree_mask is not None:
        hi_bt, *tree = tree_cache_bounds(cache_lengths, tree_mask)
    lo_bt = jnp.zeros_like(hi_bt)
    return _attend(q_btnh, k_bksh, v_bksh, lo_bt, hi_bt, None, interpret, patch, tree, steps)


def heads_per_step(kv_heads: int, head_dim: int, dtype) -> int:
    """KV heads each grid step reads: the most that divide `kv_heads` with one key (or value)
    block of them [heads, BLOCK, H] within BLOCK_BYTES (Qwen3-8B's 8 KV heads at head dim 128:
    4 in bf16, 2 in fp32; all of a device's 1 or 2 under tensor parallelism). Each head's
    numbers are the same whatever the count: it only groups the grid's steps."""
    per_head = BLOCK * head_dim * jnp.dtype(dtype).itemsize
    fits = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and d * per_head <= BLOCK_BYTES]
    return max(fits, default=1)


def _attend(
    q_btnh, k_bksh, v_bksh, lo_bt, hi_bt, block, interpret, patch=None, tree=None, steps=None
):
    """block: None, or (blk_k, blk_v [B,K,TILE,H], visible [T,T] bool: query vs block key).
    patch: None, or (k, v [B,K,P*BLOCK,H], first [B]): cache blocks first[b] .. first[b]+P-1
    are read from the patch instead of the cache. tree: None, or (base [B,T], bits [B,T]
    int32): slot base + j (j < 32) is seen by query t only if bit j of bits[b,t] is set.
    steps: None, or (cache slots, KV heads) per grid step (`appended_attention`)."""
    b, t, n, h = q_btnh.shape
    kh, s = k_bksh.shape[1], k_bksh.shape[2]
    g = n // kh
    m = t * g
    m_pad = _round_up(m, 32 // jnp.dtype(q_btnh.dtype).itemsize)  # sublane tile: 8 fp32, 16 bf16
    keys, heads = steps or (BLOCK, heads_per_step(kh, h, k_bksh.dtype))
    if keys % TILE or kh % heads:
        raise ValueError(f"steps={steps}: slots a multiple of {TILE}, heads dividing {kh}")
    num_blocks = pl.cdiv(s, keys)

    q_bkmh = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, m, h)
    q_bkmh = jnp.pad(q_bkmh, ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))

    def per_row(x_bt):
        """Per-query bounds [B,T] -> [B,M_pad,TILE]: rows t*G .. t*G+G-1 get query t's,
        copied on every lane; padding rows the empty range [0, 0)."""
        x_bm = jnp.pad(jnp.repeat(x_bt.astype(jnp.int32), g, axis=1), ((0, 0), (0, m_pad - m)))
        return jnp.broadcast_to(x_bm[:, :, None], (b, m_pad, TILE))

    tile_first, tile_last = _live_tiles(lo_bt, hi_bt, s, keys)  # scalar prefetch, in blocks
    prefetch = [tile_first, tile_last]
    cache_block = lambda b_, k_, c, first, last, *_: (
        b_, k_, _tile_index(c, first[b_], last[b_]), 0
    )  # fmt: skip
    per_bk = lambda rows: pl.BlockSpec(
        (None, heads, rows, h), lambda b_, k_, c, *_: (b_, k_, 0, 0)
    )  # fmt: skip
    per_b = pl.BlockSpec((None, m_pad, TILE), lambda b_, k_, c, *_: (b_, 0, 0))
    in_specs = [
        per_bk(m_pad),
        pl.BlockSpec((None, heads, keys, h), cache_block),
        pl.BlockSpec((None, heads, keys, h), cache_block),
        per_b,
        per_b,
    ]
    args = [q_bkmh, k_bksh, v_bksh, per_row(lo_bt), per_row(hi_bt)]
    patch_blocks = 0
    if patch is not None:
        patch_k, patch_v, patch_first = patch
        patch_blocks = patch_k.shape[2] // keys
        # Steps outside the patch repeat its first or last block's index: no DMA for them.
        patch_block = lambda b_, k_, c, first, last, p_first: (
            b_, k_, jnp.clip(c - p_first[b_], 0, patch_blocks - 1), 0
        )  # fmt: skip
        in_specs += [pl.BlockSpec((None, heads, keys, h), patch_block)] * 2
        args += [patch_k, patch_v]
        prefetch.append(patch_first)
    if tree is not None:
        in_specs += [per_b, per_b]
        args += [per_row(tree[0]), per_row(tree[1])]
    if block is not None:
        blk_k, blk_v, visible_tt = block
        visible_mu = jnp.repeat(visible_tt.astype(jnp.int32), g, axis=0)
        visible_mu = jnp.pad(visible_mu, ((0, m_pad - m), (0, TILE - t)))
        in_specs += [per_bk(TILE), per_bk(TILE), pl.BlockSpec((m_pad, TILE), lambda *_: (0, 0))]
        args += [blk_k.astype(k_bksh.dtype), blk_v.astype(v_bksh.dtype), visible_mu]

    out_bkmh = pl.pallas_call(
        functools.partial(
            _kernel,
            scale=h**-0.5,
            num_keys=s,
            num_blocks=num_blocks,
            block_keys=keys,
            heads=heads,
            with_block=block is not None,
            patch_blocks=patch_blocks,
            with_tree=tree is not None,
        ),  # fmt: skip
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(b, kh // heads, num_blocks + (block is not None)),
            in_specs=in_specs,
            out_specs=per_bk(m_pad),
            scratch_shapes=[
                pltpu.VMEM((heads, m_pad, TILE), jnp.float32),  # running max, lane-replicated
                pltpu.VMEM((heads, m_pad, TILE), jnp.float32),  # running sum, lane-replicated
                pltpu.VMEM((heads, m_pad, h), jnp.float32),  # accumulator
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, kh, m_pad, h), q_btnh.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY)
        ),
        interpret=interpret,
        name="dflash_decode_attention",
    )(*prefetch, *args)
    out_bkmh = out_bkmh[:, :, :m]
    return out_bkmh.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def online_softmax_step(scores, visible, v, m_ref, l_ref, acc_ref) -> None:
    """Inside a kernel: one key tile or block into the running softmax of a row tile. scores
    [M,W] fp32 (scaled; W a multiple of TILE: a training kernel's tile, a decode block),
    visible [M,W] bool, v [W,H]; m_ref/l_ref [M,TILE] fp32 (running max and sum,
    lane-replicated), acc_ref [M,H] fp32. The TPU decode and training kernels both run it."""
    scores = jnp.where(visible, scores, NEG_INF)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    # where, not exp alone: a row with nothing visible yet has m_next = NEG_INF = score.
    p = jnp.where(visible, jnp.exp(scores - m_next[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _live_tiles(lo_bt, hi_bt, num_keys: int, size: int = BLOCK):
    """The cache blocks (`size` slots) each row reads: [first, last] over its queries' slot
    ranges, clipped to the cache; a row that sees no slot gets last = first - 1 (nothing is
    live; `_tile_index` stays on `first`). -> two [B] int32."""
    slot_lo = jnp.min(lo_bt, axis=1).astype(jnp.int32)
    slot_hi = jnp.minimum(jnp.max(hi_bt, axis=1), num_keys).astype(jnp.int32)
    first = jnp.minimum(slot_lo // size, pl.cdiv(num_keys, size) - 1)
    last = jnp.where(slot_hi > slot_lo, (slot_hi - 1) // size, first - 1)
    return first, last


def _tile_index(c, first, last):
    """The cache block grid step c reads: c clamped into the row's live blocks [first, last]
    (`first` when there is none). Dead steps repeat the index of the step before (or after,
    for the blocks before `first`), so the pipeline fetches each live block once and no
    other."""
    return jnp.maximum(jnp.minimum(c, last), first)


def _kernel(
    first_ref, last_ref, *refs, scale, num_keys, num_blocks, block_keys, heads, with_block,
    patch_blocks, with_tree,
):  # fmt: skip
    if patch_blocks:
        patch_first_ref, *refs = refs
    q_ref, k_ref, v_ref, lo_ref, hi_ref, *refs = refs
    if patch_blocks:
        pk_ref, pv_ref, *refs = refs
    if with_tree:
        base_ref, bits_ref, *refs = refs
    if with_block:
        bk_ref, bv_ref, bvis_ref, *refs = refs
    o_ref, m_ref, l_ref, acc_ref = refs
    b, c = pl.program_id(0), pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(i, k, v, visible):
        """KV head i of the step's `heads`: its rows' scores against k, into its softmax."""
        scores = lax.dot_general(
            q_ref[i], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        online_softmax_step(scores * scale, visible, v, m_ref.at[i], l_ref.at[i], acc_ref.at[i])

    @pl.when((c >= first_ref[b]) & (c <= last_ref[b]))
    def _cache_block():
        # The rows' bounds (lane-replicated [M,TILE]) against the block's slots.
        shape = (lo_ref.shape[0], block_keys)
        slots = c * block_keys + lax.broadcasted_iota(jnp.int32, shape, 1)
        visible = (slots >= lo_ref[...][:, :1]) & (slots < hi_ref[...][:, :1])
        if with_tree:  # a new row only where the query's ancestor bits say
            visible &= tree_visible(slots, base_ref[...][:, :1], bits_ref[...][:, :1])
        if num_keys % block_keys:  # the last block runs past the cache: unspecified values
            visible &= slots < num_keys
        if patch_blocks:  # a block the new rows fall in: the patch's copy of it
            patched = (c >= patch_first_ref[b]) & (c < patch_first_ref[b] + patch_blocks)
        for i in range(heads):
            k, v = k_ref[i], v_ref[i]
            if patch_blocks:
                k, v = lax.cond(
                    patched, lambda i=i: (pk_ref[i], pv_ref[i]), lambda k=k, v=v: (k, v)
                )
            if num_keys % block_keys:
                v_slots = c * block_keys + lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v = jnp.where(v_slots < num_keys, v, jnp.zeros_like(v))
            attend(i, k, v, visible)

    if with_block:

        @pl.when(c == num_blocks)
        def _block_keys():
            for i in range(heads):
                attend(i, bk_ref[i], bv_ref[i], bvis_ref[...] != 0)

    @pl.when(c == pl.num_programs(2) - 1)
    def _finish():
        l = l_ref[...][:, :, :1]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)
