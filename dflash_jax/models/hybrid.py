"""The layers of the MoE and hybrid targets (config.LAYERED_ARCHS), built per layer kind:

  qwen3_moe     Qwen3 attention (q/k RMSNorm) + sparse MoE MLPs
  qwen3_5       Gated DeltaNet linear-attention layers (`linear_attention.py`) beside gated full
                attention, dense MLPs
  qwen3_next,   the same with MoE MLPs and a gated shared expert
  qwen3_5_moe

The hybrid families use zero-centred RMSNorms (`normalise(x) * (1 + w)`, in fp32, then cast),
a full attention whose q_proj also yields a per-channel output gate (`o * sigmoid(gate)`), and
RoPE on the first `rotary_dim` channels of each head. Full-attention layers use the cache and
attention dispatch of the dense target (`ops.dispatch`); linear-attention layers carry a
(conv, recurrent) state instead (`KVCache.state`).

`forward_layers` is the layer loop of `Transformer.hidden` for these configs.
Letters: B batch, T tokens, D model dim, N query heads, K kv heads, H head dim, R rotary dim.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import MLP, AttentionProjections, RMSNorm
from dflash_jax.models.linear_attention import GatedDeltaNet
from dflash_jax.models.moe import SparseMoE
from dflash_jax.ops import dots
from dflash_jax.ops.caches import write_rows
from dflash_jax.ops.dispatch import cached_attention, causal_attention


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5 RMSNorm: fp32 normalise, times (1 + scale) in fp32, then cast."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)  # (1 + w) in fp32


def apply_partial_rope(x_btnh, cos, sin):
    """NeoX rotate-half RoPE on the first R = cos.shape[-1] channels; the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x_btnh[..., :r], x_btnh[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    rot = rot * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([rot, rest], axis=-1)


class GatedAttentionProjections(nn.Module):
    """Hybrid full attention's projections. Kernels: q_proj [D,N,2H] (query, then gate, per
    head, as HF lays them out), k_proj/v_proj [D,K,H], o_proj [N,H,D]; zero-centred q/k norms."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eps: float
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        opts = dict(use_bias=False, dtype=self.dtype, dot_general=dots.dot_general)
        dg = lambda feats, name: nn.DenseGeneral(feats, **opts, name=name)
        self.q_proj = dg((self.num_heads, 2 * self.head_dim), "q_proj")
        self.k_proj = dg((self.num_kv_heads, self.head_dim), "k_proj")
        self.v_proj = dg((self.num_kv_heads, self.head_dim), "v_proj")
        self.o_proj = nn.DenseGeneral(self.hidden_size, axis=(-2, -1), **opts, name="o_proj")
        self.q_norm = ZeroCenteredRMSNorm(self.eps, self.dtype, name="q_norm")
        self.k_norm = ZeroCenteredRMSNorm(self.eps, self.dtype, name="k_norm")

    def query(self, x_btd, cos, sin):
        """-> (q [B,T,N,H] normed and rotated, gate [B,T,N,H])."""
        q_gate = self.q_proj(x_btd)
        q_btnh, gate_btnh = jnp.split(q_gate, 2, axis=-1)
        return apply_partial_rope(self.q_norm(q_btnh), cos, sin), gate_btnh

    def key_value(self, x_btd, cos, sin):
        k_btkh = apply_partial_rope(self.k_norm(self.k_proj(x_btd)), cos, sin)
        return jnp.swapaxes(k_btkh, 1, 2), jnp.swapaxes(self.v_proj(x_btd), 1, 2)

    def output(self, attn_btnh, gate_btnh):
        return self.o_proj(attn_btnh * jax.nn.sigmoid(gate_btnh))


def attend(config, q_btnh, k_bkth, v_bkth, layer_cache, cache_lengths, defer, tree_mask):
    """The target's attention over the cache (the dense `DecoderLayer`'s rule): with
    cache_lengths, the new tokens append at cache_lengths[b]; without, a causal pass (written
    from slot 0 when there is a cache). -> (attn [B,T,N,H], new cache | new rows | None)."""
    impl = config.attention_impl
    if layer_cache is not None and cache_lengths is not None:
        new_cache = None
        if not defer:
            new_cache = tuple(
                write_rows(c, r, cache_lengths)
                for c, r in zip(layer_cache, (k_bkth, v_bkth), strict=True)
            )
        attn = cached_attention(
            q_btnh, layer_cache, new_cache, (k_bkth, v_bkth), cache_lengths, impl=impl,
            tree_mask=tree_mask,
        )  # fmt: skip
        return attn, (k_bkth, v_bkth) if defer else new_cache
    zeros_b = jnp.zeros((q_btnh.shape[0],), jnp.int32)
    attn = causal_attention(q_btnh, k_bkth, v_bkth, zeros_b, impl=impl)
    if layer_cache is not None:
        layer_cache = tuple(
            write_rows(c, r, zeros_b) for c, r in zip(layer_cache, (k_bkth, v_bkth), strict=True)
        )
    return attn, layer_cache


class HybridLayer(nn.Module):
    """One decoder layer of kind (mixer, mlp) = `TargetConfig.layer_kind(i)`."""

    config: TargetConfig
    mixer: str  # "attention" | "linear"
    mlp_kind: str  # "dense" | "moe"

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        norm = (lambda: ZeroCenteredRMSNorm(c.rms_norm_eps, dtype)) if c.hybrid else (
            lambda: RMSNorm(c.rms_norm_eps, dtype)
        )  # fmt: skip
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if self.mixer == "linear":
            self.linear_attn = GatedDeltaNet(
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.linear_conv_kernel_dim,
                c.rms_norm_eps,
                dtype,
            )
        elif c.hybrid:
            self.self_attn = GatedAttentionProjections(
                c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.rms_norm_eps, dtype
            )
        else:
            self.self_attn = AttentionProjections(
                c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, True, c.rms_norm_eps, dtype
            )
        if self.mlp_kind == "moe":
            self.mlp = SparseMoE(
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                c.norm_topk_prob,
                c.shared_expert_intermediate_size,
                dtype,
            )
        else:
            self.mlp = MLP(c.intermediate_size, dtype)

    def __call__(
        self, x_btd, cos, sin, layer_cache, cache_lengths, state_lengths, defer, tree_mask
    ):
        """As `DecoderLayer.__call__`; a linear layer's cache is its (conv, rec) state, and
        state_lengths [B] (or None: all T) stops the state at each row's last real token."""
        h_btd = self.input_layernorm(x_btd)
        if self.mixer == "linear":
            if tree_mask is not None:
                raise NotImplementedError("token-tree verification of a linear-attention target")
            defer_state = defer and cache_lengths is not None
            mixed, layer_cache = self.linear_attn(h_btd, layer_cache, state_lengths, defer_state)
        else:
            attn = self.self_attn
            if self.config.hybrid:
                q_btnh, gate_btnh = attn.query(h_btd, cos, sin)
            else:
                q_btnh, gate_btnh = attn.query(h_btd, cos, sin), None
            k_bkth, v_bkth = attn.key_value(h_btd, cos, sin)
            out_btnh, layer_cache = attend(
                self.config, q_btnh, k_bkth, v_bkth, layer_cache, cache_lengths, defer, tree_mask
            )
            mixed = attn.output(out_btnh) if gate_btnh is None else attn.output(out_btnh, gate_btnh)
        x_btd = x_btd + mixed
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd))
        return x_btd, layer_cache


