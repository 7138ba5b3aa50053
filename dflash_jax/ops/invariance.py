"""Batch-invariant target passes: every pass computes a position's result bitwise the same,
whether the position sits in a 1-token AR step, a 16-token verify, a prefill or a batch.

Why it is needed. XLA compiles each op for its whole shape, and the code it picks can sum in
another order. A GEMM library picks its kernel from the row count M: XLA:CPU runs M = 1
through its own matrix-vector loop and M >= 2 through YNNPACK, which switches kernels again
at larger M (measured on an AMD EPYC without AVX-512, fp32, SmolLM2's shapes: rows are bitwise
equal for M in [2, 32], then in [33, 63], then from 64 on; with Eigen: from 8 on; an Intel
Xeon with AMX: M >= 2 in fp32, M >= 4 in bf16). Reductions too: the same RMSNorm over [4, 576]
and over [8, 576], or the same softmax over [1,3,12,64] and [1,3,24,64], round apart. So a
position's logits in an AR step and in a verify differ in the last bits, and in bf16 that
flips argmaxes: speculative output stops being the target's own.

The rules. (1) Matmuls (`RowRule`) run at one fixed row tile, `ROW_TILE` rows unless a run
sets another (`DecodeConfig.row_tile`): fewer rows are padded up to the tile (zero rows,
sliced off after), more are cut into tiles of exactly that many rows that run one after
another (`lax.map`, so XLA cannot merge them back into one GEMM of another shape). Every
GEMM of every pass is then the same compiled [tile, K] @ [K, N] program, whatever the pass,
so a row's bits cannot depend on how many rows share it: by construction, not by a probe of
which row counts a machine's kernels happen to treat alike. What it still rests on is that
one GEMM call gives a row the same bits whatever the other rows are and wherever the row
sits in it; tests/test_batch_invariance.py checks that at SmolLM2's shapes, in fp32 and bf16
(`test_within_one_gemm_call_a_row_gets_its_own_bits`), on every machine CI runs.
Each such matmul runs as an op of its own (`isolated_gemm`: barriers around it, an fp32
product rounded after it), because what XLA fuses into a GEMM, and where it rounds, otherwise
depends on the program around it; a tied head contracts the embedding as stored
(`transposed_matmul`), never through a `.T` that is a copy in one program and a layout in
another.
(2) Reductions run at one fixed shape: the norms in row tiles of exactly `RowRule.tile` rows
(the rule's tile, at most `REDUCTION_TILE`, `fixed_rows`), the attention in fixed (query tile
x key tile) blocks (`ops.attention.tiled_attention`). Whatever the pass, every number comes
out of the same compiled shapes in the same order. The tests (tests/test_batch_invariance.py)
check it bitwise for every pass kind, in fp32 and bf16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops import dots, quant

# The row tile every GEMM of a batch-invariant pass runs at, unless the run sets another
# (`DecodeConfig.row_tile`). It holds a stream's verify of 16 (or a tree of 32) in one tile,
# and on the CPUs measured a one-row AR step padded to it costs what the step padded to 2-3
# rows did: bf16 SmolLM2, the 210 products of one pass on an Intel Xeon with AMX
# (2026-12-04): 31 ms a pass at 1 row padded to 16 or 32, 37 at 64, 48 at 128 (unpadded: 48,
# the matrix-vector loop). A wider tile pays for every narrow pass; a narrower one runs a wide
# pass as several tiles, one after another (128 rows as 4 tiles of 32: 147 ms against 55 as
# one of 128), so a run whose passes are all wide (a batched acceptance run, `row_tile_for`)
# sets a wider one, and a server the rows of its plain step (`served_row_tile`).
ROW_TILE = 32
# The widest tile a run picks by itself for its passes (`row_tile_for`).
MAX_ROW_TILE = 128
# The most rows a norm's or an attention query tile's fixed shape holds. Any fixed shape keeps
# them invariant; a small one pads a one-row AR step less. Against 128 (bf16 SmolLM2, an Intel
# Xeon with AMX, 2026-12-04): the AR step 37.3-38.0 ms against 42.9-44.3, a 256-token default
# DFlash decode 3.28-3.40 s against 3.53-3.87 s, the same tokens in the same steps.
REDUCTION_TILE = 32


def row_tile_for(rows: int) -> int:
    """The row tile for a run whose passes are about `rows` rows wide (a batch's rows x their
    widest verify): the power of two that holds them, from `ROW_TILE` up to `MAX_ROW_TILE`,
    so the widest pass runs as one tile."""
    tile = ROW_TILE
    while tile < rows and tile < MAX_ROW_TILE:
        tile *= 2
    return tile


def prefill_rows(rows: tuple[int, int] | None, width: int) -> tuple[int, int] | None:
    """The row rule a prefill of a `width`-token prompt buffer runs under, given the decode's
    `rows` (`TargetConfig.invariant_rows`): the decode's tile widened to the buffer, up to
    `MAX_ROW_TILE` (never narrowed). A prefill's bits need only be the same in every decode of
    the same prompt, the target alone's and DFlash's (both run this one prefill, so they start
    from the same cache and first token); its tile need not be the steps'. A small step tile
    (`api.choose_decode`: 4 on some CPUs) would otherwise cut a 5k-token prefill into ~2,000
    tiles run one after another, each reading every weight."""
    if rows is None:
        return None
    tile = max(rows[1], min(width, MAX_ROW_TILE))
    return (tile, tile)


def served_row_tile(slots: int) -> int:
    """The row tile of a server with `slots` rows (`infer.serve`): with 8 or more, its slots
    (the plain step over every slot, the step a busy server runs most: 465 of 509 at 8 slots
    in `serve_load`, docs/results.md), which then runs as one tile; with fewer, `ROW_TILE`,
    since a server of a few slots drafts as a stream does. Measured at 8 slots (SmolLM2, an
    Intel Xeon with AMX, 2026-12-04, ms per served step, plain / block 4 / block 16): fp32 at
    a tile of 8 58.8 / 166 / 505, of 32 86.6 / 103 / 360; bf16 51.7 / 123 / 368 and 62.5 / 76 /
    214."""
    return slots if slots >= 8 else ROW_TILE


@dataclasses.dataclass(frozen=True)
class RowRule:
    """The row counts every GEMM of a pass runs at: [min_rows, max_rows] (max_rows 0: no upper
    bound). The runs use one fixed tile (`RowRule.fixed`: min = max); a wider range is what
    the tests use for their controls. Hashable: it is part of the static `TargetConfig`."""

    min_rows: int = 1
    max_rows: int = 0

    def __post_init__(self):
        if self.min_rows < 1 or (self.max_rows and self.max_rows < self.min_rows):
            raise ValueError(f"bad row rule [{self.min_rows}, {self.max_rows or 'inf'}]")

    @classmethod
    def fixed(cls, tile: int) -> RowRule:
        """Every GEMM at exactly `tile` rows."""
        return cls(tile, tile)

    @property
    def tile(self) -> int:
        """The row tile of the reductions that run at one fixed shape (`fixed_rows`) and of the
        attention's query tiles (`query_tile`): the rule's tile, at most `REDUCTION_TILE`."""
        return min(self.max_rows or max(self.min_rows, REDUCTION_TILE), REDUCTION_TILE)

    def rows_matmul(self, x_md: jax.Array, fn) -> jax.Array:
        """fn(x [M', D]) -> [M', N] applied to x [M, D] with every call's M' inside the rule.
        fn must treat rows independently (a matmul, a row-wise GEMM + reduction)."""
        m = x_md.shape[0]
        if m < self.min_rows:
            pad = jnp.zeros((self.min_rows - m, *x_md.shape[1:]), x_md.dtype)
            return fn(jnp.concatenate([x_md, pad], 0))[:m]
        if not self.max_rows or m <= self.max_rows:
            return fn(x_md)
        r = self.max_rows
        tiles = -(-m // r)
        pad = jnp.zeros((tiles * r - m, *x_md.shape[1:]), x_md.dtype)
        x_crd = jnp.concatenate([x_md, pad], 0).reshape(tiles, r, *x_md.shape[1:])
        out_cr = jax.lax.map(fn, x_crd)
        return out_cr.reshape(tiles * r, *out_cr.shape[2:])[:m]

    def query_tile(self, group: int) -> int:
        """Queries per attention tile for `group` query heads per kv head: the tile's matmuls
        hold group x queries rows, as many as `tile` allows (at least `min_rows`)."""
        return max(-(-self.min_rows // group), self.tile // group, 1)


NO_RULE = RowRule()


def fixed_rows(x_md: jax.Array, fn, rows: int) -> jax.Array:
    """fn(x [rows, D]) -> [rows, ...] applied to x [M, D] in tiles of exactly `rows` rows (zero
    rows pad the last; one tile is called directly, several through `lax.map`): every row goes
    through one compiled shape, for the reductions whose code XLA picks by the whole shape."""
    m = x_md.shape[0]
    tiles = -(-m // rows)
    # Barriers on both sides, as in `isolated_gemm`: fn runs as written whether one tile is
    # called directly or several through `lax.map`, never fused with a producer or consumer
    # that differs between programs (where the excess-precision rewrite could drop a rounding).
    x_md = jax.lax.optimization_barrier(x_md)
    x_md = jnp.pad(x_md, ((0, tiles * rows - m),) + ((0, 0),) * (x_md.ndim - 1))
    if tiles == 1:
        return jax.lax.optimization_barrier(fn(x_md))[:m]
    out = jax.lax.map(fn, x_md.reshape(tiles, rows, *x_md.shape[1:]))
    return jax.lax.optimization_barrier(out).reshape(tiles * rows, *out.shape[2:])[:m]


def dot_general(rule: RowRule | None):
    """A `dot_general` for flax's Dense/DenseGeneral that runs under `rule` (None: as XLA
    picks, under the dot policy of `ops.dots`: fp32 accumulation, one cast). Contracts the
    lhs's trailing dims with the rhs's leading dims (what Dense does)."""
    if rule is None or rule == NO_RULE:
        return dots.dot_general
    return functools.partial(_rule_dot_general, rule)


def _rule_dot_general(rule, lhs, rhs, dimension_numbers, precision=None, **kwargs):
    # A quantized weight enters the isolated GEMMs dequantized (an elementwise op of the weight
    # alone, so every row still meets the same float GEMM).
    rhs = quant.weight(rhs, lhs.dtype)
    (lc, rc), (lb, rb) = dimension_numbers
    nc = len(lc)
    trailing = tuple(lc) == tuple(range(lhs.ndim - nc, lhs.ndim)) and tuple(rc) == tuple(range(nc))
    if lb or rb or not trailing:
        raise NotImplementedError(f"row rule for dot_general {dimension_numbers}: not a Dense")
    lead, contract = lhs.shape[: lhs.ndim - nc], lhs.shape[lhs.ndim - nc :]
    k = int(np.prod(contract))
    out_dims = rhs.shape[nc:]
    # A barrier: the weight reaches every call as one materialised [K, N] array. Otherwise XLA
    # may fold a transpose (a tied head's embedding.T) into the GEMM in one program and not in
    # another (inside `lax.map`), and the two kernels round apart.
    rhs_kn = jax.lax.optimization_barrier(rhs.reshape(k, -1))
    x_mk = lhs.reshape(-1, k)
    out_dtype = kwargs.pop("preferred_element_type", None) or jnp.result_type(lhs, rhs)
    out = rule.rows_matmul(x_mk, lambda x: isolated_gemm(x, rhs_kn, out_dtype, precision))
    return out.reshape(*lead, *out_dims)


def transposed_matmul(rule: RowRule, x: jax.Array, w_nk: jax.Array) -> jax.Array:
    """x [..., K] @ w_nk.T under `rule` -> [..., N] in x's dtype, for a weight stored [N, K]
    (a tied head: the embedding). The contraction names w's dim 1 itself: a transpose in the
    program (`w.T`) may be a copy in one program (a value captured by a loop) and a layout
    bitcast in another, and the two GEMM kernels round apart (measured for the tied SmolLM2
    head: a prefill's `lax.map` tiles and a verify's direct call disagreed)."""
    *lead, k = x.shape
    w_nk = jax.lax.optimization_barrier(w_nk.astype(x.dtype))
    fn = lambda x_mk: isolated_gemm(x_mk, w_nk, x.dtype, transposed=True)
    return rule.rows_matmul(x.reshape(-1, k), fn).reshape(*lead, w_nk.shape[0])


def isolated_gemm(x_mk, w, out_dtype, precision=None, transposed=False) -> jax.Array:
    """x [M, K] @ w [K, N] (transposed: w [N, K], contracted on its dim 1) as an op of its own:
    materialised input, fp32 product, rounded to `out_dtype` after another barrier. This is
    what every tile of the row rule runs (and what the tests check row by row).

    Why each part (measured on an AMD EPYC, XLA:CPU, bf16, when the rule was a range of row
    counts probed per machine; the parts keep the op the same in every program):
    - The input barrier: XLA fuses a GEMM's elementwise producer (the MLP's silu(gate) * up)
      into its YNNPACK subgraph, and the fused subgraph classes rows differently from a plain
      dot of the same values.
    - The fp32 product: with a bf16 output XLA lets the GEMM round to bf16 itself, by a kernel
      that changes at M = 17 (K = 768), which a probe could not see: a bf16 result flips
      for about one element in 2^16, so a kernel boundary shows in one probe and hides in
      the next. In fp32 every difference shows, and the rounding to bf16 is an elementwise op
      of its own, the same in every program. (A plain bf16 dot probed as one class for M in
      [2, 48]; the model's fused one flipped a near-tied token between a bf16 AR step and an
      8-row verify.)
    - The output barriers: the excess-precision rewrite may otherwise drop the rounding in
      one program (a residual add fused with it) and keep it in another (a `lax.map` tile)."""
    x_mk = jax.lax.optimization_barrier(x_mk)
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    acc = jax.lax.dot_general(x_mk, w, dims, precision, preferred_element_type=jnp.float32)
    acc = jax.lax.optimization_barrier(acc)
    return jax.lax.optimization_barrier(acc.astype(out_dtype))


# The CPU features that change which GEMM kernels XLA:CPU runs (and so floors and step
# costs): a VM's "model name" can be the same ("AMD EPYC") on hosts with and without them.
GEMM_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def machine_name() -> str:
    """The CPU model and its GEMM features (`GEMM_CPU_FLAGS`: GEMM kernels differ by
    instruction set), e.g. "cpu:AMD EPYC [avx2 avx512f avx512_bf16]", or the accelerator's kind."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}"
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if model is None:
        import platform

        model = platform.processor() or platform.machine()
    features = " ".join(f for f in GEMM_CPU_FLAGS if f in flags)
    return f"cpu:{model} [{features}]" if features else f"cpu:{model}"


def software_name() -> str:
    """The software that compiles and runs the GEMMs, for the keys of what is measured per
    machine: jax, jaxlib and the backend's plugin (its platform version: the CUDA or libtpu
    build the PJRT plugin reports; "cpu" for XLA:CPU, which ships in jaxlib), e.g.
    "jax 0.10.2 jaxlib 0.10.2 cpu". A new jaxlib or plugin may pick other kernels."""
    import jaxlib

    device = jax.devices()[0]
    plugin = getattr(device.client, "platform_version", device.platform)
    return f"jax {jax.__version__} jaxlib {jaxlib.__version__} {device.platform} {plugin}"
