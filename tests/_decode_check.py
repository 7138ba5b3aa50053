"""A greedy speculative decode on a tiny random pair against the autoregressive reference,
shared by the kernel tests (GPU kernels in interpret mode, TPU kernels on a faked TPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DecodeConfig, DrafterConfig, TargetConfig
from dflash_jax.decoding import autoregressive_decode, speculative_decode
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import init_params


def assert_greedy_speculative_equals_ar(
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    reference_tcfg: TargetConfig,
    max_new_tokens: int,
    tree_nodes: int = 0,
) -> None:
    """Speculative decode with (tcfg, dcfg) gives the tokens of the autoregressive decode with
    `reference_tcfg` (the same model under another attention implementation), and accepts some
    drafts. Sharp random weights; a drafter that always drafts token 0, which the target's head
    favours, so acceptance varies. tree_nodes: every step a token tree of that many nodes."""
    tp = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, init_params(tcfg, jax.random.key(0)))
    tp["lm_head"]["kernel"] = tp["lm_head"]["kernel"].at[:, 0].mul(6.0)  # vary acceptance
    dp = init_drafter_params(dcfg, jax.random.key(1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])  # always drafts token 0
    prompt = jnp.array([[5, 9, 13, 2, 7, 7], [3, 8, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([6, 2], jnp.int32)
    cfg = DecodeConfig(
        max_new_tokens=max_new_tokens, block_size=dcfg.block_size, tree_nodes=tree_nodes
    )
    rng = jax.random.key(0)
    spec = speculative_decode(
        tp, dp, prompt, lengths, rng, target_config=tcfg, drafter_config=dcfg, decode_config=cfg
    )
    ar = autoregressive_decode(
        tp, prompt, lengths, rng, target_config=reference_tcfg, decode_config=cfg
    )
    assert np.array_equal(spec.tokens, ar.tokens) and np.array_equal(spec.lengths, ar.lengths)
    assert spec.acceptance_lengths.max() > 1  # some drafts were accepted
