"""Cloud paths: a run whose workdir, data, tap cache and drafter export are `gs://` URLs trains,
stops, resumes and exports as a local one does; generated data, z-lab drafters and targets
under a URL are written and read; and nothing lands under the current directory (where a URL
taken for a local path would go). `gs://` is a fake bucket on local disk (tests/_fake_gcs.py)
reached through the real URL code path of etils.epath and Orbax."""

import json
import os

import jax
import numpy as np
import pytest
from _fake_gcs import fake_gcs
from _training import TINY_TARGET, Killed, corpus, train_config
from etils import epath

from dflash_jax.io import paths, target_loader
from dflash_jax.io.drafter_io import read_drafter, save_drafter
from dflash_jax.io.hf import CheckpointError
from dflash_jax.io.zlab import write_zlab
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.training import checkpoint, data, plots, trainer
from dflash_jax.training.generate import generate_records, mixture
from dflash_jax.training.prompts import Prompt, read_prompt_file


class Bucket:
    """The fake `gs://bucket` (`disk`: where its objects are) and the run's current directory,
    where a URL mistaken for a local path would land (as `gs:/bucket/...`)."""

    def __init__(self, disk, cwd):
        self.disk, self.cwd = disk, cwd

    def leaked(self) -> list[str]:
        return sorted(str(p.relative_to(self.cwd)) for p in self.cwd.rglob("*"))[:5]


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with fake_gcs(tmp_path / "gcs"):
        yield Bucket(tmp_path / "gcs" / "bucket", cwd)


def test_user_paths_keep_urls_and_resolve_local_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = paths.path("gs://bucket/run")
    assert isinstance(url, epath.Path) and str(url) == "gs://bucket/run"
    assert str(url / "checkpoints") == "gs://bucket/run/checkpoints"
    assert paths.is_url(url) and paths.is_url("s3://b/k") and not paths.is_url("run")
    assert str(paths.path("run")) == str(tmp_path / "run")
    assert str(paths.path("~/run")) == os.path.expanduser("~/run")
    with pytest.raises(ValueError, match="memory://"):
        paths.path("memory://bucket/run")


def _metrics(bucket) -> list[int]:
    lines = (bucket.disk / "run" / trainer.METRICS_FILE).read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if "loss" in json.loads(x)]


