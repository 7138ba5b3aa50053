"""The converted-target cache behind `load_target`: a hit is identical to converting again, a
damaged entry is rebuilt with one warning, a changed source never meets its old entry, and the
cache can be turned off. Every test caches into its own tmp_path."""

import json
import logging
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from _tiny_models import make_tiny_gguf, make_tiny_hf_model, make_tiny_hf_target
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from dflash_jax.io import SMOLLM2_NAME, load_target, target_cache, target_loader


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(path))
    monkeypatch.delenv("DFLASH_JAX_NO_CACHE", raising=False)
    return path


def _entries(cache_dir):
    targets = cache_dir / "targets"
    return (
        sorted(p for p in targets.iterdir() if not p.name.startswith("."))
        if targets.exists()
        else []
    )


def _assert_same(a, b):
    """Same config, source and chat template, and params equal bit for bit in the same dtype."""
    assert a.config == b.config and a.source == b.source and a.chat_template == b.chat_template
    assert jax.tree_util.tree_structure(a.params) == jax.tree_util.tree_structure(b.params)
    for x, y in zip(
        jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params), strict=True
    ):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _no_conversion(monkeypatch):
    """Makes any conversion from the source fail, so that a load must come from the cache."""

    def refuse(path, dtype):
        raise AssertionError(f"converted {path} again instead of reading the cache")

    monkeypatch.setattr(target_loader, "_load_gguf", refuse)
    monkeypatch.setattr(target_loader, "_load_hf_dir", refuse)


def _cache_warnings(caplog):
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "target cache" in r.getMessage()
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_dir_hit_is_identical(tmp_path, cache_dir, monkeypatch, dtype):
    path = make_tiny_hf_target(tmp_path, "qwen3")
    reference = load_target(str(path), dtype, cache=False)
    assert not _entries(cache_dir)
    built = load_target(str(path), dtype)
    (entry,) = _entries(cache_dir)
    assert dtype in entry.name
    _no_conversion(monkeypatch)
    cached = load_target(str(path), dtype)
    _assert_same(built, reference)
    _assert_same(cached, reference)


def test_gguf_hit_is_identical(tmp_path, cache_dir, monkeypatch):
    path = make_tiny_gguf(tmp_path, make_tiny_hf_model("llama", tie=True))
    reference = load_target(str(path), cache=False)
    load_target(str(path))
    _no_conversion(monkeypatch)
    cached = load_target(str(path))
    assert cached.tokenizer is None and reference.tokenizer is None
    _assert_same(cached, reference)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_recast_is_a_fresh_load_in_that_dtype(tmp_path, cache_dir, monkeypatch, kind):
    """`--dtype=auto` on a first run casts the float32 target it loaded to the dtype it chose
    (`target_loader.recast`) instead of converting the source again: bit for bit the fresh
    bf16 load, and the cache entry it leaves is what the next bf16 load reads."""
    if kind == "hf":
        path = make_tiny_hf_target(tmp_path, "qwen3")
    else:
        path = make_tiny_gguf(tmp_path, make_tiny_hf_model("llama", tie=True))
    reference = load_target(str(path), "bfloat16", cache=False)
    recast = target_loader.recast(load_target(str(path)), "bfloat16")
    _assert_same(recast, reference)
    assert sum("bfloat16" in e.name for e in _entries(cache_dir)) == 1
    _no_conversion(monkeypatch)
    _assert_same(load_target(str(path), "bfloat16"), reference)


def _flip_a_byte(file):
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "truncated array": lambda entry: os.truncate(
        entry / "params.safetensors", os.path.getsize(entry / "params.safetensors") - 4
    ),
    "flipped byte": lambda entry: _flip_a_byte(entry / "params.safetensors"),
    "no manifest": lambda entry: (entry / "manifest.json").unlink(),
    "stray file": lambda entry: (entry / "extra.json").write_text("{}"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_entry_is_rebuilt_with_one_warning(tmp_path, cache_dir, caplog, damage):
    path = make_tiny_hf_target(tmp_path, "llama", tie=True)
    reference = load_target(str(path))
    (entry,) = _entries(cache_dir)
    DAMAGE[damage](entry)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rebuilt = load_target(str(path))
    (warning,) = _cache_warnings(caplog)
    assert str(entry) in warning.getMessage() and "rebuilding" in warning.getMessage()
    _assert_same(rebuilt, reference)
    assert _entries(cache_dir) == [entry]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _assert_same(load_target(str(path)), reference)
    assert not _cache_warnings(caplog)


def test_killed_writer_leaves_no_entry(tmp_path, cache_dir):
    """A process killed while writing leaves only a temporary directory: never read as an entry,
    removed by a later write once it is a day old."""
    path = make_tiny_hf_target(tmp_path, "qwen3")
    code = (
        "import os\n"
        "from dflash_jax.io import load_target, target_cache\n"
        "def die(file, arrays, fill=None):\n"
        "    open(file, 'wb').write(b'half an array')\n"
        "    os._exit(9)\n"
        "target_cache.write_safetensors = die\n"
        f"load_target({str(path)!r})\n"
    )
    repo = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo).returncode == 9
    (leftover,) = (cache_dir / "targets").iterdir()
    assert leftover.name.startswith(".") and not _entries(cache_dir)
    day_old = time.time() - 25 * 3600
    os.utime(leftover, (day_old, day_old))
    _assert_same(load_target(str(path)), load_target(str(path), cache=False))
    assert [p.name for p in (cache_dir / "targets").iterdir()] == [
        e.name for e in _entries(cache_dir)
    ]


