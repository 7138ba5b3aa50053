"""The one dot policy: every matrix product of the target, the drafter, the head and the XLA
attention references takes its inputs in the compute dtype, accumulates in fp32
(`preferred_element_type=jnp.float32`) and is cast once to its output dtype (the inputs' by
default), as MaxText and jax-llm-examples do. In fp32 nothing changes: the product is the plain
one. Flax layers take `dot_general` (as `Dense(..., dot_general=dots.dot_general)`); the row
rules of `ops.invariance` keep to the same policy (`isolated_gemm`).

Why (XLA:CPU, jaxlib 0.10.2, an AMD EPYC with avx512_bf16, 2026-12-03): a bf16 x bf16 -> bf16
dot is rewritten by XLA:CPU into an fp32 dot of widened operands (a `convert` of the activation
and of the weight: hoisted out of a simple loop, but run at every step inside the adaptive
decode's `lax.switch` branches), so the bf16 units never run; with an fp32 product the dot stays
bf16 x bf16 and runs as one YNNPACK bf16 GEMM. 210 SmolLM2-shaped products (30 layers) at 4 rows
in one jit: 176 ms against 30 ms. One row is the exception (`pads_one_row`). The issue measured
the plain form's adaptive decode at 0.6 tok/s. `tests/test_dot_policy.py` checks the compiled
decode programs; docs/results.md has the measurements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops import platform, quant


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`jax.lax.dot_general` accumulating in fp32, the result cast once to
    `preferred_element_type` (None: the inputs' promoted dtype). A drop-in `dot_general` for
    flax's Dense / DenseGeneral. A Dense-form bf16 product of one row on a CPU runs as two rows
    (the second zero, sliced off): see `pads_one_row`. A quantized rhs (`ops.quant.QWeight`)
    is dequantized to the lhs's dtype first."""
    rhs = quant.weight(rhs, lhs.dtype)
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    if pads_one_row(lhs, rhs, dimension_numbers):
        (lc, _), _ = dimension_numbers
        lead = lhs.shape[: lhs.ndim - len(lc)]
        x = lhs.reshape(1, *lhs.shape[lhs.ndim - len(lc) :])
        x = jnp.concatenate([x, jnp.zeros_like(x)], 0)
        dims = ((tuple(range(1, x.ndim)), dimension_numbers[0][1]), ((), ()))
        acc = jax.lax.dot_general(x, rhs, dims, precision, preferred_element_type=jnp.float32)
        return acc[:1].astype(out_dtype).reshape(*lead, *acc.shape[1:])
    acc = jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type=jnp.float32
    )
    return acc.astype(out_dtype)


def pads_one_row(lhs, rhs, dimension_numbers) -> bool:
    """Whether `dot_general` runs this product as two rows: a bf16 lhs of one row (its
    non-contracting dims multiply to 1) against a bf16 weight, with no batch dims and the lhs's
    trailing dims contracted (a Dense layer, a head), on a CPU. XLA:CPU widens both
    operands of a one-row bf16 dot to fp32 (no bf16 GEMM kernel takes M = 1), and the weight's
    widening runs at every call where it cannot be hoisted out of the loop (a `lax.switch`
    branch of the adaptive decode): 30 SmolLM2 layers per step, 2026-12-03, an AMD EPYC with
    avx512_bf16, best of 5 interleaved: 50.5 ms in a loop, 74.8 ms in a switch; as two rows
    32.8 and 25.8 ms (fp32: 19.1 and 27.2 ms). Two rows are also what a batch-invariant step
    pads one row to (the row rule's minimum here), so the plain path is never slower."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb or not platform.is_cpu():
        return False
    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16:
        return False
    nc = len(lc)
    trailing = tuple(lc) == tuple(range(lhs.ndim - nc, lhs.ndim))
    return trailing and lhs.size == int(np.prod(lhs.shape[lhs.ndim - nc :]))


def einsum(spec: str, a, b, out_dtype=None, precision=None):
    """`jnp.einsum(spec, a, b)` accumulating in fp32, cast once to `out_dtype` (None: the
    inputs' promoted dtype)."""
    out_dtype = out_dtype or jnp.result_type(a, b)
    acc = jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)
    return acc.astype(out_dtype)


def matmul(x, w, out_dtype=None):
    """x [..., K] @ w [K, N] -> [..., N] under the policy."""
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), None, out_dtype)


def matmul_t(x, w_nk, out_dtype=None):
    """x [..., K] @ w_nk.T -> [..., N] under the policy, contracting a weight stored [N, K] (a
    tied head's embedding) as stored."""
    return dot_general(x, w_nk, (((x.ndim - 1,), (1,)), ((), ())), None, out_dtype)


def ragged_dot(lhs, rhs, group_sizes, out_dtype=None):
    """`jax.lax.ragged_dot` under the policy (the MoE experts' grouped matmuls)."""
    out_dtype = out_dtype or jnp.result_type(lhs, rhs)
    acc = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return acc.astype(out_dtype)
