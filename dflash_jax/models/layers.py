"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP and the
attention projections. Submodule names mirror HF (`q_proj`, `k_norm`, `gate_proj`, ...) so
checkpoint conversion is a rename plus transposes.

Letters: B batch, T tokens, D model dim, N query heads, K kv heads, H head dim, F ffn dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops import dots, quant
from dflash_jax.ops.invariance import fixed_rows

Dtype = jnp.dtype


class RMSNorm(nn.Module):
    """HF Qwen3/Llama RMSNorm: normalise in fp32, cast back, then scale (no 1+ offset)."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    # > 0: normalise in tiles of exactly this many rows (`ops.invariance.fixed_rows`), so each
    # row's mean is reduced by the same code whatever the pass's row count (XLA:CPU vectorises
    # a [4, 576] and an [8, 576] mean apart, and they round apart).
    tile_rows: int = 0
    # True: the scale multiplies the fp32 normalised rows before the cast (gpt-oss, Gemma 4:
    # `(w * x32).to(dtype)`); False: after it (Qwen3/Llama: `w * x32.to(dtype)`).
    scale_fp32: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)

        def normalise(x):
            x32 = x.astype(jnp.float32)
            x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            if self.scale_fp32:
                return (scale.astype(jnp.float32) * x32).astype(self.dtype)
            return x32.astype(self.dtype)

        if self.tile_rows:
            lead, d = x.shape[:-1], x.shape[-1]
            normed = fixed_rows(x.reshape(-1, d), normalise, self.tile_rows).reshape(*lead, d)
        else:
            normed = normalise(x)
        return normed if self.scale_fp32 else scale.astype(self.dtype) * normed


def thaw(value: Any) -> Any:
    """The inverse of `io.hf_config.freeze`: tuples of (str, value) pairs back into dicts,
    other tuples into lists, recursively (a config's frozen `rope_scaling` -> its HF JSON
    form)."""
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in value)
    ):
        return {k: thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Inverse frequencies [H/2] in fp32 as HF computes them (llama3 scaling supported)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    if not scaling:
        return inv_freq
    s = thaw(scaling)
    rope_type = s.get("rope_type", s.get("type"))
    if rope_type == "linear":
        return (inv_freq / np.float32(s["factor"])).astype(np.float32)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, s)
    if rope_type == "proportional":  # the first fraction of the frequencies rotate, the rest 0
        angles = int(float(s.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq = np.where(np.arange(head_dim // 2) < angles, inv_freq, np.float32(0))
        return (inv_freq / np.float32(s.get("factor", 1.0))).astype(np.float32)
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN: each frequency blended between interpolated (/ factor) and extrapolated by a
    linear ramp over the dims whose rotations at the original context lie between beta_fast
    and beta_slow (the YaRN paper's rule, as transformers computes it)."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations):  # the dim whose wavelength fits `rotations` turns in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    base = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)
    inv = (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate
    return inv.astype(np.float32)


def rope_attention_factor(scaling: tuple | None) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other RoPE)."""
    s = thaw(scaling) if scaling else {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale(1.0)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype: Dtype, scale: float = 1.0):
    """positions [B,T] int -> (cos, sin) [B,T,H] computed in fp32 at HIGHEST precision (times
    `scale`, YaRN's `rope_attention_factor`), then cast to the activation dtype, as HF does
    (bf16 positions would round 257 to 256)."""
    freqs_bth = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb_bth = jnp.concatenate([freqs_bth, freqs_bth], axis=-1)
    cos, sin = jnp.cos(emb_bth), jnp.sin(emb_bth)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX rotate-half RoPE. x [B,T,N,H], cos/sin [B,T,H]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases."""

    intermediate_size: int
    dtype: Dtype = jnp.float32
    dot_general: Callable | None = None  # None: `ops.dots.dot_general` (see ops.invariance)

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dot = self.dot_general or dots.dot_general
        dense = lambda f, name: nn.Dense(
            f, use_bias=False, dtype=self.dtype, dot_general=dot, name=name,
            promote_dtype=quant.promote_dtype,
        )  # fmt: skip
        gate_btf = dense(self.intermediate_size, "gate_proj")(x_btd)
        up_btf = dense(self.intermediate_size, "up_proj")(x_btd)
        return dense(x_btd.shape[-1], "down_proj")(nn.silu(gate_btf) * up_btf)


class AttentionProjections(nn.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm (applied before RoPE).

    Kernels: q_proj [D,N,H], k_proj/v_proj [D,K,H], o_proj [N,H,D].
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qk_norm: bool
    eps: float
    dtype: Dtype = jnp.float32
    dot_general: Callable | None = None  # None: `ops.dots.dot_general` (see ops.invariance)
    norm_rows: int = 0  # the q/k norms' `RMSNorm.tile_rows`

    def setup(self):
        dot = self.dot_general or dots.dot_general
        opts = dict(
            use_bias=False, dtype=self.dtype, dot_general=dot, promote_dtype=quant.promote_dtype
        )
        dg = lambda feats, name: nn.DenseGeneral(feats, **opts, name=name)
        self.q_proj = dg((self.num_heads, self.head_dim), "q_proj")
        self.k_proj = dg((self.num_kv_heads, self.head_dim), "k_proj")
        self.v_proj = dg((self.num_kv_heads, self.head_dim), "v_proj")
        self.o_proj = nn.DenseGeneral(self.hidden_size, axis=(-2, -1), **opts, name="o_proj")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.eps, self.dtype, self.norm_rows, name="q_norm")
            self.k_norm = RMSNorm(self.eps, self.dtype, self.norm_rows, name="k_norm")

    def query(self, x_btd, cos, sin):
        q_btnh = self.q_proj(x_btd)
        if self.qk_norm:
            q_btnh = self.q_norm(q_btnh)
        return apply_rope(q_btnh, cos, sin)

    def key_value(self, x_btd, cos, sin):
        """-> (k, v), each kv-head-major [B,K,T,H] (the cache layout); k normed and rotated."""
        k_btkh = self.k_proj(x_btd)
        if self.qk_norm:
            k_btkh = self.k_norm(k_btkh)
        k_btkh = apply_rope(k_btkh, cos, sin)
        return jnp.swapaxes(k_btkh, 1, 2), jnp.swapaxes(self.v_proj(x_btd), 1, 2)

    def output(self, attn_btnh):
        return self.o_proj(attn_btnh)
