"""The layers of the sliding-window families (config.SLIDING_ARCHS), each layer full or sliding
(`TargetConfig.window`: a query at position p sees keys at p - window < s <= p):

  gemma3    Gemma 3 text: zero-centred RMSNorms before and after each sublayer (four per
            layer), q/k RMSNorm, scores scaled by query_pre_attn_scalar ** -0.5 (optionally
            tanh-capped), a GeGLU MLP (tanh GELU), embeddings times sqrt(hidden), tied head;
            sliding layers rotate with their own RoPE base (`local_rope_theta`), full ones with
            rope_theta and its scaling.
  gemma4    Gemma 4 text: as Gemma 3, but plain RMSNorms (x * w), values RMS-normed
            too (no scale), scores unscaled, each layer's output times its `layer_scalar`;
            full layers with their own head dim and kv heads, keys doubling as values
            (attention_k_eq_v), proportional RoPE (only the first fraction of frequencies
            rotate); logits tanh-capped at final_logit_softcapping (`models.target.Head`).
            As released: per-layer inputs (`PerLayerInputs`, each layer's gated projection
            after its MLP), the last `kv_shared_layers` layers on an earlier layer's K/V
            (`TargetConfig.kv_source`), an MoE block beside the MLP (`Gemma4MoE`).
  gpt_oss   gpt-oss: q/k/v/o with biases, one learned sink logit per query head in the softmax
            (its probability dropped), YaRN RoPE (cos/sin times its attention factor), and a
            top-k MoE: a router with a bias, softmax over the chosen k logits, each expert a
            SwiGLU with biases, gate clamped above at `swiglu_limit`, up clamped to
            [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

The KV cache of a full layer holds its keys at their positions' slots (as the dense target's
does); a sliding layer's is a ring of `cache_slots` slots, position p at slot p mod its length
(`ops.caches.write_rows(ring=True)`, `ring_positions`): its window and one verify's rows, so a
rejected row, written and never committed, lands only on slots the window no longer reads. The
attention is the XLA
reference with the window, scale, softcap and sinks (`ops.dispatch.target_mods`); the kernels
refuse them (`attention_impl=pallas`: ConfigError; auto: one log line, then xla).

`forward_layers` is the layer loop of `Transformer.hidden` for these configs; `embed_scale`
the embedding multiplier. Params mirror HF names (gpt-oss's fused, interleaved gate_up_proj
is split into gate_proj / up_proj at load, `io/hf_layered.py`).
Letters: B batch, T tokens, D model dim, N query heads, K kv heads, H head dim, M tokens
flattened, E experts, F expert width, R (token, choice) rows.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.models import moe
from dflash_jax.models.hybrid import ZeroCenteredRMSNorm
from dflash_jax.models.layers import RMSNorm, apply_rope, rope_attention_factor, rope_inv_freq
from dflash_jax.models.layers import rope_tables as _rope_tables
from dflash_jax.models.moe import combine
from dflash_jax.ops import dots, quant
from dflash_jax.ops.caches import write_rows
from dflash_jax.ops.dispatch import cached_attention, causal_attention, target_mods


def gemma(config: TargetConfig) -> bool:
    return config.arch in ("gemma3", "gemma4")


def embed_scale(config: TargetConfig) -> float | None:
    """What the embedding is multiplied by (Gemma: sqrt(hidden)), None for 1."""
    return float(np.sqrt(config.hidden_size)) if gemma(config) else None


def _norm(config: TargetConfig, name: str | None = None):
    dtype = jnp.dtype(config.dtype)
    if config.zero_centred_norms:
        return ZeroCenteredRMSNorm(config.rms_norm_eps, dtype, name=name)
    fp32 = config.arch in ("gpt_oss", "gemma4")  # HF: (w * x32).to(dtype)
    return RMSNorm(config.rms_norm_eps, dtype, scale_fp32=fp32, name=name)


def rope_tables(config: TargetConfig, positions_bt, dtype) -> dict:
    """Layer kind ("full" / "sliding") -> its (cos, sin) [B,T,H] at these positions."""
    c = config
    full = _rope_tables(
        positions_bt,
        rope_inv_freq(c.global_head_dim or c.head_dim, c.rope_theta, c.rope_scaling),
        dtype,
        rope_attention_factor(c.rope_scaling),
    )
    if not gemma(c):
        return {"full": full, "sliding": full}
    local = _rope_tables(positions_bt, rope_inv_freq(c.head_dim, c.local_rope_theta, None), dtype)
    return {"full": full, "sliding": local}


class Attention(nn.Module):
    """Kernels: q_proj [D,N,H], k_proj/v_proj [D,K,H], o_proj [N,H,D] (gpt-oss: with biases,
    and sinks [N]); Gemma: q_norm / k_norm [H]. K and H are the layer's
    (`TargetConfig.layer_heads`); a Gemma 4 layer whose keys are its values has no v_proj."""

    config: TargetConfig
    window: int | None
    shared: bool = False  # Gemma 4's KV-sharing layers: no k/v projections of their own

    @property
    def k_is_v(self) -> bool:
        return self.config.attention_k_eq_v and self.window is None

    def setup(self):
        c = self.config
        if self.window is None:
            kv_heads, head_dim = (
                c.global_kv_heads or c.num_kv_heads,
                c.global_head_dim or c.head_dim,
            )
        else:
            kv_heads, head_dim = c.num_kv_heads, c.head_dim
        bias = c.arch == "gpt_oss"
        opts = dict(use_bias=bias, dtype=jnp.dtype(c.dtype), dot_general=dots.dot_general)
        dg = lambda feats, name: nn.DenseGeneral(feats, **opts, name=name)
        self.q_proj = dg((c.num_heads, head_dim), "q_proj")
        if not self.shared:
            self.k_proj = dg((kv_heads, head_dim), "k_proj")
        if not (self.k_is_v or self.shared):
            self.v_proj = dg((kv_heads, head_dim), "v_proj")
        self.o_proj = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), **opts, name="o_proj")
        if gemma(c):
            self.q_norm = _norm(c, "q_norm")
            if not self.shared:
                self.k_norm = _norm(c, "k_norm")
        if c.arch == "gpt_oss":
            self.sinks = self.param("sinks", nn.initializers.zeros, (c.num_heads,), jnp.float32)

    def mods(self) -> dict:
        c = self.config
        scale = c.query_pre_attn_scalar**-0.5 if c.query_pre_attn_scalar else None
        return target_mods(
            window=self.window,
            scale=scale,
            softcap=c.attn_logit_softcapping or None,
            sinks=self.sinks if c.arch == "gpt_oss" else None,
        )

    def __call__(self, x_btd, cos, sin, layer_cache, cache_lengths, defer, tree_mask, ends_b,
                 shared_kv=None):  # fmt: skip
        """As `hybrid.attend`: -> (out [B,T,D], new cache | new rows | None, the new rows
        (k, v) [B,K,T,H]). A sliding layer's cache is a ring (`ops.caches.write_rows(ring=True)`);
        ends_b [B] (a prefill, or None): each row's prompt length, the rows from it on (padding)
        left unwritten. shared_kv (a KV-sharing layer): its source layer's new rows, used as
        this layer's (its cache a copy of the source's)."""
        q_btnh = self.q_proj(x_btd)
        if gemma(self.config):
            q_btnh = self.q_norm(q_btnh)
        q_btnh = apply_rope(q_btnh, cos, sin)
        if self.shared:
            k_bkth, v_bkth = shared_kv
        else:
            k_bkth, v_bkth = self.key_value(x_btd, cos, sin)
        out, layer_cache = self._attend(
            q_btnh, k_bkth, v_bkth, layer_cache, cache_lengths, defer, tree_mask, ends_b
        )
        return out, layer_cache, (k_bkth, v_bkth)

    def key_value(self, x_btd, cos, sin):
        """x [B,T,D] -> this layer's new (k, v) [B,K,T,H] (normed, k with RoPE)."""
        k_btkh = self.k_proj(x_btd)
        v_btkh = k_btkh if self.k_is_v else self.v_proj(x_btd)
        if gemma(self.config):
            k_btkh = self.k_norm(k_btkh)
        if self.config.arch == "gemma4":  # values RMS-normed, no scale
            v32 = v_btkh.astype(jnp.float32)
            v32 = v32 * jax.lax.rsqrt(
                jnp.mean(v32 * v32, -1, keepdims=True) + self.config.rms_norm_eps
            )
            v_btkh = v32.astype(v_btkh.dtype)
        return jnp.swapaxes(apply_rope(k_btkh, cos, sin), 1, 2), jnp.swapaxes(v_btkh, 1, 2)

    def _attend(self, q_btnh, k_bkth, v_bkth, layer_cache, cache_lengths, defer, tree_mask,
                ends_b):  # fmt: skip
        """Attention of the new queries over the new rows and the cache (writing the rows) ->
        (out [B,T,D], cache as `__call__`)."""
        impl, mods = self.config.attention_impl, self.mods()
        ring = self.window is not None
        if layer_cache is not None and cache_lengths is not None:
            new_cache = None
            if not defer:  # ends_b: a prefill chunk's, its rows past each prompt unwritten
                new_cache = tuple(
                    write_rows(c, r, cache_lengths, ring, ends_b if ring else None)
                    for c, r in zip(layer_cache, (k_bkth, v_bkth), strict=True)
                )
            out = cached_attention(
                q_btnh, layer_cache, new_cache, (k_bkth, v_bkth), cache_lengths, impl=impl,
                tree_mask=tree_mask, **mods,
            )  # fmt: skip
            layer_cache = (k_bkth, v_bkth) if defer else new_cache
        else:
            zeros_b = jnp.zeros((q_btnh.shape[0],), jnp.int32)
            out = causal_attention(q_btnh, k_bkth, v_bkth, zeros_b, impl=impl, **mods)
            if layer_cache is not None:
                layer_cache = tuple(
                    write_rows(c, r, zeros_b, ring, ends_b if ring else None)
                    for c, r in zip(layer_cache, (k_bkth, v_bkth), strict=True)
                )
        return self.o_proj(out), layer_cache