def make_layers(config: TargetConfig) -> list[HybridLayer]:
    return [HybridLayer(config, *config.layer_kind(i)) for i in range(config.num_layers)]


def final_norm(config: TargetConfig):
    dtype = jnp.dtype(config.dtype)
    if config.hybrid:
        return ZeroCenteredRMSNorm(config.rms_norm_eps, dtype)
    return RMSNorm(config.rms_norm_eps, dtype)


@functools.cache
def _jitted_layer(config: TargetConfig, mixer: str, mlp_kind: str, defer: bool):
    """`HybridLayer.apply`, jitted once per layer kind (see `target._jitted_layer`)."""

    def apply(params, x_btd, cos, sin, layer_cache, cache_lengths, state_lengths, tree_mask):
        return HybridLayer(config, mixer, mlp_kind, parent=None).apply(
            {"params": params},
            x_btd, cos, sin, layer_cache, cache_lengths, state_lengths, defer, tree_mask,
        )  # fmt: skip

    return jax.jit(apply)


def forward_layers(layers, params, config, x_btd, cos, sin, cache, cache_lengths, state_lengths,
                   tap_layers, defer, tree_mask):  # fmt: skip
    """The decoder layers over x [B,T,D]. cache: a `KVCache` whose k/v hold the attention
    layers' buffers and whose `state` holds each linear layer's (conv, rec), in layer order
    (None: no cache). params None: init (the submodules create their params).
    -> (x [B,T,D], {tap layer: its residual output}, (ks, vs, states) or None)."""
    taps, ks, vs, states = {}, [], [], []
    attn_i = lin_i = 0
    for i, layer in enumerate(layers):
        mixer, mlp_kind = config.layer_kind(i)
        layer_cache = None
        if cache is not None and mixer == "linear":
            layer_cache, lin_i = cache.state[lin_i], lin_i + 1
        elif cache is not None:
            layer_cache, attn_i = (cache.k[attn_i], cache.v[attn_i]), attn_i + 1
        args = (x_btd, cos, sin, layer_cache, cache_lengths, state_lengths)
        if params is None:
            x_btd, layer_cache = layer(*args, defer, tree_mask)
        else:
            fn = _jitted_layer(config, mixer, mlp_kind, defer)
            x_btd, layer_cache = fn(params[f"layers_{i}"], *args, tree_mask)
        if layer_cache is not None and mixer == "linear":
            states.append(layer_cache)
        elif layer_cache is not None:
            ks.append(layer_cache[0])
            vs.append(layer_cache[1])
        if i in tap_layers:
            taps[i] = x_btd
    return x_btd, taps, (None if cache is None else (tuple(ks), tuple(vs), tuple(states)))