@pytest.mark.slow  # resume: test_training*; gs:// paths: the other tests here
def test_train_stop_resume_on_gcs(bucket, tiny_target, monkeypatch):
    corpus("gs://bucket/data/data-00000.jsonl")
    cfg = train_config("gs://bucket/data", num_steps=6, checkpoint_every=3, taps="cached")
    save = checkpoint.save_checkpoint

    def save_and_wait(manager, *args):  # the kill below comes after the save is complete
        save(manager, *args)
        manager.wait_until_finished()

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_and_wait)
    real, calls = trainer.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # after the checkpoint at 3 and the log line of 4
            raise Killed()
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", step)
    with pytest.raises(Killed):
        trainer.train(cfg, "gs://bucket/run")
    assert bucket.leaked() == []
    assert _metrics(bucket) == [1, 2, 3, 4]
    assert sorted(os.listdir(bucket.disk / "run" / checkpoint.CHECKPOINT_DIR)) == ["3"]
    # A new machine: the local copy of the tap cache is gone, the bucket's is read back.
    mirror = paths.local_mirror("gs://bucket/run/tap_cache")
    assert (mirror / "taps.bin").is_file()
    for f in mirror.iterdir():
        f.unlink()

    calls.clear()
    calls.append(-9)  # never dies again
    trainer.train(cfg, "gs://bucket/run")
    assert len(calls) - 1 == 3  # resumed at step 4, after the checkpoint at 3
    assert bucket.leaked() == []
    assert _metrics(bucket) == [1, 2, 3, 4, 5, 6]  # the killed run's line 4 replaced
    assert sorted(os.listdir(bucket.disk / "run" / checkpoint.CHECKPOINT_DIR)) == ["3", "6"]
    assert json.loads((bucket.disk / "run" / "tap_cache" / "taps.json").read_text())["complete"]
    exported = read_drafter("gs://bucket/run/drafter")
    assert exported.config.block_size == cfg.block_size
    assert exported.source == "gs://bucket/run/drafter"
    plots.plot(plots.read_metrics("gs://bucket/run/metrics.jsonl"), "gs://bucket/run/m.png", "t")
    assert (bucket.disk / "run" / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert bucket.leaked() == []


def test_drafter_export_and_load_on_gcs(bucket):
    config = trainer.drafter_config_for(train_config("unused.jsonl"), TINY_TARGET)
    first = init_drafter_params(config, jax.random.key(0))
    second = jax.tree.map(lambda x: x + 1, first)
    for params in (first, second):  # the second export replaces the first
        out = checkpoint.export_drafter("gs://bucket/run", config, params)
        assert str(out) == "gs://bucket/run/drafter"
        loaded = read_drafter("gs://bucket/run/drafter")
        assert loaded.config == config
        for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(a, b)
    assert (bucket.disk / "run" / "drafter" / "drafter_config.json").is_file()
    assert not (bucket.disk / "run" / "drafter.tmp").exists()
    with pytest.raises(CheckpointError, match="already holds"):
        save_drafter("gs://bucket/run/drafter", config, first)
    assert bucket.leaked() == []


def test_shards_on_gcs_round_trip(bucket):
    records = [{"tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "source": "t", "prompt": "p"}]
    data.write_shard("gs://bucket/d/data-00000.jsonl", records)
    data.write_shard("gs://bucket/d/data-00001.array_record", records)
    assert sorted(os.listdir(bucket.disk / "d")) == ["data-00000.jsonl", "data-00001.array_record"]
    shards = data.expand_paths("gs://bucket/d")
    assert shards == ["gs://bucket/d/data-00000.jsonl", "gs://bucket/d/data-00001.array_record"]
    assert data.expand_paths("gs://bucket/d/*.jsonl") == shards[:1]
    assert data.read_shard(shards[0]) == records
    # ArrayRecord reads gs:// natively (not through epath), so the fake bucket reads locally.
    assert data.read_shard(bucket.disk / "d" / "data-00001.array_record") == records
    epath.Path("gs://bucket/p.jsonl").write_text('{"prompt": "one"}\n')
    assert [p.text for p in read_prompt_file("gs://bucket/p.jsonl")] == ["one"]
    assert bucket.leaked() == []


def test_generated_data_on_gcs_resumes(bucket, target, chat):
    prompts = [Prompt(t, "test") for t in ("hello", "write a poem", "abc")]
    settings = dict(fmt="jsonl", batch_size=2, max_new_tokens=4, min_loss_tokens=1, bucket=128)
    counts = generate_records(target, chat, prompts[:2], "gs://bucket/data", **settings)
    assert counts["written"] + counts["short_response"] == 2
    again = generate_records(target, chat, prompts, "gs://bucket/data", **settings)
    assert again["written"] + again["short_response"] == 1  # only the new prompt
    assert sorted(os.listdir(bucket.disk / "data")) == [
        "data-00000.json",
        "data-00000.jsonl",
        "data-00001.json",
        "data-00001.jsonl",
    ]
    total = counts["written"] + again["written"]
    assert mixture("gs://bucket/data")["total"]["records"] == total
    assert bucket.leaked() == []


def test_move_on_gcs(bucket):
    (epath.Path("gs://bucket/a/x") / "y.txt").write_text("y")
    epath.Path("gs://bucket/a/z.txt").write_text("z")
    paths.move(paths.path("gs://bucket/a"), paths.path("gs://bucket/b"))
    assert not (bucket.disk / "a").exists()
    assert (bucket.disk / "b" / "x" / "y.txt").read_text() == "y"
    assert (bucket.disk / "b" / "z.txt").read_text() == "z"
    paths.move(paths.path("gs://bucket/b/z.txt"), paths.path("gs://bucket/c.txt"))
    assert (bucket.disk / "c.txt").read_text() == "z" and not (bucket.disk / "b" / "z.txt").exists()
    assert bucket.leaked() == []


def test_zlab_drafter_and_target_from_gcs_are_read_from_a_local_copy(bucket, monkeypatch):
    config = trainer.drafter_config_for(train_config("unused.jsonl"), TINY_TARGET)
    params = init_drafter_params(config, jax.random.key(0))
    write_zlab("gs://bucket/zlab", config, params, dtype="float32")
    assert sorted(os.listdir(bucket.disk / "zlab")) == ["config.json", "model.safetensors"]
    epath.Path("gs://bucket/zlab/original/consolidated.pth").write_bytes(b"not read")
    loaded = read_drafter("gs://bucket/zlab")
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    copy = paths.local_mirror("gs://bucket/zlab") / "zlab"
    assert sorted(os.listdir(copy)) == ["config.json", "model.safetensors"]  # what it reads

    seen = []
    monkeypatch.setattr(target_loader, "_load", lambda path, *args: seen.append(path))
    target_loader.load_target("gs://bucket/zlab")  # any directory: `_load` is what reads it
    assert seen == [copy]
    assert bucket.leaked() == []


def test_corpus_table_on_gcs(bucket):
    """A corpus table is written and read through the checkpoints' file layer (no local path
    taken for the URL)."""
    from dflash_jax.io import corpus_table

    table = corpus_table.build_table([(np.arange(1, 9), np.ones(8, int))], 16, 2, 2)
    corpus_table.save_table(table, "gs://bucket/drafter/corpus_ngrams.npz")
    back = corpus_table.read("gs://bucket/drafter", 16)
    np.testing.assert_array_equal(back.keys, table.keys)
    np.testing.assert_array_equal(back.next, table.next)
    assert (bucket.disk / "drafter" / "corpus_ngrams.npz").is_file()
    assert bucket.leaked() == []
