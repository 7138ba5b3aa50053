"""Pallas kernels for the DFlash attentions on GPU, lowered through Triton.

Lowering: Triton (`jax.experimental.pallas.triton`), not Mosaic GPU. The pinned jax 0.10.2 and
0.11.x both ship the Pallas Triton backend (0.11 deprecates it, without removing it), and it
compiles for H200 (sm_90; Triton emits wgmma there). These kernels are plain `pallas_call`s
over BlockSpecs with jnp math, so the same body runs in interpret mode on CPU (the tests) and
lowers to Triton IR without a GPU (tests/test_kernels.py cross-lowers it for "cuda"). A Mosaic
GPU kernel (`plgpu.kernel`, warpgroup wgmma, explicit SMEM pipelines and barriers) is a
different program whose tile and layout constraints cannot be checked on this CPU; porting to
it is the follow-up once these kernels have GPU timings (dflash-spec §12.5).

One forward kernel serves every mask. Queries are folded with the G query heads of their kv
head into one row axis, m = t*G + g ([B,K,M,H], M = T*G): a program's rows share one kv head
(GQA without repeating K/V), and 16 decode queries x G heads still fill an MMA tile. Row m
(query t = m // G) sees
  context/cache slot s  iff lo[t] <= s < hi[t]                 (ops.attention.context_bounds,
                                                                causal_cache_bounds)
  block key u           iff u // J == t // J and, inside the block, the `block_mask` rule
                        (bidirectional; causal: u <= t; window: |t - u| < w).
Each program loops only over the key tiles its rows' ranges touch, so tiles the mask leaves
empty (context past the anchors, cache slots past a row's live length, other blocks) are never
read; with sorted anchors that is all of them. Softmax is online in fp32; matmuls take the
input dtype with fp32 accumulation. A row that sees no key returns zeros.

Splitting the context (flash-decoding): `splits` programs share one row tile's keys and their
partial results are merged by log-sum-exp. Split p takes the key tiles c = p (mod splits) of the
rows' live range, so each split gets ceil(live tiles / splits) whatever the buffer size (a
4096-slot cache with 1000 live slots keeps all its splits busy), and the tile -> split map is
fixed by the buffer alone. Contiguous shares of [lo, hi) would move their edges with the live
length, and so with the pass: a position's result would differ between an AR step and a verify.
Every decode pass over the target's cache (`appended_attention`: an AR step, a verify, a tree)
takes DECODE_SPLITS, whatever the buffer's length and however many row tiles (a 16-query verify
with GQA 8 has two) and rows the pass has, so that an AR decode and a speculative one, whose
buffers differ in length (prompt + new + 2 slots against prompt + new + 2 x block), reduce every
position in the same order. A prefill (`causal_attention` over the prompt's own keys, the same
shape in every decode of that prompt) and the drafter (`block_attention`) split by their keys
only while their grid is small: a long prefill's grid already fills the device, and its fp32
partial outputs would grow with the splits; training never splits.

Verify and AR steps (`appended_attention`) read the target's cache before the step's new rows
are written to it: the few key tiles those rows fall in come as a separate patch (the tiles as
the written cache would hold them, `ops.caches.patched_tiles`) that the context loop reads in
their place. The key tiles and their order are those of `causal_attention` on the written
cache, so a position's result is bitwise the same in an AR step, a verify or a prefill, and the
cache is written once, after acceptance, by the decode loop.

Backward (custom_vjp): delta = rowsum(dO*O); dq mirrors the forward; dk/dv run one program per
key tile over the row tiles that can see it: for context keys a range computed from the rows'
bounds (a suffix of the row tiles when anchors are sorted), for block keys the rows of the same
blocks. Its tiles are smaller than the forward's (`backward_tiles`): a dk/dv program keeps two
fp32 [keys, H] accumulators beside its k, v, q and dO tiles, and at head dim 128 the forward's
64 x 64 would hold 64 KiB of accumulators alone, more than sm_90's 255 registers per thread
leave room for; 32 x 32 (what jax's own Pallas GPU flash attention uses for its backward) keeps
them at 32 KiB.

Pallas GPU kernels are per-device: under a multi-device mesh, call them inside `shard_map`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.ops.attention import (
    NEG_INF,
    causal_cache_bounds,
    tree_cache_bounds,
    tree_visible,
)
from dflash_jax.ops.caches import patched_tiles

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: Triton tensors; >= 16: MMA K dim
DTYPES = ("float32", "bfloat16", "float16")
MAX_SPLITS = 16
# Splits of every decode pass (`appended_attention`), fixed: see `_splits`.
DECODE_SPLITS = 16
SPLIT_TILES = 8  # a split's share of the key buffer, in key tiles, at least
# The drafter splits its context only while its grid has fewer programs than this (twice
# H200's 132 SMs): decode drafting, never training's thousands of row tiles.
MIN_PROGRAMS = 264
# Backward tiles: the dk/dv program's two fp32 [keys, H] accumulators at most this many bytes.
BACKWARD_ACCUMULATOR_BYTES = 32 << 10
# Shared memory one program (a thread block) may take on sm_90 (H100, H200): 227 KiB.
SHARED_MEMORY_BYTES = 227 << 10


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes (powers of two, >= 16 for Triton's MMA).

    rows: folded query rows (queries x G heads) per program; keys: context/cache slots per
    loop step; block_keys: block keys per loop step (and per block dk/dv program); splits:
    programs that share one row tile's context (0: chosen from the shapes, see the module
    doc); bwd_rows / bwd_keys: the backward's row tile and context key tile (0: from the head
    dim, `backward_tiles`; rows at most `rows`); num_warps/num_stages: Triton launch settings
    (num_warps 0: 4 up to head_dim 64, else 8, as jax's Pallas flash attention picks).
    count_visits: for the tile-schedule tests (`tile_visits`), not for use.
    """

    rows: int = 64
    keys: int = 64
    block_keys: int = 16
    splits: int = 0
    bwd_rows: int = 0
    bwd_keys: int = 0
    num_warps: int = 0
    num_stages: int = 2
    count_visits: bool = False

    def __post_init__(self):
        for name in ("rows", "keys", "block_keys", "bwd_rows", "bwd_keys"):
            size = getattr(self, name)
            if name.startswith("bwd") and size == 0:
                continue
            if size < 16 or size & (size - 1):
                raise ValueError(f"Tiles.{name}={size} must be a power of two >= 16")
        if not 0 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"Tiles.splits={self.splits} must be in [0, {MAX_SPLITS}]")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one call (hashable: a custom_vjp nondiff argument)."""

    groups: int  # G
    block_size: int  # J; 0 = no block keys
    num_block_keys: int  # N*J block keys (= queries) when block_size > 0
    causal: bool
    window: int | None
    scale: float
    splits: int
    tiles: Tiles
    interpret: bool
    patch_tiles: int = 0  # context key tiles read from a patch (`appended_attention`)
    tree: bool = False  # a token tree's verify: new rows seen by ancestor bits (`ancestor_bits`)


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
    interpret: bool = False,
    tiles: Tiles | None = None,
) -> jax.Array:
    """`ops.attention.block_attention` as a kernel (training and drafting).

    q [B,Q,N,H] (Q = blocks x block_size); ctx_k/ctx_v [B,K,S,H]; blk_k/blk_v [B,K,Q,H];
    lo/hi [B,Q] int32 from `context_bounds`. -> [B,Q,N,H] in q's dtype. Differentiable.
    """
    q_len = q_bqnh.shape[1]
    if q_len % block_size or blk_k.shape[2] != q_len:
        raise ValueError(
            f"block attention needs Q={q_len} queries = blocks x block_size={block_size} and "
            f"as many block keys, got {blk_k.shape[2]}"
        )
    spec = _make_spec(q_bqnh, ctx_k, block_size, q_len, causal, window, interpret, tiles)
    if spec.tiles.count_visits:
        return _fold_and_forward(q_bqnh, ctx_k, ctx_v, blk_k, blk_v, lo_bq, hi_bq, spec)[0][2]
    return _attend(q_bqnh, ctx_k, ctx_v, blk_k, blk_v, lo_bq, hi_bq, spec)


def causal_attention(
    q_btnh: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    hi_bt: jax.Array,
    *,
    interpret: bool = False,
    tiles: Tiles | None = None,
) -> jax.Array:
    """The target's attention over a cache (prefill, verify, no-cache passes) as a kernel.

    q [B,T,N,H]; k/v [B,K,S,H]; hi [B,T] from `causal_cache_bounds` (query t sees slots
    s < hi[b,t]; slots at or past it are never read). -> [B,T,N,H] in q's dtype.
    """
    spec = _make_spec(q_btnh, k_bksh, 0, 0, False, None, interpret, tiles)
    lo_bt = jnp.zeros_like(hi_bt)
    if spec.tiles.count_visits:
        return _fold_and_forward(q_btnh, k_bksh, v_bksh, None, None, lo_bt, hi_bt, spec)[0][2]
    return _attend(q_btnh, k_bksh, v_bksh, None, None, lo_bt, hi_bt, spec)


def appended_attention(
    q_btnh: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    cache_lengths: jax.Array,
    tree_mask: jax.Array | None = None,
    *,
    interpret: bool = False,
    tiles: Tiles | None = None,
) -> jax.Array:
    """`causal_attention` over the cache with the T new rows written at cache_lengths[b] + t,
    bitwise, without writing it (the rows' key tiles come as a patch, see the module doc).

    q [B,T,N,H]; k/v [B,K,S,H] (the cache before the write); new_k/new_v [B,K,T,H];
    cache_lengths [B]. -> [B,T,N,H] in q's dtype. Forward only (decoding).
    tree_mask [B,T,T] bool (a token tree's verify, `attention.tree_attention_mask`; T <=
    MAX_TREE): query t sees new row t' iff tree_mask[b,t,t'] instead of t' <= t, through each
    query's ancestor bitmask (`ancestor_bits`) tested against the new rows' slots.
    """
    t, n = q_btnh.shape[1], q_btnh.shape[2]
    kh = k_bksh.shape[1]
    spec = _make_spec(q_btnh, k_bksh, 0, 0, False, None, interpret, tiles, kind="decode")
    rows, keys = spec.tiles.rows, spec.tiles.keys
    patch_k, first_b = patched_tiles(k_bksh, new_k, cache_lengths, keys)
    patch_v, _ = patched_tiles(v_bksh, new_v, cache_lengths, keys)
    spec = dataclasses.replace(
        spec, patch_tiles=patch_k.shape[2] // keys, tree=tree_mask is not None
    )
    hi_bt = causal_cache_bounds(cache_lengths, t)
    tree = ()
    if tree_mask is not None:  # every new row in range; the bits decide which are seen
        hi_bt, *tree_bt = tree_cache_bounds(cache_lengths, tree_mask)
        tree = tuple(_fold_bounds(x, spec.groups, rows) for x in tree_bt)
    first_bt = jnp.broadcast_to(first_b[:, None] * keys, hi_bt.shape)
    patch = (_fold_bounds(first_bt, spec.groups, rows), patch_k, patch_v)
    bounds = (_fold_bounds(jnp.zeros_like(hi_bt), spec.groups, rows),)
    bounds += (_fold_bounds(hi_bt, spec.groups, rows),)
    q_bkmh = _fold_rows(q_btnh, kh, rows)
    out = _forward(q_bkmh, k_bksh, v_bksh, *bounds, None, None, spec, patch, tree)
    return out[2] if spec.tiles.count_visits else _unfold_rows(out[0], t, n)


def tile_visits(attention, *args, **kwargs) -> jax.Array:
    """The key tiles (context, patch and block tiles) each forward program of `attention`
    (`block_attention`, `causal_attention` or `appended_attention`, called with these
    arguments) runs its loop body for: [B,K,splits,row_tiles] int32. The tile-schedule test
    compares it with the tiles the masks touch: a tile that is skipped, not masked."""
    tiles = kwargs.pop("tiles", None) or Tiles()
    return attention(*args, **kwargs, tiles=dataclasses.replace(tiles, count_visits=True))


def backward_tiles(head_dim: int) -> tuple[int, int]:
    """(rows, keys) of the backward's tiles for `head_dim`: the largest power of two up to 64
    whose dk/dv accumulators (2 x keys x head_dim fp32) fit BACKWARD_ACCUMULATOR_BYTES, and as
    many rows (dq's accumulator is [rows, head_dim] fp32): 64 up to head dim 64, 32 at 128,
    16 at 256 (see the module doc)."""
    keys = 64
    while keys > 16 and 2 * keys * head_dim * 4 > BACKWARD_ACCUMULATOR_BYTES:
        keys //= 2
    return keys, keys


def shared_memory_bytes(head_dim: int, dtype, tiles: Tiles | None = None) -> int:
    """The forward program's tiles in shared memory: q [rows, H] and, in each of the context
    loop's `num_stages` pipeline buffers, k and v [keys, H] (Triton double-buffers the loop's
    loads), in `dtype`. With the default tiles: 160 KiB for bf16 at head dim 256, 160 KiB for
    fp32 at 128, 320 KiB for fp32 at 256."""
    tiles = tiles or Tiles()
    rows = tiles.rows + 2 * tiles.keys * tiles.num_stages
    return rows * head_dim * jnp.dtype(dtype).itemsize


def unfit(head_dim: int, dtype, tiles: Tiles | None = None) -> str | None:
    """Why the forward's tiles do not fit one sm_90 program's shared memory
    (`shared_memory_bytes` over SHARED_MEMORY_BYTES), with the fix; None when they fit. Only
    fp32 at head dim 256 does not: Triton would fail to compile (out of resources) on the
    device, so dispatch refuses it before (`ops.dispatch`) as it refuses a missing case."""
    need = shared_memory_bytes(head_dim, dtype, tiles)
    if need <= SHARED_MEMORY_BYTES:
        return None
    return (
        f"dtype {jnp.dtype(dtype).name} at head_dim={head_dim}: the forward's q, k and v tiles "
        f"need {need >> 10} KiB of shared memory, an sm_90 program has "
        f"{SHARED_MEMORY_BYTES >> 10} KiB; use --dtype=bfloat16 or --attention_impl=xla"
    )


def _splits(tiles: Tiles, programs: int, key_tiles: int, kind: str) -> int:
    """Programs per row tile's keys. kind "decode" (`appended_attention`: AR steps, verifies,
    trees): DECODE_SPLITS always, whatever the buffer's length or the query count, so an AR
    decode and a speculative one (whose buffers differ in length) reduce every position in the
    same order, and batch 1 fills the device (Qwen3-8B: 8 KV heads x 16 = 128 programs for
    H200's 132 SMs). "prefill" (`causal_attention` over the given tokens, the same shape in
    every decode of a prompt) and "drafter": by the live keys, while the grid of `programs`
    (batch x KV heads x row tiles) is under MIN_PROGRAMS, so a long prefill's grid is not
    multiplied (nor its fp32 partial outputs) and training never splits."""
    if tiles.splits:
        return tiles.splits
    if kind == "decode":
        return DECODE_SPLITS
    splits = min(key_tiles // SPLIT_TILES, pl.cdiv(MIN_PROGRAMS, programs))
    return max(1, min(MAX_SPLITS, splits))


def _make_spec(
    q_btnh, k_bksh, block_size, num_block_keys, causal, window, interpret, tiles, kind="prefill"
):
    b, t, n, h = q_btnh.shape
    kh, s = k_bksh.shape[1], k_bksh.shape[2]
    tiles = tiles or Tiles()
    programs = b * kh * pl.cdiv(t * (n // kh), tiles.rows)
    kind = "drafter" if block_size else kind
    splits = _splits(tiles, programs, pl.cdiv(s, tiles.keys), kind)
    bwd_rows, bwd_keys = backward_tiles(h)
    tiles = dataclasses.replace(
        tiles,
        bwd_rows=min(tiles.bwd_rows or bwd_rows, tiles.rows),
        bwd_keys=tiles.bwd_keys or bwd_keys,
        num_warps=tiles.num_warps or (4 if h <= 64 else 8),
    )
    return _Spec(
        groups=n // kh,
        block_size=block_size,
        num_block_keys=num_block_keys,
        causal=causal,
        window=window,
        scale=h**-0.5,
        splits=splits,
        tiles=tiles,
        interpret=interpret,
    )


def training_buffers(
    batch: int,
    queries: int,
    context: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype,
    tiles: Tiles | None = None,
) -> dict[str, int]:
    """Bytes of the HBM buffers `block_attention`'s forward + backward allocates between its
    kernels (inputs, outputs and gradients excluded), read off the code below: the row-folded
    q, dO and dq, the output and lse kept for the backward, delta, the per-row bounds, the dk/dv
    row-tile ranges, and key padding when the context is not a multiple of the key tile. For
    backends whose compiler does not report the kernel path's memory; their sum bounds its
    peak. "on_chip_per_program" is one program's forward working set (registers/shared
    memory: q, k and v tiles, fp32 accumulator and scores), not HBM."""
    tiles = tiles or Tiles()
    item = jnp.dtype(dtype).itemsize
    m_pad = _round_up(queries * (num_heads // kv_heads), tiles.rows)
    rows_h = batch * kv_heads * m_pad * head_dim * item
    rows_f32 = batch * kv_heads * m_pad * 4
    bwd_keys = tiles.bwd_keys or backward_tiles(head_dim)[1]  # the dk/dv programs' key tile
    key_tiles = pl.cdiv(context, bwd_keys)
    # A padded copy of k and v, and padded dk/dv, when n is not a multiple of the tile.
    pad = lambda n, tile: (
        0 if n % tile == 0 else 4 * batch * kv_heads * _round_up(n, tile) * head_dim * item
    )
    return {
        "folded_q": rows_h,
        "out_residual": rows_h,
        "lse_residual": rows_f32,
        "row_bounds": 2 * batch * m_pad * 4,
        "folded_dout": rows_h,
        "delta": rows_f32,
        "folded_dq": rows_h,
        "dkv_row_ranges": 2 * batch * key_tiles * 4,
        "key_padding": pad(context, bwd_keys) + pad(queries, tiles.block_keys),
        "on_chip_per_program": (tiles.rows + 2 * tiles.keys) * head_dim * item
        + tiles.rows * head_dim * 4
        + tiles.rows * tiles.keys * 4,
    }


# Layout: [B,T,N,H] <-> rows [B,K,M_pad,H] with m = t*G + g, padded to whole row tiles.


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _fold_rows(x_btnh: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    b, t, n, h = x_btnh.shape
    g = n // kv_heads
    x_bkmh = (
        x_btnh.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, h)
    )
    pad = _round_up(t * g, rows) - t * g
    return jnp.pad(x_bkmh, ((0, 0), (0, 0), (0, pad), (0, 0)))


def _unfold_rows(x_bkmh: jax.Array, t: int, n: int) -> jax.Array:
    b, kh, _, h = x_bkmh.shape
    g = n // kh
    return (
        x_bkmh[:, :, : t * g].reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
    )


def _fold_bounds(x_bt: jax.Array, groups: int, rows: int) -> jax.Array:
    """Per-query bounds [B,T] -> per-row [B,M_pad]; padding rows get the empty range [0,0)."""
    x_bm = jnp.repeat(x_bt.astype(jnp.int32), groups, axis=1)
    return jnp.pad(x_bm, ((0, 0), (0, _round_up(x_bm.shape[1], rows) - x_bm.shape[1])))


def _pad_keys(x_bksh: jax.Array, tile: int) -> jax.Array:
    s = x_bksh.shape[2]
    return jnp.pad(x_bksh, ((0, 0), (0, 0), (0, _round_up(s, tile) - s), (0, 0)))


# Kernel pieces (traced inside the kernels; jnp/lax only, all of it lowers to Triton).


def _cdiv(x, d: int):
    return lax.div(x + (d - 1), d)


def _mm_nt(a, b):
    """a [m,h] . b [n,h]^T -> fp32 [m,n]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mm_nn(a, b):
    """a [m,n] . b [n,h] -> fp32 [m,h]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mm_tn(a, b):
    """a [m,n]^T . b [m,h] -> fp32 [n,h]."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _load_keys(ref, start, size: int, slot_lo, slot_hi):
    """Rows [start, start+size) of a [S,H] ref, reading only slots in [slot_lo, slot_hi) (the
    rows' live range, inside the array: caches need no padding to the tile size, and dead
    slots, whatever they hold, are never read); the others read as 0."""
    slots = start + jnp.arange(size)
    valid = (slots >= slot_lo) & (slots < slot_hi)
    return plgpu.load(ref.at[pl.ds(start, size), :], mask=valid[:, None], other=0.0)


