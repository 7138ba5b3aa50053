"""Meshes and shardings: one logical-axis -> mesh-axis table for every parameter, cache and batch.

Mesh axes: `data` (batch), `fsdp` (batch, and parameters' model dim), `tensor` (heads, FFN,
vocab). A parameter gets logical axes from its path (`PARAM_AXES`), and `LOGICAL_AXIS_RULES` maps
them to mesh axes; a dimension the mesh axes do not divide stays replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes, or None = replicated). The one table.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),  # tokens and cache slots
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("taps_embed", "tensor"),  # drafter fc input: concatenated target taps
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)

# param path (joined with "/") -> logical axes, first match wins; target and drafter alike.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|/)embed_tokens/embedding$", ("vocab", "embed")),
    (r"(^|/)lm_head/kernel$", ("embed", "vocab")),
    (r"/q_proj/kernel$", ("embed", "heads", "head_dim")),
    (r"/[kv]_proj/kernel$", ("embed", "kv_heads", "head_dim")),
    (r"/o_proj/kernel$", ("heads", "head_dim", "embed")),
    (r"/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"/down_proj/kernel$", ("mlp", "embed")),
    (r"(^|/)fc/kernel$", ("taps_embed", "embed")),
    (r"(^|/)[a-z_]*norm/scale$", ("norm",)),
)

KV_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_logical_axes(params):
    """Same-structure pytree of logical-axis tuples; raises naming any param without a rule or
    whose rank does not match its rule."""

    def axes_of(path, leaf):
        name = _path_str(path)
        for pattern, axes in PARAM_AXES:
            if re.search(pattern, name):
                if len(axes) != np.ndim(leaf):
                    raise ValueError(
                        f"param {name} has shape {np.shape(leaf)} but its rule gives {axes}"
                    )
                return axes
        raise ValueError(f"param {name} (shape {np.shape(leaf)}) matches no sharding rule")

    return jax.tree_util.tree_map_with_path(axes_of, params)


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules=LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` with logical `axes`; dims the mesh axes do not
    divide are replicated; a mesh axis used twice is an error."""
    table = dict(rules)
    spec, used = [], set()
    for axis, size in zip(axes, shape, strict=True):
        if axis is not None and axis not in table:
            raise ValueError(f"logical axis {axis!r} is not in the sharding rules")
        mesh_axes = table.get(axis) if axis is not None else None
        if mesh_axes is None:
            spec.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        clash = used.intersection(mesh_axes)
        if clash:
            raise ValueError(f"logical axes {tuple(axes)} map mesh axis {clash} twice")
        used.update(mesh_axes)
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        spec.append(mesh_axes if ways > 1 and size % ways == 0 else None)
    return PartitionSpec(*spec)


def make_mesh(
    data: int | None = None,
    fsdp: int = 1,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (jax 0.10 defaults to Explicit, which GSPMD
    propagation does not use). `data=None` takes the devices the other axes leave."""
    devices = list(devices if devices is not None else jax.devices())
    if data is None:
        data = len(devices) // (fsdp * tensor)
    size = data * fsdp * tensor
    if size < 1 or size > len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {size} devices, "
            f"{len(devices)} available"
        )
    return jax.make_mesh(
        (data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:size]
    )


def param_shardings(params, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedSharding pytree for params (arrays or ShapeDtypeStructs)."""
    axes = param_logical_axes(params)
    return jax.tree_util.tree_map(
        lambda leaf, ax: NamedSharding(mesh, logical_to_spec(ax, np.shape(leaf), mesh, rules)),
        params,
        axes,
    )


def cache_shardings(cache, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedSharding pytree for a KV cache whose buffers are [B,K,S,H]."""
    return jax.tree_util.tree_map(
        lambda buf: NamedSharding(mesh, logical_to_spec(KV_CACHE_AXES, buf.shape, mesh, rules)),
        cache,
    )


def batch_sharding(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> NamedSharding:
    """Shards the leading (batch) dim of token/length arrays over the batch mesh axes."""
    return NamedSharding(mesh, PartitionSpec(dict(rules)["batch"]))
