"""The `speculators` drafter format (issue 41): export and import keep every param, a checkpoint
laid out as the reference writes it decodes as the same weights in z-lab format, a draft
vocabulary (d2t/t2d) drafts its own ids as target ids, what the format holds that our decode
cannot run is refused in two lines, and (with `speculators` installed in a separate venv) the
reference module drafts our export's logits.

The reference parity test needs `speculators` 0.9.0, which pins transformers<=5.19 (ours is
newer), so it runs in its own venv, named by DFLASH_JAX_SPECULATORS_PYTHON (skipped without):

    python3 -m venv /tmp/specvenv && /tmp/specvenv/bin/pip install torch==2.13.0 speculators==0.9.0
    /tmp/specvenv/bin/pip uninstall -y torchvision torchaudio   # builds for another torch
    DFLASH_JAX_SPECULATORS_PYTHON=/tmp/specvenv/bin/python python -m pytest tests/test_speculators.py

(A lighter venv, used for issue 61: this venv's packages through a .pth file, then
`pip install --no-deps speculators==0.9.0 transformers==5.19.0 loguru pydantic-settings
hs-connectors==0.9.0` and a stub `datasets` module, which speculators imports but never uses
here.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import make_pair, two_token_tv
from _reference import make_reference_pair
from _speculators_run import REPO, SPECULATORS_PYTHON, assert_same_params, run_reference
from absl import flags
from safetensors.numpy import load_file, save_file
from transformers import Qwen3Config

import dflash_jax as dj
from dflash_jax.config import ConfigError
from dflash_jax.decoding import phases
from dflash_jax.decoding.phases import draft_tokens
from dflash_jax.decoding.sampling import process_logits
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import CheckpointError
from dflash_jax.io.drafter_io import DEFAULT_DRAFTER, read_drafter, restore_drafter, save_drafter
from dflash_jax.io.speculators import read_speculators, write_speculators
from dflash_jax.io.zlab import read_zlab, write_zlab
from dflash_jax.models.drafter import Drafter, draft_logits, drafter_logits, init_drafter_params
from dflash_jax.models.target import Transformer, decoding_head
from infer import convert


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random Qwen3 target (6 layers) and a z-lab drafter tapping layers 1 and 3, block 4."""
    return make_reference_pair(tmp_path_factory.mktemp("pair"), block_size=4)


def _as_speculators_writes(zlab_dir: Path, out: Path) -> Path:
    """The z-lab drafter laid out as `speculators` 0.9.0 saves a DFlash model, written by hand
    from the format (not by our writer): aux ids one past the z-lab tap ids (the embedding is
    hidden state 0), the draft layers' config nested, and a verifier tensor older checkpoints
    carry beside the drafter's."""
    z = json.loads((zlab_dir / "config.json").read_text())
    layer = {k: v for k, v in z.items() if k not in ("architectures", "auto_map", "dflash_config",
                                                     "block_size", "num_target_layers")}  # fmt: skip
    spec = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": z["vocab_size"],
        "block_size": 4,
        "aux_hidden_state_layer_ids": [2, 4],
        "mask_token_id": z["dflash_config"]["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": 3}],
                               "verifier": {"name_or_path": None, "architectures": []}},
    }  # fmt: skip
    out.mkdir()
    (out / "config.json").write_text(json.dumps(spec))
    tensors = load_file(str(zlab_dir / "model.safetensors"))
    tensors["verifier_norm.weight"] = np.ones(z["hidden_size"], np.float32)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _convert(*argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["convert", *argv])
    try:
        convert.main([])
    finally:
        flags.FLAGS.unparse_flags()


