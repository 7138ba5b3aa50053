"""The dot policy (`ops.dots`) in the compiled bf16 decode programs: every matrix product asks
for fp32 accumulation, and no weight matrix is multiplied as anything but bf16.

What each check catches. (1) The lowered program (what the code asks XLA for) holds no
`dot_general` with a bf16 result: a bf16 x bf16 -> bf16 product is what the policy forbids.
(2) The optimized HLO (`.compile().as_text()`, what XLA:CPU runs) holds no `dot` with a bf16
result, and every `dot` taking an operand of a weight's shape takes it as bf16. On XLA:CPU
(jaxlib 0.10.2) a bf16-result dot never survives optimisation: XLA rewrites it as an fp32 dot of
widened operands, the weight included, which is how the slow path shows there (a weight of fp32
type). On the code before the policy both checks failed for every program; an fp32 dot of
activations (XLA keeping a value at excess precision) is left to XLA.

Tiny target and drafter whose weight shapes no activation has, so the weight check is exact;
one compile per program kind (adaptive with a tree, fixed block, tree, the target alone;
invariant or not; the first kind in the default suite, the rest slow).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import autoregressive, speculative
from dflash_jax.decoding.programs import run_target_config, step_limit_array
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import init_params

# Weight shapes [64, 64], [64, 32], [64, 96], [96, 64], [64, 320] / [320, 64] (the tied head),
# [128, 64] (fc): no activation of these programs has 64, 96, 128 or 320 rows.
TARGET = TargetConfig(
    arch="qwen3", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
    max_position_embeddings=512, dtype="bfloat16", attention_impl="xla",
)  # fmt: skip
DRAFTER = DrafterConfig(
    hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
    head_dim=16, vocab_size=320, mask_token_id=319, target_layer_ids=(0, 1),
    num_target_layers=2, block_size=8, dtype="bfloat16", attention_impl="xla",
)  # fmt: skip
RULE = (2, 16)  # a row rule given: a range, as a test may give (a decode's is one fixed tile)
# The adaptive decode with a tree kind holds every step kind (a plain one-row step, a block,
# a tree) in one program, each once (block 4 would be block 8's code at another size): the
# default suite compiles it; the others are slow.
MODES = {
    "adaptive with a tree": {"adaptive": True, "tree_nodes": 6, "step_kinds": (1, 8)},
    "block": {},
    "tree": {"tree_nodes": 6},
    "target alone": None,
}


@functools.cache
def _params():
    cast = lambda tree: jax.tree.map(lambda w: w.astype(jnp.bfloat16), tree)
    tp = cast(init_params(TARGET, jax.random.key(0)))
    dp = cast(init_drafter_params(DRAFTER, jax.random.key(1)))
    return tp, dp


def _weight_shapes(*trees) -> set[tuple[int, int]]:
    """Every weight matrix as 2-D [in, out] and [out, in] (a kernel [D, N, H] as [D, N*H], an
    o_proj [N, H, D] as [N*H, D])."""
    shapes = set()
    for w in jax.tree.leaves(trees):
        if w.ndim < 2:
            continue
        for k in range(1, w.ndim):
            a, b = int(np.prod(w.shape[:k])), int(np.prod(w.shape[k:]))
            shapes |= {(a, b), (b, a)}
    return shapes


def _lowered(kind: str, invariant: bool):
    """The lowered bf16 decode of `kind` (the whole program: prefill and loop)."""
    tp, dp = _params()
    mode = MODES[kind]
    cfg = DecodeConfig(max_new_tokens=16, block_size=8, batch_invariant=invariant, **(mode or {}))
    tcfg = dataclasses.replace(TARGET, invariant_rows=RULE) if invariant else TARGET
    tcfg = run_target_config(tcfg, cfg)
    prompt, lengths = jnp.zeros((1, 32), jnp.int32), jnp.array([8], jnp.int32)
    head = (prompt, lengths, jax.random.key(0))
    if mode is None:
        cfg = autoregressive.autoregressive_config(cfg)
        args = (tp, *head, step_limit_array(cfg, None))
        return autoregressive.autoregressive_jit.lower(*args, target_config=tcfg, decode_config=cfg)
    args = (tp, dp, *head, speculative.step_cost_array(cfg), jnp.int32(-1))
    args = (*args, step_limit_array(cfg, None))
    return speculative.speculative_jit.lower(
        *args, target_config=tcfg, drafter_config=DRAFTER, decode_config=cfg
    )


def bf16_products_asked(lowered_text: str) -> list[str]:
    """The lowered program's `dot_general`s whose result is bf16."""
    return [
        line.strip()[:160]
        for line in lowered_text.splitlines()
        if "dot_general" in line and re.search(r"-> tensor<[0-9x]*bf16>", line)
    ]


