"""The one place that picks an attention implementation. Model code passes the `attention_impl`
of its config (config.ATTENTION_IMPLS) and never names a kernel.

  "xla"     ops.attention: the reference that defines every mask.
  "pallas"  GPU: ops.pallas_gpu (Triton lowering) for drafting, training and the target.
            TPU (Mosaic):
              drafter, >= 128 queries (training)   ops.pallas_tpu.block_attention (fwd + bwd)
              drafter, < 128 queries (drafting)    ops.pallas_tpu_decode.block_attention
              target, verify and AR step           ops.pallas_tpu_decode.appended_attention
              target, < 128 queries (prefill)      ops.pallas_tpu_decode.causal_attention
              target, >= 128 queries (prefill)     xla (one log line): the decode kernel keeps
                                                   all queries in one row tile
            CPU: ops.pallas_gpu in interpret mode (slow; it is how the tests run the kernels).
  "auto"    pallas on GPU and TPU, xla on CPU.

A case the kernels lack (a head dim, a dtype; on a GPU fp32 at head dim 256, whose tiles
overflow a program's shared memory: `pallas_gpu.unfit`) refuses with ConfigError under "pallas"
and falls back to xla with one log line under "auto". Never silently.

Under a mesh (jax's abstract mesh while tracing: `sharding.traced_under`, or `jax.set_mesh`) every
kernel runs in `shard_map`, since GSPMD cannot partition a Mosaic or Triton call: batch over
`data`/`fsdp` and heads over `tensor`, with the specs `sharding.logical_to_spec` gives q
(QUERY_AXES), the keys (KV_CACHE_AXES) and the per-row bounds and masks (batch-major). A dim the
table leaves whole (a batch the batch axes do not divide, heads `tensor` does not divide) is
replicated there as everywhere else (and warned once, `sharding`). When `tensor` exceeds the KV
heads (a multiple of them: Qwen3-Coder-30B-A3B's 4 at tensor=8) the KV heads are replicated and
each device's query heads share one of them, which the device picks by its `tensor` index. The
one split a kernel cannot follow, a device's query heads spanning KV heads it lacks, refuses
like a missing case.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging

from dflash_jax import sharding
from dflash_jax.config import ConfigError, check_attention_impl
from dflash_jax.ops import attention as xla
from dflash_jax.ops import pallas_gpu, pallas_tpu, pallas_tpu_decode, platform
from dflash_jax.ops.invariance import RowRule

_LOGGED: set[str] = set()
# The `interpret` argument of the TPU decode kernels: False on a TPU. Tests that fake the "tpu"
# backend on CPU set it to pallas_tpu_decode.INTERPRET.
TPU_INTERPRET = False


def _backend() -> str:
    """The platform whose kernels are picked (`ops.platform`: what infer.lower lowers for)."""
    return platform.current()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.warning("%s", message)


def _kernel(impl: str, what: str, q: jax.Array, k: jax.Array, v: jax.Array) -> str:
    """-> "xla", "gpu", "interpret" or "tpu": what serves this call ("tpu": the caller picks
    the TPU kernel by shape, see `_tpu_decode`)."""
    check_attention_impl(impl)
    if impl == "xla":
        return "xla"
    backend = _backend()
    if backend not in ("tpu", "gpu", "cuda", "rocm") and impl == "auto":
        return "xla"
    reason = _unsplittable(q, k)
    if reason is not None:
        return _fall_back(impl, what, reason)
    if backend == "tpu":
        return "tpu"
    if backend not in ("gpu", "cuda", "rocm"):
        _log_once(f"attention_impl=pallas on {backend}: Pallas GPU kernels in interpret mode")
    reason = _unsupported(pallas_gpu, "Pallas GPU kernels", q, k, v)
    on_gpu = backend in ("gpu", "cuda", "rocm")
    if reason is None and on_gpu:  # interpret mode has no shared memory to run out of
        reason = pallas_gpu.unfit(q.shape[-1], q.dtype)
    if reason is not None:
        return _fall_back(impl, what, reason)
    return "gpu" if on_gpu else "interpret"


def _tpu_decode(impl: str, what: str, q: jax.Array, k: jax.Array, v: jax.Array) -> str:
    """-> "tpu" when the TPU decode kernels (ops.pallas_tpu_decode) take these inputs, else
    "xla" (or ConfigError under "pallas")."""
    reason = _unsupported(pallas_tpu_decode, "Pallas TPU decode kernels", q, k, v)
    return "tpu" if reason is None else _fall_back(impl, what, reason)


def _target_kernel(impl: str, q: jax.Array, k: jax.Array, v: jax.Array) -> str:
    """`_kernel` for the target's attention; on TPU the decode kernel serves fewer than
    MAX_QUERIES queries and xla the longer prefills (one log line)."""
    kernel = _kernel(impl, "target attention", q, k, v)
    if kernel != "tpu":
        return kernel
    if q.shape[1] < pallas_tpu_decode.MAX_QUERIES:
        return _tpu_decode(impl, "target attention", q, k, v)
    _log_once(
        f"attention_impl={impl} on tpu: the target attention over {pallas_tpu_decode.MAX_QUERIES}"
        " or more queries (prefill) uses xla (the TPU decode kernel holds all queries in one "
        "row tile)"
    )
    return "xla"


def _unsupported(kernels, name: str, q: jax.Array, k: jax.Array, v: jax.Array) -> str | None:
    """Why the kernels of module `kernels` (its HEAD_DIMS and DTYPES) cannot take these
    inputs, or None when they can (the query count is the caller's routing, not a refusal)."""
    head_dim, dtype = q.shape[-1], jnp.dtype(q.dtype).name
    if head_dim not in kernels.HEAD_DIMS:
        return f"head_dim={head_dim} (the {name} take {kernels.HEAD_DIMS})"
    if dtype not in kernels.DTYPES:
        return f"dtype {dtype} (the {name} take {kernels.DTYPES})"
    if not q.dtype == k.dtype == v.dtype:
        return f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    return None


def _mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh of the program being traced, or None (one device, or already per device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:
        return None
    return mesh


def _unsplittable(q: jax.Array, k: jax.Array) -> str | None:
    """Why the kernels cannot run on the traced program's mesh with these q [B,T,N,H] and
    keys [B,K,S,H], or None when they can (or there is no mesh). Query heads split over
    `tensor` while their K KV heads are not (tensor exceeds them) are fine when each device's
    query heads share one KV head (`_kv_head_choice`)."""
    mesh = _mesh()
    if mesh is None:
        return None
    if not set(sharding.MESH_AXES) <= set(mesh.axis_names):
        return f"a mesh with axes {mesh.axis_names} (the kernels split over {sharding.MESH_AXES})"
    heads = sharding.logical_to_spec(sharding.QUERY_AXES, q.shape, mesh)[2]
    kv_heads = sharding.logical_to_spec(sharding.KV_CACHE_AXES, k.shape, mesh)[1]
    if heads != kv_heads and _kv_head_choice(q, k, mesh) is None:
        ways = _ways(mesh, heads)
        return (
            f"{q.shape[2]} query heads split over tensor={ways} but {k.shape[1]} KV heads not, "
            f"and a device's {q.shape[2] // ways} query heads span several KV heads (a kernel "
            "keeps a query head's KV head on its device: tensor must divide the KV heads or be "
            "a multiple of them)"
        )
    return None


def _spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry (None, an axis name or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _ways(mesh, entry) -> int:
    """How many ways a PartitionSpec entry splits a dim."""
    return math.prod(mesh.shape[a] for a in _spec_axes(entry))


def _kv_head_choice(q: jax.Array, k: jax.Array, mesh) -> tuple[tuple, int, int] | None:
    """When q's heads are split over the mesh and the KV heads [B,K,S,H] are whole on every
    device (tensor exceeds K: the table replicates them), and each device's query heads
    belong to one KV head: (the split mesh axes, query heads per device, query heads per KV
    head); None otherwise. Each device then reads KV head (its index along those axes) x (its
    query heads) // (heads per KV head) of the replicated cache."""
    heads = sharding.logical_to_spec(sharding.QUERY_AXES, q.shape, mesh)[2]
    kv_heads = sharding.logical_to_spec(sharding.KV_CACHE_AXES, k.shape, mesh)[1]
    if heads is None or kv_heads is not None:
        return None
    local, group = q.shape[2] // _ways(mesh, heads), q.shape[2] // k.shape[1]
    return (_spec_axes(heads), local, group) if group % local == 0 else None


def _per_device(fn, *operands: tuple[jax.Array, tuple]) -> jax.Array:
    """fn(*arrays) -> [B,T,N,H] like the first array (q), on each device's part of the
    operands, given as (array, logical axes) pairs, under the traced program's mesh
    (`shard_map`); called as is without one. KV heads the table leaves whole while q's heads
    are split (`_kv_head_choice`) stay whole in the specs, and each device hands the kernel
    the one KV head its query heads read, picked by its index along the split axes."""
    arrays = tuple(x for x, _ in operands)
    mesh = _mesh()
    if mesh is None:
        return fn(*arrays)
    specs = tuple(sharding.logical_to_spec(axes, x.shape, mesh) for x, axes in operands)
    keys = [axes == sharding.KV_CACHE_AXES for _, axes in operands]
    choice = next(
        (_kv_head_choice(arrays[0], x, mesh) for x, k in zip(arrays, keys, strict=True) if k),
        None,
    )
    if choice is not None:
        axes, local, group = choice
        sizes = tuple(mesh.shape[a] for a in axes)
        fn = functools.partial(_on_own_kv_head, fn, keys, axes, sizes, local, group)
    # check_vma off: pallas_call does not declare how its outputs vary over the mesh axes.
    split = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
    return split(*arrays)


def _on_own_kv_head(fn, keys, axes: tuple, sizes: tuple, local: int, group: int, *arrays):
    """fn on one device's operands with each KV-head-major one ([B,K,S,H], `keys`) cut to the
    KV head of this device's `local` query heads (`group` query heads per KV head): a dynamic
    slice of the replicated cache, the one head the kernel reads."""
    index = 0
    for axis, size in zip(axes, sizes, strict=True):  # the device's index along them, row-major
        index = index * size + jax.lax.axis_index(axis)
    kv = index * local // group
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, kv, 1, axis=1)
    return fn(*(cut(x) if key else x for x, key in zip(arrays, keys, strict=True)))


def _rows(x: jax.Array) -> tuple[jax.Array, tuple]:
    """A batch-major operand (bounds [B,T], a mask [B,Q,K]) with its logical axes."""
    return x, ("batch",) + (None,) * (x.ndim - 1)


def _queries(x: jax.Array) -> tuple[jax.Array, tuple]:
    return x, sharding.QUERY_AXES


def _keys(x: jax.Array) -> tuple[jax.Array, tuple]:
    return x, sharding.KV_CACHE_AXES


def _fall_back(impl: str, what: str, reason: str) -> str:
    if impl == "pallas":
        raise ConfigError(f"attention_impl=pallas: no kernel for the {what} with {reason}")
    _log_once(f"attention_impl={impl}: {what} uses xla ({reason})")
    return "xla"


def block_attention(
    q: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    blk_k: jax.Array,
    blk_v: jax.Array,
    context_lengths: jax.Array,
    anchors: jax.Array,
    *,
    block_size: int,
    causal: bool = False,
    window: int | None = None,
    window_from_anchor: bool = False,
    sinks_and_window: tuple[int, int] = (0, 0),
    impl: str = "auto",
) -> jax.Array:
    """The drafter's attention under `drafter_mask` (training: N anchor blocks over the whole
    sequence; drafting: one block over the context cache).

    q [B,Q,N,H] (Q = blocks x block_size); ctx_k/ctx_v [B,K,S,H]; blk_k/blk_v [B,K,Q,H];
    context_lengths [B] (live context slots); anchors [B,N] (block n's slot j sits at position
    anchors + j and sees context slots < min(anchor, context_length)); `window` (measured from
    each query, or from the anchor: `window_from_anchor`, which leaves the block unwindowed).
    Drafting one block with a window reads only the window's slots of the cache
    (`window_slice`), so its cost does not grow with the context. `sinks_and_window` (sinks,
    W), W > 0, for a full-attention layer drafting one block: it sees only the first `sinks`
    context slots and the W before the anchor (`sink_window_slice`; not the drafter it was
    trained as, but the target verifies every draft). -> [B,Q,N,H].
    """
    single = anchors.shape[1] == 1
    sinks, bound = sinks_and_window
    if window is not None and single and ctx_k.shape[2] > window:
        ctx_k, ctx_v, context_lengths, anchors = window_slice(
            ctx_k, ctx_v, context_lengths, anchors, window
        )
    elif window is None and single and bound and ctx_k.shape[2] > sinks + bound:
        ctx_k, ctx_v, context_lengths, anchors = sink_window_slice(
            ctx_k, ctx_v, context_lengths, anchors, sinks, bound
        )
    blk_window = None if window_from_anchor else window
    bounds = lambda: xla.context_bounds(
        context_lengths, anchors, block_size, window, window_from_anchor
    )
    kernel = _kernel(impl, "drafter attention", q, ctx_k, ctx_v)
    if kernel == "tpu" and q.shape[1] >= pallas_tpu.MIN_QUERIES:
        reason = _unsupported(pallas_tpu, "Pallas TPU training kernels", q, ctx_k, ctx_v)
        kernel = "tpu" if reason is None else _fall_back(impl, "drafter attention", reason)
    if kernel == "tpu" and q.shape[1] >= pallas_tpu.MIN_QUERIES:
        lo, hi = bounds()
        opts = dict(block_size=block_size, causal=causal, window=blk_window)
        fn = functools.partial(pallas_tpu.block_attention, **opts, interpret=TPU_INTERPRET)
        keys = map(_keys, (ctx_k, ctx_v, blk_k, blk_v))
        return _per_device(fn, _queries(q), *keys, _rows(lo), _rows(hi))
    if kernel == "tpu":
        kernel = _tpu_decode(impl, "drafter attention", q, ctx_k, ctx_v)
    if kernel != "xla":
        lo, hi = bounds()
        opts = dict(block_size=block_size, causal=causal, window=blk_window)
        fn = _decode_kernel(kernel, "block_attention", **opts)
        keys = map(_keys, (ctx_k, ctx_v, blk_k, blk_v))
        return _per_device(fn, _queries(q), *keys, _rows(lo), _rows(hi))
    blk_mask = xla.block_mask(block_size, causal, blk_window)

    def over(k, v):
        ctx_mask = xla.context_mask(
            context_lengths, anchors, block_size, k.shape[2], window, window_from_anchor
        )
        return xla.block_attention(q, k, v, blk_k, blk_v, ctx_mask, blk_mask)

    if anchors.shape[1] > 1:
        # Training (many blocks per row over the whole sequence): no live window, whose
        # lax.switch would keep every width's temporaries (and their gradients) in the program.
        return over(ctx_k, ctx_v)
    return live_window(over, (ctx_k, ctx_v), jnp.max(context_lengths))


def window_slice(ctx_k, ctx_v, context_lengths, anchors, window: int):
    """One block per row drafted by a layer with a sliding window sees at most `window`
    context slots (`xla.context_bounds`: from anchor - window, or later): each row's `window`
    slots ending at its anchor, cut from the cache ([B,K,S,H] -> [B,K,window,H]), with the
    lengths and anchors moved by the same offset (the mask depends on differences of slots
    only; RoPE is already in the keys). -> (ctx_k, ctx_v, context_lengths, anchors)."""
    s = ctx_k.shape[2]
    start_b = jnp.clip(anchors[:, 0] - window, 0, s - window)
    cut = jax.vmap(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, window, axis=1))
    lengths = jnp.clip(context_lengths - start_b, 0, window)
    return cut(ctx_k, start_b), cut(ctx_v, start_b), lengths, anchors - start_b[:, None]


def sink_window_slice(ctx_k, ctx_v, context_lengths, anchors, sinks: int, window: int):
    """The keys a full-attention layer drafting one block per row sees under a bounded draft
    context: context slots [0, sinks) and the `window` slots before the anchor, laid side by
    side ([B,K,S,H] -> [B,K,sinks + window,H]), with lengths and anchors such that the visible
    part is a prefix (the window starts at the anchor - window, or at `sinks` when that is
    later, so no slot is taken twice). -> (ctx_k, ctx_v, context_lengths, anchors)."""
    s = ctx_k.shape[2]
    hi_b = jnp.minimum(anchors[:, 0], context_lengths)
    start_b = jnp.clip(anchors[:, 0] - window, sinks, s - window)
    cut = jax.vmap(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, window, axis=1))
    join = lambda x: jnp.concatenate([x[:, :, :sinks], cut(x, start_b)], axis=2)
    live_b = jnp.minimum(hi_b, sinks) + jnp.clip(hi_b - start_b, 0, window)
    return join(ctx_k), join(ctx_v), live_b, live_b[:, None]


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets: jax.Array,
    *,
    impl: str = "auto",
    rows: RowRule | None = None,
    **mods,
) -> jax.Array:
    """The target's attention: query t of row b sees key slots s <= offsets[b] + t
    (`causal_cache_mask`; offsets = the cache lengths, or zeros for a pass without a cache).
    rows: the target's row rule (`ops.invariance`), under which xla is batch-invariant.
    mods: `attention.append_attention`'s window / scale / softcap / sinks (`target_mods`),
    which only xla takes (`_mods_kernel`); k/v then hold the T new tokens only.

    q [B,T,N,H]; k/v [B,K,S,H]; offsets [B] int32. -> [B,T,N,H].
    """
    if mods:  # the sliding-window families' attention: the xla reference only
        _mods_kernel(impl, q, k, v, rows)
        return xla.append_attention(q, None, None, k, v, offsets, **mods)
    kernel = _target_kernel(impl, q, k, v)
    if kernel != "xla":
        hi = xla.causal_cache_bounds(offsets, q.shape[1])
        fn = _decode_kernel(kernel, "causal_attention")
        return _per_device(fn, _queries(q), _keys(k), _keys(v), _rows(hi))
    if rows is not None:  # a pass over the given tokens alone (offsets: zeros)
        return xla.tiled_attention(q, None, (k, v), offsets, rows)
    return xla.attention(q, k, v, xla.causal_cache_mask(offsets, q.shape[1], k.shape[2]))


