"""Training: anchors, labels and the block mask on hand-built examples, loss weights, the chunked
loss against a dense one, a tiny end-to-end run, exact resume after a kill, misfit refusal."""

import dataclasses
import json
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _training import TINY_TARGET, Killed, corpus, logged_losses, train_config

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.io.drafter_io import restore_drafter
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.ops.attention import drafter_mask
from dflash_jax.training import data, evaluation, trainer
from dflash_jax.training.anchors import anchor_candidates, sample_anchors
from dflash_jax.training.loss import (
    block_diffusion_loss,
    block_inputs,
    block_labels,
    default_gamma,
    implied_acceptance,
    position_weights,
)

# --- anchors, labels, mask -----------------------------------------------------------------


def test_anchor_candidates_need_two_loss_tokens_inside_the_length():
    loss_mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 0])
    assert anchor_candidates(loss_mask, 9).tolist() == [2, 3, 6]
    assert anchor_candidates(loss_mask, 7).tolist() == [2, 3]  # p+1 = 7 is past the length


def test_sample_anchors_sorted_subset_with_padding():
    loss_mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 0])
    anchors, valid = sample_anchors(loss_mask, 9, 5, np.random.default_rng(0))
    assert anchors.tolist() == [2, 3, 6, 6, 6] and valid.tolist() == [1, 1, 1, 0, 0]
    seen = set()
    for seed in range(40):
        anchors, valid = sample_anchors(loss_mask, 9, 2, np.random.default_rng(seed))
        assert valid.all() and anchors[0] < anchors[1]
        seen.add(tuple(anchors.tolist()))
    assert seen == {(2, 3), (2, 6), (3, 6)}  # a random subset, not always the first ones
    anchors, valid = sample_anchors(np.zeros(9), 9, 3, np.random.default_rng(0))
    assert anchors.tolist() == [0, 0, 0] and not valid.any()


def test_block_inputs_and_same_position_labels():
    tokens = jnp.arange(10, 20)[None, :]  # token at position p is 10 + p
    loss_mask = jnp.array([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]])
    anchors = jnp.array([[2, 5, 5]])
    anchor_valid = jnp.array([[True, True, False]])
    blocks = block_inputs(tokens, anchors, 3, mask_token_id=99)
    assert blocks.tolist() == [[12, 99, 99, 15, 99, 99, 15, 99, 99]]
    labels, valid = block_labels(tokens, loss_mask, jnp.array([8]), anchors, anchor_valid, 3)
    assert labels[0, 0].tolist() == [12, 13, 14] and labels[0, 1].tolist() == [15, 16, 17]
    # slot 0 never; position 7 is outside the loss mask; the padding anchor never.
    assert valid[0].tolist() == [[False, True, True], [False, True, False], [False] * 3]
    _, valid = block_labels(tokens, loss_mask, jnp.array([6]), anchors, anchor_valid, 3)
    assert valid[0, 1].tolist() == [False, False, False]  # positions 6, 7 past the length 6


def test_block_mask_on_a_hand_built_example():
    # 6 context slots, context length 5, two blocks of 2 at anchors 1 and 3.
    mask = np.asarray(drafter_mask(jnp.array([5]), jnp.array([[1, 3]]), 2, 6))[0]
    want = np.zeros((4, 10), bool)
    want[0:2, 0:1] = True  # block 0 sees context < 1 (its anchor's own tap is not context)
    want[2:4, 0:3] = True  # block 1 sees context < 3
    want[0:2, 6:8] = True  # own block, both directions
    want[2:4, 8:10] = True
    np.testing.assert_array_equal(mask, want)


# --- loss ------------------------------------------------------------------------------------


def test_loss_weights_and_gamma():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    np.testing.assert_allclose(w[1:], np.exp(-np.arange(15) / 7.0), rtol=1e-6)
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    with pytest.raises(ConfigError, match="loss_gamma"):
        default_gamma(12)


def test_implied_acceptance():
    assert implied_acceptance(np.ones(15)) == 16.0
    assert implied_acceptance(np.array([0.5, 0.5, 0.0])) == pytest.approx(1.75)


