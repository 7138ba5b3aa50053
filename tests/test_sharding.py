# ruff: noqa: E402  (XLA_FLAGS must be set before jax starts)
"""Sharding rules: every target/drafter param has logical axes, the table maps them to the mesh,
and a target forward sharded over 8 fake CPU devices equals the unsharded one."""

import os
import subprocess
import sys
from pathlib import Path

FAKE_DEVICES = 8
DEVICE_FLAG = f"--xla_force_host_platform_device_count={FAKE_DEVICES}"
# The fake devices are only asked for in the fresh process that runs the sharded check, so the
# rest of the test session keeps one CPU device.
if os.environ.get("DFLASH_TEST_FAKE_DEVICES"):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_FLAG}".strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shapes import QWEN3_8B
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import Transformer, init_cache, init_params
from dflash_jax.sharding import (
    MESH_AXES,
    batch_sharding,
    cache_shardings,
    logical_to_spec,
    make_mesh,
    param_logical_axes,
    param_shardings,
)

TINY = TargetConfig(
    arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip


def _abstract_mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _leaves_with_paths(tree):
    return {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, tuple)
        )
    }


def test_every_target_and_drafter_param_has_a_rule():
    for config in (
        TINY,
        TargetConfig(**{**TINY.__dict__, "arch": "llama", "tie_word_embeddings": True}),
    ):
        params = jax.eval_shape(lambda c=config: init_params(c, jax.random.key(0)))
        axes = _leaves_with_paths(param_logical_axes(params))
        shapes = _leaves_with_paths(params)
        assert axes.keys() == shapes.keys()
        assert all(len(axes[k]) == len(shapes[k].shape) for k in axes)
    drafter = DrafterConfig(
        hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, vocab_size=128, mask_token_id=5, target_layer_ids=(0, 1), num_target_layers=2,
        block_size=4,
    )  # fmt: skip
    axes = param_logical_axes(
        jax.eval_shape(lambda: init_drafter_params(drafter, jax.random.key(0)))
    )
    assert axes["fc"]["kernel"] == ("taps_embed", "embed")
    assert axes["hidden_norm"]["scale"] == ("norm",)
    assert axes["layers_1"]["self_attn"]["k_proj"]["kernel"] == ("embed", "kv_heads", "head_dim")


def test_unmatched_param_names_its_path():
    with pytest.raises(ValueError, match=r"layers_0/mystery/kernel .*matches no sharding rule"):
        param_logical_axes({"layers_0": {"mystery": {"kernel": np.zeros((2, 2))}}})
    with pytest.raises(ValueError, match=r"lm_head/kernel has shape \(2,\)"):
        param_logical_axes({"lm_head": {"kernel": np.zeros((2,))}})


def test_table_maps_qwen3_8b_params():
    mesh = _abstract_mesh(2, 2, 4)
    params = jax.eval_shape(lambda: init_params(TargetConfig(**QWEN3_8B), jax.random.key(0)))
    specs = jax.tree_util.tree_map(
        lambda x, ax: logical_to_spec(ax, x.shape, mesh), params, param_logical_axes(params)
    )
    attn = specs["layers_0"]["self_attn"]
    assert attn["q_proj"]["kernel"] == PartitionSpec(("fsdp",), ("tensor",), None)
    assert attn["k_proj"]["kernel"] == PartitionSpec(("fsdp",), ("tensor",), None)
    assert attn["o_proj"]["kernel"] == PartitionSpec(("tensor",), None, ("fsdp",))
    assert specs["layers_0"]["mlp"]["down_proj"]["kernel"] == PartitionSpec(("tensor",), ("fsdp",))
    assert specs["embed_tokens"]["embedding"] == PartitionSpec(("tensor",), ("fsdp",))
    assert specs["norm"]["scale"] == PartitionSpec(None)


def test_indivisible_dims_stay_replicated_and_collisions_are_refused():
    mesh = _abstract_mesh(2, 1, 4)
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == PartitionSpec(
        None, None, None
    )  # kv_heads=2 on tensor=4; fsdp=1 shards nothing
    assert logical_to_spec(("batch", "length"), (5, 9), mesh) == PartitionSpec(None, None)
    assert logical_to_spec(("batch", "length"), (4, 9), mesh) == PartitionSpec(
        ("data", "fsdp"), None
    )
    with pytest.raises(ValueError, match="map mesh axis"):
        logical_to_spec(("heads", "mlp"), (4, 8), mesh)
    with pytest.raises(ValueError, match="logical axis 'nonsense'"):
        logical_to_spec(("nonsense",), (4,), mesh)


def test_make_mesh_checks_device_count():
    with pytest.raises(ValueError, match="needs 1024 devices"):
        make_mesh(data=1024)
    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES and mesh.size == len(jax.devices())
    assert set(mesh.axis_types) == {AxisType.Auto}


def sharded_forward_max_diff() -> float:
    """A tiny target's cached step (random cache, per-row lengths) with params, cache and batch
    sharded over a (data=2, fsdp=1, tensor=4) mesh, against one device. -> max |diff| over
    logits, taps and the written cache."""
    mesh = make_mesh(data=2, fsdp=1, tensor=4)
    params = jax.jit(init_params, static_argnums=0)(TINY, jax.random.key(0))  # one compile
    b, t, s = 4, 3, 16
    cache = init_cache(TINY, b, s)
    noise = jax.random.normal(jax.random.key(1), (2 * TINY.num_layers, b, 2, s, 16))
    cache = type(cache)(k=tuple(noise[: TINY.num_layers]), v=tuple(noise[TINY.num_layers :]))
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, TINY.vocab_size)
    lengths = jnp.array([12, 7, 9, 0], jnp.int32)
    positions = lengths[:, None] + jnp.arange(t)[None, :]

    def run(p, cache, tok, pos, lens):
        return Transformer(TINY).apply({"params": p}, tok, pos, cache, lens, tap_layers=(1,))

    expected = jax.jit(run)(params, cache, tokens, positions, lengths)
    shardings = param_shardings(params, mesh)
    assert shardings["lm_head"]["kernel"].spec == PartitionSpec(None, ("tensor",))
    data = batch_sharding(mesh)
    placed = (
        jax.device_put(params, shardings),
        jax.device_put(cache, cache_shardings(cache, mesh)),
        *(jax.device_put(x, data) for x in (tokens, positions, lengths)),
    )
    assert len(placed[0]["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.device_set) == 8
    got = jax.jit(run)(*placed)
    diffs = jax.tree_util.tree_map(lambda a, e: float(jnp.max(jnp.abs(a - e))), got, expected)
    return max(jax.tree_util.tree_leaves(diffs))


@pytest.mark.slow
def test_sharded_forward_equals_unsharded():
    if jax.device_count() >= FAKE_DEVICES:
        diff = sharded_forward_max_diff()
    else:  # check in a fresh process with 8 fake CPU devices
        here = Path(__file__).resolve().parent
        env = {
            **os.environ,
            "DFLASH_TEST_FAKE_DEVICES": "1",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(
                [str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]
            ),
        }
        code = "import test_sharding as t; print(t.sharded_forward_max_diff())"
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=here,
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        diff = float(out.stdout.strip().splitlines()[-1])
    assert diff <= 1e-5