class GeGLU(nn.Module):
    """Gemma's MLP: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)), no biases."""

    intermediate_size: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        dense = lambda f, name: nn.Dense(
            f, use_bias=False, dtype=self.dtype, dot_general=dots.dot_general, name=name
        )
        gate_btf = dense(self.intermediate_size, "gate_proj")(x_btd)
        up_btf = dense(self.intermediate_size, "up_proj")(x_btd)
        return dense(x_btd.shape[-1], "down_proj")(jax.nn.gelu(gate_btf, approximate=True) * up_btf)


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's expert activation: (clip(up) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def expert_rows(x_rd, ids_r, w: dict, alpha: float, limit: float) -> jax.Array:
    """Row r through expert ids_r[r] (gate/up [E,D,F], down [E,F,D], their biases) -> [R,D].
    Rows grouped by expert, one `lax.ragged_dot` per projection (as `moe.expert_rows`)."""
    num_experts = w["gate_proj"].shape[0]
    order = jnp.argsort(ids_r, stable=True)
    group_sizes = jnp.bincount(ids_r, length=num_experts).astype(jnp.int32)
    xs_rd, ids_s = x_rd[order], ids_r[order]
    cast = lambda name: quant.weight(w[name], x_rd.dtype).astype(x_rd.dtype)  # MXFP4 or float
    gate_rf = dots.ragged_dot(xs_rd, cast("gate_proj"), group_sizes) + cast("gate_bias")[ids_s]
    up_rf = dots.ragged_dot(xs_rd, cast("up_proj"), group_sizes) + cast("up_bias")[ids_s]
    h_rf = clamped_swiglu(gate_rf, up_rf, alpha, limit).astype(x_rd.dtype)
    ys_rd = dots.ragged_dot(h_rf, cast("down_proj"), group_sizes) + cast("down_bias")[ids_s]
    return jnp.zeros_like(ys_rd).at[order].set(ys_rd)


