"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, with its carried state:
a short causal depthwise convolution (state: the last `kernel - 1` inputs) and a recurrent
matrix per value head (state [Hv, Dk, Dv], kept in fp32), updated by the gated delta rule

    S_t = a_t S_{t-1} + k_t beta_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,   a_t = exp(g_t)

A pass over T tokens runs the rule as a chunked scan (`gated_delta_rule`: C-token chunks, a
unit-triangular solve by blocked forward substitution in fp32 inside each chunk, `lax.scan`
over chunks), the same code for a prefill, a verify block and a single AR token.

Rollback. A KV cache rolls back by lowering a length; this state does not. A token with
beta = 0 and g = 0 leaves the state exactly as it was, so the state after the first L of T
tokens is the same rule run with the tokens from L on masked that way. A prefill of right-padded
prompts masks each row's padding; a speculative verify returns its per-token inputs
(`LinearRows`) instead of a new state, and `commit_state` re-runs the rule on them, masked at
each row's accepted length (one extra T-token pass, nothing kept per position).

Head layout. The conv channels are kept grouped per key head, [Hk, G] with G = 2*Dk + r*Dv
(r = Hv/Hk): key head i's query, its key and its r value heads i*r .. i*r+r-1, the grouping
Qwen3-Next's checkpoints use (the loader regroups Qwen3.5's all-queries | all-keys | all-values).
So a split of the key heads over `tensor` gives each device whole groups: the in-projection
columns, conv channels and conv state of its key heads, the value heads they serve (z, b, a, the
recurrent state, the out-projection rows), and nothing it needs from another device.

Tensor parallelism is GSPMD's, with explicit constraints, not `shard_map`: the rule is plain
jnp (no Mosaic or Triton call that GSPMD cannot partition), each of its ops is batched over the
heads, and the params and carried state arrive split by the one table (`sharding`:
linear_key_heads, linear_value_heads -> tensor). `gated_delta_rule` pins its operands and the
state to that split (`sharding.constrain`), so each device runs its heads' recurrence with no
collective; the one per layer is the out-projection's row-split matmul, which GSPMD reduces
(an all-reduce of [B,T,D]). Heads that `tensor` does not divide are replicated, warned once
(`sharding.logical_to_spec`): the key heads alone (Hk=2 at tensor=4 with Hv=4: every device
projects and convolves every group and keeps its value heads; GSPMD adds one small permute of
[B,T,1,Dk] per layer), or both (the layer then runs whole on every device).

Letters: B batch, T tokens, Hk/Hv key/value heads, G = 2*Dk + r*Dv channels per key head,
Dk/Dv head dims, D model dim, W = kernel - 1.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.ops import dots

CHUNK = 64


