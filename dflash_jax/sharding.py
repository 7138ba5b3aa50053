"""Meshes and shardings: one logical-axis -> mesh-axis table for every parameter, cache and batch.

Mesh axes: `data` (batch), `fsdp` (batch, and parameters' model dim), `tensor` (heads, FFN,
vocab). A parameter gets logical axes from its path (`PARAM_AXES`), and `LOGICAL_AXIS_RULES` maps
them to mesh axes; a dimension the mesh axes do not divide stays replicated (one warning per
such dimension). Under a mesh the attention kernels run in `shard_map` with specs from the same
table (`ops.dispatch`); a function jitted on a mesh is traced under it (`traced_under`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
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
    # MoE experts (expert parallelism): each device of `tensor` holds E / |tensor| whole
    # experts; their own dims then stay unsplit over `tensor` (a mesh axis maps once per array).
    # The tokens go to them by all-to-all over these axes (`models.moe.experts_on_mesh`).
    ("expert", "tensor"),
    # Gated DeltaNet: key heads (each with its group of conv channels) and the value heads
    # they serve, split alike (`models.linear_attention`).
    ("linear_key_heads", "tensor"),
    ("linear_value_heads", "tensor"),
)

# param path (joined with "/") -> logical axes, first match wins; target and drafter alike.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|/)embed_tokens/embedding$", ("vocab", "embed")),
    (r"(^|/)lm_head/kernel$", ("embed", "vocab")),
    # MoE: stacked experts [E,D,F] / [E,F,D], the router [D,E], the shared expert's gate [D,1].
    (r"/experts/(gate|up)_proj$", ("expert", "embed", None)),
    (r"/experts/down_proj$", ("expert", None, "embed")),
    (r"/mlp/gate/kernel$", ("embed", None)),
    # gpt-oss: expert biases [E,F] / [E,D], the router [D,E] and its bias, attention biases
    # and sinks (per head).
    (r"/experts/(gate|up|down)_bias$", ("expert", None)),
    (r"/mlp/router/kernel$", ("embed", None)),
    (r"/mlp/router/bias$", (None,)),
    (r"/q_proj/bias$", ("heads", "head_dim")),
    (r"/[kv]_proj/bias$", ("kv_heads", "head_dim")),
    (r"/o_proj/bias$", (None,)),
    (r"/self_attn/sinks$", ("heads",)),
    (r"(^|/)layer_scalar$", (None,)),  # Gemma 4: each layer's output multiplier
    # Gemma 4: the MoE block's fused experts [E,D,2F], its router [D,E] and scales; the
    # per-layer inputs' table [V',L*P] and projections.
    (r"/experts/gate_up_proj$", ("expert", "embed", None)),
    (r"/experts/proj/kernel$", ("embed", None)),
    (r"/experts/(scale|per_expert_scale)$", (None,)),
    (r"(^|/)embed_tokens_per_layer/embedding$", ("vocab", None)),
    (r"(^|/)(per_layer_model_projection|per_layer_input_gate)/kernel$", ("embed", None)),
    (r"/per_layer_projection/kernel$", (None, "embed")),
    (r"(^|/)[a-z_]*norm_[12]/scale$", ("norm",)),
    (r"/shared_expert_gate/kernel$", ("embed", None)),
    # Gated DeltaNet (hybrid targets): model dim over fsdp, heads over tensor. in_proj_qkv and
    # conv1d [.., Hk, G] hold each key head's channels together; z [D,Hv,Dv], b/a [D,Hv].
    (r"/linear_attn/in_proj_qkv/kernel$", ("embed", "linear_key_heads", None)),
    (r"/linear_attn/in_proj_z/kernel$", ("embed", "linear_value_heads", None)),
    (r"/linear_attn/in_proj_[ab]/kernel$", ("embed", "linear_value_heads")),
    (r"/linear_attn/out_proj/kernel$", ("linear_value_heads", None, "embed")),
    (r"/linear_attn/conv1d/kernel$", (None, "linear_key_heads", None)),
    (r"/linear_attn/(dt_bias|A_log)$", ("linear_value_heads",)),
    # DSpark: the Markov head's token embedding [V,R] and bias projection [R,U] over the
    # vocabulary; its gate/recurrence and the confidence head (a few R-wide maps) replicated.
    (r"(^|/)markov_w1/embedding$", ("vocab", None)),
    (r"(^|/)markov_w2/kernel$", (None, "vocab")),
    (r"(^|/)(markov_head/(gate|joint)_proj|confidence_head/proj)/kernel$", (None, None)),
    (r"(^|/)(markov_head/(gate|joint)_proj|confidence_head/proj)/bias$", (None,)),
    (r"/q_proj/kernel$", ("embed", "heads", "head_dim")),
    (r"/[kv]_proj/kernel$", ("embed", "kv_heads", "head_dim")),
    (r"/o_proj/kernel$", ("heads", "head_dim", "embed")),
    (r"/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"/down_proj/kernel$", ("mlp", "embed")),
    (r"(^|/)fc/kernel$", ("taps_embed", "embed")),
    # DFlash2: the convolutions' taps and the candidate selector's codebooks and projection.
    (r"/base_kernel$", (None, None, "embed")),
    (r"/kernel_projection/kernel$", ("embed", None)),
    (r"(^|/)(predecessor|successor)_codebook/embedding$", ("vocab", None)),
    (r"(^|/)hidden_projection/kernel$", ("embed", None)),
    # A draft vocabulary's target ids (int32 [draft vocab]): every device maps every draft id.
    (r"^draft_to_target$", (None,)),
    # A corpus table (`io.corpus_table`): n-gram hashes, their continuations, the n's.
    (r"^corpus_ngrams/(keys|orders)$", (None,)),
    (r"^corpus_ngrams/next$", (None, None)),
    (r"(^|/)[a-z_]*norm/scale$", ("norm",)),
)

KV_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")
QUERY_AXES = ("batch", "length", "heads", "head_dim")  # attention queries and outputs [B,T,N,H]
# A linear-attention layer's carried state: conv [B,W,Hk,G], recurrent [B,Hv,Dk,Dv]; its conv
# channels [B,T,Hk,G] and per-value-head values [B,T,Hv,...] (`models.linear_attention`).
LINEAR_STATE_AXES = (
    ("batch", None, "linear_key_heads", None),
    ("batch", "linear_value_heads", None, None),
)
LINEAR_CHANNEL_AXES = ("batch", "length", "linear_key_heads", None)
LINEAR_VALUE_HEAD_AXES = ("batch", "length", "linear_value_heads")

_WARNED: set[tuple] = set()


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


# A quantized kernel's arrays (`ops.quant.QWeight`: the qvalue, its scales, Q4_1's offsets; a
# layer's `kernel` or gpt-oss's MXFP4 experts) are sharded as the kernel is; a scale's dims that
# the mesh axes do not divide stay replicated.
_QUANTIZED_LEAF = re.compile(
    r"(/kernel|/experts/(?:gate|up|down)_proj)/(q/(qvalue|scale|zero_point)|offset)$"
)


def _param_axes(name: str, shape) -> tuple[str, ...]:
    name = _QUANTIZED_LEAF.sub(r"\1", name)
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, name):
            if len(axes) != len(shape):
                raise ValueError(f"param {name} has shape {tuple(shape)} but its rule gives {axes}")
            return axes
    raise ValueError(f"param {name} (shape {tuple(shape)}) matches no sharding rule")


def param_logical_axes(params):
    """Same-structure pytree of logical-axis tuples; raises naming any param without a rule or
    whose rank does not match its rule."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _param_axes(_path_str(path), np.shape(leaf)), params
    )


