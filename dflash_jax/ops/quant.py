"""Quantized weights (int8, int4, fp8, mxfp4) for the target, held as Qwix arrays and applied in
our own dot path. docs/quantization.md has the design and the measurements.

A quantized weight is a `QWeight` in the param tree where the float kernel was: a `qwix.QArray`
(qvalue in the kernel's shape and layout, scale per output channel or per block of the
contracted dim) and, for GGUF's Q4_1, an offset per block (w = qvalue * scale + offset). It is a
pytree, so jit, sharding and Orbax take it like any param.

Why not Qwix's PTQ provider (`qwix.quantize_model`): it intercepts `jax.lax.dot_general` inside
flax modules and recognises a weight by identity with a param. Our products reach
`jax.lax.dot_general` through the dot policy (`ops.dots`) or the row rule's isolated GEMMs
(`ops.invariance`), which reshape the weight and put a barrier on it, and our layers are applied
as jitted functions of their params (`models.target._jitted_layer`): the provider would miss
those weights or replace our products with its own (no fp32 accumulation, no row rule), and
batch invariance would be lost. So the product stays ours: the weight is dequantized to the
compute dtype (`QWeight.dequantize`) and goes through the same dot as a float weight. That is
also what `qwix.dot_general` does with a float activation and a quantized weight (it dequantizes
the weight and trusts XLA to fuse the convert into the dot); the numbers of the quantized target
are then those of a float target with the dequantized weights, and every losslessness and
invariance argument of the float target carries over unchanged.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import qwix

from dflash_jax.config import QUANT_SCHEMES as SCHEMES

# The block of the contracted dim that shares one int4 scale (as llama.cpp's Q4_0/Q4_1), and
# one MXFP4 scale (the OCP microscaling block).
INT4_BLOCK = 32
MXFP4_BLOCK = 32
_QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}


def check_scheme(scheme: str | None) -> None:
    """Refuses a quantization scheme we do not have, naming the ones we do."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(
            f"quantize={scheme!r} is not a supported scheme; use one of {', '.join(SCHEMES)} "
            "or none for float weights"
        )


@flax.struct.dataclass
class QWeight:
    """A kernel stored quantized: `q` a `qwix.QArray` of the kernel's shape (qvalue int8, int4 or
    float8_e4m3fn; scale broadcastable to it, one per output channel or per block of the
    contracted dim), `offset` None or one per scale (GGUF Q4_1's block minimum, folded)."""

    q: qwix.QArray
    offset: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.qvalue.shape

    @property
    def ndim(self) -> int:
        return self.q.qvalue.ndim

    def reshape(self, *shape) -> QWeight:
        """As a 2-D [K, N] matrix (`shape` (K, N), or -1 for one of them), K the product of
        the leading dims: every array reshaped at the same dim boundary (blocks stay whole: a
        block lies within the last leading dim)."""
        shape = tuple(shape[0]) if len(shape) == 1 else shape
        old, size = self.shape, self.q.qvalue.size
        k = shape[0] if shape[0] != -1 else size // shape[1]
        split = next((i for i in range(len(old) + 1) if math.prod(old[:i]) == k), None)
        if len(shape) != 2 or split is None:
            raise ValueError(f"a quantized kernel {old} reshapes to a 2-D matrix only, not {shape}")
        flat = lambda x: None if x is None else x.reshape(
            math.prod(x.shape[:split]), math.prod(x.shape[split:])
        )  # fmt: skip
        q = qwix.QArray(flat(self.q.qvalue), flat(self.q.scale), flat(self.q.zero_point))
        return QWeight(q, flat(self.offset))

    def dequantize(self, dtype) -> jax.Array:
        """The float kernel in `dtype`: computed in fp32 (qvalue * scale + offset), cast once."""
        w = qwix.dequantize(self.q.astype(jnp.float32))
        if self.offset is not None:
            w = w + _expand(self.offset.astype(jnp.float32), w.shape)
        return w.astype(dtype)


