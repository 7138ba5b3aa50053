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

The rules. (1) Matmuls (`RowRule`): the row counts [min_rows, max_rows] that select one
kernel class, found by `probe_row_rule` on the running backend and dtype (never hard-coded).
Fewer rows are padded up to `min_rows` (zero rows, sliced off after); more are cut into tiles
of exactly `max_rows` that run one after another (`lax.map`, so XLA cannot merge them back
into one GEMM of another class). Within a class each row's result depends on that row alone.
Each such matmul runs as an op of its own (`isolated_gemm`: barriers around it, an fp32
product rounded after it), because what XLA fuses into a GEMM, and where it rounds, otherwise
depends on the program around it; a tied head contracts the embedding as stored
(`transposed_matmul`), never through a `.T` that is a copy in one program and a layout in
another.
(2) Reductions run at one fixed shape: the norms in row tiles of exactly `RowRule.tile`
rows (at most `REDUCTION_TILE`, `fixed_rows`), the attention in fixed (query tile x key tile) blocks
(`ops.attention.tiled_attention`). Whatever the pass, every number comes out of the same
compiled shapes in the same order. The tests (tests/test_batch_invariance.py) check it
bitwise for every pass kind, in fp32 and bf16.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops import dots, quant

# The most rows a norm's or an attention query tile's fixed shape holds. Any fixed shape keeps
# them invariant; a small one pads a one-row AR step less. 32 holds a stream's verify of 16 in
# one norm tile. Against the probed class's 128 (bf16 SmolLM2, an Intel Xeon with AMX, the
# probed rule [3, 128], 2026-12-04): the AR step 37.3-38.0 ms against 42.9-44.3, a 256-token
# default DFlash decode 3.28-3.40 s against 3.53-3.87 s, the same tokens in the same steps.
REDUCTION_TILE = 32