def _context_visible(lo_r, hi_r, cols_c):
    return (cols_c[None, :] >= lo_r[:, None]) & (cols_c[None, :] < hi_r[:, None])


def _block_visible(t_r, u_c, spec: _Spec):
    """Row queries t_r vs block keys u_c: same block, then `block_mask`'s in-block rule."""
    j = spec.block_size
    same_block = lax.div(t_r, j)[:, None] == lax.div(u_c, j)[None, :]
    visible = same_block & (u_c < spec.num_block_keys)[None, :]
    diff = t_r[:, None] - u_c[None, :]  # = slot difference inside a shared block
    if spec.causal:
        visible &= diff >= 0
    if spec.window is not None:
        visible &= (diff < spec.window) & (diff > -spec.window)
    return visible


def _row_queries(first_row, spec: _Spec):
    return lax.div(first_row + jnp.arange(spec.tiles.rows), spec.groups)


def _context_slots(lo_r, hi_r, num_keys: int):
    """The context slots rows with bounds lo_r/hi_r can see: [min lo, min(max hi, S)) over the
    rows that see any (padding rows' empty [0, 0) would pull the start to slot 0); [0, 0) when
    none does."""
    seen = hi_r > lo_r
    hi = jnp.minimum(jnp.max(jnp.where(seen, hi_r, 0)), num_keys)
    return jnp.minimum(jnp.min(jnp.where(seen, lo_r, num_keys)), hi), hi