def cached_attention(
    q: jax.Array,
    old_cache: tuple[jax.Array, jax.Array],
    new_cache: tuple[jax.Array, jax.Array] | None,
    new_kv: tuple[jax.Array, jax.Array],
    cache_lengths: jax.Array,
    *,
    impl: str = "auto",
    rows: RowRule | None = None,
    tree_mask: jax.Array | None = None,
    **mods,
) -> jax.Array:
    """The target's attention for T new tokens appended to a KV cache at cache_lengths[b]:
    query t sees the cache slots before cache_lengths[b] and the new tokens up to itself
    (with tree_mask [B,T,T], `attention.tree_attention_mask`: the new tokens it marks, its
    ancestors in a token tree; the kernels take it as ancestor bits, up to `MAX_TREE` tokens).

    q [B,T,N,H]; old_cache / new_cache: (k, v) [B,K,S,H] before and after the write (None: not
    written yet, see `Transformer.hidden(defer_cache_write=True)`); new_kv: the new tokens'
    (k, v) [B,K,T,H]; cache_lengths [B]. -> [B,T,N,H].

    XLA scores the old cache and the new block apart (`append_attention`, one joint softmax),
    over the live part of the cache only (`live_window`): the written cache then has a single
    reader, the loop carry, and is updated in place. Scoring the written cache instead made
    XLA:CPU duplicate the write into both readers, each on its own copy of the whole buffer
    (four cache copies per layer per step at batch 1). The kernels, too, take the old cache and
    the new rows as separate operands (`appended_attention`: bitwise their result on the
    written cache), so that the cache is written once, by the caller, now (new_cache) or after
    acceptance: a cache written here for the kernels while the caller still held the old one
    for its deferred write made XLA copy every layer's whole cache every step. A prefill chunk
    on XLA (`prefill_blocked`) scores the old cache in key blocks instead (`blocked_append_
    attention`): its scores are chunk x block, not chunk x cache.
    """
    if mods:  # the sliding-window families' attention (see `causal_attention`)
        _mods_kernel(impl, q, *old_cache, rows)
        if tree_mask is not None:
            raise ConfigError(
                "token-tree verification of a target with sliding-window / sink attention is "
                "not implemented; use tree_nodes=0"
            )
        if prefill_blocked(q, old_cache[0]):  # a prefill chunk: scores chunk x key block
            return xla.blocked_append_attention(q, *old_cache, *new_kv, cache_lengths, **mods)
        return live_window(
            lambda k, v: xla.append_attention(q, k, v, *new_kv, cache_lengths, **mods),
            old_cache,
            jnp.max(cache_lengths),
        )
    kernel = _target_kernel(impl, q, old_cache[0], old_cache[1])
    if kernel != "xla" and tree_mask is not None:
        if rows is not None:  # the AR step and chains run the kernel: a tree's bits would differ
            raise ConfigError(
                f"a token tree under batch invariance with attention_impl={impl}: the AR step "
                f"runs the {kernel} attention kernel, whose tree verify reads a node's "
                "ancestors where the tree holds them (not at the depths the AR step does), so "
                "its logits would not be the AR step's bits and greedy output could differ "
                "from the target's; use --attention_impl=xla, --nobatch_invariant (not bitwise "
                "lossless), or --tree_nodes=0"
            )
        if tree_mask.shape[-1] > xla.MAX_TREE:
            kernel = _fall_back(
                impl, "target attention", f"a tree of more than {xla.MAX_TREE} tokens"
            )
    if kernel != "xla":
        fn = _decode_kernel(kernel, "appended_attention")
        keys = map(_keys, (*old_cache, *new_kv))
        if tree_mask is None:
            return _per_device(fn, _queries(q), *keys, _rows(cache_lengths))
        return _per_device(fn, _queries(q), *keys, _rows(cache_lengths), _rows(tree_mask))
    if rows is not None:
        return xla.tiled_attention(q, old_cache, new_kv, cache_lengths, rows, tree_mask=tree_mask)
    if prefill_blocked(q, old_cache[0]) and tree_mask is None:
        return xla.blocked_append_attention(q, *old_cache, *new_kv, cache_lengths)
    return live_window(
        lambda k, v: xla.append_attention(q, k, v, new_kv[0], new_kv[1], cache_lengths, tree_mask),
        old_cache,
        jnp.max(cache_lengths),
    )


