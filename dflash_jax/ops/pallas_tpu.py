"""The drafter's training attention on TPU: splash attention with a per-example dynamic mask
(dflash-spec §12.6).

Keys are [context (S) ; blocks (Q)] concatenated, the mask is `drafter_mask` [B,Q,S+Q]; splash
skips the kv tiles that mask leaves empty (it cannot shrink its grid). GQA: one MQA splash
kernel per kv head over its G query heads. Sequences are padded to the 128-row tiles splash
needs (padding rows and keys are masked, then dropped). This module serves MIN_QUERIES or more
queries (training). Decode shapes (one block of 16 queries) would fill an eighth of a tile and
rebuild the mask metadata every step: ops.pallas_tpu_decode serves them (see ops/dispatch.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

TILE = 128  # splash's default q and kv tile
MIN_QUERIES = TILE


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _keep_dynamic(kernel: splash.SplashAttentionKernel) -> splash.SplashAttentionKernel:
    """Under jit/vmap `MaskInfo.is_dynamic_mask` becomes a tracer and the call raises
    TracerBoolConversionError (jax 0.10.2 and HEAD): set it back to the constant it is."""
    fix = lambda info: None if info is None else info._replace(is_dynamic_mask=True)
    return splash.SplashAttentionKernel(
        fix(kernel.fwd_mask_info),
        fix(kernel.dq_mask_info),
        fix(kernel.dkv_mask_info),
        **kernel.kwargs,
    )


def block_attention(
    q_bqnh: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    blk_k: jax.Array,
    blk_v: jax.Array,
    mask_bqk: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """q [B,Q,N,H]; ctx_k/ctx_v [B,K,S,H]; blk_k/blk_v [B,K,Q,H]; mask [B,Q,S+Q] bool
    (`drafter_mask`). -> [B,Q,N,H] in q's dtype. Differentiable (splash's own backward)."""
    b, q_len, n, h = q_bqnh.shape
    kh = ctx_k.shape[1]
    g = n // kh
    # Splash takes no scale: fold H^-0.5 into q in fp32, so that the scores are q.k times the
    # scale as every other path computes them (a bf16 q scaled in bf16 rounds first). Keys and
    # values go in as fp32 too: splash's products then never mix an fp32 operand with a bf16
    # one (its forward already widens v to fp32), at the cost of fp32 q.k products.
    f32 = jnp.float32
    k_bksh = jnp.concatenate([ctx_k.astype(f32), blk_k.astype(f32)], axis=2)
    v_bksh = jnp.concatenate([ctx_v.astype(f32), blk_v.astype(f32)], axis=2)
    kv_len = k_bksh.shape[2]
    q_pad, kv_pad = _round_up(q_len, TILE) - q_len, _round_up(kv_len, TILE) - kv_len
    q_bkgqh = q_bqnh.astype(f32) * h**-0.5
    q_bkgqh = q_bkgqh.reshape(b, q_len, kh, g, h).transpose(0, 2, 3, 1, 4)
    q_bkgqh = jnp.pad(q_bkgqh, ((0, 0), (0, 0), (0, 0), (0, q_pad), (0, 0)))
    k_bksh = jnp.pad(k_bksh, ((0, 0), (0, 0), (0, kv_pad), (0, 0)))
    v_bksh = jnp.pad(v_bksh, ((0, 0), (0, 0), (0, kv_pad), (0, 0)))
    mask_bqk = jnp.pad(mask_bqk, ((0, 0), (0, q_pad), (0, kv_pad)))

    def one_example(q_kgqh, k_ksh, v_ksh, mask_qk):
        kernel = splash.make_splash_mqa(
            mask_qk[None], head_shards=1, q_seq_shards=1, interpret=interpret
        )
        return jax.vmap(_keep_dynamic(kernel))(q_kgqh, k_ksh, v_ksh)

    out_bkgqh = jax.vmap(one_example)(q_bkgqh, k_bksh, v_bksh, mask_bqk)
    out_bqnh = out_bkgqh[:, :, :, :q_len].transpose(0, 3, 1, 2, 4).reshape(b, q_len, n, h)
    return out_bqnh.astype(q_bqnh.dtype)
