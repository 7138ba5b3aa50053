"""Training options: initialisation from the target, warm start from an exported drafter,
non-finite steps (stop or skip), and resuming past an unreadable checkpoint."""

import dataclasses
import functools
import json
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _training import TINY_TARGET, corpus, logged_losses, train_config

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.io.drafter_io import restore_drafter, save_drafter
from dflash_jax.io.target_loader import LoadedTarget
from dflash_jax.models.drafter import Drafter, init_drafter_params
from dflash_jax.models.target import Transformer, init_cache, init_params
from dflash_jax.training import trainer
from dflash_jax.training.init import (
    context_tap_for,
    grown_params,
    params_from_target,
    warm_start_params,
)

QWEN_TARGET = TargetConfig(
    arch="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


def _drafter(num_layers, taps):
    return DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=64,
        mask_token_id=0,
        target_layer_ids=taps,
        num_target_layers=4,
        block_size=4,
        rope_theta=10000.0,
    )


def _perturbed_norms(params, key):
    """Random norm scales (init gives ones), so a norm copied from the wrong place shows."""
    leaves, tree = jax.tree.flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = [
        1.0 + 0.3 * jax.random.normal(k, x.shape) if "scale" in jax.tree_util.keystr(p) else x
        for (p, x), k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, out)


@pytest.mark.slow  # 23 s; an option, not the recipe
def test_init_from_target_starts_with_the_targets_own_context_kv():
    target_params = _perturbed_norms(init_params(QWEN_TARGET, jax.random.key(0)), jax.random.key(1))
    dcfg = _drafter(2, (1, 2))  # copies target layers 2 and 3; tap 1 is layer 2's input
    assert context_tap_for(dcfg, 4) == 0
    params = params_from_target(
        init_drafter_params(dcfg, jax.random.key(2)), dcfg, QWEN_TARGET, target_params
    )
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    _, taps, cache = Transformer(QWEN_TARGET).apply(
        {"params": target_params},
        tokens,
        positions,
        init_cache(QWEN_TARGET, 2, 12),
        jnp.zeros((2,), jnp.int32),
        (1, 2),
    )
    ks, vs = Drafter(dcfg).apply({"params": params}, taps, positions, method="context_kv")
    np.testing.assert_allclose(ks[0], cache.k[2][:, :, :9], atol=1e-5)
    np.testing.assert_allclose(vs[0], cache.v[2][:, :, :9], atol=1e-5)
    # The layers themselves are the target's top layers, the final norm its final norm.
    for i in (0, 1):
        got, want = params[f"layers_{i}"], target_params[f"layers_{2 + i}"]
        jax.tree.map(np.testing.assert_array_equal, got, want)
    np.testing.assert_array_equal(params["norm"]["scale"], target_params["norm"]["scale"])


def test_init_from_target_refuses_other_shapes():
    wide = DrafterConfig(**{**_drafter(2, (1, 2)).__dict__, "intermediate_size": 48})
    with pytest.raises(ConfigError, match="intermediate_size 48"):
        params_from_target(
            init_drafter_params(wide, jax.random.key(0)),
            wide,
            QWEN_TARGET,
            init_params(QWEN_TARGET, jax.random.key(0)),
        )


def test_every_start_keeps_fp32_master_weights_and_adam_state():
    """Under a bf16 compute dtype with a bf16 target, the train state of a fresh run, of
    init_from_target and of init_norm_from_target, and the state a resume or
    init_from_checkpoint restores into, hold fp32 params and Adam moments (issue 56: warm
    starts cast them to bf16; init_from is checked in
    test_warm_start_loads_an_exported_drafters_params)."""
    from types import SimpleNamespace

    from dflash_jax.training import checkpoint
    from dflash_jax.training.step import OptimizerConfig

    # Shapes and dtypes only (jax.eval_shape): nothing is compiled or computed.
    target_params = jax.eval_shape(
        lambda: jax.tree.map(
            lambda x: x.astype(jnp.bfloat16), init_params(QWEN_TARGET, jax.random.key(0))
        )
    )
    dcfg = dataclasses.replace(_drafter(2, (1, 2)), dtype="bfloat16")
    optimizer = OptimizerConfig(1e-3, 1, 10, 0.9, 0.999, 1e-8, 0.0, 1.0)
    floats = lambda state: {
        x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
    }
    assert floats(target_params) == {jnp.dtype("bfloat16")}
    for start in ({"init_from_target": True}, {"init_norm_from_target": True}, {}):
        cfg = train_config("", compute_dtype="bfloat16", **start)
        state = jax.eval_shape(
            lambda params, cfg=cfg: trainer.initial_state(
                cfg, dcfg, SimpleNamespace(config=QWEN_TARGET, params=params), optimizer, None
            ),
            target_params,
        )
        assert floats(state) == {jnp.dtype("float32")}, start
        assert len(jax.tree.leaves(state["opt_state"])) > 2 * len(jax.tree.leaves(state["params"]))
    if_restored = checkpoint.abstract_state(dcfg, optimizer)  # resume, init_from_checkpoint
    assert floats(if_restored) == {jnp.dtype("float32")}