class Experts(nn.Module):
    """The routed experts: gate_proj, up_proj [E,D,F], down_proj [E,F,D] and their biases
    gate_bias, up_bias [E,F], down_bias [E,D]."""

    config: TargetConfig

    @nn.compact
    def __call__(self, x_md, weights_mk, ids_mk):
        c = self.config
        e, d, f = c.num_experts, x_md.shape[-1], c.moe_intermediate_size
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        zeros = nn.initializers.zeros
        w = {
            "gate_proj": self.param("gate_proj", init, (e, d, f), jnp.float32),
            "up_proj": self.param("up_proj", init, (e, d, f), jnp.float32),
            "down_proj": self.param("down_proj", init, (e, f, d), jnp.float32),
            "gate_bias": self.param("gate_bias", zeros, (e, f), jnp.float32),
            "up_bias": self.param("up_bias", zeros, (e, f), jnp.float32),
            "down_bias": self.param("down_bias", zeros, (e, d), jnp.float32),
        }
        m, k = ids_mk.shape
        y_rd = expert_rows(
            jnp.repeat(x_md, k, axis=0), ids_mk.reshape(-1), w, c.swiglu_alpha, c.swiglu_limit
        )
        return combine(weights_mk, y_rd.reshape(m, k, -1), x_md.dtype)


