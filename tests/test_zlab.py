"""z-lab import/export, Orbax save/restore and `infer.convert`, against the reference loader."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from _reference import make_reference_pair, reference_draft_logits, reference_taps
from absl import flags
from dflash.model import DFlashDraftModel
from safetensors.numpy import load_file, save_file
from transformers import Qwen3ForCausalLM

from dflash_jax.io import CheckpointError, drafter_io
from dflash_jax.io.drafter_io import read_drafter, restore_drafter, save_drafter
from dflash_jax.io.zlab import read_zlab, write_zlab
from dflash_jax.models.drafter import init_drafter_params
from infer import convert


@pytest.fixture(scope="module")
def zlab_dir(tmp_path_factory):
    """A reference drafter saved by `DFlashDraftModel.save_pretrained` (plus its target)."""
    _, drafter_dir = make_reference_pair(
        tmp_path_factory.mktemp("ref"), block_size=8, num_kv_heads=2, num_heads=4
    )
    return drafter_dir


def _tensors(directory):
    return load_file(str(directory / "model.safetensors"))


def _assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_import_export_gives_identical_tensors_and_reference_logits(zlab_dir, tmp_path):
    config, params = read_zlab(zlab_dir)
    assert config.target_layer_ids == (1, 3) and config.mask_token_id == 511
    assert config.rope_theta == 1e6
    shapes = jax.tree.map(lambda x: x.shape, params)
    fresh = jax.eval_shape(lambda rng: init_drafter_params(config, rng), jax.random.key(0))
    assert shapes == jax.tree.map(lambda x: x.shape, fresh)

    write_zlab(tmp_path / "out", config, params, dtype="float32")
    _assert_same_tensors(_tensors(zlab_dir), _tensors(tmp_path / "out"))
    assert read_zlab(tmp_path / "out")[0] == config

    # the reference package loads the export and drafts exactly what the original drafts
    target = Qwen3ForCausalLM.from_pretrained(zlab_dir.parent / "target", dtype=torch.float32)
    original = DFlashDraftModel.from_pretrained(zlab_dir, dtype=torch.float32).eval()
    exported = DFlashDraftModel.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert exported.target_layer_ids == [1, 3] and exported.mask_token_id == 511
    rng = np.random.default_rng(0)
    taps = reference_taps(target.eval(), original, rng.integers(0, 512, size=9))
    block = np.array([7] + [511] * 7)
    np.testing.assert_array_equal(
        reference_draft_logits(target, exported, taps, block),
        reference_draft_logits(target, original, taps, block),
    )


def test_bfloat16_export_loads_in_reference(zlab_dir, tmp_path):
    config, params = read_zlab(zlab_dir)
    write_zlab(tmp_path / "bf16", config, params, dtype="bfloat16")
    tensors = _tensors(tmp_path / "bf16")
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    hf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert hf["torch_dtype"] == "bfloat16"
    model = DFlashDraftModel.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    fc = model.state_dict()["fc.weight"].numpy()
    np.testing.assert_array_equal(fc, tensors["fc.weight"].astype(np.float32))
    back_config, back = read_zlab(tmp_path / "bf16", dtype="bfloat16")
    assert back_config.dtype == "bfloat16"
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)
    _assert_same_params(back, rounded)


def test_model_prefix_is_accepted_and_bad_tensors_are_named(zlab_dir, tmp_path):
    tensors = _tensors(zlab_dir)
    _, params = read_zlab(zlab_dir)

    def variant(name, table):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(zlab_dir / "config.json", d / "config.json")
        save_file(table, str(d / "model.safetensors"))
        return d

    prefixed = variant("prefixed", {f"model.{k}": v for k, v in tensors.items()})
    _assert_same_params(read_zlab(prefixed)[1], params)

    bad = {
        "unmapped.*layers.0.attention_conv.weight": {
            **tensors,
            "layers.0.attention_conv.weight": tensors["norm.weight"],
        },
        "missing.*layers.1.mlp.up_proj.weight": {
            k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"
        },
        "'layers.0.self_attn.k_proj.weight' has shape \\[16, 64\\]; expected \\[32, 64\\]": {
            **tensors,
            "layers.0.self_attn.k_proj.weight": np.zeros((16, 64), np.float32),
        },
        "'fc.weight' appears twice": {**tensors, "model.fc.weight": tensors["fc.weight"]},
    }
    for i, (message, table) in enumerate(bad.items()):
        with pytest.raises(CheckpointError, match=message):
            read_zlab(variant(f"bad{i}", table))


def test_orbax_round_trip(zlab_dir, tmp_path):
    config, params = read_zlab(zlab_dir)
    save_drafter(tmp_path / "ckpt", config, params)
    restored = restore_drafter(tmp_path / "ckpt")
    assert restored.config == config
    with pytest.raises(CheckpointError, match="already holds a drafter checkpoint"):
        save_drafter(tmp_path / "ckpt", config, params)
    _assert_same_params(restored.params, params)
    half = restore_drafter(tmp_path / "ckpt", dtype="bfloat16")
    assert half.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(half.params)} == {np.dtype(ml_dtypes.bfloat16)}
    via_source = read_drafter(str(tmp_path / "ckpt"))
    _assert_same_params(via_source.params, params)


def test_convert_round_trip(zlab_dir, tmp_path):
    def run(*argv):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["convert", *argv])
        convert.main([])

    run(f"--source={zlab_dir}", f"--output={tmp_path / 'orbax'}", "--format=orbax")
    run(f"--source={tmp_path / 'orbax'}", f"--output={tmp_path / 'zlab'}", "--format=zlab")
    _assert_same_tensors(_tensors(zlab_dir), _tensors(tmp_path / "zlab"))
    assert DFlashDraftModel.from_pretrained(tmp_path / "zlab").target_layer_ids == [1, 3]
    flags.FLAGS.unparse_flags()


def test_corrupt_or_missing_checkpoints_raise_clear_errors(zlab_dir, tmp_path, monkeypatch):
    config, params = read_zlab(zlab_dir)
    save_drafter(tmp_path / "ckpt", config, params)
    for f in (tmp_path / "ckpt" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0garbage" * 3)
    with pytest.raises(CheckpointError, match=str(tmp_path / "ckpt" / "params")):
        restore_drafter(tmp_path / "ckpt")

    (tmp_path / "no_config").mkdir()
    with pytest.raises(CheckpointError, match="drafter_config.json"):
        restore_drafter(tmp_path / "no_config")
    with pytest.raises(CheckpointError, match="neither an Orbax drafter"):
        read_drafter(tmp_path / "no_config")

    truncated = tmp_path / "truncated"
    shutil.copytree(zlab_dir, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(truncated / "model.safetensors")):
        read_zlab(truncated)

    monkeypatch.setattr(drafter_io, "DEFAULT_DRAFTER", tmp_path / "no-such-default")
    with pytest.raises(CheckpointError, match="default drafter is missing"):
        read_drafter("default")
    with pytest.raises(CheckpointError, match="'nobody/no-such-drafter'"):
        read_drafter("nobody/no-such-drafter")


def test_config_is_kept_through_both_formats(zlab_dir, tmp_path):
    config, params = read_zlab(zlab_dir)
    custom = dataclasses.replace(
        config, input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0
    )
    write_zlab(tmp_path / "zlab", custom, params, dtype="float32")
    assert read_zlab(tmp_path / "zlab")[0] == custom
    save_drafter(tmp_path / "orbax", custom, params)
    assert restore_drafter(tmp_path / "orbax").config == custom
