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

NEG_INF = -1e30


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B,T,N,H], k/v [B,K,S,H], mask [B,T,S] bool -> [B,T,N,H] in q's dtype.

    Scores and softmax in fp32; scale H^-0.5. Fully masked rows give a uniform average
    (never NaN); callers ignore such rows.
    """
    b, t, n, h = q.shape
    kh = k.shape[1]
    g = n // kh
    q_btkgh = q.reshape(b, t, kh, g, h)
    scores_bkgts = jnp.einsum(
        "btkgh,bksh->bkgts", q_btkgh, k, preferred_element_type=jnp.float32
    ) * (h**-0.5)
    scores_bkgts = jnp.where(mask[:, None, None, :, :], scores_bkgts, NEG_INF)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1)
    out_btkgh = jnp.einsum("bkgts,bksh->btkgh", probs_bkgts.astype(v.dtype), v)
    return out_btkgh.reshape(b, t, n, h).astype(q.dtype)


def causal_cache_mask(cache_lengths: jax.Array, num_queries: int, num_keys: int) -> jax.Array:
    """Target mask over a KV cache: query t of row b (written at slot cache_lengths[b] + t)
    sees slots s <= cache_lengths[b] + t.  -> [B,T,S] bool."""
    q_slot_bt = cache_lengths[:, None] + jnp.arange(num_queries)[None, :]
    return jnp.arange(num_keys)[None, None, :] <= q_slot_bt[:, :, None]


def causal_mask(batch: int, num_queries: int) -> jax.Array:
    """Plain causal mask over the given tokens (no cache). -> [B,T,T] bool."""
    m = jnp.tril(jnp.ones((num_queries, num_queries), dtype=bool))
    return jnp.broadcast_to(m, (batch, num_queries, num_queries))


def drafter_mask(
    context_lengths: jax.Array,
    anchors: jax.Array,
    block_size: int,
    num_context: int,
    causal: bool = False,
    window: int | None = None,
) -> jax.Array:
    """The DFlash draft/training mask over keys [context (S slots) ; blocks (N*B slots)].

    context_lengths [B]: valid context slots per row (slot s holds position s).
    anchors [B,N]: anchor position of each block; block n, slot j sits at position anchors+j.
    A query in block n sees context slot s iff s < min(anchor_n, context_length) (strictly
    before its anchor), and the block slots of its own block only (bidirectional, or causal
    for sliding layers). With `window`, keys must also satisfy q_pos - k_pos < window (both
    directions when non-causal).  -> [B, N*B, S + N*B] bool.
    """
    b, n = anchors.shape
    j = jnp.arange(block_size)
    q_pos_bnj = anchors[:, :, None] + j[None, None, :]
    q_pos_bt = q_pos_bnj.reshape(b, n * block_size)
    q_anchor_bt = jnp.repeat(anchors, block_size, axis=1)
    q_block_t = jnp.repeat(jnp.arange(n), block_size)

    ctx_pos_s = jnp.arange(num_context)
    ctx_limit_bt = jnp.minimum(q_anchor_bt, context_lengths[:, None])
    ctx_vis_bts = ctx_pos_s[None, None, :] < ctx_limit_bt[:, :, None]
    if window is not None:
        ctx_vis_bts &= (q_pos_bt[:, :, None] - ctx_pos_s[None, None, :]) < window

    same_block_tt = q_block_t[:, None] == q_block_t[None, :]
    blk_vis_btt = jnp.broadcast_to(same_block_tt, (b, n * block_size, n * block_size))
    diff_btt = q_pos_bt[:, :, None] - q_pos_bt[:, None, :]
    if causal:
        blk_vis_btt &= diff_btt >= 0
    if window is not None:
        blk_vis_btt &= jnp.abs(diff_btt) < window
    return jnp.concatenate([ctx_vis_bts, blk_vis_btt], axis=-1)
