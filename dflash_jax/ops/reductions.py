"""Reductions XLA:CPU runs poorly in their stock form."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.ops import dots, platform


def argmax_last(x: jax.Array) -> jax.Array:
    """argmax over the last axis (first index on ties, as `jnp.argmax`) -> int32 [...].

    Two plain reductions (the max, then the lowest index that reaches it) instead of
    `jnp.argmax`'s (value, index) pair reduction, which XLA:CPU does not vectorise: over
    15 x 49152 logits 0.47 ms instead of 1.75 ms.

    A row holding a NaN has no maximum: it gives V - 1, the last id (`jnp.argmax` gives the
    NaN's index), so the result is always a valid id and nothing downstream gathers out of
    range. A caller that must tell such a row from a real choice checks its input
    (`jnp.isnan(x).any(-1)`); the decode does not, as NaN logits have no correct token.
    """
    v = x.shape[-1]
    max_x1 = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(x == max_x1, iota, v), axis=-1), v - 1)


def head_argmax(
    hidden_xd: jax.Array, head_dv: jax.Array, head_vd: jax.Array, chunk: int = 128
) -> jax.Array:
    """argmax_v (hidden @ head_dv)[..., v] without materialising the logits -> int32 [...].

    XLA:CPU fuses a GEMM with a max over its output into one kernel that never writes the
    logits (16 x 576 x 49152: 2.6 ms), but a full argmax materialises them and reads them twice
    (4.7 ms). So: (1) the fused GEMM + max per vocabulary chunk of `chunk` columns [N, V/chunk]
    (the barrier keeps that max the GEMM's only consumer, which the fusion needs); (2) each
    row's first chunk holding the row max; (3) that chunk's logits recomputed from the head's
    [V,D] rows `head_vd` (the tied embedding, gathered contiguously) and their first max. 16
    rows: 3.0 ms; 1 row: unchanged. Ties resolve to the lowest index, as `jnp.argmax`. The
    recomputed chunk is a different GEMM, so in fp32 a near-tie (within rounding) can resolve
    differently from `argmax_last(hidden @ head_dv)`: decoding uses this one function for every
    greedy target token (prefill, AR and verify), so both decoders agree.

    In bf16 (which decodes through `argmax_last` instead, `head_argmax_applies`) the GEMM
    contracts the [V,D] rows as stored, as `Head.logits` does.
    """
    *lead, d = hidden_xd.shape
    v = head_dv.shape[1]
    n_chunks = v // chunk
    x_nd = hidden_xd.reshape(-1, d)
    n = x_nd.shape[0]
    if x_nd.dtype == jnp.bfloat16:  # the [V,D] rows as stored: see the docstring
        logits_nv = dots.matmul_t(x_nd, head_vd.astype(x_nd.dtype))
    else:
        logits_nv = dots.matmul(x_nd, head_dv.astype(x_nd.dtype))
    logits_nck = logits_nv.reshape(n, n_chunks, chunk)
    chunk_max_nc = jax.lax.optimization_barrier(jnp.max(logits_nck, axis=-1))
    best_n = argmax_last(chunk_max_nc)  # a NaN row: the last chunk, then its last id
    rows_nkd = jnp.take(head_vd.reshape(n_chunks, chunk, d), best_n, axis=0)
    local_nk = dots.einsum("nd,nkd->nk", x_nd, rows_nkd.astype(x_nd.dtype))
    return (best_n * chunk + argmax_last(local_nk)).reshape(lead)


def head_argmax_applies(head_vd, vocab_size: int, chunk: int = 128) -> bool:
    """Whether `head_argmax` is the faster greedy path: on CPU, with [V,D] rows, V % chunk == 0,
    not in bf16. In bf16 `argmax_last` over the logits of one GEMM on the stored rows was the
    faster (SmolLM2's head in a loop, 2026-12-03, avx512_bf16, best of 5: 3.9 against 5.8 ms at
    1 row, 6.0 against 8.3 ms at 16)."""
    if head_vd is None or head_vd.dtype == jnp.bfloat16:
        return False
    return vocab_size % chunk == 0 and platform.is_cpu()
