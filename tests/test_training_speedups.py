"""The two CPU-budget options of the trainer: the sampled-softmax vocabulary (an estimate of the
full-vocabulary CE) and the on-disk tap cache (exactly the online taps, resumable, refused when
corrupt)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _training import TINY_TARGET, corpus, logged_losses, train_config

from dflash_jax.io.drafter_io import restore_drafter
from dflash_jax.io.target_loader import LoadedTarget
from dflash_jax.models.target import Transformer, init_params
from dflash_jax.training import data, tap_cache, trainer
from dflash_jax.training.loss import (
    NEG_INF,
    block_diffusion_loss,
    even_chunk_rows,
    sampled_vocabulary,
)


@pytest.fixture
def tiny_target(monkeypatch):
    target = LoadedTarget(
        TINY_TARGET, init_params(TINY_TARGET, jax.random.key(1)), None, None, "tiny"
    )
    monkeypatch.setattr(trainer, "load_target", lambda source, dtype: target)
    return target


def test_sampled_vocabulary_candidates_and_remapped_labels():
    labels = jnp.asarray([[[7, 3, 3, 9], [0, 39, 3, 5]]])
    valid = jnp.asarray([[[False, True, True, True], [False, True, False, True]]])
    ids, bias, remapped = sampled_vocabulary(labels, valid, 40, 64, jax.random.key(0))
    ids, bias, remapped = np.asarray(ids), np.asarray(bias), np.asarray(remapped)
    positives = ids[:8][bias[:8] == 0]
    np.testing.assert_array_equal(positives, [3, 5, 9, 39])  # distinct valid labels, sorted
    ok = np.asarray(valid)
    np.testing.assert_array_equal(ids[remapped[ok]], np.asarray(labels)[ok])
    negatives, neg_bias = ids[8:], bias[8:]
    in_positives = np.isin(negatives, positives)
    assert in_positives.any()  # 64 draws from 40 ids: collisions happen and are masked
    np.testing.assert_array_equal(neg_bias[in_positives], NEG_INF)
    np.testing.assert_allclose(neg_bias[~in_positives], np.log(40 / 64), rtol=1e-6)


def test_sampled_softmax_partition_is_unbiased():
    """E[exp(logsumexp of the candidates)] equals the full softmax's partition function."""
    v, m = 50, 8
    z = jax.random.normal(jax.random.key(1), (v,)) * 2.0
    labels = jnp.asarray([[[0, 4, 17, 4]]])
    valid = jnp.asarray([[[False, True, True, True]]])

    def partition(key):
        ids, bias, _ = sampled_vocabulary(labels, valid, v, m, key)
        return jnp.exp(jax.nn.logsumexp(z[ids] + bias))

    estimates = jax.vmap(partition)(jax.random.split(jax.random.key(2), 20000))
    full = float(jnp.exp(jax.nn.logsumexp(z)))
    stderr = float(jnp.std(estimates)) / np.sqrt(estimates.shape[0])
    assert abs(float(jnp.mean(estimates)) - full) < 4 * stderr, (float(jnp.mean(estimates)), full)
    # Without the log(V/M) correction the estimate is far off: the test can fail.
    assert float(jnp.mean(estimates)) > 1.5 * float(jnp.exp(jax.nn.logsumexp(z[:m])))


