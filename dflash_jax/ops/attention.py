"""Masked multi-head attention with GQA: the XLA reference that defines every mask kind.

Shapes (style.md letters): B batch, T queries, S keys, N query heads, K kv heads, G = N // K,
H head dim. Keys/values are kv-head-major [B,K,S,H] (the KV-cache layout): the batch dims of
both attention matmuls then lead, so XLA never transposes a whole cache per step. Masks are
boolean [B,T,S] (True = visible), built by the helpers below, so one attention function serves
target prefill/verify, drafting and training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.ops import platform
from dflash_jax.ops.caches import bits16, ring_positions
from dflash_jax.ops.invariance import RowRule

NEG_INF = -1e30


def _pv(spec: str, p, v) -> jax.Array:
    """probabilities (in v's dtype) x values, accumulated and returned in fp32 (the dot policy
    of `ops.dots`: a bf16 product would run as an upcast fp32 dot on XLA:CPU); each caller
    casts the attention's output to q's dtype once, at its end."""
    return jnp.einsum(spec, p, v, preferred_element_type=jnp.float32)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B,T,N,H], k/v [B,K,S,H], mask [B,T,S] bool -> [B,T,N,H] in q's dtype.

    Scores and softmax in fp32; scale H^-0.5. Fully masked rows give a uniform average
    (never NaN); callers ignore such rows.

    The G query heads that share a kv head and the T queries are folded into one M = G*T
    axis first ([B,K,M,H], a small copy of q): both matmuls are then plain batched GEMMs over
    (B,K) with the cache as the [S,H] operand in its stored layout. Contracting
    "btkgh,bksh" directly made XLA:CPU emit S-major scores plus transposes, ~6x slower for
    decode shapes (measured: batch 8, one query, 548 cache slots, 30 layers: 20 ms -> 3 ms).
    """
    b, t, n, h = q.shape
    kh = k.shape[1]
    g = n // kh
    q_bkmh = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    scores_bkms = jnp.einsum("bkmh,bksh->bkms", q_bkmh, k, preferred_element_type=jnp.float32)
    scores_bkgts = scores_bkms.reshape(b, kh, g, t, -1) * (h**-0.5)
    scores_bkgts = jnp.where(mask[:, None, None, :, :], scores_bkgts, NEG_INF)
    probs_bkms = jax.nn.softmax(scores_bkgts, axis=-1).reshape(b, kh, g * t, -1)
    out_bkmh = _pv("bkms,bksh->bkmh", probs_bkms.astype(v.dtype), v)
    out_btnh = out_bkmh.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return out_btnh.astype(q.dtype)


def causal_cache_mask(cache_lengths: jax.Array, num_queries: int, num_keys: int) -> jax.Array:
    """Target mask over a KV cache: query t of row b (written at slot cache_lengths[b] + t)
    sees slots s <= cache_lengths[b] + t.  -> [B,T,S] bool."""
    q_slot_bt = cache_lengths[:, None] + jnp.arange(num_queries)[None, :]
    return jnp.arange(num_keys)[None, None, :] <= q_slot_bt[:, :, None]


def causal_mask(batch: int, num_queries: int) -> jax.Array:
    """Plain causal mask over the given tokens (no cache). -> [B,T,T] bool."""
    m = jnp.tril(jnp.ones((num_queries, num_queries), dtype=bool))
    return jnp.broadcast_to(m, (batch, num_queries, num_queries))


def context_mask(
    context_lengths: jax.Array,
    anchors: jax.Array,
    block_size: int,
    num_context: int,
    window: int | None = None,
    from_anchor: bool = False,
) -> jax.Array:
    """The context part of the DFlash draft/training mask. context_lengths [B]: valid context
    slots per row (slot s holds position s); anchors [B,N]: block n's slot j sits at position
    anchors + j. A query of block n sees context slot s iff s < min(anchor_n, context_length)
    (strictly before its anchor) and, with `window`, q_pos - s < window (`from_anchor`:
    anchor - s <= window, the same W context rows for every slot). -> [B, N*J, S] bool."""
    b, n = anchors.shape
    q_pos_bt = (anchors[:, :, None] + jnp.arange(block_size)[None, None, :]).reshape(b, -1)
    q_anchor_bt = jnp.repeat(anchors, block_size, axis=1)
    ctx_pos_s = jnp.arange(num_context)
    ctx_limit_bt = jnp.minimum(q_anchor_bt, context_lengths[:, None])
    visible_bts = ctx_pos_s[None, None, :] < ctx_limit_bt[:, :, None]
    if window is not None:
        start_bt = q_anchor_bt if from_anchor else q_pos_bt + 1
        visible_bts &= (start_bt[:, :, None] - ctx_pos_s[None, None, :]) <= window
    return visible_bts


