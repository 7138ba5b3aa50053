# ruff: noqa: E402  (XLA_FLAGS must be set before jax starts)
"""MoE and hybrid targets on a mesh of 8 fake CPU devices: experts split over the `expert`
axis (mesh axis `tensor`), the linear layers' state split with the batch, and greedy
speculative decoding equal to one device. The checks run in one fresh process with 8 CPU
devices (the rest of the session keeps one); the tests read its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

if os.environ.get("DFLASH_TEST_FAKE_DEVICES"):
    flag = "--xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax
import numpy as np
import pytest

from dflash_jax import sharding
from dflash_jax.config import DecodeConfig
from dflash_jax.decoding import speculative_decode

MESH = "data=2,tensor=4"
PROMPT = np.array([[5, 17, 33, 3, 42, 7], [11, 2, 60, 31, 0, 0]] * 2, np.int32)
LENS = np.array([6, 4, 6, 4], np.int32)


def mesh_checks(workdir: str) -> dict:
    from _tiny_layered import make_tiny_layered
    from test_layered_targets import _drafter

    from dflash_jax.io import load_target

    out = {}
    mesh = sharding.mesh_from_spec(MESH)
    for family in ("qwen3_moe", "qwen3_5_moe"):
        path = make_tiny_layered(Path(workdir) / family, family, num_experts=8)
        plain = load_target(str(path), cache=False)
        placed = load_target(str(path), cache=False, mesh=mesh)
        dcfg, dp = _drafter(plain)
        cfg = DecodeConfig(max_new_tokens=10, block_size=4)
        kw = dict(target_config=plain.config, drafter_config=dcfg, decode_config=cfg)
        key = jax.random.key(0)
        ref = speculative_decode(plain.params, dp, PROMPT, LENS, key, **kw)
        got = speculative_decode(placed.params, dp, PROMPT, LENS, key, **kw, mesh=mesh)
        layer = next(k for k in placed.params if k.startswith("layers_"))
        experts = placed.params[layer]["mlp"]["experts"]["up_proj"]
        out[family] = {
            "same": np.array_equal(got.tokens, ref.tokens),
            "expert_shards": sorted({s.data.shape[0] for s in experts.addressable_shards}),
        }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("layered_mesh")
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "DFLASH_TEST_FAKE_DEVICES": "1",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            [str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]
        ),
    }
    code = "import json, sys, test_layered_mesh as t; print(json.dumps(t.mesh_checks(sys.argv[1])))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(workdir)],
        env=env, cwd=here, capture_output=True, text=True, check=False, timeout=1500,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_sharded_layered_decode_equals_one_device(results, family):
    got = results[family]
    assert got["same"], got
    assert got["expert_shards"] == [2], got  # 8 experts over tensor=4: 2 whole experts each