def test_round_trips_keep_config_and_params(pair, tmp_path):
    """ours -> speculators -> ours, for a z-lab drafter, a DFlash2 drafter and (through
    `infer.convert`) the shipped default: the same config and bit-identical params."""
    _, zlab_dir = pair
    config, params = read_zlab(zlab_dir)
    write_speculators(tmp_path / "spec", config, params, dtype="float32", verifier="some/target")
    hf = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert hf["speculators_model_type"] == "dflash" and hf["aux_hidden_state_layer_ids"] == [2, 4]
    assert hf["speculators_config"]["verifier"]["name_or_path"] == "some/target"
    # transformers 4 readers take rope_theta / rope_scaling, 5 rope_parameters: both written
    layer = hf["transformer_layer_config"]
    assert layer["rope_theta"] == config.rope_theta == 1e6  # not transformers' default
    assert Qwen3Config(**layer).rope_parameters["rope_theta"] == config.rope_theta
    back_config, back = read_speculators(tmp_path / "spec")
    assert back_config == config
    assert_same_params(back, params)

    v2 = dataclasses.replace(config, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                             selector_top_k=4)  # fmt: skip
    v2_params = jax.tree.map(np.asarray, init_drafter_params(v2, jax.random.key(3)))
    write_speculators(tmp_path / "spec2", v2, v2_params, dtype="float32")
    assert json.loads((tmp_path / "spec2" / "config.json").read_text())["selector_rank"] == 8
    v2_back = read_drafter(tmp_path / "spec2")
    assert v2_back.config == v2
    assert_same_params(v2_back.params, v2_params)

    _convert("--source=default", f"--output={tmp_path / 'default'}", "--format=speculators",
             "--dtype=bfloat16")  # fmt: skip
    shipped = restore_drafter(DEFAULT_DRAFTER)
    again = read_drafter(tmp_path / "default", dtype="bfloat16")
    assert again.config == shipped.config
    assert_same_params(again.params, shipped.params)
    # The shipped corpus table travels beside the export as a side file.
    table = read_drafter(DEFAULT_DRAFTER).corpus_table
    np.testing.assert_array_equal(again.corpus_table.keys, table.keys)


def test_a_speculators_checkpoint_decodes_as_the_same_weights_in_zlab_format(pair, tmp_path):
    target_dir, zlab_dir = pair
    spec_dir = _as_speculators_writes(zlab_dir, tmp_path / "spec")
    target = dj.load_target(str(target_dir), cache=False)
    zlab, spec = dj.load_drafter(zlab_dir, target), dj.load_drafter(spec_dir, target)
    # the format has no num_target_layers of its own (ours keep it in the layer config)
    unknown = dict(num_target_layers=zlab.config.num_target_layers)
    assert dataclasses.replace(spec.config, **unknown) == zlab.config
    assert spec.config.target_layer_ids == (1, 3)
    outs = [_decode(target, d) for d in (zlab, spec)]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].acceptance_lengths, outs[1].acceptance_lengths)


@pytest.mark.slow  # moved out of the default suite for its budget (2026-12-06); CI's slow step runs it
def test_an_embedding_tap_loads_decodes_and_exports(pair, tmp_path):
    """Aux id 0 (the embedding's output, which the format allows) is our tap -1: loaded from
    speculators, written back as 0 and to z-lab as -1, the tap is the embedding, and greedy
    decoding equals the target alone (issue 54: it was refused)."""
    target_dir, zlab_dir = pair
    spec_dir = _as_speculators_writes(zlab_dir, tmp_path / "spec")
    hf = json.loads((spec_dir / "config.json").read_text())
    (spec_dir / "config.json").write_text(json.dumps(hf | {"aux_hidden_state_layer_ids": [0, 4]}))
    target = dj.load_target(str(target_dir), cache=False)
    drafter = dj.load_drafter(spec_dir, target)
    assert drafter.config.target_layer_ids == (-1, 3)
    write_speculators(tmp_path / "again", drafter.config, drafter.params, dtype="float32")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["aux_hidden_state_layer_ids"] == [0, 4]
    write_zlab(tmp_path / "zlab", drafter.config, drafter.params, dtype="float32")
    assert read_zlab(tmp_path / "zlab")[0].target_layer_ids == (-1, 3)

    tokens = jnp.array([[5, 9, 13, 2]], jnp.int32)
    model = Transformer(target.config)
    _, taps, _ = model.apply({"params": target.params}, tokens, jnp.arange(4)[None],
                             tap_layers=(-1, 3), method=Transformer.hidden)  # fmt: skip
    embedded = model.apply({"params": target.params}, tokens, method=lambda m, t: m.embed(t))
    np.testing.assert_array_equal(taps[..., : target.config.hidden_size], embedded)

    out = _decode(target, drafter)
    ar = dj.autoregressive_decode(
        target.params, jnp.array([[5, 9, 13, 2, 7, 7, 40, 3], [3, 8, 100, 0, 0, 0, 0, 0]]),
        jnp.array([8, 3], jnp.int32), jax.random.key(0), target_config=target.config,
        decode_config=DecodeConfig(max_new_tokens=24, block_size=4),
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, ar.tokens)