@dataclasses.dataclass(frozen=True)
class RowRule:
    """Row counts that give every row the same bits: [min_rows, max_rows] (max_rows 0: no
    upper bound). Hashable: it is part of the static `TargetConfig`."""

    min_rows: int = 1
    max_rows: int = 0

    def __post_init__(self):
        if self.min_rows < 1 or (self.max_rows and self.max_rows < self.min_rows):
            raise ValueError(f"bad row rule [{self.min_rows}, {self.max_rows or 'inf'}]")

    @property
    def tile(self) -> int:
        """The row tile of the reductions that run at one fixed shape (`fixed_rows`) and of the
        attention's query tiles (`query_tile`): the rule's class, at most `REDUCTION_TILE`."""
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
    what the row rule classes (the probe runs this very function).

    Why each part (measured on an AMD EPYC, XLA:CPU, bf16):
    - The input barrier: XLA fuses a GEMM's elementwise producer (the MLP's silu(gate) * up)
      into its YNNPACK subgraph, and the fused subgraph classes rows differently from a plain
      dot of the same values.
    - The fp32 product: with a bf16 output XLA lets the GEMM round to bf16 itself, by a kernel
      that changes at M = 17 (K = 768), and the probe cannot see it: a bf16 result flips for
      about one element in 2^16, so a class boundary shows in one probe and hides in the
      next. In fp32 every difference shows, and the rounding to bf16 is an elementwise op of
      its own, the same in every program. (A plain bf16 dot probed as one class for M in
      [2, 48]; the model's fused one flipped a near-tied token between a bf16 AR step and an
      8-row verify.)
    - The output barriers: the excess-precision rewrite may otherwise drop the rounding in
      one program (a residual add fused with it) and keep it in another (a `lax.map` tile)."""
    x_mk = jax.lax.optimization_barrier(x_mk)
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    acc = jax.lax.dot_general(x_mk, w, dims, precision, preferred_element_type=jnp.float32)
    acc = jax.lax.optimization_barrier(acc)
    return jax.lax.optimization_barrier(acc.astype(out_dtype))


# ---------------------------------------------------------------------------------------------
# The probe.

# Part of the on-disk cache key: a rule probed by an older probe is probed again.
PROBE_VERSION = 2
# Up to 128: a class reaching it is used as tiles of 128 rows (a bigger tile gains little).
_PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 64, 96, 128)
# The row count every decode uses for its verify (block 16 at batch 1): the class to find.
_ANCHOR_ROWS = 16


def _row_classes(results: dict[int, np.ndarray]) -> RowRule:
    """The contiguous run of probed row counts around _ANCHOR_ROWS whose rows' results (up to
    the anchor's count) equal the anchor's -> RowRule (never unbounded: only probed counts
    are known to agree)."""
    rows = sorted(results)
    anchor = results[_ANCHOR_ROWS]
    same = [np.array_equal(results[m], anchor[: len(results[m])]) for m in rows]
    i = rows.index(_ANCHOR_ROWS)
    lo = i
    while lo > 0 and same[lo - 1]:
        lo -= 1
    hi = i
    while hi + 1 < len(rows) and same[hi + 1]:
        hi += 1
    return RowRule(rows[lo], rows[hi])


def _intersect(a: RowRule, b: RowRule) -> RowRule:
    lo = max(a.min_rows, b.min_rows)
    his = [h for h in (a.max_rows, b.max_rows) if h]
    return RowRule(lo, min(his) if his else 0)


@functools.cache
def probe_row_rule(shapes: tuple[tuple[int, int], ...], dtype: str, backend: str) -> RowRule:
    """The row rule of this backend's GEMMs [M,K] @ [K,N] in `dtype` at each (K, N) of
    `shapes` ((K, N, True): the weight stored [N, K], `transposed_matmul`), run as the model
    runs them (`isolated_gemm`): each shape's output rows (the first min(M, 16)) at every
    probed M are compared with their values at M = 16, and the contiguous run of equal ones
    around 16 is kept (intersected over the shapes). ~5-15 s (bf16 without matrix units is
    slow); cached per process, and on disk by `machine_row_rule`. `backend`: the cache key."""
    del backend  # the key: a probe describes the backend it ran on
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    rule = None
    m_max = max(_PROBE_ROWS)
    # The GEMMs as the model runs them, every M in one call, each input made by an elementwise
    # op in the same program (as the model's are), so a fusion that reached through the
    # barrier would show here. A transposed weight (a tied head) goes through
    # `transposed_matmul`, whose kernels class rows apart from the [K, N] ones.
    unbounded = RowRule(1, 1 << 30)
    dot = dot_general(unbounded)
    dims = (((1,), (0,)), ((), ()))
    f = jax.jit(lambda x, w: dot(jnp.tanh(x).astype(dt), w, dims))
    f_t = jax.jit(lambda x, w_nk: transposed_matmul(unbounded, jnp.tanh(x).astype(dt), w_nk))
    runs = []  # (shape, m, lowered program, its arguments)
    for shape in shapes:
        k, n = shape[:2]
        transposed = len(shape) > 2 and shape[2]
        w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)) / np.sqrt(k), dt)
        # Sliced on the host: an eager slice of a device array compiles a program per m.
        x = rng.standard_normal((m_max, k)).astype(np.float32)
        g = f_t if transposed else f
        runs += [(shape, m, g.lower(x[:m], w), (x[:m], w)) for m in _PROBE_ROWS]
    # Compiled two at a time (XLA compiles outside the GIL; most of the probe's time), each
    # the program `g(x[:m], w)` would compile; then run one after the other.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiled = list(pool.map(lambda run: run[2].compile(), runs))
    results = {}
    for (shape, m, _, args), program in zip(runs, compiled, strict=True):
        # Every row up to the anchor's, not only the first: a kernel's remainder rows may round
        # apart from its full tiles.
        out = np.asarray(program(*args))[:_ANCHOR_ROWS].astype(np.float32)
        results.setdefault(shape, {})[m] = out
    for shape in shapes:
        found = _row_classes(results[shape])
        rule = found if rule is None else _intersect(rule, found)
    return rule


def target_shapes(config) -> tuple[tuple, ...]:
    """The (K, N) of every matmul a target pass runs (`config`: a `TargetConfig`); the head's
    is (D, V, True) when it is the tied embedding, used transposed."""
    d, f, h = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * h, config.num_kv_heads * h
    head = (d, config.vocab_size, True) if config.tie_word_embeddings else (d, config.vocab_size)
    return tuple(dict.fromkeys(((d, q), (d, kv), (q, d), (d, f), (f, d), head)))


# The CPU features that change which GEMM kernels XLA:CPU runs (and so row rules, floors and
# step costs): a VM's "model name" can be the same ("AMD EPYC") on hosts with and without them.
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


def machine_row_rule(config) -> RowRule:
    """`probe_row_rule` for this target's matmul shapes and dtype on this machine, kept in
    <cache_root>/row_rules.json (keyed by machine and its GEMM ISA features, `software_name`
    (jax, jaxlib, plugin), XLA_FLAGS, dtype and shapes) so that a machine probes each target
    once."""
    import json
    import os

    from dflash_jax.config import cache_root, write_json_atomic

    shapes = target_shapes(config)
    parts = [
        f"probe{PROBE_VERSION}",
        machine_name(),
        software_name(),
        os.environ.get("XLA_FLAGS", ""),
        config.dtype,
    ]
    key = "|".join([*parts, str(shapes)])
    path = cache_root() / "row_rules.json"
    table = {}
    try:
        table = json.loads(path.read_text())
        if key in table:
            return RowRule(*table[key])
    except (OSError, ValueError, TypeError):
        table = {}
    rule = probe_row_rule(shapes, config.dtype, jax.default_backend())
    table[key] = [rule.min_rows, rule.max_rows]
    write_json_atomic(path, table)  # a read-only cache: probe again next time
    return rule