class TopKMoE(nn.Module):
    """gpt-oss's MLP: x [B,T,D] -> [B,T,D]. The router [D,E] (+ bias) picks each token's top-k
    logits; their softmax weights the chosen experts' outputs."""

    config: TargetConfig

    @nn.compact
    def __call__(self, x_btd):
        c = self.config
        b, t, d = x_btd.shape
        x_md = x_btd.reshape(b * t, d)
        router = nn.Dense(
            c.num_experts, dtype=jnp.dtype(c.dtype), dot_general=dots.dot_general, name="router"
        )
        logits_me = router(x_md)
        top_mk, ids_mk = jax.lax.top_k(logits_me, c.num_experts_per_tok)
        weights_mk = jax.nn.softmax(top_mk.astype(jnp.float32), axis=-1).astype(x_md.dtype)
        out_md = Experts(c, name="experts")(x_md, weights_mk, ids_mk.astype(jnp.int32))
        return out_md.reshape(b, t, d)


class Gemma4MoE(nn.Module):
    """Gemma 4's MoE block (beside the MLP), x [B,T,D] (the residual, not normed) -> [B,T,D].
    Router: x RMS-normed without a weight, x scale [D] / sqrt(D), proj [D,E], softmax in fp32,
    top-k renormalised, x per_expert_scale; experts: gate_up_proj [E,D,2F] (gate, then up),
    down_proj [E,F,D], gelu_tanh(gate) * up, on `pre_feedforward_layernorm_2`'s rows."""

    config: TargetConfig

    @nn.compact
    def __call__(self, x_btd, normed_btd):
        c = self.config
        b, t, d = x_btd.shape
        e, f = c.num_experts, c.moe_intermediate_size
        x32 = x_btd.reshape(b * t, d).astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + c.rms_norm_eps)
        scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)
        h_md = (x32.astype(x_btd.dtype) * scale.astype(x_btd.dtype)) * jnp.asarray(
            d**-0.5, x_btd.dtype
        )
        proj = nn.Dense(e, use_bias=False, dtype=x_btd.dtype, dot_general=dots.dot_general,
                        name="proj")  # fmt: skip
        probs_me = jax.nn.softmax(proj(h_md).astype(jnp.float32), axis=-1)
        top_mk, ids_mk = jax.lax.top_k(probs_me, c.num_experts_per_tok)
        top_mk = top_mk / jnp.sum(top_mk, -1, keepdims=True)
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (e,), jnp.float32)
        weights_mk = top_mk * per_expert.astype(jnp.float32)[ids_mk]
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        gate_up = self.param("gate_up_proj", init, (e, d, 2 * f), jnp.float32)
        down = self.param("down_proj", init, (e, f, d), jnp.float32)
        m, k = ids_mk.shape
        rows_rd = jnp.repeat(normed_btd.reshape(m, d), k, axis=0)
        y_rd = moe.expert_rows(
            rows_rd, ids_mk.reshape(-1).astype(jnp.int32), gate_up[..., :f], gate_up[..., f:],
            down, act=functools.partial(jax.nn.gelu, approximate=True),
        )  # fmt: skip
        return combine(weights_mk, y_rd.reshape(m, k, d), x_btd.dtype).reshape(b, t, d)