def _rewrite_keeping_size_and_mtime(file, tensor_name):
    """Changes one tensor's values in place: same size, same mtime (only ctime moves)."""
    stat = os.stat(file)
    with safe_open(file, "np") as f:
        metadata = f.metadata()
    tensors = load_file(file)
    tensors[tensor_name] = tensors[tensor_name] + 1.0
    save_file(tensors, file, metadata=metadata)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(file) == stat.st_size


def test_changed_source_gets_a_new_key(tmp_path, cache_dir, monkeypatch):
    # Let the hash memo trust a file as soon as it is older than its hashing: the strictest case.
    monkeypatch.setattr(target_cache, "_RACY_NS", 0)
    hashed = []
    sha256 = target_cache._sha256
    monkeypatch.setattr(target_cache, "_sha256", lambda p: hashed.append(p.name) or sha256(p))
    path = make_tiny_hf_target(tmp_path, "llama")
    time.sleep(0.05)  # older than its first hashing by more than a timestamp tick
    first = load_target(str(path))
    (old_entry,) = _entries(cache_dir)
    hashed.clear()
    load_target(str(path))
    assert hashed == [], "unchanged files are hashed again instead of memoised"

    _rewrite_keeping_size_and_mtime(path / "model.safetensors", "model.norm.weight")
    changed = load_target(str(path))
    assert "model.safetensors" in hashed
    (new_entry,) = _entries(cache_dir)  # the old entry of this source is gone
    assert new_entry != old_entry
    np.testing.assert_array_equal(
        changed.params["norm"]["scale"], first.params["norm"]["scale"] + 1.0
    )
    _assert_same(changed, load_target(str(path), cache=False))


def test_config_change_gets_a_new_key(tmp_path, cache_dir):
    path = make_tiny_hf_target(tmp_path, "qwen3")
    load_target(str(path))
    config = path / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert load_target(str(path)).config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("how", ["env", "keyword"])
def test_cache_can_be_turned_off(tmp_path, cache_dir, monkeypatch, how):
    path = make_tiny_hf_target(tmp_path, "qwen3")
    if how == "env":
        monkeypatch.setenv("DFLASH_JAX_NO_CACHE", "1")
    load_target(str(path), cache=how != "keyword")
    assert not cache_dir.exists()
    monkeypatch.setenv("DFLASH_JAX_NO_CACHE", "0")
    load_target(str(path))
    assert len(_entries(cache_dir)) == 1


def test_unwritable_cache_warns_and_loads(tmp_path, monkeypatch, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(not_a_dir))
    path = make_tiny_hf_target(tmp_path, "qwen3")
    with caplog.at_level(logging.INFO):
        loaded = load_target(str(path))
    (warning,) = _cache_warnings(caplog)
    assert "cannot write the target cache" in warning.getMessage()
    _assert_same(loaded, load_target(str(path), cache=False))


@pytest.mark.slow
def test_smollm2_hit_is_identical(cache_dir, monkeypatch):
    """The real default target: params, config, tokenizer and chat template read back from the
    cache equal those just converted from the GGUF."""
    built = load_target(SMOLLM2_NAME)
    _no_conversion(monkeypatch)
    cached = load_target(SMOLLM2_NAME)
    _assert_same(cached, built)
    a, b = built.tokenizer, cached.tokenizer
    assert type(a) is type(b) and a.name_or_path == b.name_or_path
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.get_vocab() == b.get_vocab() and a.special_tokens_map == b.special_tokens_map
    assert {i: str(t) for i, t in a.added_tokens_decoder.items()} == {
        i: str(t) for i, t in b.added_tokens_decoder.items()
    }
    texts = ["def f(x):\n\treturn x ** 2  # é 中文 🙂", "<|im_start|>user\nhi<|im_end|>", "  a  b "]
    for text in texts:
        assert a(text)["input_ids"] == b(text)["input_ids"]
        ids = a.encode(text)
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": texts[0]}]
    for tokenize in (False, True):
        assert a.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=tokenize
        ) == b.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
    assert cached.chat_template == b.chat_template and cached.chat_template