def param_sharding(path: Sequence[str], shape, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedSharding of the one param at `path` (e.g. ("layers_0", "mlp", "up_proj", "kernel"))
    with `shape`: what `param_shardings` gives it in a whole tree."""
    return logical_sharding(_param_axes("/".join(path), shape), shape, mesh, rules)


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules=LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` with logical `axes`; dims the mesh axes do not
    divide are replicated (warned once per axis, size and mesh axes); a mesh axis used twice is
    an error. `mesh`: a Mesh or an AbstractMesh."""
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
        if ways > 1 and size % ways and size > 1:  # (a size-1 dim: a quantized kernel's scale)
            _warn_replicated(axis, size, mesh_axes, ways)
        spec.append(mesh_axes if ways > 1 and size % ways == 0 else None)
    return PartitionSpec(*spec)


def _warn_replicated(axis: str, size: int, mesh_axes: tuple[str, ...], ways: int) -> None:
    key = (axis, size, mesh_axes, ways)
    if key not in _WARNED:
        _WARNED.add(key)
        logging.warning(
            "sharding: %s of size %d is not divisible by mesh axes %s (%d ways): replicated, "
            "every device along them holds and computes all of it",
            axis, size, " x ".join(mesh_axes), ways,
        )  # fmt: skip


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
    """NamedSharding pytree for a KV cache whose buffers are [B,K,S,H]; a hybrid target's
    linear-layer states (`KVCache.state`) by `LINEAR_STATE_AXES`."""
    state = getattr(cache, "state", None)
    if state is not None:
        cache = cache.replace(state=None)
    out = jax.tree_util.tree_map(
        lambda buf: NamedSharding(mesh, logical_to_spec(KV_CACHE_AXES, buf.shape, mesh, rules)),
        cache,
    )
    if state is None:
        return out
    spec = lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules))
    layers = tuple(
        tuple(spec(axes, x) for axes, x in zip(LINEAR_STATE_AXES, s, strict=True)) for s in state
    )
    return out.replace(state=layers)


