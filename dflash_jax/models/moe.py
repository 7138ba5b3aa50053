"""The sparse mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE: a softmax router
picks each token's top-k experts (weights renormalised over the k when `norm_topk_prob`), every
chosen expert runs (dropless: a verify's extra tokens may route anywhere), and an optional
shared expert, scaled by a sigmoid gate, is added.

Each chosen expert runs on its (token, choice) rows sorted by expert: each SwiGLU matmul is one
`lax.ragged_dot` over the expert groups (each row multiplied only by its own expert's weights).
On GPU/TPU ragged_dot is a grouped matmul, so the cost is that of the chosen (token, expert)
products and each expert's weights are read once; on CPU JAX expands it into a masked product
against every expert (E times the flops), which is fine for tests. A token's k outputs are then
combined in fp32 in the router's order (choice 0, 1, ..): the same sum on any mesh.

Expert parallelism: under a mesh whose `expert` axis (the table's; mesh axis `tensor`) splits
the experts, each device holds E/n whole experts and they stay put; the tokens move
(`experts_on_mesh`, in `shard_map`): each device of an expert group takes 1/n of its tokens,
sends each (token, choice) row to the device of its expert with `all_to_all`, runs the rows it
receives through its own experts, gets its rows' outputs back by the reverse `all_to_all`
and combines them; the outputs leave split over the group (GSPMD gathers these activations,
never a weight). The send buffers hold, per
destination, as many rows as the device has (token, choice) pairs (capacity = tokens x k), so
no pair can overflow and none is ever dropped, at any batch or verify width.

Params (names mirror HF): gate [D,E] (the router), experts {gate_proj, up_proj [E,D,F],
down_proj [E,F,D]}, optional shared_expert (an `MLP`) and shared_expert_gate [D,1].
Letters: M tokens, D model dim, E experts, F expert width, K = top-k.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dflash_jax import sharding
from dflash_jax.models.layers import MLP
from dflash_jax.ops import dots


def route(logits_me: jax.Array, top_k: int, normalise: bool):
    """Router logits [M,E] -> (weights [M,K] in the logits' dtype, expert ids [M,K] int32):
    softmax in fp32, top-k, optionally renormalised over the k."""
    probs_me = jax.nn.softmax(logits_me.astype(jnp.float32), axis=-1)
    weights_mk, ids_mk = jax.lax.top_k(probs_me, top_k)
    if normalise:
        weights_mk = weights_mk / jnp.sum(weights_mk, axis=-1, keepdims=True)
    return weights_mk.astype(logits_me.dtype), ids_mk.astype(jnp.int32)


def expert_rows(x_rd, ids_r, w_gate_edf, w_up_edf, w_down_efd, act=nn.silu) -> jax.Array:
    """Row r through expert ids_r[r]'s gated MLP (act(gate) * up; SwiGLU by default) -> [R,D]
    in x's dtype. Rows whose id is E or more (an empty slot of a dispatch buffer) are left
    out of every group and give 0."""
    num_experts = w_gate_edf.shape[0]
    order = jnp.argsort(ids_r, stable=True)  # rows grouped by expert, left-out rows last
    group_sizes = jnp.bincount(ids_r, length=num_experts).astype(jnp.int32)  # (ids >= E: none)
    xs_rd = x_rd[order]
    cast = lambda w: w.astype(x_rd.dtype)
    gate_rf = dots.ragged_dot(xs_rd, cast(w_gate_edf), group_sizes)
    up_rf = dots.ragged_dot(xs_rd, cast(w_up_edf), group_sizes)
    ys_rd = dots.ragged_dot(act(gate_rf) * up_rf, cast(w_down_efd), group_sizes)
    y_rd = jnp.zeros_like(ys_rd).at[order].set(ys_rd)
    return jnp.where((ids_r < num_experts)[:, None], y_rd, 0)


def combine(weights_mk: jax.Array, y_mkd: jax.Array, dtype) -> jax.Array:
    """sum_k weights[m,k] * y[m,k] in fp32, added in the router's order k = 0, 1, .. (the same
    sum on any mesh) -> [M,D] in `dtype`."""
    w_mk = weights_mk.astype(jnp.float32)
    acc_md = w_mk[:, 0, None] * y_mkd[:, 0].astype(jnp.float32)
    for k in range(1, y_mkd.shape[1]):
        acc_md = acc_md + w_mk[:, k, None] * y_mkd[:, k].astype(jnp.float32)
    return acc_md.astype(dtype)


def experts_forward(x_md, weights_mk, ids_mk, w_gate_edf, w_up_edf, w_down_efd) -> jax.Array:
    """Each token through its chosen experts, weighted and summed -> [M,D] (dropless)."""
    m, k = ids_mk.shape
    y_rd = expert_rows(jnp.repeat(x_md, k, axis=0), ids_mk.reshape(-1), w_gate_edf, w_up_edf,
                       w_down_efd)  # fmt: skip
    return combine(weights_mk, y_rd.reshape(m, k, -1), x_md.dtype)


def experts_on_mesh(x_md, weights_mk, ids_mk, w_gate_edf, w_up_edf, w_down_efd) -> jax.Array:
    """`experts_forward` with the experts split over the traced program's mesh by the table's
    `expert` axis, the tokens dispatched to them by all-to-all in `shard_map` (module
    docstring); `experts_forward` as is without a mesh or when the experts stay whole (E not
    divisible by the axis). The tokens stay split over the batch axes; an expert weight
    entering whole in its other dims (fsdp > 1 splits its model dim) is gathered over those
    axes, as FSDP does."""
    mesh = sharding.program_mesh()
    args = (x_md, weights_mk, ids_mk, w_gate_edf, w_up_edf, w_down_efd)
    if mesh is None:
        return experts_forward(*args)
    expert = sharding.logical_to_spec(("expert",), w_gate_edf.shape[:1], mesh)[0]
    if expert is None:
        return experts_forward(*args)
    axes = (expert,) if isinstance(expert, str) else tuple(expert)
    sizes = tuple(mesh.shape[a] for a in axes)
    rows = sharding.logical_to_spec(("batch", None), x_md.shape, mesh)
    weights = sharding.logical_to_spec(("expert", None, None), (w_gate_edf.shape[0], 1, 1), mesh)
    fn = functools.partial(_dispatch, axes, sizes)
    # Out: each device's share of its batch rows' tokens, so the tokens split over the batch
    # axes and then the expert axes ([groups, n x per, D]; the group's padding cut after).
    row_axes = rows[0] if isinstance(rows[0], tuple) else (rows[0],) * (rows[0] is not None)
    out_spec = PartitionSpec(row_axes + axes, None)
    specs = (rows, rows, rows, weights, weights, weights)
    out = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec)(*args)
    groups = math.prod(mesh.shape[a] for a in row_axes)
    m = x_md.shape[0] // groups
    return out.reshape(groups, -1, x_md.shape[1])[:, :m].reshape(x_md.shape)


def _dispatch(axes, sizes, x_md, weights_mk, ids_mk, w_gate_edf, w_up_edf, w_down_efd):
    """One device's part of `experts_on_mesh`: x [M,D], weights/ids [M,K] of its batch rows
    (whole over `axes`), its E/n experts. -> [ceil(M/n),D]: the outputs of its share of the
    tokens (the last device's padded)."""
    (m, k), d = ids_mk.shape, x_md.shape[1]
    n, local = math.prod(sizes), w_gate_edf.shape[0]
    me = 0
    for axis, size in zip(axes, sizes, strict=True):  # this device's index along `axes`
        me = me * size + jax.lax.axis_index(axis)
    per = -(-m // n)  # tokens each device of the group dispatches (the last ones padded)

    def mine(a):
        a = jnp.pad(a, [(0, per * n - m)] + [(0, 0)] * (a.ndim - 1))
        return jax.lax.dynamic_slice_in_dim(a, me * per, per)

    x_pd, w_pk, ids_p = mine(x_md), mine(weights_mk), mine(ids_mk).reshape(-1)
    # (token, choice) pair p goes to device dest_p, into the next free slot of its buffer
    dest_p = ids_p // local
    to_pn = dest_p[:, None] == jnp.arange(n)
    slot_p = jnp.sum(jnp.cumsum(to_pn, axis=0) * to_pn, axis=1) - 1
    capacity = per * k  # every pair of this device may go to one device: never overflows
    send_ncd = jnp.zeros((n, capacity, d), x_md.dtype)
    send_ncd = send_ncd.at[dest_p, slot_p].set(jnp.repeat(x_pd, k, axis=0))
    send_nc = jnp.full((n, capacity), local, jnp.int32).at[dest_p, slot_p].set(ids_p % local)
    swap = lambda a: jax.lax.all_to_all(a, axes, 0, 0)  # [n,..]: chunk i to/from device i
    recv_ncd, recv_nc = swap(send_ncd), swap(send_nc)
    y_rd = expert_rows(recv_ncd.reshape(n * capacity, d), recv_nc.reshape(-1), w_gate_edf,
                       w_up_edf, w_down_efd)  # fmt: skip
    back_ncd = swap(y_rd.reshape(n, capacity, d))
    return combine(w_pk, back_ncd[dest_p, slot_p].reshape(per, k, d), x_md.dtype)


class Experts(nn.Module):
    """The routed experts' stacked SwiGLU weights: gate_proj, up_proj [E,D,F], down_proj [E,F,D]."""

    num_experts: int
    expert_size: int

    @nn.compact
    def __call__(self, x_md, weights_mk, ids_mk):
        e, d, f = self.num_experts, x_md.shape[-1], self.expert_size
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        gate = self.param("gate_proj", init, (e, d, f), jnp.float32)
        up = self.param("up_proj", init, (e, d, f), jnp.float32)
        down = self.param("down_proj", init, (e, f, d), jnp.float32)
        return experts_on_mesh(x_md, weights_mk, ids_mk, gate, up, down)


class SparseMoE(nn.Module):
    """x [B,T,D] -> [B,T,D]."""

    num_experts: int
    top_k: int
    expert_size: int
    normalise: bool
    shared_size: int = 0  # 0: no shared expert
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        b, t, d = x_btd.shape
        x_md = x_btd.reshape(b * t, d)
        dense = lambda f, name: nn.Dense(
            f, use_bias=False, dtype=self.dtype, dot_general=dots.dot_general, name=name
        )
        router = dense(self.num_experts, "gate")
        weights_mk, ids_mk = route(router(x_md), self.top_k, self.normalise)
        experts = Experts(self.num_experts, self.expert_size, name="experts")
        out_md = experts(x_md, weights_mk, ids_mk)
        if self.shared_size:
            shared_md = MLP(self.shared_size, self.dtype, name="shared_expert")(x_md)
            gate_m1 = dense(1, "shared_expert_gate")(x_md)
            out_md = out_md + jax.nn.sigmoid(gate_m1) * shared_md
        return out_md.reshape(b, t, d)