# --- per shard, on a mesh of 8 fake devices --------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SHARD_MESH = "fsdp=4,tensor=2"
# A vocabulary large enough that the embedding (8192 x 64 fp32, 2 MiB) dwarfs every other param
# and anything a load allocates besides: one shard of it (vocab / tensor x embed / fsdp) is
# 256 KiB.
BIG_VOCAB = 8192


class _Intervals:
    """Host memory a call allocates (tracemalloc: numpy's buffers included, memory maps not):
    the peak during the call above the memory at its start, nested calls included. On CPU a
    device buffer may be the host array it was made from, so what a whole load allocates counts
    the placed params too; each shard's callback, each param's cache write and the
    tied-embedding check are measured instead, the steps where a whole param could appear on
    the host."""

    def __init__(self):
        self.open, self.largest = [], 0

    def wrap(self, fn):
        def measured(*args, **kwargs):
            self._sync()
            self.open.append([tracemalloc.get_traced_memory()[0], 0])
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                start, peak = self.open.pop()
                self.largest = max(self.largest, peak - start)

        return measured

    def _sync(self):
        peak = tracemalloc.get_traced_memory()[1]
        for interval in self.open:
            interval[1] = max(interval[1], peak)
        tracemalloc.reset_peak()


def sharded_load_peaks(directory: str) -> dict:
    """(Runs in a fresh process with 8 fake devices.) The most host memory one step of each
    load onto SHARD_MESH allocates (`_Intervals`): an HF directory whose lm_head repeats the
    tied embedding (converted and cached; then read from the cache), and the same model as a
    GGUF (dequantised and cached). Each sharded load must equal the one-device load."""
    from dflash_jax import sharding
    from dflash_jax.io import hf as hf_io
    from dflash_jax.io import load_target

    directory = Path(directory)
    hf, gguf_file = directory / "hf", directory / "tiny-llama.gguf"
    mesh = sharding.mesh_from_spec(SHARD_MESH)
    make_array = jax.make_array_from_callback
    peaks = {}
    for name, source in [("hf_convert", hf), ("hf_cached", hf), ("gguf_convert", gguf_file)]:
        intervals = _Intervals()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(
                jax, "make_array_from_callback",
                lambda shape, s, callback, w=intervals.wrap: make_array(shape, s, w(callback)),
            )  # fmt: skip
            mp.setattr(target_cache, "_store", intervals.wrap(target_cache._store))
            mp.setattr(hf_io, "_equal_by_rows", intervals.wrap(hf_io._equal_by_rows))
            tracemalloc.start()
            target = load_target(str(source), mesh=mesh)
            tracemalloc.stop()
        peaks[name] = intervals.largest
        whole = load_target(str(source), cache=False)
        for a, b in zip(
            jax.tree_util.tree_leaves(target.params), jax.tree_util.tree_leaves(whole.params),
            strict=True,
        ):  # fmt: skip
            assert len(a.sharding.device_set) == 8
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    embedding = target.params["embed_tokens"]["embedding"]
    peaks["leaf"] = embedding.nbytes
    peaks["shard"] = embedding.addressable_shards[0].data.nbytes
    return peaks


def test_sharded_load_holds_no_host_array_larger_than_a_few_shards(tmp_path, cache_dir):
    """On fsdp=4 x tensor=2: converting an HF directory (the tied-embedding check included) and
    caching it, reading it back from the cache, and converting and caching a GGUF: no step
    allocates more than three shards' worth on the host (a GGUF chunk of whole rows, the
    region and the device's private copy), under half the embedding, so no param was ever
    whole there. Before, the cache write gathered every param onto the host at once (the whole
    model), the GGUF was dequantised a tensor at a time (the whole embedding in its first
    shard's callback) and the tied check read two whole embeddings."""
    model = make_tiny_hf_model("llama", tie=True, vocab_size=BIG_VOCAB)
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    tensors = load_file(hf / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    make_tiny_gguf(tmp_path, model)
    flag = "--xla_force_host_platform_device_count=8"
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    }
    code = (
        "import json, sys, test_target_cache as t; "
        "print(json.dumps(t.sharded_load_peaks(sys.argv[1])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
        text=True, check=False, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = json.loads(out.stdout.splitlines()[-1])
    assert peaks["leaf"] == BIG_VOCAB * 64 * 4 and peaks["shard"] == peaks["leaf"] // 8, peaks
    for name in ("hf_convert", "hf_cached", "gguf_convert"):
        assert 0 < peaks[name] <= 3 * peaks["shard"] + (64 << 10) < peaks["leaf"] // 2, peaks
    assert len(_entries(cache_dir)) == 2  # the HF directory's and the GGUF's
