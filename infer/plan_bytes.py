"""The byte arithmetic of `infer.memory_plan`, without its flags (tests and other tools import
it in a process that already defines theirs): per-device bytes of sharded abstract trees at each
dtype's bits per value, quantized kernels and their float copies, and where a plan books them."""

from __future__ import annotations

import math

CPU_ONLY = "of which float weight copies (CPU only)"
# The row rule's dequantized kernels: held by every platform's program (`held_copies_row`).
EVERYWHERE = "of which float weight copies (every platform)"


def shard_shape(sharding, shape: tuple) -> tuple:
    """The largest shard's shape of an array of `shape` placed by `sharding` (None: unplaced,
    as on one device: the whole)."""
    return shape if sharding is None else sharding.shard_shape(shape)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard), each
    array at its dtype's bits per value: sub-byte types (int4, float4_e2m1fn) pack two values
    a byte, as XLA holds them (its memory_analysis, tests/test_memory_plan.py), where numpy's
    itemsize says one byte."""
    import jax

    return sum(
        -(-math.prod(shard_shape(x.sharding, x.shape)) * jax.dtypes.itemsize_bits(x.dtype) // 8)
        for x in jax.tree.leaves(tree)
    )


def _quantized_leaves(tree) -> list:
    import jax

    from dflash_jax.ops.quant import QWeight

    is_q = lambda x: isinstance(x, QWeight)
    return [x for x in jax.tree.leaves(tree, is_leaf=is_q) if is_q(x)]


def dequantized_bytes(tree, dtype: str) -> int:
    """Bytes one device would hold of the quantized kernels of `tree` dequantized to `dtype`."""
    import jax.numpy as jnp

    itemsize = jnp.dtype(dtype).itemsize
    return sum(
        math.prod(shard_shape(w.q.qvalue.sharding, w.shape)) * itemsize
        for w in _quantized_leaves(tree)
    )


def expert_kernel_bytes(tree, dtype: str, quantized: bool = True) -> int:
    """Bytes one device holds of the MoE expert kernels of `tree` ([E, in, out] leaves under an
    `experts` key; quantized ones at `dtype`, dequantized): XLA:CPU's `ragged_dot` holds a copy
    of every kernel it takes, all at once, inside a loop or not (4 bf16 [32, 512, 512]
    kernels, 64 MiB: 67 MiB of temporaries, 2026-12-07), which a grouped matmul on an
    accelerator reads in place (not verified on one): the CPU-only line. quantized=False:
    float kernels only."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.ops.quant import QWeight

    is_q = lambda x: isinstance(x, QWeight)
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_q):
        if not any(getattr(k, "key", None) == "experts" for k in path) or len(leaf.shape) != 3:
            continue
        if is_q(leaf) and not quantized:  # booked with the other dequantized kernels
            continue
        if is_q(leaf):
            shape = shard_shape(leaf.q.qvalue.sharding, leaf.shape)
            total += math.prod(shape) * jnp.dtype(dtype).itemsize
        else:
            total += per_device_bytes(leaf)
    return total


def held_copies_row(invariant_rows) -> str:
    """Where a quantized target's float kernel copies go in a decode's plan: a program under a
    row rule (`invariant_rows` not None) holds them on every platform: `ops.invariance` puts
    an optimization barrier on each dequantized kernel (every GEMM tile meets one materialised
    [K, N] float array, so no program fuses the dequantization into its GEMM and another not),
    and a barrier is a buffer on every backend. XLA:CPU also hoists each one out of the decode
    loop, so the plan books them all (what its temporaries hold: tests/test_memory_plan.py); an
    accelerator holds at least the largest at a time, and all if its compiler hoists them too.
    Without a rule the dot takes the dequantization as an operand: XLA:CPU still hoists a copy
    of every kernel out of the loop (Qwen3-8B int8, bf16, 8K: 12.9 GiB more temporaries than
    the bf16 target's, its kernels' bf16 size; SmolLM2 int8, fp32: +0.40 GiB); an accelerator
    that fuses the dequantization into the dot (as Qwix relies on) holds none: not verified on
    one yet, so they are the CPU-only line."""
    return CPU_ONLY if invariant_rows is None else EVERYWHERE