@pytest.mark.slow
def test_exact_head_speedups_keep_the_loss_and_gradient():
    """Issue 25 item 2: a positive-slot cap at the batch's token count, chunks without padded
    rows and no remat change the sampled CE only by rounding; a cap below the distinct labels
    would not (it is what `unique(size=)` silently truncates), so the comparison can fail."""
    assert even_chunk_rows(7680, 1024) == 960  # 8 chunks, none padded
    assert even_chunk_rows(100, 1024) == 100 and even_chunk_rows(97, 10) == 10  # prime: padded
    b, s, n, j, d, v, m = 2, 12, 3, 4, 8, 50, 16
    tokens = jax.random.randint(jax.random.key(3), (b, s), 0, v)
    labels = tokens[:, : n * j].reshape(b, n, j)  # labels are tokens of the batch, as in training
    valid = jnp.ones((b, n, j), bool).at[:, :, 0].set(False)
    hidden = jax.random.normal(jax.random.key(4), (b, n * j, d))
    head = jax.random.normal(jax.random.key(5), (d, v))
    weights = jnp.linspace(1.0, 0.5, j)

    def loss(h, cap, chunk, remat):
        ids, bias, remapped = sampled_vocabulary(labels, valid, v, m, jax.random.key(6), cap)
        fn = lambda x: x @ head[:, ids] + bias  # noqa: E731
        return block_diffusion_loss(h, remapped, valid, weights, fn, chunk, remat)[0]

    ref, ref_grad = jax.value_and_grad(loss)(hidden, None, 7, True)  # old: U = B*N*J, padded
    new, new_grad = jax.value_and_grad(loss)(hidden, b * s, 9, False)  # capped, 2 chunks of 9
    np.testing.assert_allclose(new, ref, rtol=1e-6)
    np.testing.assert_allclose(new_grad, ref_grad, rtol=1e-5, atol=1e-6)
    distinct = len(np.unique(np.asarray(labels)[np.asarray(valid)]))
    too_tight = loss(hidden, distinct - 3, 9, False)
    assert abs(float(too_tight) - float(ref)) > 1e-3


def _online_taps(target, tokens, tap_layers):
    t = len(tokens)
    _, taps, _ = Transformer(TINY_TARGET).apply(
        {"params": target.params},
        jnp.asarray([tokens]),
        jnp.arange(t)[None],
        tap_layers=tap_layers,
        logit_indices=jnp.zeros((1, 1), jnp.int32),
    )
    return np.asarray(taps[0])


def test_tap_cache_equals_online_taps_resumes_and_refuses_corruption(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl", num_records=12)
    source = data.record_source([str(tmp_path / "data.jsonl")])
    layers = (1, 2)
    build = lambda: tap_cache.build_tap_cache(  # noqa: E731
        tmp_path / "cache",
        source,
        tiny_target,
        layers,
        24,
        dtype="float32",
        batch_tokens=96,
        bucket=8,
    )
    cache = build()
    for i in range(len(source)):
        tokens = data.decode_record(source[i])["tokens"][:24]
        row = cache.row(i)
        assert row.shape == (24, 2 * TINY_TARGET.hidden_size)
        np.testing.assert_allclose(
            row[: len(tokens)], _online_taps(tiny_target, tokens, layers), atol=2e-5
        )
        assert not row[len(tokens) :].any()
    reference = np.stack([cache.row(i) for i in range(len(source))])

    # A build killed after its first batch: the rest is garbage, `done` says 1 batch.
    meta_path = tmp_path / "cache" / tap_cache.INDEX_FILE
    meta = json.loads(meta_path.read_text())
    meta.update(done=1, complete=False)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="incomplete"):
        tap_cache.TapCache(tmp_path / "cache")
    store = np.memmap(tmp_path / "cache" / tap_cache.DATA_FILE, np.float32, "r+")
    store[:] = np.nan
    rows = 96 // (-(-int(cache.lengths.max()) // 8) * 8)  # the build's first batch
    first_batch = np.argsort(-cache.lengths, kind="stable")[:rows]
    for r in first_batch:  # what the killed run had written
        n = cache.lengths[r] * cache.features
        start = cache.offsets[r] * cache.features
        store[start : start + n] = reference[r, : cache.lengths[r]].reshape(-1)
    store.flush()
    del store
    resumed = build()
    np.testing.assert_array_equal(np.stack([resumed.row(i) for i in range(len(source))]), reference)

    with open(tmp_path / "cache" / tap_cache.DATA_FILE, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="corrupt"):
        tap_cache.TapCache(tmp_path / "cache")
    # Other tap layers are another cache: rebuilt, never read as this one.
    other = tap_cache.build_tap_cache(
        tmp_path / "cache", source, tiny_target, (0, 3), 24, dtype="float32"
    )
    assert other.fingerprint != cache.fingerprint
    np.testing.assert_allclose(
        other.row(0)[: cache.lengths[0]],
        _online_taps(tiny_target, data.decode_record(source[0])["tokens"][:24], (0, 3)),
        atol=2e-5,
    )


