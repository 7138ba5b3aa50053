"""DSpark drafters (issue 41): the DFlash backbone with a Markov logit bias over the block (three
variants) and a confidence head. The walk conditions each draft on the token before it and on
nothing after.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig
from dflash_jax.models import dspark


def test_the_markov_walk_reads_the_previous_token_and_nothing_after():
    """Each variant's bias (and the confidence with the Markov input) at slot j depends on the
    previous token of slot j; changing slot 2's changes slot 2 alone (vanilla, gated) or slots
    2.. (rnn, through its state), never the slots before; `previous_tokens` shifts by one
    without `sample_from_anchor`, the anchor repeated at slot 0."""
    base = DrafterConfig(
        hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=8, vocab_size=40, mask_token_id=39, target_layer_ids=(0,), num_target_layers=1,
        block_size=5, markov_rank=4, enable_confidence_head=True, confidence_head_with_markov=True,
    )  # fmt: skip
    rng, rng_key = np.random.default_rng(0), jax.random.key(0)
    hidden = rng.standard_normal((2, 3, 5, 16)).astype(np.float32)
    prev = rng.integers(0, 40, size=(2, 3, 5))
    changed = prev.copy()
    changed[:, :, 2] = (prev[:, :, 2] + 1) % 40
    moved = {"vanilla": [2], "gated": [2], "rnn": [2, 3, 4]}
    configs = {kind: dataclasses.replace(base, markov_head_type=kind) for kind in moved}
    params = {}
    for kind, config in configs.items():
        shapes = jax.eval_shape(functools.partial(dspark.init_dspark_params, config), rng_key)
        params[kind] = jax.tree.map(lambda w: rng.standard_normal(w.shape), shapes)

    @jax.jit  # one compile for the three variants
    def both(params):
        return {kind: [dspark.block_heads(configs[kind], params[kind], hidden, tokens)
                       for tokens in (prev, changed)] for kind in configs}  # fmt: skip

    for kind, ((bias, confidence), (bias2, confidence2)) in both(params).items():
        assert bias.shape == (2, 3, 5, 40) and confidence.shape == (2, 3, 5)
        differs = np.abs(np.asarray(bias2 - bias)).max(axis=(0, 1, 3)) > 1e-6
        np.testing.assert_array_equal(np.flatnonzero(differs), moved[kind], err_msg=kind)
        differs = np.abs(np.asarray(confidence2 - confidence)).max(axis=(0, 1)) > 1e-6
        np.testing.assert_array_equal(np.flatnonzero(differs), [2], err_msg=kind)
    tokens = jnp.arange(10).reshape(1, 2, 5)
    np.testing.assert_array_equal(dspark.previous_tokens(base, tokens)[0, 1], [5, 5, 6, 7, 8])
    anchor = dataclasses.replace(base, sample_from_anchor=True)
    np.testing.assert_array_equal(dspark.previous_tokens(anchor, tokens), tokens)
