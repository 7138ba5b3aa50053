"""Distillation (issue 25 item 3): the target's top-k as soft labels and as exact candidates of
each row's softmax, checked against a direct computation; the teacher's top-k sits at each
label's own position; a run trains with it, and bad settings are refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _training import TINY_TARGET, corpus, train_config

from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import Transformer, init_params
from dflash_jax.training import trainer
from dflash_jax.training.loss import (
    NEG_INF,
    distill_cross_entropy,
    sampled_vocabulary,
    teacher_extras,
    teacher_top_k,
)
from dflash_jax.training.step import distill_inputs, drafter_loss


def _direct(z_rv, labels_r, ids_u, bias_u, negatives, teacher_rk, q_rk, correction):
    """Per row, by enumeration: the positives once, each teacher id not among them once, each
    live negative that is no teacher id of the row with its correction."""
    ids_u, bias_u = np.asarray(ids_u), np.asarray(bias_u)
    p = len(ids_u) - negatives
    positives = {int(i) for i, b in zip(ids_u[:p], bias_u[:p], strict=True) if b == 0.0}
    live = [int(i) for i, b in zip(ids_u[p:], bias_u[p:], strict=True) if b > NEG_INF / 2]
    hard, soft, correct = [], [], []
    for r, z in enumerate(np.asarray(z_rv, np.float64)):
        teacher = [int(t) for t in teacher_rk[r]]
        added = [t for t in teacher if t not in positives]
        terms = [z[u] for u in positives] + [z[t] for t in added]
        terms += [z[n] + correction for n in live if n not in teacher]
        lse = np.log(np.sum(np.exp(terms)))
        y = int(labels_r[r])
        hard.append(lse - z[y])
        soft.append(-np.sum(np.asarray(q_rk[r]) * (z[teacher] - lse)))
        best = max([z[u] for u in positives] + [z[n] + correction for n in live])
        correct.append(z[y] >= best and all(z[y] >= z[t] for t in added))
    return np.asarray(hard), np.asarray(soft), np.asarray(correct)


@pytest.mark.parametrize("negatives", [0, 48])
def test_distill_cross_entropy_counts_each_teacher_id_exactly_once(negatives):
    """With 48 negatives drawn from 40 ids most teacher ids are also drawn negatives (some
    twice): the normaliser must hold each once, by its true logit. Over the full vocabulary
    (no negatives) the teacher ids are already in and nothing is added."""
    r, d, v, k = 14, 8, 40, 5
    hidden = jax.random.normal(jax.random.key(0), (r, d))
    emb = jax.random.normal(jax.random.key(1), (v, d))
    labels = jax.random.randint(jax.random.key(2), (1, 1, r), 0, v)
    teacher = jax.lax.top_k(jax.random.normal(jax.random.key(3), (r, v)), k)[1].astype(jnp.int32)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(4), (r, k)))
    z_rv = hidden @ emb.T
    rows_fn = lambda h, ids: jnp.einsum("cd,ckd->ck", h, emb[ids])  # noqa: E731
    if negatives:
        valid = jnp.ones_like(labels, bool)
        ids_u, bias_u, remapped = sampled_vocabulary(labels, valid, v, negatives, jax.random.key(5))
        extra, hits = teacher_extras(teacher, ids_u, bias_u, negatives)
        assert float(hits.max()) >= 1  # the case this test is about occurs
        correction = float(np.log(v / negatives))
        logits_fn = lambda h: h @ emb[ids_u].T + bias_u  # noqa: E731
        y = remapped.reshape(-1)
        want = _direct(z_rv, labels.reshape(-1), ids_u, bias_u, negatives, teacher, q, correction)
    else:
        extra, hits = jnp.full((r, k), NEG_INF), jnp.zeros((r, k))
        correction, logits_fn, y = 0.0, (lambda h: h @ emb.T), labels.reshape(-1)  # noqa: E731
        lse = jax.nn.logsumexp(z_rv, axis=-1)
        want = (
            lse - z_rv[jnp.arange(r), y],
            -jnp.sum(q * (jnp.take_along_axis(z_rv, teacher, 1) - lse[:, None]), axis=-1),
            jnp.argmax(z_rv, axis=-1) == y,
        )
    got = distill_cross_entropy(
        hidden, y, logits_fn, rows_fn, teacher, q, extra, hits, correction, chunk_rows=4
    )  # 14 rows in chunks of 4: the last one padded
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_array_equal(got[2], want[2])


def _batch(b=2, s=24, n=3):
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 64, (b, s)).astype(np.int32)
    loss_mask = np.ones((b, s), np.int32)
    loss_mask[:, :4] = 0
    anchors = np.sort(rng.choice(np.arange(4, s - 5), (b, n), replace=False), axis=1)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "length": np.full((b,), s, np.int32),
        "anchors": anchors.astype(np.int32),
        "anchor_valid": np.ones((b, n), bool),
    }


@pytest.mark.slow
def test_the_teacher_sits_at_each_labels_position_and_weight_0_is_the_plain_loss(tmp_path):
    """Slot k of the block at anchor a is labelled x_{a+k}: its teacher is the target's
    distribution at position a+k-1 (its full forward's logits there). Over the full vocabulary
    with weight 0 the loss is the plain one; with weight 1 it is the soft CE alone."""
    cfg = train_config(tmp_path / "x")
    dcfg = trainer.drafter_config_for(cfg, TINY_TARGET)
    tparams = init_params(TINY_TARGET, jax.random.key(1))
    params = init_drafter_params(dcfg, jax.random.key(2))
    batch = _batch()
    b, s = batch["tokens"].shape
    logits_bsv, _, _ = Transformer(TINY_TARGET).apply(
        {"params": tparams}, jnp.asarray(batch["tokens"]), jnp.broadcast_to(jnp.arange(s), (b, s))
    )
    final, _, _ = Transformer(TINY_TARGET).apply(
        {"params": tparams},
        jnp.asarray(batch["tokens"]),
        jnp.broadcast_to(jnp.arange(s), (b, s)),
        method="hidden",
    )
    head = lambda h: Transformer(TINY_TARGET).apply({"params": tparams}, h, method="unembed")  # noqa: E731
    ids, q = teacher_top_k(final.reshape(b * s, -1), head, 3, chunk_rows=10)
    got = distill_inputs(
        (ids.reshape(b, s, 3), q.reshape(b, s, 3)), jnp.asarray(batch["anchors"]),
        dcfg.block_size, tparams, TINY_TARGET, dcfg, None,
    )  # fmt: skip
    for bi in range(b):
        for ni, a in enumerate(batch["anchors"][bi]):
            for k in range(1, dcfg.block_size):
                z = np.asarray(logits_bsv[bi, a + k - 1])
                assert got["teacher_ids"][bi, ni, k - 1, 0] == np.argmax(z)
                top = np.sort(z)[::-1][:3]
                want_q = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
                np.testing.assert_allclose(got["teacher_q"][bi, ni, k - 1], want_q, rtol=1e-5)

    kw = dict(target_config=TINY_TARGET, drafter_config=dcfg, ce_chunk_rows=16)
    weights = jnp.linspace(1.0, 0.4, dcfg.block_size)
    plain, plain_stats = drafter_loss(params, tparams, batch, weights_j=weights, **kw)
    w0, w0_stats = drafter_loss(
        params, tparams, batch, weights_j=weights, distill_top_k=3, distill_weight=0.0, **kw
    )
    np.testing.assert_allclose(w0, plain, rtol=1e-6)
    np.testing.assert_array_equal(w0_stats["correct"], plain_stats["correct"])
    np.testing.assert_allclose(w0_stats["hard_ce"], plain, rtol=1e-6)
    w1, w1_stats = drafter_loss(
        params, tparams, batch, weights_j=weights, distill_top_k=3, distill_weight=1.0, **kw
    )
    np.testing.assert_allclose(w1, w1_stats["soft_ce"], rtol=1e-6)
    assert abs(float(w1) - float(plain)) > 1e-3


def test_bad_distillation_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="needs config.taps='online'"):
        trainer.check_config(train_config(tmp_path / "d", distill_top_k=4, taps="cached"))
    with pytest.raises(ValueError, match="distill_weight must be in"):
        trainer.check_config(train_config(tmp_path / "d", distill_top_k=4, distill_weight=1.5))
    with pytest.raises(ValueError, match="distill_top_k must be >= 0"):
        trainer.check_config(train_config(tmp_path / "d", distill_top_k=-1))


@pytest.mark.slow
def test_a_distilled_run_learns_under_a_sampled_softmax(tmp_path, tiny_target):
    corpus(tmp_path / "data.jsonl")
    cfg = train_config(
        tmp_path / "data.jsonl", num_steps=40, vocab_negatives=16, distill_top_k=4,
        distill_weight=0.5,
    )  # fmt: skip
    trainer.train(cfg, tmp_path / "run")
    lines = (tmp_path / "run" / trainer.METRICS_FILE).read_text().splitlines()
    logged = [x for x in map(json.loads, lines) if "loss" in x]
    for x in logged:
        np.testing.assert_allclose(x["loss"], 0.5 * x["hard_ce"] + 0.5 * x["soft_ce"], rtol=1e-4)
    first, last = logged[:5], logged[-5:]
    # The corpus is a fixed cycle the hard labels give away; the soft labels are a random
    # tiny target's near-flat top-4 (their CE cannot go below its entropy, ~ln 4): both fall.
    for key, factor in (("hard_ce", 0.8), ("soft_ce", 0.95)):
        before, after = np.mean([x[key] for x in first]), np.mean([x[key] for x in last])
        assert after < factor * before, (key, before, after)