def _expand(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """x, each dim dividing `shape`'s, repeated blockwise to `shape` (a block's value on each of
    its elements)."""
    split, full = [], []
    for a, n in zip(x.shape, shape, strict=True):
        split += [a] if a == n else [a, 1]
        full += [a] if a == n else [a, n // a]
    return jnp.broadcast_to(x.reshape(split), full).reshape(shape)


def weight(w, dtype) -> jax.Array:
    """A kernel as the dot takes it: a `QWeight` dequantized to `dtype`, else `w` itself."""
    return w.dequantize(dtype) if isinstance(w, QWeight) else w


def quantize(w: jax.Array, scheme: str, contracted: tuple[int, ...]) -> QWeight:
    """Post-training quantization of kernel `w` (absmax, symmetric: Qwix's weight PTQ) contracted
    over the dims `contracted`: int8 and fp8 one scale per output channel; int4 one per output
    channel and block of `INT4_BLOCK` along the last contracted dim (per channel when that dim is
    not a multiple), the other contracted dims one scale each. Computed in fp32; scales fp32."""
    check_scheme(scheme)
    if scheme == "mxfp4":
        return quantize_mxfp4(w, contracted[-1])
    w = jnp.asarray(w, jnp.float32)
    channels = tuple(a for a in range(w.ndim) if a not in contracted)
    tiles = {}
    if scheme == "int4":
        last = contracted[-1]
        tiles = {a: 1 for a in contracted[:-1]}
        if w.shape[last] % INT4_BLOCK == 0 and w.shape[last] > INT4_BLOCK:
            tiles[last] = INT4_BLOCK
    q = qwix.quantize(w, _QTYPES[scheme], channelwise_axes=channels, tiled_axes=tiles)
    return QWeight(q)


def mxfp4(values: jax.Array, exponents: jax.Array, axis: int) -> QWeight:
    """An MXFP4 kernel as stored: values float4_e2m1fn in the kernel's shape, exponents int
    (the scale 2^exponent, e8m0's 2^(stored - 127)) with the contracted `axis` divided by
    MXFP4_BLOCK. The scales are held in bf16, exact for every e8m0 power of two; dequantized,
    value x scale is exact in fp32."""
    if values.shape[axis] != exponents.shape[axis] * MXFP4_BLOCK:
        raise ValueError(f"MXFP4 values {values.shape} and scales {exponents.shape} along {axis}")
    scale = jnp.ldexp(jnp.ones(exponents.shape, jnp.float32), exponents.astype(jnp.int32))
    return QWeight(qwix.QArray(values.astype(jnp.float4_e2m1fn), scale.astype(jnp.bfloat16)))


def quantize_mxfp4(w: jax.Array, axis: int) -> QWeight:
    """Post-training MXFP4 of kernel `w` over blocks of MXFP4_BLOCK along `axis` (the OCP rule:
    scale 2^(floor(log2 absmax) - 2), e2m1's largest exponent being 2; values rounded to the
    nearest e2m1, clipped to +-6)."""
    w = jnp.moveaxis(jnp.asarray(w, jnp.float32), axis, -1)
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = jnp.max(jnp.abs(blocks), -1, keepdims=True)
    exp = jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2, -127)
    exp = jnp.clip(exp, -127, 127).astype(jnp.int32)
    values = jnp.clip(blocks / jnp.ldexp(jnp.ones_like(amax), exp), -6.0, 6.0)
    values = values.astype(jnp.float4_e2m1fn).reshape(w.shape)
    return mxfp4(jnp.moveaxis(values, -1, axis), jnp.moveaxis(exp[..., 0], -1, axis), axis)


def promote_dtype(*args, dtype=None, inexact=True):
    """flax's `promote_dtype` for Dense / DenseGeneral (their `promote_dtype=`) that passes a
    `QWeight` kernel through untouched: the dot dequantizes it (`weight`)."""
    from flax.linen.dtypes import promote_dtype as flax_promote

    plain = [None if isinstance(a, QWeight) else a for a in args]
    out = flax_promote(*plain, dtype=dtype, inexact=inexact)
    return [a if isinstance(a, QWeight) else o for a, o in zip(args, out, strict=True)]
