"""Drafters over a hybrid target (Gated DeltaNet linear-attention layers beside full attention):
trained by the JAX trainer from the target's taps (online and cached), loaded from the z-lab
format with taps on linear-attention layers and decoded exactly, and tree verification refused
when the decode is configured, before anything compiles.

The target is a tiny random transformers qwen3_5 (`_tiny_layered`), layers linear, full, linear,
full, loaded by our loader.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _reference import _randomize
from _tiny_layered import make_tiny_layered
from _training import corpus, logged_losses, train_config
from dflash.model import DFlashDraftModel
from transformers import Qwen3Config

from dflash_jax import api
from dflash_jax.config import ConfigError
from dflash_jax.decoding import autoregressive_decode, speculative_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import load_target
from dflash_jax.io.drafter_io import load_drafter, restore_drafter
from dflash_jax.models.target import Transformer
from dflash_jax.training import data, init, tap_cache, trainer

VOCAB = 64  # the training corpus's tokens (_training.corpus) are below 64


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_tiny_layered(tmp_path_factory.mktemp("hybrid"), "qwen3_5", vocab_size=VOCAB)
    target = load_target(str(path), cache=False)
    assert [target.config.layer_kind(i)[0] for i in range(4)] == ["linear", "attention"] * 2
    return target


@pytest.fixture
def hybrid_trainer(hybrid, monkeypatch):
    monkeypatch.setattr(trainer, "load_target", lambda source, dtype: hybrid)
    return hybrid


TRAIN = dict(num_steps=4, checkpoint_every=4, num_eval_prompts=1)


def _train(data_path, workdir, **overrides) -> np.ndarray:
    """A 4-step run tapping a full-attention layer (1) and a linear-attention one (2)."""
    cfg = train_config(data_path, **TRAIN, **overrides)
    assert tuple(cfg.drafter.target_layer_ids) == (1, 2)
    trainer.train(cfg, workdir)
    losses = logged_losses(workdir)
    assert list(losses) == [1, 2, 3, 4]
    return np.array(list(losses.values()))


@pytest.mark.slow
def test_trainer_learns_from_a_hybrid_targets_taps(tmp_path, hybrid_trainer):
    """Online taps (the hybrid forward cut after layer 2): finite losses falling at every step
    and an exported drafter. The tap cache's rows are the full target's taps."""
    target = hybrid_trainer
    corpus(tmp_path / "data.jsonl", num_records=24)
    losses = _train(tmp_path / "data.jsonl", tmp_path / "online")
    assert np.isfinite(losses).all() and (np.diff(losses) < 0).all(), losses
    assert restore_drafter(tmp_path / "online" / "drafter").config.target_layer_ids == (1, 2)

    source = data.record_source([str(tmp_path / "data.jsonl")])
    cache = tap_cache.build_tap_cache(
        tmp_path / "cache", source, target, (1, 2), 32, dtype="float32", batch_tokens=128
    )
    for i in (0, len(source) - 1):
        tokens = data.decode_record(source[i])["tokens"][:32]
        _, want, _ = Transformer(target.config).apply(
            {"params": target.params}, jnp.asarray([tokens]), jnp.arange(len(tokens))[None],
            tap_layers=(1, 2),
        )  # fmt: skip
        np.testing.assert_allclose(cache.row(i)[: len(tokens)], np.asarray(want[0]), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_cached_taps_of_a_hybrid_target_train_like_online(family, tmp_path, monkeypatch):
    """Online and cached taps give the same losses, for a dense-MLP and an MoE hybrid."""
    target = load_target(str(make_tiny_layered(tmp_path, family, vocab_size=VOCAB)), cache=False)
    monkeypatch.setattr(trainer, "load_target", lambda source, dtype: target)
    corpus(tmp_path / "data.jsonl", num_records=24)
    online = _train(tmp_path / "data.jsonl", tmp_path / "online")
    cached = _train(
        tmp_path / "data.jsonl", tmp_path / "cached", taps="cached", tap_cache_dtype="float32"
    )
    assert np.isfinite(online).all() and online[-1] < online[0], online
    np.testing.assert_allclose(cached, online, rtol=1e-4)


def test_target_initialisations_over_a_hybrid_target(tmp_path, hybrid_trainer):
    """Copying the top layers is refused (naming the setting) before any data is read; the
    final norm starts at the target's zero-centred norm's multiplier, 1 + w."""
    target = hybrid_trainer
    empty = tmp_path / "empty.jsonl"  # found (missing data is refused first), never read
    empty.touch()
    cfg = train_config(empty, init_from_target=True)
    with pytest.raises(ConfigError, match="init_from_target"):
        trainer.train(cfg, tmp_path / "run")
    cfg = train_config(empty, init_norm_from_target=True)
    params = init.initial_params(cfg, trainer.drafter_config_for(cfg, target.config), target)
    np.testing.assert_allclose(params["norm"]["scale"], 1.0 + target.params["norm"]["scale"])


def _save_zlab_drafter(directory, target, tap_ids, block_size=4):
    """A z-lab `DFlashDraftModel` saved by its own `save_pretrained`, for `target`'s sizes; its
    final norm is zeroed, so it always proposes token 0."""
    c = target.config
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rope_theta=1e6, max_position_embeddings=256, num_target_layers=c.num_layers,
        block_size=block_size,
        dflash_config={"mask_token_id": c.vocab_size - 1, "target_layer_ids": list(tap_ids)},
    )  # fmt: skip
    drafter = DFlashDraftModel(config).float().eval()
    _randomize(drafter, 1)
    with torch.no_grad():
        drafter.norm.weight.zero_()
    drafter.save_pretrained(directory)
    return directory


def _boosted(target):
    """The target with lm_head column 0 amplified: it often emits token 0, so acceptance of the
    always-0 drafter varies between 1 and the block."""
    head = target.params["lm_head"]["kernel"]
    return {**target.params, "lm_head": {"kernel": head.at[:, 0].multiply(6.0)}}


PROMPTS = [[5, 17, 33, 3, 42, 7, 8, 50, 60], [11, 2, 60, 31]]


def _batch():
    prompt = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
    for i, p in enumerate(PROMPTS):
        prompt[i, : len(p)] = p
    return prompt, np.array([len(p) for p in PROMPTS], np.int32)


@pytest.mark.slow
def test_zlab_drafter_tapping_linear_layers_decodes_exactly(tmp_path, hybrid):
    """A z-lab drafter whose target_layer_ids are linear (0, 2) and full (1) attention layers
    loads against the hybrid target; greedy speculative decoding equals greedy AR."""
    directory = _save_zlab_drafter(tmp_path / "drafter", hybrid, (0, 1, 2))
    drafter = load_drafter(str(directory), hybrid)
    assert drafter.config.target_layer_ids == (0, 1, 2) and drafter.config.num_target_layers == 4
    params = _boosted(hybrid)
    prompt, lengths = _batch()
    cfg = DecodeConfig(max_new_tokens=16, block_size=4)
    key = jax.random.key(0)
    ar = autoregressive_decode(
        params, prompt, lengths, key, target_config=hybrid.config, decode_config=cfg
    )
    sp = speculative_decode(
        params, drafter.params, prompt, lengths, key,
        target_config=hybrid.config, drafter_config=drafter.config, decode_config=cfg,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
    acc = np.asarray(sp.acceptance_lengths)
    assert acc.max() > 1 and (acc[acc > 0] == 1).any(), acc  # partial acceptance happened


def test_tree_verification_of_a_hybrid_target_is_refused_when_configured(tmp_path, hybrid):
    """tree_nodes over linear-attention layers: a ConfigError (a ValueError) naming the setting,
    from the input checks the CLIs run first and from the decode before it traces; a chain, or
    the target alone, are accepted."""
    drafter = load_drafter(str(_save_zlab_drafter(tmp_path / "drafter", hybrid, (1, 2))), hybrid)
    prompt, lengths = _batch()
    tree = DecodeConfig(max_new_tokens=8, block_size=4, tree_nodes=4)
    with pytest.raises(ValueError, match=r"tree_nodes=4 \(--tree_nodes\).*linear attention"):
        api.check_inputs(hybrid, drafter, prompt, lengths, tree)
    with pytest.raises(ConfigError, match="tree_nodes"):
        speculative_decode(
            hybrid.params, drafter.params, prompt, lengths, jax.random.key(0),
            target_config=hybrid.config, drafter_config=drafter.config, decode_config=tree,
        )  # fmt: skip
    api.check_inputs(hybrid, drafter, prompt, lengths, DecodeConfig(max_new_tokens=8, block_size=4))
    api.check_inputs(hybrid, None, prompt, lengths, tree)