@flax.struct.dataclass
class LinearRows:
    """A pass's per-token state inputs, for `commit_state`: x [B,T,Hk,G] (the conv's inputs),
    k [B,T,Hk,Dk] (l2-normed, fp32), v [B,T,Hv,Dv], g [B,T,Hv] (log decay), beta [B,T,Hv]."""

    x: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def _l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _repeat_heads(x_bthk, num_v_heads):
    """Key heads -> value heads: key head i serves value heads i*r .. i*r+r-1."""
    return jnp.repeat(x_bthk, num_v_heads // x_bthk.shape[2], axis=2)


# Rows of the diagonal blocks `_unit_lower_solve` inverts one row at a time.
SOLVE_BLOCK = 16


def _unit_lower_solve(a_cc, b_cw, block=SOLVE_BLOCK):
    """X = (I + A)^-1 B for strictly lower-triangular A [..., C, C] and B [..., C, W], in fp32,
    by blocked forward substitution: each diagonal block's unit-triangular inverse row by row
    (row i = e_i - A_i T, from the rows before it; one small product per row, all blocks at
    once), then the blocks in order, X_p = T_pp (B_p - A_p,<p X_<p), as matmuls.

    Every step sums exact terms of the solution, which stays O(1) where the delta rule's
    inverse does (it is the rule's own WY factor): repeated keys with write strengths near 1
    and no decay included. The product form (I - A)(I + A^2)(I + A^4)... built A^32 on the way,
    whose entries reach C^31 / 31! there, and lost every digit to cancellation past one
    64-token chunk (NaN at 520 tokens). No triangular-solve call either: XLA:CPU runs one as a
    LAPACK custom call (batched decodes of a few hundred rows stalled in it), and accelerators
    run it slower than matmuls."""
    c = a_cc.shape[-1]
    s = min(block, c)
    n = -(-c // s)
    pad = n * s - c  # zero rows and columns: their X rows are B's, zero
    a_cc = jnp.pad(a_cc, [(0, 0)] * (a_cc.ndim - 2) + [(0, pad), (0, pad)])
    b_cw = jnp.pad(b_cw, [(0, 0)] * (b_cw.ndim - 2) + [(0, pad), (0, 0)])
    hi = jax.lax.Precision.HIGHEST
    # The diagonal blocks [..., N, S, S] and their inverses T, built one row at a time.
    diag = jnp.stack([a_cc[..., p * s : (p + 1) * s, p * s : (p + 1) * s] for p in range(n)], -3)
    inv = jnp.broadcast_to(jnp.eye(s, dtype=a_cc.dtype), diag.shape)
    for i in range(1, s):
        row = jnp.einsum("...j,...jk->...k", diag[..., i, :], inv, precision=hi)  # A_i T
        inv = inv.at[..., i, :].add(-row)  # row i of T was e_i; rows >= i of T @ A_i are 0
    xs = []
    for p in range(n):
        rhs = b_cw[..., p * s : (p + 1) * s, :]
        if p:
            done = jnp.concatenate(xs, -2)  # X_<p [..., p*S, W]
            rhs = rhs - jnp.einsum(
                "...ij,...jw->...iw", a_cc[..., p * s : (p + 1) * s, : p * s], done, precision=hi
            )
        xs.append(jnp.einsum("...ij,...jw->...iw", inv[..., p, :, :], rhs, precision=hi))
    return jnp.concatenate(xs, -2)[..., :c, :]


_TOKEN_HEADS = sharding.LINEAR_VALUE_HEAD_AXES
_CONV_AXES, _STATE_AXES = sharding.LINEAR_STATE_AXES


def gated_delta_rule(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, s_bhkv, chunk=CHUNK):
    """The rule over T tokens from state s [B,H,Dk,Dv]; all fp32, q/k already repeated to the
    value heads, q scaled. -> (o [B,T,H,Dv], final state [B,H,Dk,Dv]). Under a mesh every
    operand, the state and the output are split over batch and heads, so the rule runs on each
    device's heads alone."""
    tokens = lambda x: sharding.constrain(x, (*_TOKEN_HEADS, None)[: x.ndim])
    state = lambda s: sharding.constrain(s, _STATE_AXES)
    operands = map(tokens, (q_bthk, k_bthk, v_bthv, g_bth, beta_bth))
    o_bthv, s_bhkv = _chunked_rule(*operands, state(s_bhkv), chunk)
    return tokens(o_bthv), state(s_bhkv)


def _chunked_rule(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, s_bhkv, chunk):
    b, t, h, dk = k_bthk.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # [B,T,H,...] -> [N,B,H,C,...]; padding tokens have beta = g = 0
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    xs = tuple(chunks(x) for x in (q_bthk, k_bthk, v_bthv, g_bth, beta_bth))
    incl = jnp.tril(jnp.ones((c, c), bool))  # j <= i
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    hi = jax.lax.Precision.HIGHEST

    def step(s, inp):
        q, k, v, g, beta = inp  # [B,H,C,Dk], [B,H,C,Dk], [B,H,C,Dv], [B,H,C], [B,H,C]
        gam = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
        decay_cc = jnp.where(
            incl, jnp.exp(jnp.where(incl, gam[..., :, None] - gam[..., None, :], 0)), 0
        )
        kk = jnp.einsum("bhik,bhjk->bhij", k, k, precision=hi)
        a_cc = jnp.where(strict, beta[..., :, None] * kk * decay_cc, 0)
        rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gam))[..., None] * k], -1)
        u, w = jnp.split(_unit_lower_solve(a_cc, rhs), [v.shape[-1]], -1)  # [B,H,C,Dv|Dk]
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s, precision=hi)
        qk = jnp.einsum("bhik,bhjk->bhij", q, k, precision=hi) * decay_cc
        o = jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(gam)[..., None], s, precision=hi)
        o = o + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=hi)
        tail = jnp.exp(gam[..., -1:] - gam)[..., None] * k
        s = s * jnp.exp(gam[..., -1])[..., None, None]
        s = s + jnp.einsum("bhck,bhcv->bhkv", tail, v_new, precision=hi)
        return s, o

    if n == 1:  # a decode step or verify block: one chunk, no loop to compile
        s, o = step(s_bhkv, tuple(x[0] for x in xs))
        return jnp.swapaxes(o, 1, 2)[:, :t], s
    s, o = jax.lax.scan(step, s_bhkv, xs)  # o [N,B,H,C,Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, -1)[:, :, :t]
    return jnp.swapaxes(o, 1, 2), s


