"""DFlash2's two additions to the drafter (the reference: `dflash` 0.1.0, `DFlash2DraftModel`).

Grouped dynamic causal convolution, around each drafter layer's attention and around its MLP:
  prepare(h):  dyn = kernel_projection(h) -> [.., 2, O, G] (O taps, G = D / group_size groups);
               returns conv(h; base_kernel[0] + dyn[0]) and dyn[1] for `finish`
  finish(y):   conv(y; base_kernel[1] + dyn[1]), y the sublayer's output
  conv(x)[j] = sum_o (base[o] + dyn[j, o, group]) * x[j - o], causal inside each draft block:
               block slot 0 sees only itself, and no tap crosses a block boundary (training
               lays many blocks side by side).

Candidate selector, over each draft slot's top-k candidates of the unary logits z:
  score(c | prev) = z[c] + <predecessor_codebook[prev] * hidden_projection(h),
                            successor_codebook[c]>
The walk over the block (decoding/selector.py) starts from the anchor and conditions each slot
on the token chosen at the slot before; training scores the ground-truth predecessor
(training/selector_loss.py).

Letters: B batch, Q block rows (N blocks x J slots), O conv taps, G groups, C channels per
group, D model dim, R selector rank, K candidates, V vocab.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.ops import dots


def _identity_taps(key, shape, dtype):
    """Base kernel [2, O, D] starting as the identity (tap 0 = 1, later taps 0): a fresh DFlash2
    layer computes what the DFlash layer without convolutions would."""
    del key
    return jnp.zeros(shape, dtype).at[:, 0].set(1.0)


def grouped_causal_convolve(x_bqd, dyn_bqog, base_od, block_size: int):
    """x [B,Q,D] with Q = N blocks x block_size; dyn [B,Q,O,G] the dynamic taps of each output
    slot; base [O,D] -> [B,Q,D]: out[j] = sum_o (base[o] + dyn[j,o,g]) * x[j-o] per block,
    x before the block's slot 0 being zero."""
    b, q, d = x_bqd.shape
    taps, groups = dyn_bqog.shape[-2:]
    n = q // block_size
    x_bnjgc = x_bqd.reshape(b, n, block_size, groups, d // groups)
    dyn_bnjogc = dyn_bqog.reshape(b, n, block_size, taps, groups)[..., None].astype(x_bqd.dtype)
    base_ogc = base_od.reshape(taps, groups, d // groups).astype(x_bqd.dtype)
    out_bnjgc = jnp.zeros_like(x_bnjgc)
    for o in range(taps):
        shift = ((0, 0), (0, 0), (o, 0), (0, 0), (0, 0))
        past_bnjgc = jnp.pad(x_bnjgc, shift)[:, :, :block_size]  # x[j - o], zero before slot 0
        out_bnjgc = out_bnjgc + base_ogc[o] * past_bnjgc
        out_bnjgc = out_bnjgc + dyn_bnjogc[:, :, :, o] * past_bnjgc
    return out_bnjgc.reshape(b, q, d)


class GroupedDynamicCausalConv(nn.Module):
    """Params: base_kernel [2, O, D] (identity at init), kernel_projection{kernel [D, 2*O*G]}
    (zero at init: the dynamic part starts off). See the module docstring."""

    hidden_size: int
    kernel_size: int
    group_size: int
    dtype: Any = jnp.float32

    def setup(self):
        groups = self.hidden_size // self.group_size
        self.base_kernel = self.param(
            "base_kernel", _identity_taps, (2, self.kernel_size, self.hidden_size), jnp.float32
        )
        self.kernel_projection = nn.Dense(
            2 * self.kernel_size * groups,
            use_bias=False,
            dtype=self.dtype,
            kernel_init=nn.initializers.zeros,
            dot_general=dots.dot_general,
        )

    def prepare(self, h_bqd, block_size: int):
        """h [B,Q,D] (the normed sublayer input) -> (its convolution [B,Q,D], the output
        convolution's dynamic taps [B,Q,O,G] for `finish`)."""
        b, q, _ = h_bqd.shape
        dyn_bqsog = self.kernel_projection(h_bqd).reshape(b, q, 2, self.kernel_size, -1)
        conv_bqd = grouped_causal_convolve(
            h_bqd, dyn_bqsog[:, :, 0], self.base_kernel[0], block_size
        )
        return conv_bqd, dyn_bqsog[:, :, 1]

    def finish(self, y_bqd, dyn_bqog, block_size: int):
        """The sublayer's output y [B,Q,D] convolved with the taps `prepare` returned."""
        return grouped_causal_convolve(y_bqd, dyn_bqog, self.base_kernel[1], block_size)


class CandidateSelector(nn.Module):
    """Params: predecessor_codebook{embedding [V,R]}, successor_codebook{embedding [V,R]}
    (zero at init: the selector starts as the unary argmax), hidden_projection{kernel [D,R]}."""

    config: DrafterConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.predecessor_codebook = nn.Embed(c.vocab_size, c.selector_rank, dtype=dtype)
        self.successor_codebook = nn.Embed(
            c.vocab_size, c.selector_rank, dtype=dtype, embedding_init=nn.initializers.zeros
        )
        self.hidden_projection = nn.Dense(
            c.selector_rank, use_bias=False, dtype=dtype, dot_general=dots.dot_general
        )

    def project(self, hidden_xd: jax.Array) -> jax.Array:
        """Final-normed drafter hidden [..., D] -> [..., R] (once per block, before the walk)."""
        return self.hidden_projection(hidden_xd)

    def transition(self, h_xr, predecessor_x, candidates_xk) -> jax.Array:
        """The pairwise score of each candidate [..., K] after `predecessor` [...], given the
        projected hidden [..., R] of its slot -> fp32 [..., K] (added to the unary logits)."""
        p_xr = self.predecessor_codebook(predecessor_x) * h_xr
        s_xkr = self.successor_codebook(candidates_xk)
        return dots.einsum("...r,...kr->...k", p_xr, s_xkr, out_dtype=jnp.float32)

    def __call__(self, hidden_xd, unary_xk, predecessor_x, candidates_xk) -> jax.Array:
        """Selector scores [..., K] of the candidates: unary + transition (fp32)."""
        h_xr = self.project(hidden_xd)
        return unary_xk.astype(jnp.float32) + self.transition(h_xr, predecessor_x, candidates_xk)


def init_selector_params(config: DrafterConfig, rng: jax.Array) -> dict:
    """Random selector params (the `candidate_selector` entry of a DFlash2 drafter's params)."""
    k = config.selector_top_k
    hidden = jnp.zeros((1, config.hidden_size), jnp.dtype(config.dtype))
    ids = jnp.zeros((1,), jnp.int32)
    return CandidateSelector(config).init(
        rng, hidden, jnp.zeros((1, k), jnp.float32), ids, jnp.zeros((1, k), jnp.int32)
    )["params"]