@pytest.mark.slow  # the taps themselves: test_tap_cache_equals_online_taps_...
def test_cached_taps_train_like_online_and_sampled_vocab_learns(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl")
    online = train_config(tmp_path / "data.jsonl", num_steps=6, checkpoint_every=6)
    trainer.train(online, tmp_path / "online")
    cached = train_config(
        tmp_path / "data.jsonl",
        num_steps=6,
        checkpoint_every=6,
        taps="cached",
        tap_cache_dtype="float32",
    )
    # Built ahead (--taps_only), the cache is then used as it is by the run.
    with pytest.raises(ValueError, match="taps='cached'"):
        trainer.build_taps(online, tmp_path / "online")
    built = trainer.build_taps(cached, tmp_path / "cached")
    assert len(built) == len(data.record_source([str(tmp_path / "data.jsonl")]))
    taps_file = tmp_path / "cached" / "tap_cache" / tap_cache.DATA_FILE
    written = taps_file.stat().st_mtime_ns
    trainer.train(cached, tmp_path / "cached")
    assert taps_file.stat().st_mtime_ns == written
    a, b = logged_losses(tmp_path / "online"), logged_losses(tmp_path / "cached")
    assert list(a) == list(b) == list(range(1, 7))
    np.testing.assert_allclose(list(b.values()), list(a.values()), rtol=1e-4)

    sampled = train_config(tmp_path / "data.jsonl", num_steps=40, vocab_negatives=16)
    trainer.train(sampled, tmp_path / "sampled")
    losses = list(logged_losses(tmp_path / "sampled").values())
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def test_bad_taps_setting_is_refused(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl")
    with pytest.raises(ValueError, match="online' or 'cached"):
        trainer.train(train_config(tmp_path / "data.jsonl", taps="disk"), tmp_path / "run")
    with pytest.raises(ValueError, match="tap_cache_dtype"):
        trainer.train(
            train_config(tmp_path / "data.jsonl", tap_cache_dtype="int8"), tmp_path / "run"
        )
    with pytest.raises(ValueError, match="vocab_negatives"):
        trainer.train(train_config(tmp_path / "data.jsonl", vocab_negatives=-1), tmp_path / "run")


@pytest.mark.slow
def test_final_norm_can_start_from_the_target(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl")
    scale = jnp.linspace(0.5, 2.0, TINY_TARGET.hidden_size)
    tiny_target.params["norm"]["scale"] = scale
    cfg = train_config(
        tmp_path / "data.jsonl",
        num_steps=1,
        checkpoint_every=1,
        learning_rate=0.0,
        init_norm_from_target=True,
    )
    trainer.train(cfg, tmp_path / "run")
    exported = restore_drafter(tmp_path / "run" / "drafter")
    np.testing.assert_allclose(exported.params["norm"]["scale"], scale)


def test_plot_metrics_writes_a_png(tmp_path):
    from dflash_jax.training.plots import plot

    records = [
        {"step": s, "loss": 5.0 / s, "tau_implied": 1 + s / 10, "accuracy": [0.5, 0.25]}
        for s in (1, 2, 3)
    ] + [{"step": 3, "tau_eval": 1.2}]
    plot(records, tmp_path / "m.png", "run")
    # With blocks and two measured points the plot adds the projection to tau = 3.
    with_blocks = [dict(r, blocks=100 * r["step"]) for r in records]
    with_blocks.append({"step": 6, "blocks": 600, "tau_eval": 1.4, "heldout_tau_forced": 1.6})
    plot(with_blocks, tmp_path / "p.png", "run")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no training lines"):
        plot(records[-1:], tmp_path / "n.png", "run")


def test_tau_projection_recovers_a_power_law_and_refuses_flat_curves():
    from dflash_jax.training.plots import tau_projection

    points = [(x, 1 + 0.002 * x**0.5) for x in (1e4, 4e4, 1.6e5)]  # tau 1.2, 1.4, 1.8
    fit = tau_projection(points, goal=3.0)
    assert np.isclose(fit["p"], 0.5) and np.isclose(fit["c"], 0.002)
    assert np.isclose(fit["x_goal"], 1e6)  # 0.002 * sqrt(1e6) = 2
    assert tau_projection(points[:1], goal=3.0) is None  # one point: no curve
    assert tau_projection([(1e4, 1.3), (4e4, 1.3)], goal=3.0) is None  # not rising


def test_tap_cache_grows_by_copying_the_records_it_has(tmp_path, tiny_target, monkeypatch):
    """More records, same taps: records the finished cache has are copied (we poison them to
    see it), new ones computed; the old cache survives until the new one is complete."""
    corpus(tmp_path / "small.jsonl", num_records=8)
    corpus(tmp_path / "other.jsonl", num_records=6, seed=1)  # another cycle: new records
    small_src, other_src = (
        data.record_source([str(tmp_path / n)]) for n in ("small.jsonl", "other.jsonl")
    )
    records = [data.decode_record(r) for r in [*small_src, *other_src]]
    data.write_shard(tmp_path / "large.jsonl", records[:12])  # the same 8 records, then 4 more
    data.write_shard(tmp_path / "larger.jsonl", records)  # and 2 more
    layers, cache_dir = (1, 2), tmp_path / "cache"

    def build(name):
        source = data.record_source([str(tmp_path / name)])
        return source, tap_cache.build_tap_cache(
            cache_dir, source, tiny_target, layers, 24, dtype="float32", batch_tokens=48, bucket=8
        )

    def assert_rows(source, cache, copied):
        """Each row is the poison 7.0 where `copied(tokens)`, else the record's online taps."""
        for i in range(len(source)):
            tokens = data.decode_record(source[i])["tokens"][:24]
            taps = cache.row(i)[: len(tokens)]
            if copied(tokens):
                assert (taps == 7.0).all(), i
            else:
                np.testing.assert_allclose(
                    taps, _online_taps(tiny_target, tokens, layers), atol=2e-5
                )

    _, small = build("small.jsonl")
    # The corpus repeats itself: later records may equal one of the first 8, and are copied.
    in_small = {tuple(data.decode_record(r)["tokens"][:24]) for r in small_src}
    was_copied = lambda tokens: tuple(tokens) in in_small  # noqa: E731
    store = np.memmap(cache_dir / tap_cache.DATA_FILE, np.float32, "r+")
    store[:] = 7.0  # not what any forward gives
    store.flush()
    del store
    source, large = build("large.jsonl")
    assert large.fingerprint != small.fingerprint
    assert not (cache_dir / tap_cache.PREV_DATA_FILE).exists()
    assert_rows(source, large, was_copied)

    # Grown again and killed after its copy batch (the first forward fails): the old cache is
    # still there, and the rerun keeps the copies and computes the rest.
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tap_cache, "Transformer", killed)
    with pytest.raises(KeyboardInterrupt):
        build("larger.jsonl")
    assert json.loads((cache_dir / tap_cache.INDEX_FILE).read_text())["done"] == 1
    assert (cache_dir / tap_cache.PREV_DATA_FILE).exists()
    monkeypatch.undo()
    source, larger = build("larger.jsonl")
    assert not (cache_dir / tap_cache.PREV_DATA_FILE).exists()
    assert_rows(source, larger, was_copied)

    # A half-built cache whose batch plan is not this build's (e.g. its previous cache was
    # deleted meanwhile) is started over, not resumed: every row is then a real forward.
    meta_path = cache_dir / tap_cache.INDEX_FILE
    meta = json.loads(meta_path.read_text())
    meta.update(done=2, complete=False, plan="another plan")
    meta_path.write_text(json.dumps(meta))
    _, rebuilt = build("larger.jsonl")
    assert_rows(source, rebuilt, lambda tokens: False)