def _with_sliding_layers(spec_dir: Path, out: Path, non_causal: bool) -> Path:
    """`spec_dir` with its first layer sliding (window 4), as speculators' training writes it
    (`layer_types`, `sliding_window`, `use_sliding_window`, `sliding_window_non_causal`)."""
    shutil.copytree(spec_dir, out)
    hf = json.loads((out / "config.json").read_text())
    hf["transformer_layer_config"] |= {"layer_types": ["sliding_attention", "full_attention"],
                                       "sliding_window": 4, "use_sliding_window": True}  # fmt: skip
    (out / "config.json").write_text(json.dumps(hf | {"sliding_window_non_causal": non_causal}))
    return out


@pytest.mark.parametrize("non_causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sliding_layers_load_decode_losslessly_and_round_trip(pair, tmp_path, non_causal):
    """A speculators checkpoint whose first layer slides (window 4, measured from the block's
    anchor; causal in the block unless sliding_window_non_causal) loads with that window,
    decodes the target's greedy tokens over contexts longer than the window, and round-trips
    through the format; z-lab's format, whose window is measured from each query, refuses it.
    Slow: the non-causal case (one more decode compile; its logits are the reference's in
    `test_speculators_writes_sliding_drafters_we_load_and_draft_alike`)."""
    target_dir, zlab_dir = pair
    spec_dir = _as_speculators_writes(zlab_dir, tmp_path / "spec")
    sliding_dir = _with_sliding_layers(spec_dir, tmp_path / "sliding", non_causal)
    target = dj.load_target(str(target_dir), cache=False)
    drafter = dj.load_drafter(sliding_dir, target)
    c = drafter.config
    assert c.window_from_anchor and c.sliding_window == 4 and c.layer_window(1) is None
    assert c.layer_is_causal(0) is not non_causal and not c.layer_is_causal(1)
    out = _decode(target, drafter)
    prompt = jnp.array([[5, 9, 13, 2, 7, 7, 40, 3], [3, 8, 100, 0, 0, 0, 0, 0]], jnp.int32)
    ar = dj.autoregressive_decode(
        target.params, prompt, jnp.array([8, 3], jnp.int32), jax.random.key(0),
        target_config=target.config, decode_config=DecodeConfig(max_new_tokens=24),
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, ar.tokens)

    write_speculators(tmp_path / "again", c, drafter.params, dtype="float32")
    again = read_drafter(tmp_path / "again")
    assert dataclasses.replace(again.config, dtype=c.dtype) == c
    assert_same_params(again.params, drafter.params)
    with pytest.raises(ConfigError, match="export it with --format=speculators"):
        write_zlab(tmp_path / "zlab", c, drafter.params)


def _decode(target, drafter, tree_nodes: int = 0):
    """A greedy speculative decode of two prompts (one compile per drafter config)."""
    prompt = jnp.array([[5, 9, 13, 2, 7, 7, 40, 3], [3, 8, 100, 0, 0, 0, 0, 0]], jnp.int32)
    return dj.speculative_decode(
        target.params, drafter.params, prompt, jnp.array([8, 3], jnp.int32), jax.random.key(0),
        target_config=target.config, drafter_config=drafter.config,
        decode_config=DecodeConfig(
            max_new_tokens=24, block_size=drafter.config.block_size, tree_nodes=tree_nodes
        ),
    )  # fmt: skip


REFUSED = {
    "anchor drafts": ({"sample_from_anchor": True}, "sample_from_anchor=true"),
    "eagle3": ({"speculators_model_type": "eagle3"}, "a speculators 'eagle3' model"),
    "negative tap": ({"aux_hidden_state_layer_ids": [-1, 4]}, "from 0 \\(the embedding\\)"),
    "no vocab": ({"transformer_layer_config": {"vocab_size": None}}, "lacks \\['vocab_size'\\]"),
    "rope per layer type": ({"transformer_layer_config": {"rope_parameters": {
        "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}},
        "rope_parameters per layer type"),
}  # fmt: skip


def test_what_our_decode_cannot_run_is_refused_naming_it(pair, tmp_path):
    _, zlab_dir = pair
    spec_dir = _as_speculators_writes(zlab_dir, tmp_path / "spec")
    hf = json.loads((spec_dir / "config.json").read_text())
    for i, (change, message) in enumerate(REFUSED.values()):
        variant = tmp_path / f"v{i}"
        shutil.copytree(spec_dir, variant)
        layer = hf["transformer_layer_config"] | change.get("transformer_layer_config", {})
        (variant / "config.json").write_text(
            json.dumps(hf | change | {"transformer_layer_config": layer})
        )
        with pytest.raises(ConfigError, match=message):
            read_drafter(variant)
    config = read_zlab(zlab_dir)[0]
    z_window = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 4}
    for bad in ({"causal": True}, {"output_multiplier": 2.0}, z_window):
        with pytest.raises(ConfigError, match="export it with --format=zlab"):
            write_speculators(tmp_path / "no", dataclasses.replace(config, **bad), {})

    # on the command line: two lines, the problem and the fix, no traceback
    out = subprocess.run(
        [sys.executable, "-m", "infer.convert", f"--source={tmp_path / 'v0'}",
         f"--output={tmp_path / 'out'}", "--format=orbax"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    err = out.stderr.strip()
    assert out.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 2, err
    assert "sample_from_anchor=true" in err and "use a drafter trained with" in err


def _with_draft_vocab(spec_dir: Path, target_dir: Path, ids: np.ndarray, out: Path) -> Path:
    """`spec_dir` with a draft vocabulary of the target ids `ids` (ascending), as `speculators`
    builds one: its lm_head the target's head rows at those ids, d2t offsets, t2d a mask."""
    shutil.copytree(spec_dir, out)
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf | {"draft_vocab_size": len(ids)}))
    tensors = load_file(str(out / "model.safetensors"))
    target_head = load_file(str(target_dir / "model.safetensors"))["lm_head.weight"]
    t2d = np.zeros(hf["transformer_layer_config"]["vocab_size"], np.bool_)
    t2d[ids] = True
    tensors |= {"lm_head.weight": target_head[ids], "d2t": ids - np.arange(len(ids)), "t2d": t2d}
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.slow  # moved out of the default suite for its budget (2026-12-06); CI's slow step runs it
def test_a_draft_vocabulary_drafts_over_its_ids_mapped_to_the_targets(pair, tmp_path):
    """A speculators drafter with a 64-id draft vocabulary (d2t/t2d): teacher-forced logits are
    the full-vocabulary drafter's at those ids and -inf elsewhere; greedy drafts and samples
    come out as target ids of the vocabulary, the sampled proposal's log-probs are the draft
    vocabulary's; greedy decoding equals AR; the maps survive speculators and Orbax round
    trips, and maps that disagree are refused."""
    target_dir, zlab_dir = pair
    ids = np.sort(np.random.default_rng(1).choice(512, size=64, replace=False)).astype(np.int64)
    spec_dir = _as_speculators_writes(zlab_dir, tmp_path / "spec")
    vocab_dir = _with_draft_vocab(spec_dir, target_dir, ids, tmp_path / "vocab")
    target = dj.load_target(str(target_dir), cache=False)
    full, small = dj.load_drafter(zlab_dir, target), dj.load_drafter(vocab_dir, target)
    assert small.config.draft_vocab_size == 64
    np.testing.assert_array_equal(small.params["draft_to_target"], ids)

    # teacher-forced: one block over 9 context rows (each step jitted: eager costs seconds)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 500, size=(1, 9)), jnp.int32)
    tcfg, positions = target.config, jnp.arange(9)[None]
    taps_fn = lambda tp: Transformer(tcfg).apply(
        {"params": tp}, tokens, positions, None, None, (1, 3)
    )
    taps = jax.jit(taps_fn)(target.params)[1]
    block = jnp.asarray([[7, 511, 511, 511]], jnp.int32)

    def logits(d):
        def fn(dp, tp):
            ctx_k, ctx_v = Drafter(d.config).apply(
                {"params": dp}, taps, positions, method="context_kv"
            )
            nine = jnp.array([9])
            return draft_logits(dp, tp, tcfg, d.config, block, ctx_k, ctx_v, nine, nine[None], 4)

        return np.asarray(jax.jit(fn)(d.params, target.params))

    want, got = logits(full), logits(small)
    outside = np.setdiff1d(np.arange(512), ids)
    np.testing.assert_allclose(got[..., ids], want[..., ids], rtol=1e-5, atol=1e-5)
    assert np.all(got[..., outside] == -np.inf)

    def drafted(cfg, hidden, dp, tp):  # greedy or sampled drafts, and the full-vocab logits
        head = decoding_head(tp, tcfg)
        drafts, logp = draft_tokens(head, tcfg, small.config, cfg, hidden, jax.random.key(1), dp)
        return drafts, logp, drafter_logits(head, tcfg, small.config, dp, hidden)

    hidden = jax.random.normal(jax.random.key(0), (2, 3, 64))
    run = lambda cfg: jax.jit(drafted, static_argnums=0)(cfg, hidden, small.params, target.params)
    greedy, _, full_logits = run(DecodeConfig(block_size=4))
    np.testing.assert_array_equal(greedy, np.argmax(full_logits, -1))
    assert np.isin(np.asarray(greedy), ids).all()
    drafts, logp, _ = run(DecodeConfig(block_size=4, temperature=1.0))
    assert np.isin(np.asarray(drafts), ids).all()
    assert np.all(np.asarray(logp)[..., outside] == -np.inf)
    draft_logp = jax.nn.log_softmax(full_logits[..., ids], -1)
    np.testing.assert_allclose(np.asarray(logp)[..., ids], draft_logp, rtol=1e-5, atol=1e-6)

    # greedy: the target's tokens, as the full-vocabulary drafter's decode gives them
    np.testing.assert_array_equal(_decode(target, small).tokens, _decode(target, full).tokens)

    write_speculators(tmp_path / "again", small.config, small.params, dtype="float32")
    written, original = (
        load_file(str(d / "model.safetensors")) for d in (tmp_path / "again", vocab_dir)
    )
    for key in ("lm_head.weight", "d2t", "t2d"):
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    save_drafter(tmp_path / "orbax", small.config, small.params)
    restored = restore_drafter(tmp_path / "orbax")
    assert restored.config == small.config and restored.params["draft_to_target"].dtype == np.int32
    assert_same_params(restored.params, small.params)
    with pytest.raises(ConfigError, match="export it with --format=speculators"):
        write_zlab(tmp_path / "zlab", small.config, small.params)
    original["d2t"] = original["d2t"][::-1].copy()
    save_file(original, str(vocab_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t and t2d disagree"):
        read_drafter(vocab_dir)


@pytest.mark.slow
def test_a_tree_over_a_draft_vocabulary_decodes_the_targets_tokens(pair, tmp_path):
    """Only this test runs a token tree (8 nodes) grown from a draft vocabulary's proposals:
    greedy, it gives the target's tokens (as the full drafter's chain decode gives them). ~15 s."""
    target_dir, zlab_dir = pair
    ids = np.sort(np.random.default_rng(1).choice(512, size=64, replace=False)).astype(np.int64)
    spec_dir = _as_speculators_writes(zlab_dir, tmp_path / "spec")
    vocab_dir = _with_draft_vocab(spec_dir, target_dir, ids, tmp_path / "vocab")
    target = dj.load_target(str(target_dir), cache=False)
    full, small = dj.load_drafter(zlab_dir, target), dj.load_drafter(vocab_dir, target)
    tree = _decode(target, small, tree_nodes=8)
    np.testing.assert_array_equal(tree.tokens, _decode(target, full).tokens)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_sampling_with_a_draft_vocabulary_is_lossless(broken, monkeypatch):
    """Only this test guards sampled losslessness with a draft vocabulary (its proposal placed
    at target ids, zero probability elsewhere, as rejection sampling reads it): the empirical
    law of the first two tokens matches the target's exact law (temperature 3, where the law
    is flat enough to show a bias), and a proposal whose claimed law puts mass outside the
    draft vocabulary (logits 0 there, not -inf) is detected. ~15 s each."""
    if broken:
        sampled = phases._sampled_drafts

        def claims_mass_outside(logits_bgv, key, cfg):
            drafts_bg, _ = sampled(logits_bgv, key, cfg)
            return drafts_bg, process_logits(jnp.where(jnp.isinf(logits_bgv), 0.0, logits_bgv), cfg)

        monkeypatch.setattr(phases, "_sampled_drafts", claims_mass_outside)
        jax.clear_caches()
    tcfg, tp, dcfg, dp = make_pair(vocab=12, zero_boost=1.0, seed=4)
    ids = np.array([0, 2, 3, 5, 8, 11], np.int32)
    small = dataclasses.replace(dcfg, draft_vocab_size=6)
    dp = {**dp, "norm": {"scale": jnp.full_like(dp["norm"]["scale"], 0.5)},
          "draft_to_target": jnp.asarray(ids),
          "lm_head": {"kernel": 3 * jax.random.normal(jax.random.key(7), (32, 6))}}  # fmt: skip
    prompt, n = np.array([3, 1, 4], np.int32), 20000
    out = dj.speculative_decode(
        tp, dp, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(11),
        target_config=tcfg, drafter_config=small,
        decode_config=DecodeConfig(max_new_tokens=2, block_size=4, temperature=3.0),
    )  # fmt: skip
    if broken:
        jax.clear_caches()
    tv = two_token_tv(tcfg, tp, prompt, 3.0, out.tokens)
    # measured 2026-12-04: 0.025 as built, 0.085 broken (sampling noise about 0.03 at n=20000)
    assert (tv > 0.06) if broken else (tv < 0.05), tv


@pytest.mark.skipif(
    not SPECULATORS_PYTHON,
    reason="speculators needs its own venv (it pins transformers<=5.19): set "
    "DFLASH_JAX_SPECULATORS_PYTHON to its python (see this module's docstring)",
)
def test_the_reference_module_drafts_our_exports_logits(pair, tmp_path):
    """Our drafters exported with --format=speculators (DFlash with the target's vocabulary and
    with a 64-id draft vocabulary, DFlash2), loaded by `speculators`' `from_pretrained`
    (embedding and full head from the target as its verifier): teacher-forced draft logits of
    one block (DFlash2: the unary ones, before the selector) equal ours within fp32 tolerance
    (ours at the draft ids for the draft vocabulary)."""
    target_dir, zlab_dir = pair
    target = dj.load_target(str(target_dir), cache=False)
    drafter = dj.load_drafter(zlab_dir, target)
    ids = np.sort(np.random.default_rng(1).choice(512, size=64, replace=False)).astype(np.int32)
    small = dataclasses.replace(drafter.config, draft_vocab_size=64)
    small_params = {**drafter.params, "draft_to_target": jnp.asarray(ids),
                    "lm_head": {"kernel": target.params["lm_head"]["kernel"][:, ids]}}  # fmt: skip
    v2 = dataclasses.replace(drafter.config, conv_kernel_size=2, conv_group_size=16,
                             selector_rank=8, selector_top_k=4)  # fmt: skip
    keys = iter(jax.random.split(jax.random.key(5), 64))  # every weight off its init (convs too)
    v2_params = jax.tree.map(
        lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape),
        init_drafter_params(v2, jax.random.key(4)),
    )
    exports = {"full": (drafter.config, drafter.params), "small": (small, small_params),
               "dflash2": (v2, v2_params)}  # fmt: skip
    run = run_reference(target_dir, target, exports, tmp_path)
    for i, (config, params) in enumerate(exports.values()):
        bs = config.block_size
        block = jnp.asarray([[run.tokens[run.anchor]] + [config.mask_token_id] * (bs - 1)])
        ctx_k, ctx_v = run.context(config, params)
        ours = draft_logits(params, target.params, target.config, config, block, ctx_k, ctx_v,
                            jnp.array([run.anchor]), jnp.array([[run.anchor]]), bs)[0, 0]  # fmt: skip
        if config.draft_vocab_size:
            ours = ours[..., ids]
        reference = np.load(f"{tmp_path / 'ref'}{i}.npy")  # [bs, V or 64]: slot 0 is the anchor's
        np.testing.assert_allclose(np.asarray(ours), reference[1:], atol=2e-4, rtol=1e-4)


# Written by speculators itself (`_speculators_reference.py --write`): DFlash with a sliding first
# layer, causal and non-causal in the block, and DFlash2 in its released layout (block 8, its
# sliding layers before a full one, non-causal by DFlash2's default), windows of 4 context rows.
_WRITTEN = {
    "dflash causal": ("dflash", 4, ["sliding_attention", "full_attention"], {}),
    "dflash non-causal": ("dflash", 4, ["sliding_attention", "full_attention"],
                          {"sliding_window_non_causal": True}),
    "dflash2": ("dflash2", 8, ["sliding_attention", "sliding_attention", "full_attention"],
                {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                 "selector_top_k": 4}),
}  # fmt: skip


@pytest.mark.skipif(
    not SPECULATORS_PYTHON,
    reason="speculators needs its own venv (it pins transformers<=5.19): set "
    "DFLASH_JAX_SPECULATORS_PYTHON to its python (see this module's docstring)",
)
def test_speculators_writes_sliding_drafters_we_load_and_draft_alike(pair, tmp_path):
    """Random drafters with sliding-window layers, built and saved by `speculators` 0.9.0's own
    classes (`_WRITTEN`), load with `load_drafter` (window measured from the anchor) and draft
    one teacher-forced block at anchor 12 of 24 tokens (8 rows past the window) with the
    reference's logits; they decode the target's greedy tokens."""
    target_dir, _ = pair
    target = dj.load_target(str(target_dir), cache=False)
    tokens = np.random.default_rng(0).integers(0, 500, size=24).astype(np.int64)
    anchor = 12
    dirs = []
    for name, (kind, block, types, top) in _WRITTEN.items():
        spec = {"kind": kind, "seed": len(dirs) + 3, "verifier": str(target_dir),
                "layer": dict(vocab_size=512, hidden_size=64, intermediate_size=192,
                              num_hidden_layers=len(types), num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                              max_position_embeddings=512, layer_types=types, sliding_window=4,
                              use_sliding_window=True),
                "top": dict(draft_vocab_size=512, block_size=block, mask_token_id=511,
                            aux_hidden_state_layer_ids=[2, 4], **top)}  # fmt: skip
        (tmp_path / f"{kind}{len(dirs)}.json").write_text(json.dumps(spec))
        dirs.append(tmp_path / name.replace(" ", "_"))
        _reference_script("--write", tmp_path / f"{kind}{len(dirs) - 1}.json", dirs[-1])
    _, taps_btf, _ = Transformer(target.config).apply(
        {"params": target.params}, jnp.asarray(tokens[None], jnp.int32),
        jnp.arange(24, dtype=jnp.int32)[None], None, None, (1, 3),
    )  # fmt: skip
    np.savez(tmp_path / "inputs.npz", taps=np.asarray(taps_btf[0]), tokens=tokens, anchor=anchor)
    _reference_script(tmp_path / "inputs.npz", tmp_path / "ref", *dirs)
    for i, directory in enumerate(dirs):
        drafter = dj.load_drafter(directory, target)
        config, params = drafter.config, drafter.params
        assert config.window_from_anchor and config.sliding_window == 4, directory
        bs = config.block_size
        ctx_k, ctx_v = Drafter(config).apply(
            {"params": params}, taps_btf, jnp.arange(24)[None], method="context_kv"
        )
        block = jnp.asarray([[tokens[anchor]] + [config.mask_token_id] * (bs - 1)])
        ours = draft_logits(params, target.params, target.config, config, block, ctx_k, ctx_v,
                            jnp.array([anchor]), jnp.array([[anchor]]), bs)[0, 0]  # fmt: skip
        reference = np.load(f"{tmp_path / 'ref'}{i}.npy")
        np.testing.assert_allclose(np.asarray(ours), reference[1:], atol=2e-4, rtol=1e-4)
        out = _decode(target, drafter)
        ar = dj.autoregressive_decode(
            target.params, jnp.array([[5, 9, 13, 2, 7, 7, 40, 3], [3, 8, 100, 0, 0, 0, 0, 0]]),
            jnp.array([8, 3], jnp.int32), jax.random.key(0), target_config=target.config,
            decode_config=DecodeConfig(max_new_tokens=24),
        )  # fmt: skip
        np.testing.assert_array_equal(out.tokens, ar.tokens)


def _reference_script(*args) -> None:
    """Runs `_speculators_reference.py` in the speculators venv."""
    subprocess.run(
        [SPECULATORS_PYTHON, str(REPO / "tests" / "_speculators_reference.py"), *map(str, args)],
        check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
