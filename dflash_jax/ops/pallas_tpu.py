"""The drafter's training attention on TPU: Pallas (Mosaic) kernels, forward and backward, that
mask by bounds (dflash-spec §12.6).

What a query row sees. `drafter_mask` is two key ranges per query, never a dense mask:
  context slot s  iff lo[t] <= s < hi[t]        (`ops.attention.context_bounds`: the slots
                                                  before the row's anchor, inside the window)
  block key u     iff blo[t] <= u < bhi[t]       (`block_bounds`: the query's own block,
                                                  narrowed to u <= t when causal, |t-u| < w
                                                  with a window)
The four bounds come in as one int32 [B, 4, M] array (M query rows), so the kernels read 16
bytes per row where a dense mask [B, Q, S+Q] grows with the context times the queries.

Layout. The G query heads of a kv head fold into the rows, m = t*G + g ([B,K,M,H]), so a
program's rows share one kv head (GQA without repeating K/V). Tiles of TILE rows and TILE keys.
Forward and dq: grid (B, K, row tiles, context tiles + block tiles); the key axis is
sequential, with the online softmax (fp32 running max and sum, lane-replicated [rows, 128],
and an fp32 [rows, H] accumulator) in VMEM scratch. Each row tile's live key tiles, a range
[first, last] of context tiles and one of block tiles, come in by scalar prefetch; the K/V
index maps clamp every step into them, so a dead step repeats a fetched tile's block index (no
DMA) and `pl.when` skips its compute. dk/dv: one call per key kind (context, blocks), grid
(B, K, key tiles, row tiles), each key tile visiting the row tiles whose live range holds it
(again by scalar prefetch), the scores computed transposed ([keys, rows]) so that the rows'
log-sum-exp and delta broadcast as [1, rows] rows, as the bounds do.

Numerics. q.k and p.v and every backward product take the input dtype with fp32 accumulation
(no operand is widened: Mosaic takes mixed operands only in its compatibility mode); the fp32
scores are scaled by H^-0.5 after the product, as every other path scales them. A row that
sees no key returns zeros and gets no gradient. Padding (rows to a multiple of TILE, keys to a
multiple of TILE) is masked by the bounds and sliced off.

Tested in Pallas' TPU interpreter on CPU against `ops.attention.block_attention` (values and
gradients) and lowered to Mosaic for "tpu" (tests/test_kernels.py); not yet compiled or timed
on a TPU. Decode shapes (one block of 16 queries) use ops.pallas_tpu_decode (ops/dispatch.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dflash_jax.ops.attention import NEG_INF
from dflash_jax.ops.pallas_tpu_decode import online_softmax_step

TILE = 128  # rows and keys per tile: one lane width, so scores line up with the m/l scratch
MIN_QUERIES = TILE  # fewer queries: the decode kernels (ops/pallas_tpu_decode.py)
HEAD_DIMS = (64, 128)  # what dispatch offers the kernels (as the decode kernels')
DTYPES = ("float32", "bfloat16")


def block_bounds(q_len: int, block_size: int, causal: bool = False, window: int | None = None):
    """`attention.block_mask` over Q = blocks x block_size queries as a key range per query:
    query t sees block key u iff blo[t] <= u < bhi[t] (its own block; u <= t when causal;
    |t - u| < window). -> (blo, bhi), two int32 [Q] numpy arrays (static)."""
    t = np.arange(q_len)
    lo = t // block_size * block_size
    hi = lo + block_size
    if causal:
        hi = np.minimum(hi, t + 1)
    if window is not None:
        lo, hi = np.maximum(lo, t - window + 1), np.minimum(hi, t + window)
    return lo.astype(np.int32), hi.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static shape of one call."""

    groups: int  # query heads per kv head
    queries: int  # Q
    context: int  # S
    scale: float
    interpret: bool | pltpu.InterpretParams

    @property
    def rows(self) -> int:  # M, padded
        return _round_up(self.queries * self.groups, TILE)

    @property
    def ctx_tiles(self) -> int:
        return max(pl.cdiv(self.context, TILE), 1)

    @property
    def blk_tiles(self) -> int:
        return pl.cdiv(self.queries, TILE)


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
    """`ops.attention.block_attention` as a differentiable kernel (training: Q >= MIN_QUERIES).

    q [B,Q,N,H] (Q = blocks x block_size); ctx_k/ctx_v [B,K,S,H]; blk_k/blk_v [B,K,Q,H];
    lo/hi [B,Q] int32 from `context_bounds`. -> [B,Q,N,H] in q's dtype.
    """
    b, q_len, n, h = q_bqnh.shape
    kh, s = ctx_k.shape[1], ctx_k.shape[2]
    if q_len % block_size or blk_k.shape[2] != q_len or n % kh:
        raise ValueError(
            f"block attention needs Q={q_len} = blocks x block_size={block_size}, as many "
            f"block keys (got {blk_k.shape[2]}) and query heads ({n}) a multiple of kv heads ({kh})"
        )
    spec = _Spec(n // kh, q_len, s, float(h) ** -0.5, interpret)
    blo, bhi = (
        jnp.broadcast_to(x, (b, q_len)) for x in block_bounds(q_len, block_size, causal, window)
    )
    bounds = _row_bounds(jnp.stack([lo_bq, jnp.minimum(hi_bq, s), blo, bhi], 1), spec)
    dtype = q_bqnh.dtype
    keys = [x.astype(dtype) for x in (ctx_k, ctx_v, blk_k, blk_v)]
    out_bkmh = _attention(spec, _fold(q_bqnh, kh, spec), *keys, bounds)
    return _unfold(out_bkmh, spec, n)


# --- layout -----------------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _fold(x_bqnh: jax.Array, kh: int, spec: _Spec) -> jax.Array:
    """[B,Q,N,H] -> [B,K,M,H], row m = t*G + g, padded to spec.rows."""
    b, q, n, h = x_bqnh.shape
    x = x_bqnh.reshape(b, q, kh, n // kh, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, -1, h)
    return jnp.pad(x, ((0, 0), (0, 0), (0, spec.rows - x.shape[2]), (0, 0)))


def _unfold(x_bkmh: jax.Array, spec: _Spec, n: int) -> jax.Array:
    b, kh, _, h = x_bkmh.shape
    x = x_bkmh[:, :, : spec.queries * spec.groups].reshape(b, kh, spec.queries, spec.groups, h)
    return x.transpose(0, 2, 1, 3, 4).reshape(b, spec.queries, n, h)


def _pad_keys(x_bksh: jax.Array) -> jax.Array:
    pad = max(_round_up(x_bksh.shape[2], TILE), TILE) - x_bksh.shape[2]
    return jnp.pad(x_bksh, ((0, 0), (0, 0), (0, pad), (0, 0)))


def _row_bounds(bounds_b4q: jax.Array, spec: _Spec) -> jax.Array:
    """Per-query (lo, hi, blo, bhi) [B,4,Q] -> per row [B,4,M]: rows t*G .. t*G+G-1 get query
    t's; padding rows empty ranges."""
    rows = jnp.repeat(bounds_b4q.astype(jnp.int32), spec.groups, axis=2)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, spec.rows - rows.shape[2])))