# A chunk of a prefill (`decoding.phases.prompt_pass`): as many queries as the TPU decode kernel
# refuses, more than a verify or a token tree holds.
PREFILL_QUERIES = pallas_tpu_decode.MAX_QUERIES


def prefill_blocked(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether XLA scores T queries q [B,T,N,H] over the cache [B,K,S,H] in key blocks
    (`attention.blocked_append_attention`): a prefill chunk over a cache longer than a block, so
    its scores stay T x block, not T x S, whatever the prompt (a verify keeps `live_window`)."""
    return q.shape[1] >= PREFILL_QUERIES and k_cache.shape[2] > xla.PREFILL_KEY_BLOCK


def target_mods(window=None, scale=None, softcap=None, sinks=None) -> dict:
    """The options of a target attention beyond the causal mask (`append_attention`), the
    unset ones left out: {} for the Llama / Qwen families."""
    mods = dict(window=window, scale=scale, softcap=softcap, sinks=sinks)
    return {k: v for k, v in mods.items() if v is not None}


def _mods_kernel(impl: str, q, k, v, rows) -> None:
    """The kernels take no sliding window, sinks, softcap or other scale: under "pallas" a
    ConfigError, under "auto" on a GPU/TPU one log line, then xla."""
    if rows is not None:
        raise ConfigError(
            "batch-invariant passes (a row rule) are not built for sliding-window / sink "
            "attention; run with --nobatch_invariant"
        )
    if _kernel(impl, "target attention", q, k, v) != "xla":
        _fall_back(impl, "target attention", "a sliding window, sinks, softcap or scale")


def _decode_kernel(kernel: str, name: str, **opts):
    """Kernel `name` (block_attention, causal_attention, appended_attention) of the TPU decode
    kernels (kernel "tpu") or the GPU ones ("gpu", "interpret"), its options bound."""
    if kernel == "tpu":
        return functools.partial(getattr(pallas_tpu_decode, name), **opts, interpret=TPU_INTERPRET)
    return functools.partial(getattr(pallas_gpu, name), **opts, interpret=kernel == "interpret")


def live_window(fn, cache, live, min_window: int = 64, max_windows: int = 8):
    """fn(k, v) on the cache cut to the smallest of a few static widths covering the `live`
    slots ([B,K,S,H] -> [B,K,W,H], W a multiple of max(min_window, S / max_windows)): the
    attention then scores the slots in use instead of the whole buffer. One `lax.switch`
    branch per width; a single width when the cache is small."""
    s = cache[0].shape[2]
    step = max(min_window, -(-s // max_windows))
    widths = [w for w in range(step, s, step)] + [s]
    if len(widths) == 1:
        return fn(*cache)
    # The first width >= live; a count, not jnp.searchsorted (a while loop on XLA:CPU).
    index = jnp.sum(jnp.asarray(widths[:-1]) < live)
    branches = [lambda k, v, w=w: fn(k[:, :, :w], v[:, :, :w]) for w in widths]
    return jax.lax.switch(index, branches, *cache)