def _split_loop(first, last, step, carry, split, splits: int):
    """carry = step(c, carry) over the key tiles c in [first, last) that `split` owns (c = split
    mod splits), in increasing order: ceil((last - first) / splits) trips at most."""
    if splits == 1:
        return lax.fori_loop(first, jnp.maximum(first, last), step, carry)
    start = first + lax.rem(split - lax.rem(first, splits) + splits, splits)
    trips = _cdiv(jnp.maximum(last - start, 0), splits)
    return lax.fori_loop(0, trips, lambda i, c: step(start + i * splits, c), carry)


def _counted(step, count: bool):
    """`step` on the softmax carry; with `count` (`tile_visits`) on (carry, visits), adding one
    visit per call."""
    if not count:
        return step
    return lambda c, carry: (step(c, carry[0]), carry[1] + 1)


def _block_slots(first_row, spec: _Spec):
    """The block keys of the blocks of rows [first_row, first_row + rows): [lo, hi)."""
    j = spec.block_size
    t_first = lax.div(first_row, spec.groups)
    t_last = lax.div(first_row + spec.tiles.rows - 1, spec.groups)
    key_hi = jnp.minimum((lax.div(t_last, j) + 1) * j, spec.num_block_keys)
    return lax.div(t_first, j) * j, key_hi