def _live_tiles(bounds_b4m: jax.Array, spec: _Spec):
    """Each row tile's live key tiles: (ctx_first, ctx_last, blk_first, blk_last), each [B, row
    tiles] int32; a tile range with nothing live has last = first - 1, first a valid tile."""
    b = bounds_b4m.shape[0]
    tiles = bounds_b4m.reshape(b, 4, spec.rows // TILE, TILE)
    out = []
    for lo, hi, count in (
        (tiles[:, 0], tiles[:, 1], spec.ctx_tiles),
        (tiles[:, 2], tiles[:, 3], spec.blk_tiles),
    ):
        live = hi > lo
        slot_lo = jnp.min(jnp.where(live, lo, jnp.iinfo(jnp.int32).max), axis=-1)
        slot_hi = jnp.max(jnp.where(live, hi, 0), axis=-1)
        any_live = jnp.any(live, axis=-1)
        first = jnp.where(any_live, slot_lo // TILE, count - 1).astype(jnp.int32)
        out += [first, jnp.where(any_live, (slot_hi - 1) // TILE, first - 1).astype(jnp.int32)]
    return tuple(out)


def _visiting_rows(first, last, key_tiles: int):
    """For each key tile, the row tiles whose live range [first, last] ([B, row tiles]) holds
    it, as a range: (row_first, row_last) [B, key tiles] (last = first - 1 when none)."""
    c = jnp.arange(key_tiles)[None, None, :]
    i = jnp.arange(first.shape[1])[None, :, None]
    seen = (first[:, :, None] <= c) & (c <= last[:, :, None])  # [B, row tiles, key tiles]
    row_first = jnp.min(jnp.where(seen, i, first.shape[1] - 1), axis=1).astype(jnp.int32)
    row_last = jnp.max(jnp.where(seen, i, -1), axis=1).astype(jnp.int32)
    return jnp.where(row_last >= 0, row_first, 0), row_last


def _clamp(c, first, last):
    """Grid step c's tile: clamped into [first, last] (`first` when the range is empty), so a
    dead step repeats a live tile's block index and the pipeline fetches nothing for it."""
    return jnp.maximum(jnp.minimum(c, last), first)


# --- forward ----------------------------------------------------------------------------------


def _scores(q, k, scale, transposed=False):
    dims = (((1,), (1,)), ((), ()))
    a, b_ = (k, q) if transposed else (q, k)
    return lax.dot_general(a, b_, dims, preferred_element_type=jnp.float32) * scale


def _row_visible(bnd_ref, part: int, base, shape):
    """Inside the forward and dq kernels: which of a key tile's slots (base + column) each row
    of the row tile sees, by its bounds of `part` (0: context, 1: block keys). -> [rows, keys]."""
    slots = base + lax.broadcasted_iota(jnp.int32, shape, 1)
    lo = jnp.expand_dims(bnd_ref[2 * part], -1)
    hi = jnp.expand_dims(bnd_ref[2 * part + 1], -1)
    return (slots >= lo) & (slots < hi)


def _on_live_tile(fn, spec: _Spec, live, key_refs) -> None:
    """Inside the forward and dq kernels, at grid step (b, k, i, c): fn(k, v, part, base) on
    the key tile this step reads, when it is live for row tile i (`_live_tiles`): context tile c,
    or block tile c - ctx_tiles."""
    cf, cl, bf, bl = live
    ck_ref, cv_ref, bk_ref, bv_ref = key_refs
    b, i, c = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when((c < spec.ctx_tiles) & (c >= cf[b, i]) & (c <= cl[b, i]))
    def _context_tile():
        fn(ck_ref[...], cv_ref[...], 0, c * TILE)

    u = c - spec.ctx_tiles

    @pl.when((u >= bf[b, i]) & (u <= bl[b, i]))
    def _block_tile():
        fn(bk_ref[...], bv_ref[...], 1, u * TILE)


def _fwd_kernel(cf, cl, bf, bl, q_ref, bnd_ref, ck_ref, cv_ref, bk_ref, bv_ref, o_ref, lse_ref,
                m_ref, l_ref, acc_ref, *, spec: _Spec):  # fmt: skip
    c = pl.program_id(3)

    @pl.when(c == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(k, v, part, base):
        scores = _scores(q_ref[...], k, spec.scale)
        visible = _row_visible(bnd_ref, part, base, scores.shape)
        online_softmax_step(scores, visible, v, m_ref, l_ref, acc_ref)

    _on_live_tile(attend, spec, (cf, cl, bf, bl), (ck_ref, cv_ref, bk_ref, bv_ref))

    @pl.when(c == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)[:, :1]).astype(o_ref.dtype)
        lse = jnp.where(l > 0, m_ref[...] + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)
        lse_ref[...] = lse.T[:1, :]  # [rows, 128] lane-replicated -> one [1, rows] row


def _row_grid_specs(spec: _Spec, h: int):
    """BlockSpecs of a (B, K, row tile, key step) grid with (cf, cl, bf, bl) prefetched."""
    rows = lambda *g: (g[0], g[1], g[2], 0)
    ctx = lambda b, k, i, c, cf, cl, *_: (b, k, _clamp(c, cf[b, i], cl[b, i]), 0)
    blk = lambda b, k, i, c, cf, cl, bf, bl: (
        b,
        k,
        _clamp(c - spec.ctx_tiles, bf[b, i], bl[b, i]),
        0,
    )
    tile = (None, None, TILE, h)
    return dict(
        rows=pl.BlockSpec(tile, rows),
        bounds=pl.BlockSpec((None, 4, TILE), lambda b, k, i, *_: (b, 0, i)),
        ctx=pl.BlockSpec(tile, ctx),
        blk=pl.BlockSpec(tile, blk),
        row_vec=pl.BlockSpec((None, None, 1, TILE), lambda b, k, i, *_: (b, k, 0, i)),
    )


def _forward(spec: _Spec, q, ck, cv, bk, bv, bounds):
    b, kh, m, h = q.shape
    live = _live_tiles(bounds, spec)
    s_ = _row_grid_specs(spec, h)
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, spec=spec),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, kh, m // TILE, spec.ctx_tiles + spec.blk_tiles),
            in_specs=[s_["rows"], s_["bounds"], s_["ctx"], s_["ctx"], s_["blk"], s_["blk"]],
            out_specs=[s_["rows"], s_["row_vec"]],
            scratch_shapes=[
                pltpu.VMEM((TILE, TILE), jnp.float32),  # running max, lane-replicated
                pltpu.VMEM((TILE, TILE), jnp.float32),  # running sum, lane-replicated
                pltpu.VMEM((TILE, h), jnp.float32),  # accumulator
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, kh, 1, m), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
        interpret=spec.interpret,
        name="dflash_train_attention_fwd",
    )(*live, q, bounds, ck, cv, bk, bv)
    return o, lse, live


_SEMANTICS = (pltpu.PARALLEL, pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY)


# --- backward ---------------------------------------------------------------------------------


def _dq_kernel(cf, cl, bf, bl, q_ref, do_ref, lse_ref, delta_ref, bnd_ref, ck_ref, cv_ref,
               bk_ref, bv_ref, dq_ref, acc_ref, *, spec: _Spec):  # fmt: skip
    c = pl.program_id(3)

    @pl.when(c == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(k, v, part, base):
        scores = _scores(q_ref[...], k, spec.scale)
        visible = _row_visible(bnd_ref, part, base, scores.shape)
        p = jnp.where(visible, jnp.exp(scores - jnp.expand_dims(lse_ref[0], -1)), 0.0)
        do = do_ref[...]
        dp = lax.dot_general(
            do, v.astype(do.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        ds = p * (dp - jnp.expand_dims(delta_ref[0], -1))
        acc_ref[...] += lax.dot_general(
            ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    _on_live_tile(step, spec, (cf, cl, bf, bl), (ck_ref, cv_ref, bk_ref, bv_ref))

    @pl.when(c == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * spec.scale).astype(dq_ref.dtype)


def _dkv_kernel(rf, rl, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, bnd_ref, dk_ref, dv_ref,
                dk_acc, dv_acc, *, spec: _Spec, part: int):  # fmt: skip
    b, c, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when((i >= rf[b, c]) & (i <= rl[b, c]))
    def _row_tile():
        k, v, q, do = k_ref[...], v_ref[...], q_ref[...], do_ref[...]
        scores_t = _scores(q, k, spec.scale, transposed=True)  # [keys, rows]
        slots = c * TILE + lax.broadcasted_iota(jnp.int32, scores_t.shape, 0)
        lo, hi = bnd_ref[pl.ds(2 * part, 1), :], bnd_ref[pl.ds(2 * part + 1, 1), :]
        visible = (slots >= lo) & (slots < hi)
        p_t = jnp.where(visible, jnp.exp(scores_t - lse_ref[...]), 0.0)
        nn = (((1,), (0,)), ((), ()))
        dv_acc[...] += lax.dot_general(
            p_t.astype(do.dtype), do, nn, preferred_element_type=jnp.float32
        )
        dp_t = lax.dot_general(
            v.astype(do.dtype), do, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        ds_t = p_t * (dp_t - delta_ref[...])
        dk_acc[...] += lax.dot_general(
            ds_t.astype(q.dtype), q, nn, preferred_element_type=jnp.float32
        )

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * spec.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dkv(spec: _Spec, part: int, k, v, q, do, lse, delta, bounds, first, last):
    b, kh, m, h = q.shape
    key_tiles = k.shape[2] // TILE
    row_first, row_last = _visiting_rows(first, last, key_tiles)
    row = lambda b_, k_, c, i, rf, rl: _clamp(i, rf[b_, c], rl[b_, c])
    keys = pl.BlockSpec((None, None, TILE, h), lambda b_, k_, c, i, *_: (b_, k_, c, 0))
    rows = pl.BlockSpec((None, None, TILE, h), lambda *g: (g[0], g[1], row(*g), 0))
    row_vec = pl.BlockSpec((None, None, 1, TILE), lambda *g: (g[0], g[1], 0, row(*g)))
    bnd = pl.BlockSpec((None, 4, TILE), lambda *g: (g[0], 0, row(*g)))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, spec=spec, part=part),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kh, key_tiles, m // TILE),
            in_specs=[keys, keys, rows, rows, row_vec, row_vec, bnd],
            out_specs=[keys, keys],
            scratch_shapes=[pltpu.VMEM((TILE, h), jnp.float32)] * 2,
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
        interpret=spec.interpret,
        name=f"dflash_train_attention_d{'ctx' if part == 0 else 'blk'}",
    )(row_first, row_last, k, v, q, do, lse, delta, bounds)


# --- custom_vjp -------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q, ctx_k, ctx_v, blk_k, blk_v, bounds):
    return _attention_fwd(spec, q, ctx_k, ctx_v, blk_k, blk_v, bounds)[0]


def _attention_fwd(spec: _Spec, q, ctx_k, ctx_v, blk_k, blk_v, bounds):
    keys = tuple(_pad_keys(x) for x in (ctx_k, ctx_v, blk_k, blk_v))
    o, lse, live = _forward(spec, q, *keys, bounds)
    return o, (q, keys, bounds, o, lse, live)


def _attention_bwd(spec: _Spec, res, do):
    q, (ck, cv, bk, bv), bounds, o, lse, (cf, cl, bf, bl) = res
    b, kh, m, h = q.shape
    do = do.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)[:, :, None, :]
    s_ = _row_grid_specs(spec, h)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, kh, m // TILE, spec.ctx_tiles + spec.blk_tiles),
            in_specs=[
                s_["rows"],
                s_["rows"],
                s_["row_vec"],
                s_["row_vec"],
                s_["bounds"],
                s_["ctx"],
                s_["ctx"],
                s_["blk"],
                s_["blk"],
            ],  # fmt: skip
            out_specs=s_["rows"],
            scratch_shapes=[pltpu.VMEM((TILE, h), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
        interpret=spec.interpret,
        name="dflash_train_attention_dq",
    )(cf, cl, bf, bl, q, do, lse, delta, bounds, ck, cv, bk, bv)
    dck, dcv = _dkv(spec, 0, ck, cv, q, do, lse, delta, bounds, cf, cl)
    dbk, dbv = _dkv(spec, 1, bk, bv, q, do, lse, delta, bounds, bf, bl)
    s, t = spec.context, spec.queries
    return dq, dck[:, :, :s], dcv[:, :, :s], dbk[:, :, :t], dbv[:, :, :t], None


_attention.defvjp(_attention_fwd, _attention_bwd)