def _valid_mask(lengths_b, b, t):
    """[B,T] bool: token t counts toward the state (all when lengths is None)."""
    if lengths_b is None:
        return jnp.ones((b, t), bool)
    return jnp.arange(t)[None, :] < lengths_b[:, None]


def advance_state(state, rows: LinearRows, lengths_b=None, conv_only=False):
    """The (conv [B,W,Hk,G], rec [B,Hv,Dk,Dv]) state after each row's first lengths[b] tokens
    of `rows` (all T when None)."""
    conv_bwkg, rec = state
    b, t = rows.x.shape[:2]
    window = conv_bwkg.shape[1]
    full_btkg = jnp.concatenate([conv_bwkg, rows.x.astype(conv_bwkg.dtype)], axis=1)
    taken = jnp.full((b,), t, jnp.int32) if lengths_b is None else lengths_b
    idx_bw = taken[:, None] + jnp.arange(window)[None, :]
    conv_bwkg = jnp.take_along_axis(full_btkg, idx_bw[:, :, None, None], axis=1)
    conv_bwkg = sharding.constrain(conv_bwkg, _CONV_AXES)
    if conv_only:
        return conv_bwkg, rec
    valid_bt = _valid_mask(lengths_b, b, t)
    g = jnp.where(valid_bt[..., None], rows.g, 0.0)
    beta = jnp.where(valid_bt[..., None], rows.beta, 0.0)
    k = _repeat_heads(rows.k, rows.v.shape[2])
    _, rec = gated_delta_rule(jnp.zeros_like(k), k, rows.v.astype(jnp.float32), g, beta, rec)
    return conv_bwkg, rec


def commit_state(state, rows: LinearRows, lengths_b):
    """A verify's state committed at each row's accepted length: `advance_state` over `rows`
    stopped at lengths[b] (0 leaves the row's state as it was)."""
    return advance_state(state, rows, lengths_b)


