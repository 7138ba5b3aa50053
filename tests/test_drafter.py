"""The drafter against the reference z-lab `DFlashDraftModel` (dflash 0.1.0), fp32, CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import (
    MASK_TOKEN_ID,
    VOCAB_SIZE,
    load_reference_pair,
    make_reference_pair,
    reference_draft_logits,
    reference_taps,
)

from dflash_jax.config import ConfigError
from dflash_jax.io import load_target
from dflash_jax.io.drafter_io import load_drafter
from dflash_jax.models.drafter import Drafter, check_fits, draft_logits
from dflash_jax.models.target import Transformer

TOL = 1e-4
CONTEXT = 13  # odd on purpose


class Pair:
    """Reference models and ours, loaded from the same files."""

    def __init__(self, tmp_path, **kwargs):
        target_dir, drafter_dir = make_reference_pair(tmp_path, **kwargs)
        self.drafter_dir = drafter_dir
        self.hf_target, self.hf_drafter = load_reference_pair(target_dir, drafter_dir)
        self.target = load_target(str(target_dir))
        self.drafter = load_drafter(drafter_dir, self.target)

    def context_kv(self, taps_btf, positions_bt):
        return _context_kv(self.drafter.config, self.drafter.params, taps_btf, positions_bt)

    def logits(self, block_tokens_bq, ctx_k, ctx_v, lengths_b, anchors_bn, block_size):
        return _draft_logits(
            self.drafter.params,
            self.target.params,
            self.target.config,
            self.drafter.config,
            block_tokens_bq,
            ctx_k,
            ctx_v,
            lengths_b,
            anchors_bn,
            block_size,
        )

    def taps(self, tokens_bt):
        return _target_taps(
            self.target.config, self.drafter.config.target_layer_ids, self.target.params, tokens_bt
        )


# jitted: op-by-op dispatch would compile every primitive separately
_draft_logits = jax.jit(draft_logits, static_argnums=(2, 3, 9))


@jax.jit(static_argnums=0)
def _context_kv(config, params, taps_btf, positions_bt):
    return Drafter(config).apply({"params": params}, taps_btf, positions_bt, method="context_kv")


@jax.jit(static_argnums=(0, 1))
def _target_taps(config, tap_ids, params, tokens_bt):
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    _, taps_btf, _ = Transformer(config).apply(
        {"params": params}, tokens_bt, positions_bt, tap_layers=tap_ids
    )
    return taps_btf


def _tokens(rng, n):
    return rng.integers(0, VOCAB_SIZE, size=n)


def _block(rng, block_size):
    """An anchor token followed by mask tokens, with a few random tokens mixed in so that a
    wrong within-block mask or position changes the result."""
    block = np.full(block_size, MASK_TOKEN_ID)
    block[0] = rng.integers(0, VOCAB_SIZE - 1)
    block[rng.integers(1, block_size, size=2)] = rng.integers(0, VOCAB_SIZE, size=2)
    return block


@pytest.fixture(scope="module", params=[2, 1], ids=["gqa4:2", "gqa4:1"])
def pair(request, tmp_path_factory):
    """One random target + drafter per GQA ratio (4 query heads over 2 or 1 kv heads)."""
    return Pair(tmp_path_factory.mktemp("pair"), block_size=8, num_kv_heads=request.param)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_single_block_matches_reference(pair, block_size):
    rng = np.random.default_rng(block_size)
    tokens = _tokens(rng, CONTEXT)
    taps_tf = reference_taps(pair.hf_target, pair.hf_drafter, tokens)
    block = _block(rng, block_size)
    ref = reference_draft_logits(pair.hf_target, pair.hf_drafter, taps_tf, block)

    positions = jnp.arange(CONTEXT)[None]
    ctx_k, ctx_v = pair.context_kv(jnp.asarray(taps_tf)[None], positions)
    ours = pair.logits(
        jnp.asarray(block)[None],
        ctx_k,
        ctx_v,
        jnp.array([CONTEXT]),
        jnp.array([[CONTEXT]]),
        block_size,
    )
    assert ours.shape == (1, 1, block_size - 1, VOCAB_SIZE)
    diff = float(np.max(np.abs(np.asarray(ours[0, 0]) - ref)))
    kv = pair.drafter.config.num_kv_heads
    print(f"\nmax|ours - reference| block_size={block_size} heads 4/{kv}: {diff:.2e}")
    assert diff <= TOL

    # Our own target's taps feed the drafter the same context as HF hidden_states[l + 1].
    our_taps = pair.taps(jnp.asarray(tokens)[None])
    np.testing.assert_allclose(np.asarray(our_taps[0]), taps_tf, atol=TOL, rtol=0)


def test_batched_blocks_over_cache_match_reference(pair):
    _check_batched_blocks(pair, 8)


@pytest.mark.parametrize(
    "kwargs",
    [
        {
            "block_size": 4,
            "num_kv_heads": 1,
            "num_layers": 3,
            "tap_ids": (0, 2, 5),
            "layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
            "sliding_window": 5,
        },
        {"block_size": 8, "num_kv_heads": 2, "is_causal": True},
    ],
    ids=["sliding", "causal"],
)
def test_sliding_and_causal_layers_match_reference(tmp_path, kwargs):
    pair = Pair(tmp_path, **kwargs)
    assert pair.drafter.config.layer_is_causal(0)
    _check_batched_blocks(pair, kwargs["block_size"])


def _check_batched_blocks(pair, bs):
    """Two rows of different context lengths in one cache with garbage past each row's length,
    two blocks per row at different anchors: each block equals the reference drafting that block
    with the context before its anchor."""
    rng = np.random.default_rng(0)
    lengths, anchors = [CONTEXT, 9], [[6, CONTEXT], [3, 9]]
    slots = CONTEXT + 4
    taps = [reference_taps(pair.hf_target, pair.hf_drafter, _tokens(rng, n)) for n in lengths]
    taps_btf = np.stack([np.pad(t, ((0, slots - len(t)), (0, 0))) for t in taps])
    ctx_k, ctx_v = pair.context_kv(
        jnp.asarray(taps_btf), jnp.broadcast_to(jnp.arange(slots), (2, slots))
    )
    garbage = lambda c: tuple(
        jnp.where(
            jnp.arange(slots)[None, None, :, None] < jnp.array(lengths)[:, None, None, None], x, 1e3
        )
        for x in c
    )
    blocks = np.stack([np.concatenate([_block(rng, bs) for _ in range(2)]) for _ in range(2)])
    ours = pair.logits(
        jnp.asarray(blocks),
        garbage(ctx_k),
        garbage(ctx_v),
        jnp.array(lengths),
        jnp.array(anchors),
        bs,
    )
    assert ours.shape == (2, 2, bs - 1, VOCAB_SIZE)
    for b in range(2):
        for n in range(2):
            a = anchors[b][n]
            ref = reference_draft_logits(
                pair.hf_target, pair.hf_drafter, taps[b][:a], blocks[b, n * bs : (n + 1) * bs]
            )
            diff = float(np.max(np.abs(np.asarray(ours[b, n]) - ref)))
            assert diff <= TOL, f"row {b} block {n} (anchor {a}): max diff {diff:.2e}"


def test_sliding_layers_without_use_sliding_window_have_no_window():
    """A z-lab config whose layer types say sliding but that lacks use_sliding_window reads as
    Qwen3Config does (its default False): those layers causal in the block, with no window."""
    from transformers import Qwen3Config

    from dflash_jax.io.drafter_config import drafter_from_zlab

    hf = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, sliding_window=5,
              layer_types=["sliding_attention", "full_attention"], num_target_layers=6,
              dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": [1, 3]})  # fmt: skip
    assert Qwen3Config(**hf).sliding_window is None
    c = drafter_from_zlab(hf)
    assert c.layer_window(0) is None and c.layer_is_causal(0)
    assert drafter_from_zlab({**hf, "use_sliding_window": True}).layer_window(0) == 5


def test_context_kv_appends_equal_one_shot(pair):
    rng = np.random.default_rng(1)
    taps_btf = jnp.asarray(reference_taps(pair.hf_target, pair.hf_drafter, _tokens(rng, CONTEXT)))[
        None
    ]
    positions = jnp.arange(CONTEXT)[None]
    one_k, one_v = pair.context_kv(taps_btf, positions)
    cut = 6
    a_k, a_v = pair.context_kv(taps_btf[:, :cut], positions[:, :cut])
    b_k, b_v = pair.context_kv(taps_btf[:, cut:], positions[:, cut:])
    assert len(one_k) == pair.drafter.config.num_layers
    assert one_k[0].shape == (1, pair.drafter.config.num_kv_heads, CONTEXT, 16)
    for one, a, b in zip(one_k + one_v, a_k + a_v, b_k + b_v, strict=True):
        np.testing.assert_allclose(np.concatenate([a, b], axis=2), one, atol=1e-6, rtol=0)
    # positions matter: the same rows at shifted positions give different keys, not values
    shifted_k, shifted_v = pair.context_kv(taps_btf[:, cut:], positions[:, :-cut] + 1)
    assert not np.allclose(shifted_k[0], b_k[0], atol=1e-3)
    np.testing.assert_allclose(shifted_v[0], b_v[0], atol=1e-6, rtol=0)


def test_misfits_are_refused(pair):
    d, t = pair.drafter.config, pair.target.config
    check_fits(d, t, pair.drafter.params)
    cases = {
        "hidden_size": dataclasses.replace(t, hidden_size=32),
        "vocab_size": dataclasses.replace(t, vocab_size=1024),
        "target_layer_ids": dataclasses.replace(t, num_layers=3),
    }
    for reason, bad_target in cases.items():
        with pytest.raises(ConfigError, match=reason):
            check_fits(d, bad_target)
    with pytest.raises(ConfigError, match="mask_token_id=600"):
        check_fits(dataclasses.replace(d, mask_token_id=600), t)
    wide = {**pair.drafter.params, "fc": {"kernel": jnp.zeros((3 * 64, 64))}}
    with pytest.raises(ConfigError, match="fc takes 192 inputs"):
        check_fits(d, t, wide)
    target_like = type("T", (), {"config": dataclasses.replace(t, num_layers=3)})()
    with pytest.raises(ConfigError, match=r"outside \[-1 \(the embedding\), 2\]"):
        load_drafter(pair.drafter_dir, target_like)