def bad_dots(hlo: str, weight_shapes: set) -> list[str]:
    """The optimized HLO's `dot`s with a bf16 result, or with an operand of a weight's shape
    that is not bf16 (a widened weight)."""
    types = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\w+)\[([\d,]*)\]", line)
        if m:
            dims = tuple(int(d) for d in m.group(3).split(",") if d)
            types[m.group(1)] = (m.group(2), dims)
    bad = []
    for line in hlo.splitlines():
        m = re.search(r"= (\w+)\[[\d,]*\]\S*\s+dot\((%[^,\s)]+), (%[^,\s)]+)", line)
        if not m:
            continue
        operands = [types.get(m.group(i), ("?", ())) for i in (2, 3)]
        widened = any(dims in weight_shapes and t != "bf16" for t, dims in operands)
        if m.group(1) == "bf16" or widened:
            bad.append(f"{line.strip()[:140]} (operands {operands})")
    return bad


@pytest.mark.parametrize(  # the invariant path asks isolated_gemm for fp32 by construction
    "invariant", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "invariant"]
)
@pytest.mark.parametrize(
    "kind", [k if i == 0 else pytest.param(k, marks=pytest.mark.slow) for i, k in enumerate(MODES)]
)
def test_bf16_decode_programs_accumulate_in_fp32_and_never_widen_a_weight(kind, invariant):
    lowered = _lowered(kind, invariant)
    asked = bf16_products_asked(lowered.as_text())
    assert not asked, f"{len(asked)} bf16-result products asked for, e.g.\n" + "\n".join(asked[:5])
    bad = bad_dots(lowered.compile().as_text(), _weight_shapes(_params()))
    assert not bad, f"{len(bad)} dots off the policy, e.g.\n" + "\n".join(bad[:5])


def test_the_checks_see_a_plain_bf16_product():
    """The two checks themselves: a plain bf16 `x @ w` of one row and of four is asked for
    with a bf16 result, and compiled as an fp32 dot of a widened weight; the policy's is not."""
    from dflash_jax.ops import dots

    w = jnp.ones((64, 96), jnp.bfloat16)
    for rows in (1, 4):
        x = jnp.ones((rows, 64), jnp.bfloat16)
        plain = jax.jit(lambda x, w: x @ w).lower(x, w)
        assert bf16_products_asked(plain.as_text())
        assert bad_dots(plain.compile().as_text(), {(64, 96)})
        policy = jax.jit(dots.matmul).lower(x, w)
        assert not bf16_products_asked(policy.as_text())
        assert not bad_dots(policy.compile().as_text(), {(64, 96)})


def widened_buffers(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """The optimized HLO's instructions that make an f32 array of `shape` (a bf16 buffer's
    widened copy)."""
    dims = ",".join(str(d) for d in shape)
    return [line.strip()[:140] for line in hlo.splitlines() if f"= f32[{dims}]" in line]


def test_a_bf16_cache_is_written_and_read_without_widening_it():
    """XLA:CPU widened a bf16 cache buffer to f32 as a whole: for the scatter that writes new
    rows (and narrowed it back), and, hoisted out of the invariant attention's loops, for the
    tiles' f32 products: K and V of every layer, every step (~9 ms of a 26 ms bf16 SmolLM2 step
    at one row on 2 cores). A cache write and an invariant attention over a bf16 cache [B,K,S,H]
    compile to no f32 [B,K,S,H] value (both had it on the code before); the write holds the
    float32 write's values, and the attention a float32 reference's within bf16 rounding."""
    from dflash_jax.ops.attention import tiled_attention
    from dflash_jax.ops.caches import write_rows
    from dflash_jax.ops.invariance import RowRule

    b, k, s, h, t = 2, 2, 256, 16, 3
    rng = np.random.default_rng(0)
    cache = tuple(jnp.asarray(rng.normal(size=(b, k, s, h)), jnp.bfloat16) for _ in range(2))
    new = tuple(jnp.asarray(rng.normal(size=(b, k, t, h)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(b, t, 4, h)), jnp.bfloat16)
    start = jnp.array([70, 130], jnp.int32)
    write = jax.jit(write_rows)
    attend = jax.jit(lambda q, c, n, st: tiled_attention(q, c, n, st, RowRule(*RULE)))
    for fn, args in ((write, (cache[0], new[0], start)), (attend, (q, cache, new, start))):
        widened = widened_buffers(fn.lower(*args).compile().as_text(), (b, k, s, h))
        assert not widened, "\n".join(widened[:3])
    written = write(cache[0], new[0], start)
    want = write(cache[0].astype(jnp.float32), new[0].astype(jnp.float32), start)
    assert (written == want.astype(jnp.bfloat16)).all()
    out = np.asarray(attend(q, cache, new, start), np.float32)  # [B,T,N,H]
    f = lambda x: np.asarray(x, np.float32)
    for r in range(b):
        n0 = int(start[r])
        keys = np.concatenate([f(cache[0])[r, :, :n0], f(new[0])[r]], 1)  # [K, n0 + T, H]
        vals = np.concatenate([f(cache[1])[r, :, :n0], f(new[1])[r]], 1)
        for i in range(t):
            for head in range(4):
                kv = head // 2
                score = keys[kv, : n0 + i + 1] @ f(q)[r, i, head] / np.sqrt(h)
                p = np.exp(score - score.max())
                want = (p / p.sum()) @ vals[kv, : n0 + i + 1]
                np.testing.assert_allclose(out[r, i, head], want, atol=3e-2, rtol=3e-2)