def context_bounds(
    context_lengths: jax.Array,
    anchors: jax.Array,
    block_size: int,
    window: int | None = None,
    from_anchor: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`context_mask` as one slot range per query, the form the kernels take: query t of row b
    sees context slot s iff lo[b,t] <= s < hi[b,t] (nothing when lo >= hi).
    -> (lo, hi), each [B, N*J] int32."""
    b = anchors.shape[0]
    anchor_bt = jnp.repeat(anchors, block_size, axis=1)
    q_pos_bt = (anchors[:, :, None] + jnp.arange(block_size)[None, None, :]).reshape(b, -1)
    hi_bt = jnp.minimum(anchor_bt, context_lengths[:, None])
    if window is None:
        lo_bt = jnp.zeros_like(hi_bt)
    elif from_anchor:
        lo_bt = jnp.maximum(anchor_bt - window, 0)
    else:
        lo_bt = jnp.maximum(q_pos_bt - window + 1, 0)
    return lo_bt.astype(jnp.int32), hi_bt.astype(jnp.int32)


def causal_cache_bounds(cache_lengths: jax.Array, num_queries: int) -> jax.Array:
    """`causal_cache_mask` as an exclusive slot limit per query: query t of row b sees slots
    s < hi[b,t] = cache_lengths[b] + t + 1. -> [B,T] int32."""
    hi_bt = cache_lengths[:, None] + jnp.arange(num_queries)[None, :] + 1
    return hi_bt.astype(jnp.int32)


def tree_attention_mask(parent_bt: jax.Array) -> jax.Array:
    """The mask among the T tokens of a token tree (a verify of tree proposals): token t sees
    token t' iff t' is t or one of its ancestors. parent [B,T] int32, each token's parent index
    (< its own; the root's is ignored), so tokens are in topological order. -> [B,T,T] bool."""
    b, t = parent_bt.shape
    eye_tt = jnp.eye(t, dtype=bool)
    parent_bt = jnp.where(jnp.arange(t)[None, :] == 0, 0, parent_bt)

    def add(i, anc_btt):  # row i = row parent[i] (already final, parents come first) + self
        row_bt = jnp.take_along_axis(anc_btt, parent_bt[:, i, None, None], axis=1)[:, 0]
        return anc_btt.at[:, i].set((row_bt & (i > 0)) | eye_tt[i])

    return jax.lax.fori_loop(0, t, add, jnp.broadcast_to(eye_tt, (b, t, t)))


# The most tokens a tree verify may hold in the decode kernels: one int32 of ancestor bits per
# query (`ancestor_bits`).
MAX_TREE = 32


def ancestor_bits(tree_mask: jax.Array) -> jax.Array:
    """How the decode kernels take a token tree's mask: tree_mask [B,T,T] bool (T <= MAX_TREE)
    -> [B,T] int32, bit t' of row t set iff tree_mask[b,t,t'] (bit 31 is the sign bit: read
    with a logical shift)."""
    t = tree_mask.shape[-1]
    if t > MAX_TREE:
        raise ValueError(f"a tree of {t} tokens: the attention kernels take at most {MAX_TREE}")
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(t, dtype=jnp.uint32))
    bits = jnp.sum(jnp.where(tree_mask, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def tree_cache_bounds(cache_lengths: jax.Array, tree_mask: jax.Array):
    """A token tree's verify as the decode kernels bound it: every new row in range (hi =
    cache_lengths[b] + T for every query), the new rows' first slot, and each query's
    `ancestor_bits`, which decide which new rows it sees (`tree_visible`).
    -> (hi, base, bits), each [B,T] int32."""
    b, t = tree_mask.shape[:2]
    hi_bt = jnp.broadcast_to(cache_lengths[:, None] + t, (b, t)).astype(jnp.int32)
    base_bt = jnp.broadcast_to(cache_lengths[:, None], (b, t)).astype(jnp.int32)
    return hi_bt, base_bt, ancestor_bits(tree_mask)


def tree_visible(slots, base, bits):
    """Inside a kernel: whether a query with these `tree_cache_bounds` sees each of `slots`
    (broadcast against base and bits): a cached slot (before base) always, new row j (slot
    base + j) only where bit j of its bits is set. Elementwise jnp/lax only."""
    j = slots - base
    bit = jax.lax.shift_right_logical(bits, jnp.clip(j, 0, MAX_TREE - 1)) & 1
    return (j < 0) | (bit == 1)


def block_mask(block_size: int, causal: bool = False, window: int | None = None) -> jax.Array:
    """Inside one block (the same for every block, since slot j sits at anchor + j): all slots
    see each other (bidirectional), or only earlier ones (causal); with `window`, only slots
    less than `window` apart. -> [J, J] bool (query slot, key slot)."""
    diff_jj = jnp.arange(block_size)[:, None] - jnp.arange(block_size)[None, :]
    visible_jj = jnp.ones((block_size, block_size), bool)
    if causal:
        visible_jj &= diff_jj >= 0
    if window is not None:
        visible_jj &= jnp.abs(diff_jj) < window
    return visible_jj


def drafter_mask(
    context_lengths: jax.Array,
    anchors: jax.Array,
    block_size: int,
    num_context: int,
    causal: bool = False,
    window: int | None = None,
    from_anchor: bool = False,
) -> jax.Array:
    """The whole DFlash draft/training mask over keys [context (S slots) ; blocks (N*B slots)]:
    `context_mask`, then each block seeing its own block only (`block_mask`); blocks never see
    each other. The dense definition that `block_attention` computes without materialising
    the block-to-block part. A window measured `from_anchor` bounds the context only.
    -> [B, N*B, S + N*B] bool."""
    b, n = anchors.shape
    ctx_bts = context_mask(context_lengths, anchors, block_size, num_context, window, from_anchor)
    block_t = jnp.repeat(jnp.arange(n), block_size)
    same_block_tt = (block_t[:, None] == block_t[None, :]) & jnp.tile(
        block_mask(block_size, causal, None if from_anchor else window), (n, n)
    )
    blk_btt = jnp.broadcast_to(same_block_tt, (b, n * block_size, n * block_size))
    return jnp.concatenate([ctx_bts, blk_btt], axis=-1)


def block_attention(
    q: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    blk_k: jax.Array,
    blk_v: jax.Array,
    ctx_mask: jax.Array,
    blk_mask: jax.Array,
) -> jax.Array:
    """`attention` under `drafter_mask`, in memory and time linear in the number of blocks.

    q [B,Q,N,H] with Q = blocks x J block slots; ctx_k/ctx_v [B,K,S,H] (context);
    blk_k/blk_v [B,K,Q,H] (the blocks' own keys and values); ctx_mask [B,Q,S]
    (`context_mask`); blk_mask [J,J] (`block_mask`). Each query's softmax runs jointly over
    its visible context slots and its own block's J slots; the other blocks are never scored.
    -> [B,Q,N,H] in q's dtype (fp32 scores and softmax, scale H^-0.5).
    """
    b, t, n, h = q.shape
    kh = ctx_k.shape[1]
    g = n // kh
    j = blk_mask.shape[0]
    nb = t // j
    scale = h**-0.5
    q_bkmh = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    ctx_bkgts = jnp.einsum("bkmh,bksh->bkms", q_bkmh, ctx_k, preferred_element_type=jnp.float32)
    ctx_bkgts = ctx_bkgts.reshape(b, kh, g, t, -1) * scale
    ctx_bkgts = jnp.where(ctx_mask[:, None, None], ctx_bkgts, NEG_INF)
    # Block part: queries and keys of block n only, [B,K,N,G*J,J].
    q_bknmh = q.reshape(b, nb, j, kh, g, h).transpose(0, 3, 1, 4, 2, 5).reshape(b, kh, nb, g * j, h)
    k_bknih = blk_k.reshape(b, kh, nb, j, h)
    v_bknih = blk_v.reshape(b, kh, nb, j, h)
    blk_bknmi = jnp.einsum(
        "bknmh,bknih->bknmi", q_bknmh, k_bknih, preferred_element_type=jnp.float32
    )
    blk_bkngji = blk_bknmi.reshape(b, kh, nb, g, j, j) * scale
    blk_bkngji = jnp.where(blk_mask[None, None, None, None], blk_bkngji, NEG_INF)
    # Joint softmax over [context ; own block].
    blk_bkgti = blk_bkngji.transpose(0, 1, 3, 2, 4, 5).reshape(b, kh, g, t, j)
    max_bkgt1 = jnp.maximum(
        jnp.max(ctx_bkgts, axis=-1, keepdims=True), jnp.max(blk_bkgti, axis=-1, keepdims=True)
    )
    pc_bkgts = jnp.exp(ctx_bkgts - max_bkgt1)
    pb_bkgti = jnp.exp(blk_bkgti - max_bkgt1)
    denom_bkgt1 = jnp.sum(pc_bkgts, -1, keepdims=True) + jnp.sum(pb_bkgti, -1, keepdims=True)
    pc_bkms = (pc_bkgts / denom_bkgt1).reshape(b, kh, g * t, -1).astype(ctx_v.dtype)
    out_bkmh = _pv("bkms,bksh->bkmh", pc_bkms, ctx_v)
    pb_bknmi = (
        (pb_bkgti / denom_bkgt1)
        .reshape(b, kh, g, nb, j, j)
        .transpose(0, 1, 3, 2, 4, 5)
        .reshape(b, kh, nb, g * j, j)
        .astype(blk_v.dtype)
    )
    blk_out_bknmh = _pv("bknmi,bknih->bknmh", pb_bknmi, v_bknih)
    blk_out_bkmh = (
        blk_out_bknmh.reshape(b, kh, nb, g, j, h)
        .transpose(0, 1, 3, 2, 4, 5)
        .reshape(b, kh, g * t, h)
    )
    out_btnh = (
        (out_bkmh + blk_out_bkmh)
        .reshape(b, kh, g, t, h)
        .transpose(0, 3, 1, 2, 4)
        .reshape(b, t, n, h)
    )
    return out_btnh.astype(q.dtype)


def append_attention(
    q: jax.Array,
    k_cache: jax.Array | None,
    v_cache: jax.Array | None,
    k_new: jax.Array,
    v_new: jax.Array,
    cache_lengths: jax.Array,
    tree_mask: jax.Array | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """T new queries over a KV cache and themselves: query t of row b sees cache slots
    s < cache_lengths[b] and new tokens t' <= t. Equals `attention` over the cache after the
    new keys are written at cache_lengths[b] (`causal_cache_mask`), without reading the
    written buffer (see `dispatch.cached_attention` for why).

    q [B,T,N,H]; k/v_cache [B,K,S,H] (None: no cache, a causal pass over the new tokens);
    k/v_new [B,K,T,H]; cache_lengths [B] -> [B,T,N,H].
    tree_mask [B,T,T] bool (a token tree, `tree_attention_mask`): query t sees new token t'
    iff tree_mask[b,t,t'] instead of t' <= t. One joint softmax in fp32 over both score
    blocks, normalised at the output.

    The sliding-window families' options (no tree): `window`, a query at position p sees
    positions > p - window only, and the cache is a ring (`caches.ring_positions`: slot s holds
    the latest position below cache_lengths[b] that is s modulo S; a flat cache is the case
    S > every position); `scale` instead of H^-0.5; `softcap`, scores
    capped as softcap * tanh(score / softcap); `sinks` [N], one more logit per query head in
    the softmax's denominator (gpt-oss), whose probability is dropped.
    """
    b, t, n, h = q.shape
    kh = k_new.shape[1]
    g = n // kh
    q_bkmh = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    scale = h**-0.5 if scale is None else scale
    query_m = jnp.tile(jnp.arange(t), g)  # row m of the folded queries is query m % T

    def scores(keys, spec):
        x = jnp.einsum(spec, q_bkmh, keys, preferred_element_type=jnp.float32) * scale
        return x if softcap is None else softcap * jnp.tanh(x / softcap)

    new_bkmt = scores(k_new, "bkmh,bkth->bkmt")
    if tree_mask is None:
        new_ok_11mt = (jnp.arange(t)[None, :] <= query_m[:, None])[None, None]
        if window is not None:
            new_ok_11mt &= (query_m[:, None] - jnp.arange(t)[None, :] < window)[None, None]
    else:  # [B,T,T] -> [B,1,M,T], row m of the folded queries is query m % T
        new_ok_11mt = jnp.take(tree_mask, query_m, axis=1)[:, None]
    new_bkmt = jnp.where(new_ok_11mt, new_bkmt, NEG_INF)
    max_bkm1 = new_bkmt.max(-1, keepdims=True)
    if k_cache is not None:
        s = k_cache.shape[2]
        old_bkms = scores(k_cache, "bkmh,bksh->bkms")
        if window is None:
            old_ok_b1ms = (jnp.arange(s)[None, :] < cache_lengths[:, None])[:, None, None, :]
        else:  # a ring (`caches.ring_positions`); query m sits at position cache_lengths + m % T
            pos_bs = ring_positions(cache_lengths, s)
            q_pos_bm = cache_lengths[:, None] + query_m[None, :]
            old_ok_b1ms = (pos_bs >= 0)[:, None, None, :] & (
                q_pos_bm[:, None, :, None] - pos_bs[:, None, None, :] < window
            )
        old_bkms = jnp.where(old_ok_b1ms, old_bkms, NEG_INF)
        max_bkm1 = jnp.maximum(max_bkm1, old_bkms.max(-1, keepdims=True))
    if sinks is not None:  # head k * G + g's sink for row m = g * T + t
        sink_1km1 = jnp.repeat(sinks.astype(jnp.float32).reshape(kh, g), t, axis=1)[
            None, :, :, None
        ]
        max_bkm1 = jnp.maximum(max_bkm1, sink_1km1)
    p_new_bkmt = jnp.exp(new_bkmt - max_bkm1)
    denom_bkm1 = p_new_bkmt.sum(-1, keepdims=True)
    out_bkmh = _pv("bkmt,bkth->bkmh", p_new_bkmt.astype(v_new.dtype), v_new)
    if k_cache is not None:
        p_old_bkms = jnp.exp(old_bkms - max_bkm1)
        denom_bkm1 = denom_bkm1 + p_old_bkms.sum(-1, keepdims=True)
        out_bkmh += _pv("bkms,bksh->bkmh", p_old_bkms.astype(v_cache.dtype), v_cache)
    if sinks is not None:
        denom_bkm1 = denom_bkm1 + jnp.exp(sink_1km1 - max_bkm1)
    out_bkmh = out_bkmh / denom_bkm1
    out_btnh = out_bkmh.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return out_btnh.astype(q.dtype)


PREFILL_KEY_BLOCK = 512  # cache slots per block of `blocked_append_attention`


def blocked_append_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache_lengths: jax.Array,
    key_block: int | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`append_attention` (no tree) with the cache scored in blocks of `key_block` slots
    (None: PREFILL_KEY_BLOCK) under an online softmax: a loop over the blocks before
    max(cache_lengths), each [B,K,G*T,key_block] fp32 scores, so a prefill chunk of T queries
    over a cache of S slots holds T x key_block scores, not T x S (Qwen3-8B, a 256-token chunk
    at 32K: 16 MiB instead of 1 GiB per copy). The new tokens' own causal block (and the sink
    logits, which join every softmax's denominator) seeds the running max (a query always sees
    itself). window / scale / softcap / sinks as `append_attention` (with a window the cache
    is a ring, `caches.ring_positions`). Same mathematics as `append_attention`, summed in
    another order (fp32 rounding). q [B,T,N,H]; k/v_cache [B,K,S,H]; k/v_new [B,K,T,H];
    cache_lengths [B] -> [B,T,N,H]."""
    b, t, n, h = q.shape
    kh, s = k_cache.shape[1], k_cache.shape[2]
    g = n // kh
    key_block = min(key_block or PREFILL_KEY_BLOCK, s)
    scale = h**-0.5 if scale is None else scale
    q_bkmh = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    query_m = jnp.tile(jnp.arange(t), g)

    def scores(keys_bkth):
        x = jnp.einsum("bkmh,bkth->bkmt", q_bkmh, keys_bkth, preferred_element_type=jnp.float32)
        x = x * scale
        return x if softcap is None else softcap * jnp.tanh(x / softcap)

    new_ok_11mt = (jnp.arange(t)[None, :] <= query_m[:, None])[None, None]
    if window is not None:
        new_ok_11mt &= (query_m[:, None] - jnp.arange(t)[None, :] < window)[None, None]
    new_bkmt = jnp.where(new_ok_11mt, scores(k_new), NEG_INF)
    max_bkm = new_bkmt.max(-1)
    if sinks is not None:  # head k * G + g's sink for row m = g * T + t
        sink_1km = jnp.repeat(sinks.astype(jnp.float32).reshape(kh, g), t, axis=1)[None]
        max_bkm = jnp.maximum(max_bkm, sink_1km)
    p_new_bkmt = jnp.exp(new_bkmt - max_bkm[..., None])
    sum_bkm = p_new_bkmt.sum(-1)
    if sinks is not None:
        sum_bkm = sum_bkm + jnp.exp(sink_1km - max_bkm)
    init = (max_bkm, sum_bkm, _pv("bkmt,bkth->bkmh", p_new_bkmt.astype(v_new.dtype), v_new))
    if window is not None:
        pos_bs = ring_positions(cache_lengths, s)
        q_pos_bm = cache_lengths[:, None] + query_m[None, :]
    dtype = k_cache.dtype
    # As in `tiled_attention`: read a 16-bit cache as bits, each block turned back into floats
    # inside the loop, or XLA:CPU widens the whole cache to f32 out of it.
    if platform.xla_cpu_codegen() and bits16(dtype):
        as_bits = lambda c: jax.lax.bitcast_convert_type(c, jnp.uint16)
        caches = (as_bits(k_cache), as_bits(v_cache))
    else:
        caches = (k_cache, v_cache)

    def body(i, carry):
        max_bkm, sum_bkm, acc_bkmh = carry
        # The last block may be shifted back to fit the buffer: slots it shares with the block
        # before are masked here, counted there.
        start = jnp.minimum(i * key_block, s - key_block)
        cut = lambda c: jax.lax.bitcast_convert_type(
            jax.lax.dynamic_slice_in_dim(c, start, key_block, axis=2), dtype
        )
        k_bkth, v_bkth = cut(caches[0]), cut(caches[1])
        slot_t = start + jnp.arange(key_block)
        ok_bt = (slot_t[None, :] < cache_lengths[:, None]) & (slot_t >= i * key_block)[None, :]
        ok_b1mt = ok_bt[:, None, None, :]
        if window is not None:  # a ring: slot -> its position, and the window from each query
            pos_bt = jax.lax.dynamic_slice_in_dim(pos_bs, start, key_block, axis=1)
            fresh_bt = (pos_bt >= 0) & (slot_t >= i * key_block)[None, :]
            near_bmt = q_pos_bm[:, :, None] - pos_bt[:, None, :] < window
            ok_b1mt = (fresh_bt[:, None, :] & near_bmt)[:, None]
        sc_bkmt = jnp.where(ok_b1mt, scores(k_bkth), NEG_INF)
        new_max_bkm = jnp.maximum(max_bkm, sc_bkmt.max(-1))
        rescale_bkm = jnp.exp(max_bkm - new_max_bkm)
        p_bkmt = jnp.exp(sc_bkmt - new_max_bkm[..., None])
        sum_bkm = sum_bkm * rescale_bkm + p_bkmt.sum(-1)
        pv_bkmh = _pv("bkmt,bkth->bkmh", p_bkmt.astype(v_bkth.dtype), v_bkth)
        return new_max_bkm, sum_bkm, acc_bkmh * rescale_bkm[..., None] + pv_bkmh

    # a ring's slots are all live once its length passes them
    blocks = (jnp.minimum(jnp.max(cache_lengths), s) + key_block - 1) // key_block
    _, sum_bkm, acc_bkmh = jax.lax.fori_loop(0, blocks, body, init)
    out_bkmh = acc_bkmh / sum_bkm[..., None]
    out_btnh = out_bkmh.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return out_btnh.astype(q.dtype)


KEY_TILE = 64  # keys per tile of `tiled_attention`


def tiled_attention(
    q: jax.Array,
    cache: tuple[jax.Array, jax.Array] | None,
    new_kv: tuple[jax.Array, jax.Array],
    start_b: jax.Array,
    rows: RowRule,
    key_tile: int = KEY_TILE,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """The target's causal attention, batch-invariant: a query's output is bitwise the same
    whatever pass holds it (an AR step, any verify, a tree verify, a prefill, a batch of any
    rows).

    q [B,T,N,H]: T new tokens of row b at slots start[b] + t; cache (k, v) [B,K,S,H] holds
    the slots before start[b] (None: a prefill, nothing before); new_kv (k, v) [B,K,T,H].
    Query t sees slots s <= start[b] + t; with tree_mask [B,T,T] (`tree_attention_mask`, a
    cache must be given), the slots before start[b] and new token t' iff tree_mask[b,t,t'].
    -> [B,T,N,H] in q's dtype.

    Why it is invariant: XLA compiles an op by its whole shape (a softmax over [1,3,24,64] and
    over [1,3,12,64] round apart on XLA:CPU), so every number here comes from one fixed-shape
    computation, `_tiled_lanes`, over lanes of Tq queries (`RowRule.query_tile`; a short last
    tile padded). A tree is verified as chains of its root paths (`_tree_lanes`): a node's key
    must sit where the AR step that feeds its path has it, at start + depth, or a key tile's
    sums add their terms in another order (laid out by node index, a tree's nodes off the
    main path got other bits).
    """
    b, t, n, h = q.shape
    new_k, new_v = new_kv
    kh = new_k.shape[1]
    g = n // kh
    tq = rows.query_tile(g)
    tiles_q = -(-t // tq)
    # Padded queries are dropped. [B*C, K, G*Tq, H], row m = g_i * Tq + t_i (as `attention`
    # folds them); built here, outside the lanes' loop, for every pass alike.
    q = jnp.pad(q, ((0, 0), (0, tiles_q * tq - t), (0, 0), (0, 0)))
    q_ykmh = (
        q.reshape(b, tiles_q, tq, kh, g, h).transpose(0, 1, 3, 4, 2, 5).reshape(-1, kh, g * tq, h)
    )
    if cache is None:  # a prefill: the new rows are the whole key range, from slot 0
        s = -(-t // key_tile) * key_tile
        pad = ((0, 0), (0, 0), (0, s - t), (0, 0))
        cache = (jnp.pad(new_k, pad), jnp.pad(new_v, pad))
        start_b, new_kv = jnp.zeros_like(start_b), None
    if tree_mask is not None:
        return _tree_lanes(q_ykmh, cache, new_kv, start_b, tree_mask, key_tile, n)
    # Lane (b, c): row b's queries c*Tq .. c*Tq + Tq - 1 over its new rows in order.
    query_ct = jnp.arange(tiles_q * tq, dtype=jnp.int32).reshape(tiles_q, tq)
    hi_bct = jnp.where(query_ct < t, start_b[:, None, None] + query_ct + 1, 1)
    out_xtnh = _tiled_lanes(
        q_ykmh, cache, new_kv, jnp.repeat(jnp.arange(b, dtype=jnp.int32), tiles_q),
        jnp.repeat(start_b, tiles_q), jnp.broadcast_to(query_ct, (b, tiles_q, tq)).reshape(-1, tq),
        hi_bct.reshape(-1, tq), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b * tiles_q, t)),
        key_tile, n,
    )  # fmt: skip
    return out_xtnh.reshape(b, tiles_q * tq, n, h)[:, :t]


def _tree_lanes(q_ykmh, cache, new_kv, start_b, tree_mask, key_tile: int, n: int):
    """`tiled_attention` of a token tree [B,T,T] as chains: lane (b, i, c) holds node i's root
    path laid out by depth (its ancestors' K/V at start + depth, their queries at offsets
    0..depth), so each query is computed as a chain verify of that path computes it, which
    gives the AR step's bits. Only leaves' lanes scan the cache (the others' queries see slot 0
    alone, one key tile); node i is read from the lane of the first leaf at or below it.
    q_ykmh: the queries folded per tile as `tiled_attention` folds them; n query heads."""
    b, t = tree_mask.shape[:2]
    _, kh, m, h = q_ykmh.shape
    tq, tiles_q = m * kh // n, q_ykmh.shape[0] // b
    depth_bt = jnp.sum(tree_mask, -1, dtype=jnp.int32) - 1
    leaf_bt = jnp.sum(tree_mask, 1, dtype=jnp.int32) == 1  # no node but itself below it
    # path[b, i, d]: node i's ancestor at depth d (0 past its depth).
    depth_d = jnp.arange(tiles_q * tq, dtype=jnp.int32)
    at_depth_btdt = tree_mask[:, :, None, :] & (depth_bt[:, None, None, :] == depth_d[:, None])
    path_btd = jnp.argmax(at_depth_btdt, -1).astype(jnp.int32)
    live_btd = leaf_bt[:, :, None] & (depth_d <= depth_bt[:, :, None])
    hi_btd = jnp.where(live_btd, start_b[:, None, None] + depth_d + 1, 1)
    keys_xw = jnp.repeat(path_btd[:, :, :t].reshape(b * t, t), tiles_q, axis=0)
    out_xtnh = _tiled_lanes(
        q_ykmh, cache, new_kv, jnp.repeat(jnp.arange(b, dtype=jnp.int32), t * tiles_q),
        jnp.repeat(start_b, t * tiles_q), path_btd.reshape(-1, tq), hi_btd.reshape(-1, tq),
        keys_xw, key_tile, n,
    )  # fmt: skip
    out_btdnh = out_xtnh.reshape(b, t, tiles_q * tq, n, h)
    # Node i: the first leaf at or below it (tree_mask[b, j, i]: i is j or its ancestor).
    leaf_of_bt = jnp.argmax(jnp.swapaxes(tree_mask, 1, 2) & leaf_bt[:, None, :], -1)
    return out_btdnh[jnp.arange(b)[:, None], leaf_of_bt, depth_bt]


def _tiled_lanes(
    q_ykmh, cache, new_kv, row_x, start_x, query_xt, hi_xt, keys_xw, key_tile: int, n: int
):
    """The fixed-shape core of `tiled_attention`, a loop over X lanes of Tq queries each.

    Lane x reads row row_x[x]. Its queries: the row's queries query_xt[x] (an index into its
    padded T, Tq of them), taken from q folded per query tile (q_ykmh [B*C, K, G*Tq, H], C
    tiles a row) into [K, G*Tq, H]. Its keys: the cache (k, v) [B,K,S,H] with the row's new rows
    (k, v) [B,K,W,H] (None: none) laid over slots start_x[x] + w in the order keys_xw[x] (new
    row keys_xw[x, w] at offset w). Query t sees the slots below hi_xt[x, t]. Inside, a loop
    over key tiles of `key_tile` slots, each scoring [K, G*Tq, key_tile] with an online softmax,
    from slot 0 (the cache itself is not written here). A tile past a query's last visible slot
    changes nothing exactly (its probabilities are 0 and the running max is kept, so the
    rescale is exp(0) = 1), so a lane that visits more tiles, for its later queries, gives the
    earlier ones the same bits. The lanes' gathers run inside the loop on its operands as
    every pass builds them: outside it, XLA:CPU fused RoPE into a gather of q or k and rounded
    it apart (an optimization barrier does not stop that fusion). -> [X, Tq, N, H]."""
    _, kh, m, h = q_ykmh.shape
    g = n // kh
    tq = m // g
    tiles_q = q_ykmh.shape[0] // cache[0].shape[0]
    new_k, new_v = new_kv if new_kv is not None else (None, None)
    s = cache[0].shape[2]
    if s % key_tile:
        raise ValueError(f"cache length {s} is not a multiple of the key tile {key_tile}")
    scale = h**-0.5
    dtype = cache[0].dtype
    # On a CPU a 16-bit float cache is read as its bits and each tile turned back into floats
    # inside the loop: otherwise XLA:CPU widens the whole cache to f32 once per pass for the tiles'
    # f32 products, hoisted out of the loop (K and V of every layer, every step: ~5 ms of a
    # 26 ms bf16 SmolLM2 step at one row, 2026-12-04). Same values, same products.
    if platform.xla_cpu_codegen() and bits16(dtype):
        cache_bits = tuple(jax.lax.bitcast_convert_type(c, jnp.uint16) for c in cache)
    else:
        cache_bits = cache

    def one(args):
        row, start, query_t, hi_t, keys_w = args
        # Folded row m = g_i * Tq + t_i is query_t[t_i]'s head g_i in its tile's fold.
        tile_m = jnp.tile(row * tiles_q + query_t // tq, g)
        col_m = (jnp.arange(g, dtype=jnp.int32)[:, None] * tq + query_t % tq).reshape(-1)
        q_kmh = q_ykmh[tile_m, :, col_m].transpose(1, 0, 2)
        hi_m = jnp.tile(hi_t, g)

        def key_tile_of(buf, new, i):
            tile_kth = jax.lax.dynamic_slice(buf, (row, 0, i * key_tile, 0), (1, kh, key_tile, h))
            tile_kth = jax.lax.bitcast_convert_type(tile_kth, dtype)  # a no-op but for 16 bits
            if new is None:
                return tile_kth[0]
            offset = i * key_tile + jnp.arange(key_tile) - start
            w = keys_w.shape[0]
            ours = (offset >= 0) & (offset < w)
            new_kth = jnp.take(new[row], keys_w[jnp.clip(offset, 0, w - 1)], axis=1)
            return jnp.where(ours[None, :, None], new_kth.astype(dtype), tile_kth[0])

        def body(i, carry):
            max_km, sum_km, acc_kmh = carry
            k_kth = key_tile_of(cache_bits[0], new_k, i)
            v_kth = key_tile_of(cache_bits[1], new_v, i)
            sc_kmt = jnp.einsum("kmh,kth->kmt", q_kmh, k_kth, preferred_element_type=jnp.float32)
            slot_t = i * key_tile + jnp.arange(key_tile)
            vis_mt = slot_t[None, :] < hi_m[:, None]
            sc_kmt = jnp.where(vis_mt[None], sc_kmt * scale, NEG_INF)
            new_max_km = jnp.maximum(max_km, sc_kmt.max(-1))
            rescale_km = jnp.exp(max_km - new_max_km)
            p_kmt = jnp.exp(sc_kmt - new_max_km[..., None])
            sum_km = sum_km * rescale_km + p_kmt.sum(-1)
            pv_kmh = _pv("kmt,kth->kmh", p_kmt.astype(v_kth.dtype), v_kth)
            acc_kmh = acc_kmh * rescale_km[..., None] + pv_kmh
            return new_max_km, sum_km, acc_kmh

        init = (
            jnp.full((kh, m), NEG_INF, jnp.float32),
            jnp.zeros((kh, m), jnp.float32),
            jnp.zeros((kh, m, h), jnp.float32),
        )
        n_tiles = (jnp.max(hi_m) + key_tile - 1) // key_tile
        _, sum_km, acc_kmh = jax.lax.fori_loop(0, n_tiles, body, init)
        return (acc_kmh / sum_km[..., None]).astype(q_ykmh.dtype)

    out_xkmh = jax.lax.map(one, (row_x, start_x, query_xt, hi_xt, keys_xw))
    return out_xkmh.reshape(-1, kh, g, tq, h).transpose(0, 3, 1, 2, 4).reshape(-1, tq, n, h)