class SlidingLayer(nn.Module):
    """One decoder layer; `window` its sliding window (None: full attention); `shared`: a
    Gemma 4 KV-sharing layer (`TargetConfig.kv_source`)."""

    config: TargetConfig
    window: int | None
    shared: bool = False

    def setup(self):
        c = self.config
        self.input_layernorm = _norm(c)
        self.self_attn = Attention(c, self.window, self.shared)
        self.post_attention_layernorm = _norm(c)
        if gemma(c):
            self.pre_feedforward_layernorm = _norm(c)
            self.post_feedforward_layernorm = _norm(c)
            wide = 2 if (c.double_wide_mlp and self.shared) else 1
            self.mlp = GeGLU(c.intermediate_size * wide, jnp.dtype(c.dtype))
        else:
            self.mlp = TopKMoE(c)
        if c.arch == "gemma4":
            self.layer_scalar = self.param("layer_scalar", nn.initializers.ones, (1,), jnp.float32)
            if c.num_experts:
                self.moe = Gemma4MoE(c, name="experts")
                self.post_feedforward_layernorm_1 = _norm(c)
                self.post_feedforward_layernorm_2 = _norm(c)
                self.pre_feedforward_layernorm_2 = _norm(c)
            if c.per_layer_input_size:
                dense = lambda f, name: nn.Dense(
                    f,
                    use_bias=False,
                    dtype=jnp.dtype(c.dtype),
                    dot_general=dots.dot_general,
                    name=name,
                )
                self.per_layer_input_gate = dense(c.per_layer_input_size, "per_layer_input_gate")
                self.per_layer_projection = dense(c.hidden_size, "per_layer_projection")
                self.post_per_layer_input_norm = _norm(c)

    def __call__(self, x_btd, cos, sin, layer_cache, cache_lengths, defer, tree_mask, ends_b,
                 shared_kv=None, ple_btp=None):  # fmt: skip
        """-> (x [B,T,D], cache as `Attention`, the new (k, v) rows). ple_btp [B,T,P]: this
        layer's per-layer input (Gemma 4)."""
        mixed, layer_cache, rows = self.self_attn(
            self.input_layernorm(x_btd), cos, sin, layer_cache, cache_lengths, defer, tree_mask,
            ends_b, shared_kv,
        )  # fmt: skip
        if not gemma(self.config):
            x_btd = x_btd + mixed
            return x_btd + self.mlp(self.post_attention_layernorm(x_btd)), layer_cache, rows
        # sandwich norms: each sublayer's output normed too
        x_btd = x_btd + self.post_attention_layernorm(mixed)
        h_btd = self.mlp(self.pre_feedforward_layernorm(x_btd))
        c = self.config
        if c.arch == "gemma4" and c.num_experts:  # the MoE block beside the MLP
            h2_btd = self.moe(x_btd, self.pre_feedforward_layernorm_2(x_btd))
            h_btd = self.post_feedforward_layernorm_1(h_btd) + self.post_feedforward_layernorm_2(
                h2_btd
            )
        x_btd = x_btd + self.post_feedforward_layernorm(h_btd)
        if c.arch == "gemma4" and c.per_layer_input_size:
            g_btp = jax.nn.gelu(self.per_layer_input_gate(x_btd), approximate=True) * ple_btp
            x_btd = x_btd + self.post_per_layer_input_norm(self.per_layer_projection(g_btp))
        if c.arch == "gemma4":
            x_btd = x_btd * self.layer_scalar.astype(x_btd.dtype)
        return x_btd, layer_cache, rows


def cache_slots(config: TargetConfig, i: int, max_len: int, verify: int | None) -> int:
    """The cache slots of layer i for contexts of up to `max_len` positions and verifies of up
    to `verify` tokens (None: every position kept): a full layer's max_len; a sliding layer's
    window + verify when fewer. A ring of window + verify - 1 slots is the least that holds:
    a verify at length L writes positions L .. L + verify - 1, the next (L' >= L) reads
    L' - window + 1 .. L' - 1, and a row written at p overwrites p - slots only."""
    window = config.window(i)
    if window is None or verify is None:
        return max_len
    return min(max_len, window + verify)


def rings(config: TargetConfig) -> tuple[bool, ...]:
    """Per layer, whether its cache is a ring (`KVCache.rings`): the sliding layers'."""
    return tuple(config.window(i) is not None for i in range(config.num_layers))