@pytest.fixture
def tiny_target(monkeypatch):
    target = LoadedTarget(
        TINY_TARGET, init_params(TINY_TARGET, jax.random.key(1)), None, None, "tiny"
    )
    monkeypatch.setattr(trainer, "load_target", lambda source, dtype: target)
    return target


@pytest.mark.slow
def test_warm_start_loads_an_exported_drafters_params(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl")
    cfg = train_config(tmp_path / "data.jsonl", num_steps=4, checkpoint_every=4)
    trainer.train(cfg, tmp_path / "first")
    exported = restore_drafter(tmp_path / "first" / "drafter")
    dcfg = trainer.drafter_config_for(cfg, TINY_TARGET)
    start = warm_start_params(str(tmp_path / "first" / "drafter"), dcfg)
    jax.tree.map(np.testing.assert_array_equal, start, exported.params)
    # Under a bf16 compute dtype the master weights stay fp32, as a fresh init's (issue 56:
    # they were cast to bf16, and Adam's moments with them).
    bf16 = dataclasses.replace(dcfg, dtype="bfloat16")
    dtypes = {
        x.dtype for x in jax.tree.leaves(warm_start_params(str(tmp_path / "first/drafter"), bf16))
    }
    assert dtypes == {jnp.dtype("float32")}
    # A warm-started run begins where the export ended: its first loss is the exported
    # drafter's, below a fresh run's first loss.
    warm = train_config(
        tmp_path / "data.jsonl", num_steps=2, init_from=str(tmp_path / "first/drafter")
    )
    trainer.train(warm, tmp_path / "warm")
    fresh = logged_losses(tmp_path / "first")
    assert logged_losses(tmp_path / "warm")[1] < fresh[1]
    other = trainer.drafter_config_for(train_config(tmp_path / "x", block_size=8), TINY_TARGET)
    with pytest.raises(ConfigError, match="do not have this run's shapes"):
        warm_start_params(str(tmp_path / "first" / "drafter"), DrafterConfig(
            **{**other.__dict__, "num_layers": 3, "layer_types": ()}
        ))  # fmt: skip


def test_a_grown_drafter_starts_as_the_one_it_grew_from():
    """init_grow_layers: a 1-layer drafter's params inside a 2-layer drafter. Its leaves are
    kept, the added layer's residual outputs are zero, so the grown drafter's hidden states are
    the smaller one's to the bit; and training moves the added layer (its output projections
    get gradients)."""
    small, big = _drafter(1, (1, 2)), _drafter(2, (1, 2))
    params = _perturbed_norms(init_drafter_params(small, jax.random.key(0)), jax.random.key(1))
    grown = grown_params(params, 1, big, seed=3)
    assert set(grown) == {"fc", "hidden_norm", "layers_0", "layers_1", "norm"}
    for key in ("fc", "hidden_norm", "layers_0", "norm"):
        jax.tree.map(np.testing.assert_array_equal, grown[key], params[key])
    added = grown["layers_1"]
    assert not np.any(added["self_attn"]["o_proj"]["kernel"])
    assert not np.any(added["mlp"]["down_proj"]["kernel"])
    assert np.any(added["self_attn"]["q_proj"]["kernel"])  # the rest keeps its random init

    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.normal(size=(2, 10, 64)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3 * 4, 32)), jnp.float32)
    lengths, anchors = jnp.asarray([10, 7]), jnp.asarray([[1, 4, 6], [0, 2, 5]])

    def hidden(cfg, p):
        return Drafter(cfg).apply(
            {"params": p}, taps, x, lengths, anchors, 4, method="forward_from_taps"
        )

    np.testing.assert_array_equal(
        jax.jit(functools.partial(hidden, big))(grown),
        jax.jit(functools.partial(hidden, small))(params),
    )
    grads = jax.jit(jax.grad(lambda p: jnp.sum(hidden(big, p) ** 2)))(grown)["layers_1"]
    assert np.abs(grads["self_attn"]["o_proj"]["kernel"]).max() > 0
    assert np.abs(grads["mlp"]["down_proj"]["kernel"]).max() > 0