def _online_softmax(q, k, v, visible, scale: float, carry):
    acc, m, l = carry
    s = jnp.where(visible, _mm_nt(q, k) * scale, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # where, not exp alone: a row with nothing visible yet has m_new = NEG_INF = s.
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mm_nn(p.astype(v.dtype), v)
    return acc, m_new, l


def _probs_and_grads(q, k, v, do, lse, delta, visible, scale: float):
    """Backward of one tile: probabilities p and score gradients ds (before the scale), both
    zero wherever the mask hides a key (so nothing a hidden slot holds leaks in)."""
    p = jnp.where(visible, jnp.exp(_mm_nt(q, k) * scale - lse[:, None]), 0.0)
    ds = jnp.where(visible, p * (_mm_nt(do, v) - delta[:, None]), 0.0)
    return p, ds


def _fwd_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, *refs, spec: _Spec, num_keys: int):
    if spec.patch_tiles:
        first_ref, pk_ref, pv_ref, *refs = refs
    if spec.tree:
        base_ref, bits_ref, *refs = refs
    if spec.block_size:
        bk_ref, bv_ref, *refs = refs
    o_ref, lse_ref, *visits_ref = refs
    ti = spec.tiles
    count = ti.count_visits
    i, split = pl.program_id(2), pl.program_id(3)
    q = q_ref[...]
    lo, hi = lo_ref[...], hi_ref[...]
    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((ti.rows,), NEG_INF, jnp.float32),
        jnp.zeros((ti.rows,), jnp.float32),
    )
    carry = (carry, jnp.int32(0)) if count else carry
    loop = functools.partial(_split_loop, split=split, splits=spec.splits)
    slot_lo, slot_hi = _context_slots(lo, hi, num_keys)

    def context_step(c, carry, refs=(k_ref, v_ref), base=0):
        """Key tile c, read from `refs`, which hold the context from slot `base` on."""
        start = pl.multiple_of(c * ti.keys, ti.keys)
        local = pl.multiple_of(start - base, ti.keys)
        k = _load_keys(refs[0], local, ti.keys, slot_lo - base, slot_hi - base)
        v = _load_keys(refs[1], local, ti.keys, slot_lo - base, slot_hi - base)
        visible = _context_visible(lo, hi, start + jnp.arange(ti.keys))
        if spec.tree:  # a new row only where the row's ancestor bits say
            slots = start + jnp.arange(ti.keys)[None, :]
            visible &= tree_visible(slots, base_ref[...][:, None], bits_ref[...][:, None])
        return _online_softmax(q, k, v, visible, spec.scale, carry)

    first, last = lax.div(slot_lo, ti.keys), _cdiv(slot_hi, ti.keys)
    cache_step = _counted(context_step, count)
    if spec.patch_tiles:  # tiles [p0, p0 + patch_tiles) come from the patch, in order
        base = jnp.max(first_ref[...])
        p0 = lax.div(base, ti.keys)
        clip = lambda c: jnp.minimum(jnp.maximum(c, first), last)
        patch_step = functools.partial(context_step, refs=(pk_ref, pv_ref), base=base)
        carry = loop(first, clip(p0), cache_step, carry)
        carry = loop(clip(p0), clip(p0 + spec.patch_tiles), _counted(patch_step, count), carry)
        first = clip(p0 + spec.patch_tiles)
    carry = loop(first, last, cache_step, carry)

    if spec.block_size:
        first_row = i * ti.rows
        t_r = _row_queries(first_row, spec)
        key_lo, key_hi = _block_slots(first_row, spec)

        def block_step(u, carry):
            start = pl.multiple_of(u * ti.block_keys, ti.block_keys)
            k = _load_keys(bk_ref, start, ti.block_keys, key_lo, key_hi)
            v = _load_keys(bv_ref, start, ti.block_keys, key_lo, key_hi)
            visible = _block_visible(t_r, start + jnp.arange(ti.block_keys), spec)
            return _online_softmax(q, k, v, visible, spec.scale, carry)

        b_first, b_last = lax.div(key_lo, ti.block_keys), _cdiv(key_hi, ti.block_keys)
        # The block keys belong to the last split only.
        b_first = jnp.where(split == spec.splits - 1, b_first, b_last)
        block_loop = _counted(block_step, count)
        carry = lax.fori_loop(b_first, jnp.maximum(b_first, b_last), block_loop, carry)

    if count:
        carry, visits = carry
        visits_ref[0][...] = jnp.full((ti.rows,), visits, jnp.int32)
    acc, m, l = carry
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), NEG_INF)


