"""The batch-invariance tests' shared pieces: SmolLM2-135M's shapes (2 of its 30 layers), and
a position's logits computed by a prefill, AR steps and verifies of 4, 8 and 16 tokens after a
cached prefix (`logits_five_ways`), each pass one jitted target forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.models.target import Transformer, init_cache

SMOLLM2_SHAPES = dict(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    attention_impl="xla",
)
P0 = 40  # the prefix every pass continues from
CACHE = 128


def smollm2_config(dtype: str) -> TargetConfig:
    return TargetConfig(**SMOLLM2_SHAPES, dtype=dtype)


@functools.cache
def target_pass(cfg):
    return jax.jit(lambda p, t, pos, c, n: Transformer(cfg).apply({"params": p}, t, pos, c, n))


def forward(cfg, params, tokens_bt, positions_bt, cache, lengths_b):
    logits, _, cache = target_pass(cfg)(params, tokens_bt, positions_bt, cache, lengths_b)
    return np.asarray(logits.astype(jnp.float32)), cache


def prefill(cfg, params, tokens_bp):
    b, p = tokens_bp.shape
    cache = init_cache(cfg, b, CACHE)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    return forward(cfg, params, tokens_bp, positions, cache, None)


def continue_pass(cfg, params, cache, tokens_bt, lengths_b):
    """One pass of T tokens after each row's lengths[b] cached ones -> (logits [B,T,V], cache)."""
    t = tokens_bt.shape[1]
    positions = jnp.asarray(lengths_b)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return forward(cfg, params, tokens_bt, positions, cache, jnp.asarray(lengths_b, jnp.int32))


def logits_five_ways(cfg, params, tokens):
    """The logits of positions P0 .. P0+15 of `tokens` [64] computed five ways (batch 1)."""
    seq = jnp.asarray(tokens, jnp.int32)[None]
    out = {"prefill": prefill(cfg, params, seq[:, : P0 + 16])[0][0, P0:]}
    _, cache0 = prefill(cfg, params, seq[:, :P0])
    steps, cache = [], cache0
    for i in range(16):
        logits, cache = continue_pass(cfg, params, cache, seq[:, P0 + i : P0 + i + 1], [P0 + i])
        steps.append(logits[0, 0])
    out["ar"] = np.stack(steps)
    for t in (4, 8, 16):
        parts, cache = [], cache0
        for i in range(0, 16, t):
            logits, cache = continue_pass(cfg, params, cache, seq[:, P0 + i : P0 + i + t], [P0 + i])
            parts.append(logits[0])
        out[f"verify{t}"] = np.concatenate(parts)
    return out


def random_tokens(seed=1):
    return np.random.default_rng(seed).integers(3, 49152, size=80)
