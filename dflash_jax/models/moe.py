"""The sparse mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE: a softmax router
picks each token's top-k experts (weights renormalised over the k when `norm_topk_prob`), every
chosen expert runs (dropless: no capacity, so a verify's extra tokens may route anywhere), and
an optional shared expert, scaled by a sigmoid gate, is added.

Dispatch is sort-by-expert: the M*k (token, choice) pairs are ordered by expert, the tokens
gathered in that order, and each SwiGLU matmul is one `lax.ragged_dot` over the expert groups
(M*k rows, each multiplied only by its own expert's weights), then the rows are weighted and
scattered back. On GPU/TPU ragged_dot is a grouped matmul, so the cost is that of the M*k
chosen (token, expert) products and each expert's weights are read once; on CPU JAX expands it
into a masked product against every expert (E times the flops), which is fine for tests.

Params (names mirror HF): gate [D,E] (the router), experts {gate_proj, up_proj [E,D,F],
down_proj [E,F,D]}, optional shared_expert (an `MLP`) and shared_expert_gate [D,1].
Letters: M tokens, D model dim, E experts, F expert width, K = top-k.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

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


def experts_forward(x_md, weights_mk, ids_mk, w_gate_edf, w_up_edf, w_down_efd) -> jax.Array:
    """Each token through its chosen experts, weighted and summed -> [M,D] (dropless)."""
    m, k = ids_mk.shape
    num_experts = w_gate_edf.shape[0]
    flat_ids = ids_mk.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
    token_of = order // k
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    x_rd = x_md[token_of]  # R = M*K rows in expert order
    gate_rf = dots.ragged_dot(x_rd, w_gate_edf.astype(x_md.dtype), group_sizes)
    up_rf = dots.ragged_dot(x_rd, w_up_edf.astype(x_md.dtype), group_sizes)
    y_rd = dots.ragged_dot(nn.silu(gate_rf) * up_rf, w_down_efd.astype(x_md.dtype), group_sizes)
    y_rd = y_rd * weights_mk.reshape(-1)[order][:, None]
    return jnp.zeros_like(x_md).at[token_of].add(y_rd)


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
        return experts_forward(x_md, weights_mk, ids_mk, gate, up, down)


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