@pytest.mark.slow  # moved out of the default suite for its budget (2026-12-06); CI's slow step runs it
def test_chunked_loss_matches_dense_loss_and_gradient():
    b, n, j, d, v = 2, 3, 4, 8, 50
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(k1, (b, n * j, d))
    head = jax.random.normal(k2, (d, v))
    labels = jax.random.randint(k3, (b, n, j), 0, v)
    valid = jax.random.bernoulli(k4, 0.7, (b, n, j)).at[:, :, 0].set(False)
    weights = jnp.asarray(position_weights(j, 2.0))

    def chunked(h):
        return block_diffusion_loss(h, labels, valid, weights, lambda x: x @ head, chunk_rows=5)

    def dense(h):
        logp = jax.nn.log_softmax(h.reshape(b, n, j, d) @ head, axis=-1)
        ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        w = jnp.where(valid, weights[None, None, :], 0.0)
        return jnp.sum(w * ce) / jnp.sum(w)

    (loss, stats), grad = jax.value_and_grad(chunked, has_aux=True)(hidden)
    np.testing.assert_allclose(loss, dense(hidden), rtol=1e-5)
    np.testing.assert_allclose(grad, jax.grad(dense)(hidden), rtol=1e-4, atol=1e-6)
    hits = (jnp.argmax(hidden.reshape(b, n, j, d) @ head, -1) == labels) & valid
    np.testing.assert_array_equal(stats["correct"], hits.sum((0, 1))[1:])
    np.testing.assert_array_equal(stats["count"], valid.sum((0, 1))[1:])
    # Teacher-forced acceptance: each block whose slots are all valid adds its leading run of hits.
    hits_np, valid_np = np.asarray(hits)[:, :, 1:], np.asarray(valid)[:, :, 1:]
    runs = [
        int(np.argmin(np.append(h, False)))  # index of the first miss = the run's length
        for h, ok in zip(hits_np.reshape(-1, j - 1), valid_np.reshape(-1, j - 1), strict=True)
        if ok.all()
    ]
    assert stats["full_blocks"] == len(runs)
    assert stats["forced_accepted"] == sum(runs)


def test_forced_acceptance_counts_leading_hits_of_full_blocks_only():
    # Logits = hidden (identity head over 4 tokens): row r predicts argmax(hidden[r]).
    j, v = 4, 4
    labels = jnp.asarray([[[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]])  # [1, 3, 4]
    predicted = np.asarray([[0, 1, 2, 0], [0, 1, 0, 3], [0, 1, 2, 3]])  # slot 0 is the anchor
    hidden = jax.nn.one_hot(predicted.reshape(1, -1), v) * 5.0
    valid = jnp.ones((1, 3, j), bool).at[:, :, 0].set(False).at[0, 2, 3].set(False)
    weights = jnp.asarray(position_weights(j, 2.0))
    _, stats = block_diffusion_loss(hidden, labels, valid, weights, lambda x: x, chunk_rows=3)
    # Block 0: slots 1, 2 right, 3 wrong -> 2; block 1: slot 2 wrong -> 1; block 2 not full.
    assert stats["full_blocks"] == 2
    assert stats["forced_accepted"] == 3


# --- bucketed batches ----------------------------------------------------------------------


def _short_records(path, lengths, prompt_len=3):
    rng = np.random.default_rng(5)
    data.write_shard(path, [
        {"tokens": rng.integers(2, 64, n).tolist(), "loss_mask": [0] * prompt_len
         + [1] * (n - prompt_len), "source": "t", "prompt": str(i)}
        for i, n in enumerate(lengths)
    ])  # fmt: skip
    return data.split_holdout(data.record_source([str(path)]), 1, 0)[0]


def test_batches_are_cropped_to_their_bucket_on_any_process_count(tmp_path):
    """bucket_tokens: each batch is the seq_len-padded batch with only padding cut (tokens past
    every row's length, anchor slots no row fills), to the bucket `bucket_shape` names; the
    processes of a 2-process run crop their rows of a global batch alike."""
    lengths = [6, 9, 12, 30, 7, 8, 5, 11, 40, 13, 6, 10, 9]
    train = _short_records(tmp_path / "d.jsonl", lengths)
    sizes = dict(seq_len=48, num_anchors=32, batch_size=4, num_epochs=2, seed=3)
    listed = lambda ds: [ds[k] for k in range(len(ds))]  # each batch read once
    full = listed(data.batched_dataset(train, **sizes))
    cropped = listed(data.batched_dataset(train, **sizes, bucket_tokens=8))
    halves = [
        listed(data.batched_dataset(train, **sizes, bucket_tokens=8, shard_index=i, shard_count=2))
        for i in (0, 1)
    ]
    assert len(full) == len(cropped) == len(halves[0]) == 6
    shapes = set()
    for k in range(len(full)):
        whole, crop = full[k], cropped[k]
        s, n = crop["tokens"].shape[1], crop["anchors"].shape[1]
        valid = whole["anchor_valid"].sum(1).max()
        assert (s, n) == data.bucket_shape(whole["length"].max(), valid, 48, 32, 8)
        assert s % 8 == 0 and s >= whole["length"].max() and n >= valid
        shapes.add((s, n))
        for key, cut in (("tokens", s), ("loss_mask", s), ("anchors", n), ("anchor_valid", n)):
            np.testing.assert_array_equal(crop[key], whole[key][:, :cut])
        assert not whole["tokens"][:, s:].any() and not whole["anchor_valid"][:, n:].any()
        parts = [h[k] for h in halves]
        for key in crop:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), crop[key])
    assert len(shapes) > 1 and min(shapes) < (48, 32)  # some batches were cut: the test can fail
    assert data.bucket_shape(30, 20, 48, 32, 0) == (48, 32)  # 0: no bucketing
    # group_batches: each window of 3 batches holds the same records, sorted by length into
    # batches (taken in a random order), so the crops are shorter; 2 processes still agree.
    grouped = listed(data.batched_dataset(train, **sizes, bucket_tokens=8, group_batches=3))
    split = [
        listed(data.batched_dataset(
            train, **sizes, bucket_tokens=8, group_batches=3, shard_index=i, shard_count=2
        ))
        for i in (0, 1)
    ]  # fmt: skip
    for k in (0, 3):
        window = grouped[k : k + 3]
        ids = sorted(i for batch in window for i in batch["index"].tolist())
        assert ids == sorted(i for b in range(k, k + 3) for i in full[b]["index"].tolist())
        spans = sorted((b["length"].min(), b["length"].max()) for b in window)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    for k, batch in enumerate(grouped):
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([h[k][key] for h in split]), batch[key])
    tokens = sum(b["tokens"].shape[1] for b in grouped)
    assert tokens < sum(b["tokens"].shape[1] for b in cropped)