def group_width(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """G: the conv channels of one key head (its query, its key, its value heads)."""
    return 2 * head_k_dim + num_v_heads // num_k_heads * head_v_dim


def init_state(config, batch: int, dtype):
    """A zero (conv [B,W,Hk,G], rec [B,Hv,Dk,Dv] fp32) state for one linear-attention layer."""
    c = config
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    width = group_width(hk, hv, c.linear_key_head_dim, c.linear_value_head_dim)
    conv = jnp.zeros((batch, c.linear_conv_kernel_dim - 1, hk, width), dtype)
    rec_shape = (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    return conv, jnp.zeros(rec_shape, jnp.float32)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim in fp32, scaled in the activation dtype, times silu(gate)."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, gate):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = scale.astype(self.dtype) * x32.astype(self.dtype)
        return (out * nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


class CausalConv(nn.Module):
    """Depthwise causal conv (kernel [W+1,Hk,G]) then silu over [past W inputs ; x]."""

    kernel_size: int

    @nn.compact
    def __call__(self, past_bwkg, x_btkg):
        t, channels = x_btkg.shape[1], x_btkg.shape[2:]
        shape = (self.kernel_size, *channels)
        w = self.param("kernel", nn.initializers.lecun_normal(), shape, jnp.float32)
        full = jnp.concatenate([past_bwkg.astype(x_btkg.dtype), x_btkg], axis=1)  # [B,W+T,Hk,G]
        out = sum(full[:, j : j + t] * w[j].astype(x_btkg.dtype) for j in range(self.kernel_size))
        return nn.silu(out)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer. Params (HF names): in_proj_qkv [D,Hk,G], in_proj_z [D,Hv,Dv],
    in_proj_b / in_proj_a [D,Hv], conv1d kernel [W+1,Hk,G], dt_bias / A_log [Hv], norm scale
    [Dv] (a `GatedRMSNorm`), out_proj [Hv,Dv,D]."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_btd, state=None, lengths_b=None, defer=False):
        """x [B,T,D]; state (conv, rec) or None (zeros, and none returned). lengths [B]: the
        state advances over each row's first lengths[b] tokens only (None: all). defer: the
        state is not advanced; its place in the result holds the pass's `LinearRows`.
        -> (out [B,T,D], new state | LinearRows | None)."""
        b, t, d = x_btd.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        opts = dict(use_bias=False, dtype=self.dtype, dot_general=dots.dot_general)
        dense = lambda f, name, **kw: nn.DenseGeneral(f, **opts, **kw, name=name)
        width = group_width(hk, hv, dk, dv)
        x_btkg = dense((hk, width), "in_proj_qkv")(x_btd)
        z_bthv = dense((hv, dv), "in_proj_z")(x_btd)
        b_bth = dense(hv, "in_proj_b")(x_btd)
        a_bth = dense(hv, "in_proj_a")(x_btd)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), jnp.float32)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), jnp.float32)
        window = self.conv_kernel - 1
        past = jnp.zeros((b, window, hk, width), x_btkg.dtype) if state is None else state[0]
        conv_btkg = CausalConv(self.conv_kernel, name="conv1d")(past, x_btkg)
        conv_btkg = sharding.constrain(conv_btkg, sharding.LINEAR_CHANNEL_AXES)
        q, k, v = jnp.split(conv_btkg, [dk, 2 * dk], axis=-1)  # each key head's q, k, r values
        q = _l2norm(q.astype(jnp.float32)) * dk**-0.5
        k = _l2norm(k.astype(jnp.float32))
        v = v.reshape(b, t, hv, dv)
        beta = jax.nn.sigmoid(b_bth.astype(jnp.float32))
        g = -jnp.exp(a_log) * jax.nn.softplus(a_bth.astype(jnp.float32) + dt_bias)
        rows = LinearRows(x=x_btkg, k=k, v=v, g=g, beta=beta)
        rec = jnp.zeros((b, hv, dk, dv), jnp.float32) if state is None else state[1]  # fp32 state
        valid_bt = _valid_mask(lengths_b, b, t)
        g_in = jnp.where(valid_bt[..., None], g, 0.0)
        beta_in = jnp.where(valid_bt[..., None], beta, 0.0)
        o_bthv, rec_new = gated_delta_rule(
            _repeat_heads(q, hv), _repeat_heads(k, hv), v.astype(jnp.float32), g_in, beta_in, rec
        )
        o = GatedRMSNorm(self.eps, self.dtype, name="norm")(o_bthv.astype(self.dtype), z_bthv)
        out = dense(d, "out_proj", axis=(-2, -1))(o)  # the layer's one reduction over `tensor`
        if state is None:
            return out, None
        if defer:
            return out, rows
        conv_new, _ = advance_state(state, rows, lengths_b, conv_only=True)
        return out, (conv_new, rec_new)