def batch_sharding(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> NamedSharding:
    """Shards the leading (batch) dim of token/length arrays over the batch mesh axes."""
    return NamedSharding(mesh, PartitionSpec(dict(rules)["batch"]))


def parse_mesh(spec: str) -> dict[str, int]:
    """ "data=2,tensor=4" -> {"data": 2, "tensor": 4}: mesh axes (of MESH_AXES) and their sizes;
    an axis left out has size 1, except `data`, which `make_mesh` fills with the devices left."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"mesh {spec!r}: expected axis=size pairs such as data=2,tensor=4")
        if name not in MESH_AXES:
            raise ValueError(f"mesh {spec!r}: unknown axis {name!r} (axes: {', '.join(MESH_AXES)})")
        if name in sizes:
            raise ValueError(f"mesh {spec!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh {spec!r}: {name}={value.strip()!r} is not a positive integer")
        sizes[name] = size
    return sizes


def mesh_from_spec(spec: str, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The mesh a `--mesh` flag or `config.mesh` describes ("" = none: one device, no sharding)
    over `devices` (default: all of every process's). With several processes a mesh over the
    default devices must use them all (each process runs its part)."""
    if not spec.strip():
        return None
    sizes = parse_mesh(spec)
    everyone = devices is None
    devices = list(jax.devices() if everyone else devices)
    fsdp, tensor = sizes.get("fsdp", 1), sizes.get("tensor", 1)
    data = sizes.get("data")
    if data is None:
        if len(devices) % (fsdp * tensor):
            raise ValueError(
                f"mesh {spec!r}: fsdp x tensor = {fsdp * tensor} does not divide the "
                f"{len(devices)} devices; give data= explicitly"
            )
        data = len(devices) // (fsdp * tensor)
    size = data * fsdp * tensor
    if size > len(devices):
        raise ValueError(
            f"mesh {spec!r} (data={data} x fsdp={fsdp} x tensor={tensor}) needs {size} devices, "
            f"{len(devices)} available"
        )
    if everyone and jax.process_count() > 1 and size != len(devices):
        raise ValueError(
            f"mesh {spec!r} has {size} devices but the {jax.process_count()} processes hold "
            f"{len(devices)}: a multi-process mesh must use them all"
        )
    return make_mesh(data, fsdp, tensor, devices)


def current_mesh() -> Mesh | None:
    """The mesh set by `with jax.set_mesh(mesh):`, or None."""
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def traced_under(mesh: Mesh, fn):
    """`fn`, traced with `mesh` as jax's abstract mesh: for a function jitted with in/out
    shardings on `mesh`, which alone tell the traced code no mesh. `ops.dispatch` reads it
    (`jax.sharding.get_abstract_mesh()`) to run the attention kernels in `shard_map`."""

    @functools.wraps(fn)
    def under(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return under


def jit_on_mesh(cache: dict, mesh: Mesh, fn, in_shardings, out_shardings, settings: dict, **kw):
    """`fn` (taking `mesh=` and the static `settings` as keywords) jitted for `mesh` with these
    in/out shardings and traced under the mesh (`traced_under`), kept in `cache` per mesh,
    shardings and settings: the one program a run on a mesh compiles for each input structure
    (the training step's, the held-out metric's). `kw`: jax.jit's other arguments."""
    leaves, treedef = jax.tree.flatten(in_shardings)
    key = (mesh, treedef, tuple(leaves), tuple(sorted(settings.items())))
    if key not in cache:
        # jit takes no keyword arguments beside in_shardings: the settings are bound here.
        cache[key] = jax.jit(
            functools.partial(traced_under(mesh, fn), **settings, mesh=mesh),
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            **kw,
        )
    return cache[key]


def program_mesh() -> jax.sharding.AbstractMesh | None:
    """The (abstract) mesh of the program being traced (`traced_under`, `jax.set_mesh`), or
    None: one device, inside `shard_map`, or a mesh without our axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if (
        mesh.empty
        or mesh.size == 1
        or mesh.manual_axes
        or not set(MESH_AXES) <= set(mesh.axis_names)
    ):
        return None
    return mesh


def constrain(x: jax.Array, axes: Sequence[str | None], rules=LOGICAL_AXIS_RULES) -> jax.Array:
    """x pinned to the split its logical `axes` give on the mesh of the program being traced
    (`traced_under`, `jax.set_mesh`), so GSPMD's propagation cannot choose another; x as it is
    without one (one device, inside `shard_map`, a mesh without our axes)."""
    mesh = program_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(axes, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def logical_sharding(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules=LOGICAL_AXIS_RULES
) -> NamedSharding:
    """NamedSharding of an array of `shape` whose dims have logical `axes`."""
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_shardings(tree, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedShardings for a pytree of batch-major arrays: the leading dim is `batch`, the rest
    (tokens, anchors, taps) stay whole; scalars are replicated."""
    return jax.tree.map(
        lambda x: logical_sharding(
            ("batch",) + (None,) * (np.ndim(x) - 1) if np.ndim(x) else (), np.shape(x), mesh, rules
        ),
        tree,
    )


def state_shardings(state, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedShardings for a train state (params, optimizer moments, counters): every array is
    placed like the param whose path ends its own path (`.../mu/layers_0/mlp/up_proj/kernel`);
    scalars (step, Adam's count) are replicated."""

    def one(path, leaf):
        if np.ndim(leaf) == 0:
            return replicated(mesh)
        name = _path_str(path)
        for pattern, axes in PARAM_AXES:
            if re.search(pattern, name) and len(axes) == np.ndim(leaf):
                return logical_sharding(axes, np.shape(leaf), mesh, rules)
        raise ValueError(f"state leaf {name} (shape {np.shape(leaf)}) matches no sharding rule")

    return jax.tree_util.tree_map_with_path(one, state)


def with_shardings(abstract, shardings):
    """ShapeDtypeStructs carrying `shardings`: what Orbax restores into (resharding on read)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


def put_host_array(shape, dtype, sharding: NamedSharding, read) -> jax.Array:
    """Places one array shard by shard. `read()` gives the whole array on the host, lazily (a
    memory-mapped or transposed view, read only where sliced); each device of this process gets
    its slice, cast to `dtype`. The full array never lands on one device."""
    source = []

    def shard(index):
        if not source:
            source.append(read())
            if tuple(np.shape(source[0])) != tuple(shape):
                raise ValueError(f"the source array has shape {np.shape(source[0])}, not {shape}")
        # A private copy (np.array copies): a device may alias host memory, and a memory-mapped
        # file replaced later would fault.
        return np.array(source[0][index], dtype=dtype)

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _put_leaf(x, sharding: NamedSharding):
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract (AOT lowering): just its sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if jax.process_count() == 1 or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = _put_leaf(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    elif jax.process_count() == 1:
        return jax.device_put(x, sharding)
    # Several processes: every one holds the whole host value and places its own slices.
    host = np.asarray(x)
    return put_host_array(host.shape, host.dtype, sharding, lambda: host)


def put(tree, shardings):
    """`tree` placed on `shardings` (same structure). Arrays already there are kept; host
    values are sliced per device (with several processes every process passes the same value);
    ShapeDtypeStructs get the sharding (for lowering ahead of time)."""
    return jax.tree.map(_put_leaf, tree, shardings)


def process_rows(mesh: Mesh, global_batch: int, rules=LOGICAL_AXIS_RULES) -> tuple[int, int]:
    """-> (index, count): this process feeds rows [index*n, (index+1)*n) of each global batch,
    n = global_batch // count (count = 1 when every process holds the whole batch)."""
    sharding = logical_sharding(("batch",), (global_batch,), mesh, rules)
    rows = {
        (i[0].start or 0, global_batch if i[0].stop is None else i[0].stop)
        for i in sharding.addressable_devices_indices_map((global_batch,)).values()
    }
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    n = stop - start
    if global_batch % n or start % n or sum(b - a for a, b in rows) < n:
        raise ValueError(
            f"this process's devices hold rows {sorted(rows)} of a batch of {global_batch}: "
            "not one contiguous block; order the mesh so each process holds whole batch rows"
        )
    return start // n, global_batch // n


def put_batch(batch, mesh: Mesh, global_batch: int, rules=LOGICAL_AXIS_RULES):
    """A batch pytree of this process's rows (see `process_rows`) as global arrays of
    `global_batch` rows, split over the batch mesh axes."""

    def one(x):
        x = np.asarray(x)
        shape = (global_batch, *x.shape[1:])
        sharding = logical_sharding(("batch",) + (None,) * (x.ndim - 1), shape, mesh, rules)
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(one, batch)