def _forward(q_bkmh, k_bksh, v_bksh, lo_bm, hi_bm, blk_k, blk_v, spec: _Spec, patch=(), tree=()):
    """-> (out [B,K,M_pad,H] in q's dtype, lse [B,K,M_pad] fp32; NEG_INF for empty rows),
    and with tiles.count_visits the tiles each program visited [B,K,splits,M_pad/rows].
    patch: with spec.patch_tiles, (first patched slot [B,M_pad], patch k, patch v
    [B,K,patch_tiles*keys,H]); tree: with spec.tree, (the new rows' first slot, each row's
    ancestor bits), both [B,M_pad] int32."""
    b, kh, m_pad, h = q_bkmh.shape
    s = k_bksh.shape[2]
    ti, splits = spec.tiles, spec.splits
    whole = lambda n: pl.BlockSpec((None, None, n, h), lambda b_, k_, i, p: (b_, k_, 0, 0))
    bounds = pl.BlockSpec((None, ti.rows), lambda b_, k_, i, p: (b_, i))
    in_specs = [
        pl.BlockSpec((None, None, ti.rows, h), lambda b_, k_, i, p: (b_, k_, i, 0)),
        whole(s),
        whole(s),
        bounds,
        bounds,
    ]
    args = [q_bkmh, k_bksh, v_bksh, lo_bm, hi_bm]
    if spec.patch_tiles:
        in_specs += [bounds, whole(spec.patch_tiles * ti.keys), whole(spec.patch_tiles * ti.keys)]
        args += list(patch)
    if spec.tree:
        in_specs += [bounds, bounds]
        args += list(tree)
    if spec.block_size:
        in_specs += [whole(spec.num_block_keys)] * 2
        args += [blk_k, blk_v]
    # Several splits are merged in fp32 afterwards.
    o_dtype = q_bkmh.dtype if splits == 1 else jnp.float32
    row_vec = pl.BlockSpec((None, None, None, ti.rows), lambda b_, k_, i, p: (b_, k_, p, i))
    out_specs = [
        pl.BlockSpec((None, None, None, ti.rows, h), lambda b_, k_, i, p: (b_, k_, p, i, 0)),
        row_vec,
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, splits, m_pad, h), o_dtype),
        jax.ShapeDtypeStruct((b, kh, splits, m_pad), jnp.float32),
    ]
    if ti.count_visits:
        out_specs.append(row_vec)
        out_shape.append(jax.ShapeDtypeStruct((b, kh, splits, m_pad), jnp.int32))
    o, lse, *visits = pl.pallas_call(
        functools.partial(_fwd_kernel, spec=spec, num_keys=s),
        grid=(b, kh, m_pad // ti.rows, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=ti.num_warps, num_stages=ti.num_stages),
        interpret=spec.interpret,
        name="dflash_attention_fwd",
    )(*args)
    visits = tuple(v[..., :: ti.rows] for v in visits)  # one count per program
    if splits == 1:
        return o[:, :, 0], lse[:, :, 0], *visits
    # Merge the splits by log-sum-exp; an empty split has lse NEG_INF and zero output.
    lse_max = jnp.max(lse, axis=2, keepdims=True)
    w_bkpm = jnp.exp(lse - lse_max)
    denom_bkm = jnp.sum(w_bkpm, axis=2)
    o_bkmh = jnp.sum(o * w_bkpm[..., None], axis=2) / denom_bkm[..., None]
    return o_bkmh.astype(q_bkmh.dtype), lse_max[:, :, 0] + jnp.log(denom_bkm), *visits


def _dq_kernel(
    q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref, *refs, spec, num_keys
):
    if spec.block_size:
        bk_ref, bv_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    ti = spec.tiles
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    lo, hi = lo_ref[...], hi_ref[...]

    def step(k, v, visible, dq):
        _, ds = _probs_and_grads(q, k, v, do, lse, delta, visible, spec.scale)
        return dq + _mm_nn(ds.astype(k.dtype), k)

    slot_lo, slot_hi = _context_slots(lo, hi, num_keys)

    def context_step(c, dq):
        start = pl.multiple_of(c * ti.keys, ti.keys)
        k = _load_keys(k_ref, start, ti.keys, slot_lo, slot_hi)
        v = _load_keys(v_ref, start, ti.keys, slot_lo, slot_hi)
        return step(k, v, _context_visible(lo, hi, start + jnp.arange(ti.keys)), dq)

    first, last = lax.div(slot_lo, ti.keys), _cdiv(slot_hi, ti.keys)
    dq = lax.fori_loop(
        first, jnp.maximum(first, last), context_step, jnp.zeros(q.shape, jnp.float32)
    )

    if spec.block_size:
        first_row = pl.program_id(2) * ti.rows
        t_r = _row_queries(first_row, spec)

        key_lo, key_hi = _block_slots(first_row, spec)

        def block_step(u, dq):
            start = pl.multiple_of(u * ti.block_keys, ti.block_keys)
            k = _load_keys(bk_ref, start, ti.block_keys, key_lo, key_hi)
            v = _load_keys(bv_ref, start, ti.block_keys, key_lo, key_hi)
            return step(k, v, _block_visible(t_r, start + jnp.arange(ti.block_keys), spec), dq)

        b_first, b_last = lax.div(key_lo, ti.block_keys), _cdiv(key_hi, ti.block_keys)
        dq = lax.fori_loop(b_first, jnp.maximum(b_first, b_last), block_step, dq)
    dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref, k_ref, v_ref, *refs, spec, part):
    """dk/dv of one key tile: part "context" (row tiles from the precomputed range refs) or
    "block" (the rows of the blocks the tile holds)."""
    ti = spec.tiles
    c = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    size = k.shape[0]
    cols = c * size + jnp.arange(size)
    if part == "context":
        first_ref, last_ref, dk_ref, dv_ref = refs
        first, last = first_ref[c], last_ref[c]
    else:
        dk_ref, dv_ref = refs
        j, g = spec.block_size, spec.groups
        t_lo = lax.div(c * size, j) * j
        t_hi = jnp.minimum((lax.div(c * size + size - 1, j) + 1) * j, spec.num_block_keys)
        first, last = lax.div(t_lo * g, ti.rows), _cdiv(t_hi * g, ti.rows)

    def row_step(i, carry):
        dk, dv = carry
        r0 = pl.multiple_of(i * ti.rows, ti.rows)
        rows = pl.ds(r0, ti.rows)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows], delta_ref[rows]
        if part == "context":
            visible = _context_visible(lo_ref[rows], hi_ref[rows], cols)
        else:
            visible = _block_visible(_row_queries(r0, spec), cols, spec)
        p, ds = _probs_and_grads(q, k, v, do, lse, delta, visible, spec.scale)
        dv = dv + _mm_tn(p.astype(do.dtype), do)
        dk = dk + _mm_tn(ds.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(first, jnp.maximum(first, last), row_step, (zeros, zeros))
    dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _context_row_tiles(lo_bm, hi_bm, rows: int, keys: int, key_tiles: int):
    """For each context key tile, the range [first, last) of row tiles whose rows can see it
    (min lo / max hi per row tile against the tile's slots). -> two [B, key_tiles] int32."""
    b, m_pad = lo_bm.shape
    big = jnp.iinfo(jnp.int32).max  # rows that see nothing (padding) bound nothing
    lo_bi = jnp.min(jnp.where(hi_bm > lo_bm, lo_bm, big).reshape(b, -1, rows), axis=-1)
    hi_bi = jnp.max(hi_bm.reshape(b, -1, rows), axis=-1)
    start_c = jnp.arange(key_tiles) * keys
    hit_bic = (
        (lo_bi[:, :, None] < start_c + keys)
        & (hi_bi[:, :, None] > start_c)
        & (hi_bi > lo_bi)[:, :, None]
    )
    any_bc = jnp.any(hit_bic, axis=1)
    n = hit_bic.shape[1]
    first_bc = jnp.argmax(hit_bic, axis=1)
    last_bc = n - jnp.argmax(hit_bic[:, ::-1], axis=1)
    return (
        jnp.where(any_bc, first_bc, 0).astype(jnp.int32),
        jnp.where(any_bc, last_bc, 0).astype(jnp.int32),
    )


def _backward(spec: _Spec, res, do_btnh):
    q_bkmh, k_bksh, v_bksh, blk_k, blk_v, lo_bm, hi_bm, o_bkmh, lse_bkm = res
    b, kh, m_pad, h = q_bkmh.shape
    t, n = do_btnh.shape[1], do_btnh.shape[2]
    do_bkmh = _fold_rows(do_btnh, kh, spec.tiles.rows)  # padded as q was, to M_pad
    # The backward's own tiles (bwd_rows divides M_pad: powers of two, at most `rows`).
    ti = dataclasses.replace(spec.tiles, rows=spec.tiles.bwd_rows, keys=spec.tiles.bwd_keys)
    spec = dataclasses.replace(spec, tiles=ti)
    s = k_bksh.shape[2]
    delta_bkm = jnp.sum(o_bkmh.astype(jnp.float32) * do_bkmh.astype(jnp.float32), axis=-1)
    params = plgpu.CompilerParams(num_warps=ti.num_warps, num_stages=ti.num_stages)

    whole = lambda n_, d=h: pl.BlockSpec((None, None, n_, d), lambda b_, k_, i: (b_, k_, 0, 0))
    row_tile = pl.BlockSpec((None, None, ti.rows, h), lambda b_, k_, i: (b_, k_, i, 0))
    row_vec = pl.BlockSpec((None, None, ti.rows), lambda b_, k_, i: (b_, k_, i))
    bounds = pl.BlockSpec((None, ti.rows), lambda b_, k_, i: (b_, i))
    dq_specs = [row_tile, whole(s), whole(s), bounds, bounds, row_tile, row_vec, row_vec]
    dq_args = [q_bkmh, k_bksh, v_bksh, lo_bm, hi_bm, do_bkmh, lse_bkm, delta_bkm]
    if spec.block_size:
        dq_specs += [whole(spec.num_block_keys)] * 2
        dq_args += [blk_k, blk_v]
    dq_bkmh = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec, num_keys=s),
        grid=(b, kh, m_pad // ti.rows),
        in_specs=dq_specs,
        out_specs=row_tile,
        out_shape=jax.ShapeDtypeStruct(q_bkmh.shape, q_bkmh.dtype),
        compiler_params=params,
        interpret=spec.interpret,
        name="dflash_attention_dq",
    )(*dq_args)

    all_rows = [whole(m_pad), whole(m_pad)] + [
        pl.BlockSpec((None, None, m_pad), lambda b_, k_, i: (b_, k_, 0))
    ] * 2
    all_bounds = [pl.BlockSpec((None, m_pad), lambda b_, k_, i: (b_, 0))] * 2
    row_args = [q_bkmh, do_bkmh, lse_bkm, delta_bkm, lo_bm, hi_bm]

    def dkv(part, k_x, v_x, tile, extra_specs=(), extra_args=()):
        # dk/dv programs own whole key tiles: pad the keys (a copy only when S % tile != 0).
        k_p, v_p = _pad_keys(k_x, tile), _pad_keys(v_x, tile)
        key_tile = pl.BlockSpec((None, None, tile, h), lambda b_, k_, c: (b_, k_, c, 0))
        dk, dv = pl.pallas_call(
            functools.partial(_dkv_kernel, spec=spec, part=part),
            grid=(b, kh, k_p.shape[2] // tile),
            in_specs=[*all_rows, *all_bounds, key_tile, key_tile, *extra_specs],
            out_specs=[key_tile, key_tile],
            out_shape=[
                jax.ShapeDtypeStruct(k_p.shape, k_x.dtype),
                jax.ShapeDtypeStruct(v_p.shape, v_x.dtype),
            ],
            compiler_params=params,
            interpret=spec.interpret,
            name=f"dflash_attention_dkv_{part}",
        )(*row_args, k_p, v_p, *extra_args)
        return dk[:, :, : k_x.shape[2]], dv[:, :, : v_x.shape[2]]

    key_tiles = pl.cdiv(s, ti.keys)
    first_bc, last_bc = _context_row_tiles(lo_bm, hi_bm, ti.rows, ti.keys, key_tiles)
    tile_range = pl.BlockSpec((None, key_tiles), lambda b_, k_, c: (b_, 0))
    dk, dv = dkv("context", k_bksh, v_bksh, ti.keys, [tile_range] * 2, [first_bc, last_bc])
    dblk_k = dblk_v = None
    if spec.block_size:
        dblk_k, dblk_v = dkv("block", blk_k, blk_v, ti.block_keys)
    dq = _unfold_rows(dq_bkmh, t, n)
    return dq, dk, dv, dblk_k, dblk_v, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attend(q_btnh, k_bksh, v_bksh, blk_k, blk_v, lo_bt, hi_bt, spec: _Spec):
    return _attend_fwd(q_btnh, k_bksh, v_bksh, blk_k, blk_v, lo_bt, hi_bt, spec)[0]


def _fold_and_forward(q_btnh, k_bksh, v_bksh, blk_k, blk_v, lo_bt, hi_bt, spec: _Spec):
    """-> (what `_forward` returns, the folded q [B,K,M_pad,H], lo and hi [B,M_pad])."""
    kh = k_bksh.shape[1]
    q_bkmh = _fold_rows(q_btnh, kh, spec.tiles.rows)
    lo_bm = _fold_bounds(lo_bt, spec.groups, spec.tiles.rows)
    hi_bm = _fold_bounds(hi_bt, spec.groups, spec.tiles.rows)
    out = _forward(q_bkmh, k_bksh, v_bksh, lo_bm, hi_bm, blk_k, blk_v, spec)
    return out, q_bkmh, lo_bm, hi_bm


def _attend_fwd(q_btnh, k_bksh, v_bksh, blk_k, blk_v, lo_bt, hi_bt, spec: _Spec):
    t, n = q_btnh.shape[1], q_btnh.shape[2]
    (o_bkmh, lse_bkm), q_bkmh, lo_bm, hi_bm = _fold_and_forward(
        q_btnh, k_bksh, v_bksh, blk_k, blk_v, lo_bt, hi_bt, spec
    )
    res = (q_bkmh, k_bksh, v_bksh, blk_k, blk_v, lo_bm, hi_bm, o_bkmh, lse_bkm)
    return _unfold_rows(o_bkmh, t, n), res


_attend.defvjp(_attend_fwd, _backward)