def make_layers(config: TargetConfig) -> list[SlidingLayer]:
    return [
        SlidingLayer(config, config.window(i), config.kv_source(i) != i)
        for i in range(config.num_layers)
    ]


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer inputs: tokens [B,T] and their scaled embedding x [B,T,D] ->
    [B,T,L,P]: (norm(proj(x) / sqrt(D)) + table[tokens] * sqrt(P)) / sqrt(2). Params (HF
    names): embed_tokens_per_layer [V',L*P], per_layer_model_projection [D,L*P],
    per_layer_projection_norm [P]."""

    config: TargetConfig

    @nn.compact
    def __call__(self, tokens_bt, x_btd):
        c = self.config
        dtype, lp = jnp.dtype(c.dtype), c.num_layers * c.per_layer_input_size
        shape = (*tokens_bt.shape, c.num_layers, c.per_layer_input_size)
        table = nn.Embed(c.per_layer_vocab_size, lp, dtype=dtype, name="embed_tokens_per_layer")
        scale = jnp.asarray(c.per_layer_input_size**0.5, table.embedding.dtype).astype(dtype)
        ids_btlp = (table(tokens_bt) * scale).reshape(shape)
        proj = nn.Dense(lp, use_bias=False, dtype=dtype, dot_general=dots.dot_general,
                        name="per_layer_model_projection")  # fmt: skip
        proj_btlp = (proj(x_btd) * jnp.asarray(c.hidden_size**-0.5, dtype)).reshape(shape)
        proj_btlp = _norm(c, "per_layer_projection_norm")(proj_btlp)
        return (proj_btlp + ids_btlp) * jnp.asarray(2.0**-0.5, dtype)


def final_norm(config: TargetConfig):
    return _norm(config)


@functools.cache
def _jitted_layer(config: TargetConfig, window: int | None, shared: bool, defer: bool):
    """`SlidingLayer.apply`, jitted once per layer kind (see `target._jitted_layer`)."""

    def apply(params, x_btd, cos, sin, layer_cache, cache_lengths, tree_mask, ends_b, shared_kv,
              ple_btp):  # fmt: skip
        return SlidingLayer(config, window, shared, parent=None).apply(
            {"params": params}, x_btd, cos, sin, layer_cache, cache_lengths, defer, tree_mask,
            ends_b, shared_kv, ple_btp,
        )  # fmt: skip

    return jax.jit(apply)


def forward_layers(layers, params, config, x_btd, tables, cache, cache_lengths, tap_layers, defer,
                   tree_mask, ends_b=None, ple_btlp=None):  # fmt: skip
    """The decoder layers over x [B,T,D]; tables: `rope_tables`. cache: a `KVCache` with every
    layer's k/v (None: no cache; a sliding layer's a ring, `cache_slots`; a KV-sharing layer's
    a copy of its source's), ends_b [B] a prefill's prompt lengths (None: every row's T
    tokens), ple_btlp [B,T,L,P] Gemma 4's per-layer inputs. params None: init.
    -> (x [B,T,D], {tap layer: its residual output}, (ks, vs) or None)."""
    taps, ks, vs, rows = {}, [], [], {}
    for i, layer in enumerate(layers):
        window, source = config.window(i), config.kv_source(i)
        cos, sin = tables["sliding" if window else "full"]
        layer_cache = None if cache is None else (cache.k[i], cache.v[i])
        args = (x_btd, cos, sin, layer_cache, cache_lengths)
        extra = (rows.get(source) if source != i else None,
                 None if ple_btlp is None else ple_btlp[:, :, i])  # fmt: skip
        if params is None:
            x_btd, layer_cache, rows[i] = layer(*args, defer, tree_mask, ends_b, *extra)
        else:
            x_btd, layer_cache, rows[i] = _jitted_layer(config, window, source != i, defer)(
                params[f"layers_{i}"], *args, tree_mask, ends_b, *extra
            )
        if layer_cache is not None:
            ks.append(layer_cache[0])
            vs.append(layer_cache[1])
        if i in tap_layers:
            taps[i] = x_btd
    return x_btd, taps, (None if cache is None else (tuple(ks), tuple(vs)))


def prompt_chunks(config: TargetConfig, prompt_bp, chunk: int, last_b):
    """How `decoding.phases.prompt_pass` chunks a prompt [B,P] whose rows end at last_b [B]:
    -> (chunk starts [N], the prompt the chunks read, start -> the `Transformer.hidden`
    keywords of the chunk from there). Every family but these: the last chunk ends at P,
    overlapping its predecessor. These: chunks that never overlap, the prompt padded to whole
    chunks (a sliding layer's ring holds positions before a chunk's start only,
    `caches.ring_positions`), each row's ring written up to its prompt's end (`prompt_ends`),
    never with the padding."""
    p = prompt_bp.shape[1]
    if not config.sliding:
        starts = jnp.asarray([*range(0, p - chunk, chunk), p - chunk], jnp.int32)
        return starts, prompt_bp, lambda start: {}
    n = -(-p // chunk)
    padded = jnp.pad(prompt_bp, ((0, 0), (0, n * chunk - p)))
    ends = lambda start: {"prompt_ends": jnp.minimum(last_b + 1, start + chunk)}
    return jnp.arange(0, n * chunk, chunk, dtype=jnp.int32), padded, ends