@pytest.mark.slow  # 7-50 s on the shared 2-core machine: two gradient compiles
def test_bucketed_batch_and_remat_keep_the_loss_and_gradient(tiny_target):
    """Only this guards that a batch cropped to its bucket (config.bucket_tokens) and drafter
    layers under remat (config.remat) keep the loss and gradients: the cropped batch under
    remat gives those of the seq_len-padded batch without it (one compile each); remat is in
    the program (a checkpoint in its jaxpr)."""
    from dflash_jax.training.step import drafter_loss

    lengths = [14, 9, 20, 12, 17]
    cfg = train_config("", seq_len=48, num_anchors=32)
    dcfg = trainer.drafter_config_for(cfg, TINY_TARGET)
    pad = data.PadAndSampleAnchors(cfg.seq_len, cfg.num_anchors)
    rng = np.random.default_rng(1)
    rows = [
        pad.random_map(data.record_element({"tokens": rng.integers(2, 64, n).tolist(),
                                            "loss_mask": [0] * 3 + [1] * (n - 3)}, i), rng)
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    full = {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "index"}
    crop = data.CropToBucket(cfg.seq_len, cfg.num_anchors, 8).map(full)
    assert crop["tokens"].shape == (5, 24) and crop["anchors"].shape == (5, 32 // 2)
    params = init_drafter_params(dcfg, jax.random.key(0))
    weights = jnp.asarray(position_weights(cfg.block_size, cfg.loss_gamma))

    def loss(params, batch, remat):
        return drafter_loss(
            params, tiny_target.params, batch, target_config=TINY_TARGET, drafter_config=dcfg,
            weights_j=weights, ce_chunk_rows=16, remat=remat,
        )[0]  # fmt: skip

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)
    want, want_g = grad(params, full, False)
    got, got_g = grad(params, crop, True)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_g, want_g)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss), static_argnums=2)(params, crop, True))
    assert "checkpoint" in jaxpr or "remat" in jaxpr


# --- end to end ----------------------------------------------------------------------------


