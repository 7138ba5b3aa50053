# ruff: noqa: E402  (XLA_FLAGS must be set before jax starts)
"""Decoding, loading, training and checkpoints on a mesh of 8 fake CPU devices equal one device.

The checks run in one fresh process that asks for 8 CPU devices (the rest of the session keeps
one), each on tiny models; the tests below read its results.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

FAKE_DEVICES = 8
if os.environ.get("DFLASH_TEST_FAKE_DEVICES"):
    flag = f"--xla_force_host_platform_device_count={FAKE_DEVICES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax
import numpy as np
import pytest
from _decode import LENS8, PROMPT8
from _training import write_hf_dir

from dflash_jax import sharding
from dflash_jax.config import TargetConfig
from dflash_jax.decoding import autoregressive_decode, programs, speculative, speculative_decode
from dflash_jax.decoding.settings import DecodeConfig

# One subprocess on 8 fake devices runs every check here (~2 min): CI's slow step runs it.
pytestmark = pytest.mark.slow

DECODE_MESHES = ("data=2,tensor=4", "data=8", "fsdp=2,tensor=4")
# Rows of different lengths (8 rows: one per device on data=8).
PROMPT, LENS = PROMPT8, LENS8
TRAIN_MESHES = ("fsdp=4,tensor=2", "data=8")


def _decode_checks() -> dict:
    from _decode import make_pair

    tcfg, tp, dcfg, dp = make_pair(block_size=4)
    cfg = DecodeConfig(max_new_tokens=12, block_size=4)
    key = jax.random.key(0)
    kw = dict(target_config=tcfg, drafter_config=dcfg, decode_config=cfg)
    ref = speculative_decode(tp, dp, PROMPT, LENS, key, **kw)
    out = {"reference": np.asarray(ref.tokens).tolist(), "tau": np.asarray(ref.lengths).tolist()}
    for spec in DECODE_MESHES:
        mesh = sharding.mesh_from_spec(spec)
        got = speculative_decode(tp, dp, PROMPT, LENS, key, **kw, mesh=mesh)
        out[spec] = {
            "tokens": np.asarray(got.tokens).tolist(),
            "acceptance": np.array_equal(got.acceptance_lengths, ref.acceptance_lengths),
            "replicated": got.tokens.sharding.is_fully_replicated,
        }
    # The compiled loop carries per-device buffers: every [B,K,S,H] cache holds 8/2 rows.
    mesh = sharding.mesh_from_spec("data=2,tensor=4")
    args = (tp, dp, PROMPT, LENS, key, speculative.step_cost_array(cfg), np.int32(-1), np.int32(19))
    fn, args, _ = programs.on_mesh(speculative.speculative_jit, mesh, args, kw)
    hlo = fn.lower(*args).compile().as_text()
    carry = next(line for line in hlo.splitlines() if " while(" in line)
    out["carry_cache_rows"] = sorted(set(re.findall(r"f32\[(\d+),\d+,\d+,\d+\]", carry)))
    # Under `jax.set_mesh`, the autoregressive baseline too.
    ar_cfg = DecodeConfig(max_new_tokens=12)
    ar_ref = autoregressive_decode(tp, PROMPT, LENS, key, target_config=tcfg, decode_config=ar_cfg)
    with jax.set_mesh(sharding.mesh_from_spec("data=2,tensor=4")):
        ar = autoregressive_decode(tp, PROMPT, LENS, key, target_config=tcfg, decode_config=ar_cfg)
    out["autoregressive_same"] = np.array_equal(ar.tokens, ar_ref.tokens)
    return out


HF_TARGET = TargetConfig(
    arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=128,
)  # fmt: skip


def _load_checks(workdir: Path) -> dict:
    from dflash_jax.io import load_target
    from dflash_jax.io.drafter_io import read_drafter

    write_hf_dir(workdir / "tiny_hf", HF_TARGET)
    mesh = sharding.mesh_from_spec("data=2,tensor=4")
    ref = load_target(str(workdir / "tiny_hf"), cache=False)
    out = {}
    for name, cache in (("source", False), ("cache_write", True), ("cache_read", True)):
        got = load_target(str(workdir / "tiny_hf"), cache=cache, mesh=mesh)
        same = jax.tree.map(lambda a, b: np.array_equal(a, b), ref.params, got.params)
        up = got.params["layers_0"]["mlp"]["up_proj"]["kernel"]
        out[name] = {
            "equal": all(jax.tree.leaves(same)),
            "up_proj_shards": sorted({tuple(s.data.shape) for s in up.addressable_shards}),
            "mesh": got.mesh is mesh,
        }
    # The shipped drafter's 9 heads and 3 kv heads split 3 ways (on 6 of the 8 devices).
    drafter = read_drafter("default", mesh=sharding.mesh_from_spec("data=1,fsdp=2,tensor=3"))
    plain = read_drafter("default")
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), plain.params, drafter.params)
    q = drafter.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    out["drafter"] = {"equal": all(jax.tree.leaves(same)), "q_proj_spec": str(q.sharding.spec)}
    return out


def _train(workdir: Path, run: str, mesh: str) -> dict[int, float]:
    """A tiny 6-step run (checkpoints at 3 and 6) in workdir/run on `mesh` -> losses by step."""
    import _training

    from dflash_jax.io.target_loader import LoadedTarget
    from dflash_jax.models.target import init_params
    from dflash_jax.training import trainer

    config = _training.TINY_TARGET
    params = init_params(config, jax.random.key(1))

    def load(source, dtype, mesh=None):
        if mesh is not None:
            return LoadedTarget(
                config, sharding.put(params, sharding.param_shardings(params, mesh)), None,
                None, source, mesh,
            )  # fmt: skip
        return LoadedTarget(config, params, None, None, source)

    trainer.load_target = load
    data = workdir / "data.jsonl"
    if not data.exists():
        _training.corpus(data)
    cfg = _training.train_config(
        data, num_steps=6, checkpoint_every=3, batch_size=8, learning_rate=3e-3, mesh=mesh
    )
    trainer.train(cfg, workdir / run)
    return _training.logged_losses(workdir / run)


def _train_checks(workdir: Path) -> dict:
    out = {
        "one": _train(workdir, "one", ""),
        "sharded": _train(workdir, "sharded", TRAIN_MESHES[0]),
    }
    # The sharded run again from its step-3 checkpoint, restored onto the other mesh.
    shutil.copytree(workdir / "sharded", workdir / "resumed")
    shutil.rmtree(workdir / "resumed" / "checkpoints" / "6")
    out["resumed"] = _train(workdir, "resumed", TRAIN_MESHES[1])
    return out


def mesh_checks(workdir: str) -> dict:
    """Runs every check on 8 devices -> JSON-able results."""
    assert jax.device_count() >= FAKE_DEVICES, jax.devices()
    workdir = Path(workdir)
    return {
        "decode": _decode_checks(),
        "load": _load_checks(workdir),
        "train": _train_checks(workdir),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mesh")
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "DFLASH_TEST_FAKE_DEVICES": "1",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            [str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]
        ),
    }
    code = (
        "import json, sys, test_sharding_mesh as t; print(json.dumps(t.mesh_checks(sys.argv[1])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(workdir)],
        env=env,
        cwd=here,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec", DECODE_MESHES)
def test_sharded_greedy_decode_equals_one_device(results, spec):
    decode = results["decode"]
    assert decode[spec]["tokens"] == decode["reference"]
    assert decode[spec]["acceptance"] and decode[spec]["replicated"]


def test_loop_carry_stays_split_over_the_batch(results):
    assert results["decode"]["carry_cache_rows"] == ["4"]


def test_autoregressive_under_set_mesh_equals_one_device(results):
    assert results["decode"]["autoregressive_same"]


def test_load_places_each_param_shard_by_shard(results):
    load = results["load"]
    for name in ("source", "cache_write", "cache_read"):
        assert load[name]["equal"] and load[name]["mesh"]
        # up_proj [D=64, F=96] over tensor=4: every device holds a [64, 24] slice only.
        assert load[name]["up_proj_shards"] == [[64, 24]]
    assert load["drafter"]["equal"]
    assert "tensor" in load["drafter"]["q_proj_spec"]


def test_sharded_training_equals_one_device(results):
    train = results["train"]
    one, sharded = train["one"], train["sharded"]
    assert list(one) == [str(s) for s in range(1, 7)] and list(sharded) == list(one)
    np.testing.assert_allclose([sharded[s] for s in one], [one[s] for s in one], atol=1e-5)


def test_checkpoint_restores_onto_another_mesh(results):
    train = results["train"]
    one, resumed = train["one"], train["resumed"]
    assert list(resumed) == list(one)
    np.testing.assert_allclose([resumed[s] for s in one], [one[s] for s in one], atol=1e-5)


def test_mesh_flags_are_validated():
    assert sharding.parse_mesh("data=2, tensor=4") == {"data": 2, "tensor": 4}
    for spec, message in (
        ("data=2,model=4", "unknown axis 'model'"),
        ("data=2,data=4", "axis 'data' is given twice"),
        ("tensor=0", "tensor='0' is not a positive integer"),
        ("data:2", "expected axis=size pairs"),
    ):
        with pytest.raises(ValueError, match=message):
            sharding.parse_mesh(spec)
    with pytest.raises(ValueError, match="needs 1024 devices"):
        sharding.mesh_from_spec("data=2,tensor=512")
    assert sharding.mesh_from_spec("") is None
    assert sharding.mesh_from_spec("tensor=1").shape["data"] == jax.device_count()


@pytest.mark.slow  # the plan itself: tests/test_memory_plan.py
def test_memory_plan_prints_per_device_bytes(tmp_path):
    """infer.memory_plan on a tiny target and drafter, both modes, 8 fake devices."""
    target = tmp_path / "tiny_hf"
    write_hf_dir(target, HF_TARGET)
    config = tmp_path / "tiny_config.py"
    config.write_text(
        "from dflash_jax.training.trainer import default_config\n\n\n"
        "def get_config():\n"
        "    cfg = default_config()\n"
        f"    cfg.target = {str(target)!r}\n"
        "    cfg.compute_dtype = 'float32'\n"
        "    cfg.drafter.update(dict(hidden_size=64, intermediate_size=96, num_layers=2,\n"
        "        num_heads=4, num_kv_heads=4, head_dim=16, mask_token_id=0,\n"
        "        target_layer_ids=(0, 1)))\n"
        "    cfg.block_size, cfg.seq_len, cfg.num_anchors, cfg.batch_size = 8, 32, 4, 8\n"
        "    return cfg\n"
    )
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]),
    }
    for mode, extra in (
        ("train", []),
        ("decode", ["--batch=8", "--prompt_len=8", "--max_new_tokens=8", "--dtype=float32"]),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "infer.memory_plan", f"--config={config}", f"--mode={mode}", "--mesh=data=2,tensor=4", *extra],
            env=env, cwd=here.parent, capture_output=True, text=True, check=False, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        for row in ("params (target", "optimizer state", "caches", "activations (temporaries)"):
            assert re.search(rf"{re.escape(row)}.* \d+\.\d\d GiB", out.stdout), out.stdout
        assert "total per device" in out.stdout, out.stdout