@pytest.mark.slow
def test_growing_is_asked_for_and_reads_an_export(tmp_path):
    """Through `warm_start_params`: an export grows only when asked, only into more layers,
    and only with init_from."""
    small, big = _drafter(1, (1, 2)), _drafter(2, (1, 2))
    params = _perturbed_norms(init_drafter_params(small, jax.random.key(0)), jax.random.key(1))
    save_drafter(tmp_path / "one", small, params)
    grown = warm_start_params(str(tmp_path / "one"), big, seed=3, grow_layers=True)
    jax.tree.map(np.testing.assert_array_equal, grown, grown_params(params, 1, big, seed=3))
    with pytest.raises(ConfigError, match="do not have this run's shapes"):
        warm_start_params(str(tmp_path / "one"), big)  # growing is asked for, never implied
    save_drafter(tmp_path / "two", big, grown)
    with pytest.raises(ConfigError, match="not fewer than"):
        warm_start_params(str(tmp_path / "two"), big, grow_layers=True)
    with pytest.raises(ValueError, match="init_grow_layers needs config.init_from"):
        trainer.check_config(train_config(tmp_path / "data.jsonl", init_grow_layers=True))


def _nan_at_call(monkeypatch, call: int):
    """Poisons the target embedding in the train step's `call`-th invocation: that batch's
    inputs, and so its loss and gradients, are NaN."""
    real = trainer.train_step
    calls = iter(range(1, 1000))

    def poisoned(state, target_params, batch, **kw):
        if next(calls) == call:
            emb = target_params["embed_tokens"]["embedding"]
            target_params = {**target_params, "embed_tokens": {"embedding": emb * jnp.nan}}
        return real(state, target_params, batch, **kw)

    monkeypatch.setattr(trainer, "train_step", poisoned)


@pytest.mark.slow
def test_nonfinite_step_stops_the_run_naming_it(tmp_path, tiny_target, monkeypatch):
    corpus(tmp_path / "data.jsonl")
    cfg = train_config(tmp_path / "data.jsonl", num_steps=8, checkpoint_every=2)
    _nan_at_call(monkeypatch, 5)
    with pytest.raises(trainer.NonFiniteError, match="step 5: non-finite.*up to step 4"):
        trainer.train(cfg, tmp_path / "run")
    checkpoints = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == [2, 4]
    monkeypatch.undo()
    monkeypatch.setattr(trainer, "load_target", lambda source, dtype: tiny_target)
    trainer.train(cfg, tmp_path / "run")  # resumes from 4 and finishes
    assert max(logged_losses(tmp_path / "run")) == 8


@pytest.mark.slow
def test_nonfinite_step_can_be_skipped_and_counted(tmp_path, tiny_target, monkeypatch):
    corpus(tmp_path / "data.jsonl")
    cfg = train_config(tmp_path / "data.jsonl", num_steps=6, log_every=3, nonfinite="skip")
    _nan_at_call(monkeypatch, 2)
    trainer.train(cfg, tmp_path / "run")
    lines = [
        json.loads(x) for x in (tmp_path / "run" / trainer.METRICS_FILE).read_text().splitlines()
    ]
    logged = [x for x in lines if "loss" in x]
    assert [x["skipped_steps"] for x in logged] == [1, 0]
    assert all(np.isfinite(x["loss"]) for x in logged)
    params = restore_drafter(tmp_path / "run" / "drafter").params
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_resume_skips_an_unreadable_checkpoint(tmp_path, tiny_target, caplog):
    corpus(tmp_path / "data.jsonl")
    cfg = train_config(tmp_path / "data.jsonl", num_steps=6, checkpoint_every=2, learning_rate=3e-3)
    trainer.train(cfg, tmp_path / "straight")
    run = tmp_path / "run"
    trainer.train(cfg, run)
    # As if the run had been killed after step 4's checkpoint, then that one was truncated.
    shutil.rmtree(run / "checkpoints" / "6")
    for path in (run / "checkpoints" / "4").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        trainer.train(cfg, run)
    assert "unreadable" in caplog.text
    assert (run / "checkpoints_unreadable" / "4").is_dir()
    # Resumed from step 2: steps 3..6 replay the same data and give the same losses.
    assert logged_losses(run) == logged_losses(tmp_path / "straight")
    assert max(int(p.name) for p in (run / "checkpoints").iterdir()) == 6


def test_bad_option_values_are_refused(tmp_path):
    for key, value, message in (
        ("nonfinite", "ignore", "nonfinite"),
        ("eval_prompts", "test", "eval_prompts"),
        ("init_from", str(tmp_path / "missing"), "no such drafter directory"),
    ):
        with pytest.raises(ValueError, match=message):
            trainer.train(train_config(tmp_path / "d.jsonl", **{key: value}), tmp_path / "run")
    assert not Path(tmp_path / "run" / "checkpoints").exists()