def test_tiny_run_learns_and_exports(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl")
    (tmp_path / "data.json").write_text('{"thinking": "off"}')  # the shard's manifest
    cfg = train_config(tmp_path / "data.jsonl", eval_every=40, peak_tflops=1.0)
    last = trainer.train(cfg, tmp_path / "run")
    lines = [
        json.loads(x) for x in (tmp_path / "run" / trainer.METRICS_FILE).read_text().splitlines()
    ]
    logged = [x for x in lines if "loss" in x]
    assert [x["step"] for x in logged] == list(range(1, 41))
    first, final = (
        np.mean([x["loss"] for x in logged[:5]]),
        np.mean([x["loss"] for x in logged[-5:]]),
    )
    assert final < 0.6 * first, (first, final)
    acc_first = np.mean([x["accuracy"][0] for x in logged[:5]])
    acc_final = np.mean([x["accuracy"][0] for x in logged[-5:]])
    assert acc_final > acc_first + 0.2, (acc_first, acc_final)
    assert last["tau_implied"] > 1.2
    tau_eval = [x["tau_eval"] for x in lines if "tau_eval" in x]
    assert len(tau_eval) == 1 and 1.0 <= tau_eval[0] <= cfg.block_size
    # The held-out metric, logged beside it: the records follow the training's cycle, so the
    # trained drafter predicts them through the full vocabulary too.
    (heldout,) = [x for x in lines if "heldout_tau_forced" in x]
    assert len(heldout["heldout_accuracy"]) == cfg.block_size - 1
    assert 1.0 <= heldout["heldout_tau_forced"] <= cfg.block_size, heldout
    exported = restore_drafter(tmp_path / "run" / "drafter")
    assert exported.config.block_size == 4 and exported.config.mask_token_id == 0
    # The data's thinking mode travels into the export (`load_drafter` warns on a mismatch).
    assert '"thinking": "off"' in (tmp_path / "run" / "drafter" / "training_data.json").read_text()
    # It is the exported drafter's, recomputed here, and it sees what training taught: a fresh
    # drafter on the same held-out batch scores lower.
    source = data.record_source([str(tmp_path / "data.jsonl")])
    _, records = data.split_holdout(source, cfg.num_eval_prompts, cfg.seed)
    batch = evaluation.heldout_batch(records, cfg.seq_len, cfg.num_anchors)
    score = lambda params: evaluation.heldout_metrics(
        tiny_target, exported.config, params, batch, cfg.loss_gamma, cfg.ce_chunk_rows
    )
    trained = score(exported.params)
    assert trained["heldout_tau_forced"] == pytest.approx(heldout["heldout_tau_forced"])
    assert trained["heldout_loss"] == pytest.approx(heldout["heldout_loss"], rel=1e-5)
    fresh = score(init_drafter_params(exported.config, jax.random.key(7)))
    assert fresh["heldout_loss"] > trained["heldout_loss"] + 0.5, (fresh, trained)
    assert fresh["heldout_tau_forced"] < trained["heldout_tau_forced"], (fresh, trained)
    checkpoints = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == [20, 40]
    # The same figures as TensorBoard events, as tensorboard's own reader parses them, with
    # throughput and the MFU estimate (against the config's peak: a CPU has none).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]
    assert [s for s, _ in scalars("loss")] == list(range(1, 41))
    assert [v for _, v in scalars("loss")] == pytest.approx([x["loss"] for x in logged])
    assert [s for s, _ in scalars("tokens_per_s")] == list(range(2, 41))  # step 1 compiles
    assert all(v > 0 for _, v in scalars("tokens_per_s") + scalars("mfu"))
    assert logged[-1]["mfu"] == pytest.approx(logged[-1]["model_tflops_per_s"] / 1.0)
    assert scalars("tau_eval") == [(40, pytest.approx(tau_eval[0]))]
    assert {"accuracy/1", "learning_rate", "grad_norm", "heldout_loss"} <= set(
        events.Tags()["scalars"]
    )


@pytest.mark.slow
def test_resume_after_kill_reproduces_the_losses(tmp_path, tiny_target, monkeypatch):
    """A run killed after its step-4 checkpoint, and one stopped by SIGTERM, each rerun: the
    losses of an uninterrupted run, bit for bit. Its batches are bucketed (config.bucket_tokens:
    rows of 20..32 tokens cropped to 24, 28 or 32): the crop is deterministic and resumes."""
    corpus(tmp_path / "data.jsonl")
    cfg = train_config(
        tmp_path / "data.jsonl", num_steps=12, checkpoint_every=4, learning_rate=3e-3,
        bucket_tokens=4,
    )  # fmt: skip
    trainer.train(cfg, tmp_path / "straight")

    real = trainer.train_step
    calls = iter(range(1, 100))
    lengths = set()

    def dies_at_step_7(state, target_params, batch, **kwargs):
        lengths.add(batch["tokens"].shape[1])
        if next(calls) == 7:  # after the checkpoint at 4 and the log lines of 5 and 6
            raise Killed()
        return real(state, target_params, batch, **kwargs)

    monkeypatch.setattr(trainer, "train_step", dies_at_step_7)
    with pytest.raises(Killed):
        trainer.train(cfg, tmp_path / "killed")
    assert max(logged_losses(tmp_path / "killed")) == 6
    monkeypatch.setattr(trainer, "train_step", real)
    trainer.train(cfg, tmp_path / "killed")
    straight, resumed = logged_losses(tmp_path / "straight"), logged_losses(tmp_path / "killed")
    assert list(resumed) == list(range(1, 13))
    assert resumed == straight  # bit-identical, steps 5..12 included
    assert len(lengths) > 1 and max(lengths) <= 32, lengths  # several buckets ran

    # SIGTERM during step 6 (no checkpoint due before 8): the step finishes, a checkpoint of it
    # is written, train returns saying so (no export: that waits for the end); the rerun
    # resumes there with the same losses. (Before: the default handler killed the process.)
    calls = iter(range(1, 100))

    def term_at_step_6(*args, **kwargs):
        if next(calls) == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", term_at_step_6)
    before = signal.getsignal(signal.SIGTERM)
    last = trainer.train(cfg, tmp_path / "stopped")
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone again
    assert (last["stopped_at"], last["stopped_by"]) == (6, "SIGTERM")
    assert sorted(int(p.name) for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == [4, 6]
    assert not (tmp_path / "stopped" / "drafter").exists()
    monkeypatch.setattr(trainer, "train_step", real)
    assert "stopped_at" not in trainer.train(cfg, tmp_path / "stopped")
    assert logged_losses(tmp_path / "stopped") == straight


@pytest.mark.slow  # two compiles of the step; only this guards grad_accum_steps
def test_gradient_accumulation_steps_through_the_micro_batches(tmp_path, tiny_target):
    """grad_accum_steps=2 on 4 rows: the step's loss is the mean of its two micro-batches'
    (rows 0, 2 and rows 1, 3, each run alone as a step of 2 rows), its per-slot counts their
    sum; one optimizer update (step counter 1)."""
    from dflash_jax.training.step import OptimizerConfig, train_step

    corpus(tmp_path / "data.jsonl")
    cfg = train_config(tmp_path / "data.jsonl", grad_accum_steps=2)
    dcfg = trainer.drafter_config_for(cfg, TINY_TARGET)
    optimizer = OptimizerConfig.from_config(cfg, 10)
    source = data.record_source([str(tmp_path / "data.jsonl")])
    _, records = data.split_holdout(source, 4, cfg.seed)
    batch = evaluation.heldout_batch(records, cfg.seq_len, cfg.num_anchors)
    settings = trainer.step_settings(cfg, TINY_TARGET, dcfg, optimizer)
    assert settings["grad_accum_steps"] == 2
    fresh = lambda: trainer.initial_state(cfg, dcfg, tiny_target, optimizer, None)
    state, got = train_step(fresh(), tiny_target.params, batch, **settings)
    assert int(state["step"]) == 1
    del settings["grad_accum_steps"]
    parts = [
        train_step(fresh(), tiny_target.params, {k: v[i::2] for k, v in batch.items()}, **settings)[
            1
        ]
        for i in (0, 1)
    ]
    assert float(got["loss"]) == pytest.approx(np.mean([float(p["loss"]) for p in parts]), rel=1e-5)
    for key in ("correct", "count"):
        np.testing.assert_array_equal(got[key], parts[0][key] + parts[1][key])


def test_wsd_schedule_warms_holds_and_decays():
    from dflash_jax.training.step import OptimizerConfig

    opt = OptimizerConfig(1.0, 2, 10, 0.9, 0.999, 1e-8, 0.0, 1.0, kind="wsd", decay_steps=4)
    lr = [float(opt.schedule()(s)) for s in range(11)]
    np.testing.assert_allclose(lr, [0, 0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0], atol=1e-6)
    no_warmup = dataclasses.replace(opt, warmup_steps=0)
    assert float(no_warmup.schedule()(0)) == 1.0 and float(no_warmup.schedule()(10)) == 0.0


@pytest.mark.slow
def test_a_run_warm_starts_from_another_runs_checkpoint_with_adams_state(
    tmp_path, tiny_target, monkeypatch
):
    """init_from_checkpoint: run B's first step gets run A's last params and Adam moments
    (bias-correction count included), with B's schedule count back at 0."""
    import optax

    corpus(tmp_path / "data.jsonl")
    real = trainer.train_step
    seen = []

    def recording(state, *args, **kwargs):
        before = jax.tree.map(np.asarray, state)  # the step donates its input
        out = real(state, *args, **kwargs)
        seen.append((before, jax.tree.map(np.asarray, out[0])))
        return out

    monkeypatch.setattr(trainer, "train_step", recording)
    cfg_a = train_config(
        tmp_path / "data.jsonl", num_steps=8, checkpoint_every=4, lr_schedule="wsd"
    )
    trainer.train(cfg_a, tmp_path / "a")
    a_last = seen[-1][1]
    seen.clear()
    cfg_b = train_config(
        tmp_path / "data.jsonl", num_steps=2, lr_schedule="wsd", warmup_fraction=0.0,
        init_from_checkpoint=str(tmp_path / "a"),
    )  # fmt: skip
    trainer.train(cfg_b, tmp_path / "b")
    b_first = seen[0][0]
    assert int(b_first["step"]) == 0
    jax.tree.map(np.testing.assert_array_equal, b_first["params"], a_last["params"])
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
    adam = lambda st: [x for x in jax.tree.leaves(st, is_leaf=is_adam) if is_adam(x)][0]
    sched = lambda st: [x for x in jax.tree.leaves(st, is_leaf=is_sched) if is_sched(x)][0]
    jax.tree.map(
        np.testing.assert_array_equal, adam(b_first["opt_state"]), adam(a_last["opt_state"])
    )
    assert int(adam(b_first["opt_state"]).count) == 8
    assert (
        int(sched(a_last["opt_state"]).count) == 8 and int(sched(b_first["opt_state"]).count) == 0
    )
    lines = [
        json.loads(x) for x in (tmp_path / "b" / trainer.METRICS_FILE).read_text().splitlines()
    ]
    assert [x["learning_rate"] for x in lines if "loss" in x][0] == pytest.approx(
        cfg_b.learning_rate
    )


def test_bad_warm_starts_are_refused(tmp_path):
    cfg = train_config(tmp_path / "unused.jsonl", init_from_checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="init_from_checkpoint"):
        trainer.check_config(cfg)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    cfg = train_config(
        tmp_path / "unused.jsonl", init_from_checkpoint=str(tmp_path / "run"),
        init_from_target=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="exclude each other"):
        trainer.check_config(cfg)
    with pytest.raises(ValueError, match="lr_schedule"):
        trainer.check_config(train_config(tmp_path / "unused.jsonl", lr_schedule="linear"))


def test_misfit_drafter_is_refused(tmp_path):
    cfg = train_config(tmp_path / "unused.jsonl")
    cfg.drafter.hidden_size = 48
    with pytest.raises(ConfigError, match="hidden_size=48"):
        trainer.drafter_config_for(cfg, TINY_TARGET)
    cfg = train_config(tmp_path / "unused.jsonl")
    cfg.drafter.target_layer_ids = (1, 4)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        trainer.drafter_config_for(cfg, TINY_TARGET)
    cfg = train_config(tmp_path / "unused.jsonl")
    cfg.drafter.mask_token_id = 64
    with pytest.raises(ConfigError, match="mask_token_id"):
        trainer.drafter_config_for(cfg, TINY_TARGET)


@pytest.mark.parametrize("name", ["smollm2_135m_b16", "qwen3_4b_b16", "qwen3_8b_b16", "llama31_8b"])
def test_named_configs_build_drafters_that_fit(name):
    import importlib

    cfg = importlib.import_module(f"configs.{name}").get_config()
    targets = {
        "smollm2_135m_b16": TargetConfig(
            "llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True
        ),
        "qwen3_4b_b16": TargetConfig(
            "qwen3", 151936, 2560, 9728, 36, 32, 8, 128, tie_word_embeddings=True
        ),
        "qwen3_8b_b16": TargetConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128),
        "llama31_8b": TargetConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128),
    }
    drafter = trainer.drafter_config_for(cfg, targets[name])
    assert drafter.block_size == cfg.block_size
    assert math.isclose(
        cfg.loss_gamma or default_gamma(cfg.block_size), {16: 7, 10: 5}[cfg.block_size]
    )
