"""The attention kernels under a mesh (ops/dispatch.py): every kernel call runs inside a
`shard_map` whose specs come from the sharding table, and gives the one-device XLA results.

On 8 fake CPU devices (a fresh process each, the kernels in Pallas' GPU interpret mode): greedy
speculative decoding on data=2,tensor=4, fsdp=2,tensor=4 and tensor=8 (more devices than KV
heads) gives the one-device XLA tokens, and training steps on fsdp=4,tensor=2 the XLA losses.
Without devices (an abstract mesh): tensor a multiple of the KV heads keeps the kernels on;
query heads split so that a device's span KV heads it lacks is refused under "pallas" and done by
xla under "auto"; heads the mesh does not divide are replicated with one warning. In one process: the kernel decode step
writes each cache buffer once and copies none (compiled HLO, the kernels as opaque calls), and
the kernels that read the cache with a step's rows apart (`appended_attention`) give bitwise
what they give on the written cache, so a position's result is the same in a verify and in an
AR step.
"""

import functools
import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from dflash_jax import sharding
from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.ops import attention as xla
from dflash_jax.ops import caches, dispatch, pallas_gpu, pallas_tpu_decode
from dflash_jax.ops.caches import write_rows

ROOT = Path(__file__).resolve().parents[1]
# tensor=8 exceeds the 4 KV heads: replicated, each device reads its query head's one
DECODE_MESHES = ("data=2,tensor=4", "fsdp=2,tensor=4", "tensor=8")
TRAIN_MESH = "fsdp=4,tensor=2"
PROMPT = np.array(
    [[5, 9, 3, 7, 1, 2, 8], [4, 4, 6, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0], [7, 0, 0, 0, 0, 0, 0]],
    np.int32,
)
LENS = np.array([7, 3, 5, 1], np.int32)


def _pair(
    impl: str, num_layers: int = 2, head_dim: int = 16, drafter_kv_heads: int = 4
) -> tuple[TargetConfig, DrafterConfig]:
    """Head dim 16 (the GPU kernels take it) and 4 KV heads: split 4 ways by tensor=4."""
    tcfg = TargetConfig(
        arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=num_layers,
        num_heads=8, num_kv_heads=4, head_dim=head_dim, max_position_embeddings=256,
        attention_impl=impl,
    )  # fmt: skip
    dcfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=8,
        num_kv_heads=drafter_kv_heads, head_dim=head_dim, vocab_size=64, mask_token_id=63,
        target_layer_ids=(0, 1), num_target_layers=num_layers, block_size=4, attention_impl=impl,
    )  # fmt: skip
    return tcfg, dcfg


def _params(tcfg, dcfg):
    from dflash_jax.models.drafter import init_drafter_params
    from dflash_jax.models.target import init_params

    return init_params(tcfg, jax.random.key(0)), init_drafter_params(dcfg, jax.random.key(1))


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def kernel_calls(jaxpr, inside: bool = False, found: Counter | None = None) -> dict:
    """pallas_call equations in a jaxpr (nested ones included) -> {"in_shard_map": n,
    "outside": n}."""
    found = Counter() if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found["in_shard_map" if inside else "outside"] += 1
            continue
        for sub in _subjaxprs(eqn.params):
            kernel_calls(sub, inside or eqn.primitive.name == "shard_map", found)
    return {"in_shard_map": found["in_shard_map"], "outside": found["outside"]}


def _run_checks(name: str) -> dict:
    """Runs `name`() of this module in a fresh process with 8 fake CPU devices -> its result."""
    flag = "--xla_force_host_platform_device_count=8"
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    code = f"import json, test_kernels_on_mesh as t; print(json.dumps(t.{name}()))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
        check=False, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def decode_checks() -> dict:
    """(Runs in a fresh process.) One-device XLA tokens, and per mesh the kernels' tokens and
    where the traced program's kernel calls lie."""
    from dflash_jax.decoding import programs, speculative, speculative_decode

    (tcfg, dcfg), (kcfg, kdcfg) = _pair("xla"), _pair("pallas")
    tp, dp = _params(tcfg, dcfg)
    cfg, key = DecodeConfig(max_new_tokens=12, block_size=4), jax.random.key(0)
    ref = speculative_decode(
        tp, dp, PROMPT, LENS, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg
    )
    out = {"reference": np.asarray(ref.tokens).tolist()}
    kw = dict(target_config=kcfg, drafter_config=kdcfg, decode_config=cfg)
    for spec in DECODE_MESHES:
        mesh = sharding.mesh_from_spec(spec)
        got = speculative_decode(tp, dp, PROMPT, LENS, key, **kw, mesh=mesh)
        args = (tp, dp, PROMPT, LENS, key, speculative.step_cost_array(cfg), np.int32(-1))
        fn, args, _ = programs.on_mesh(speculative.speculative_jit, mesh, (*args, np.int32(9)), kw)
        out[spec] = {
            "tokens": np.asarray(got.tokens).tolist(),
            "kernels": kernel_calls(fn.trace(*args).jaxpr.jaxpr),
        }
    return out


def train_checks() -> dict:
    """(Runs in a fresh process.) Three training steps' losses: XLA on one device, the kernels
    on TRAIN_MESH; and where the mesh step's kernel calls lie."""
    from dflash_jax.training.anchors import sample_anchors
    from dflash_jax.training.step import OptimizerConfig, train_step, train_step_on_mesh

    rng = np.random.default_rng(9)
    b, s, n = 4, 40, 4
    tokens = rng.integers(2, 62, (b, s)).astype(np.int32)
    loss_mask = np.zeros((b, s), np.int32)
    loss_mask[:, 6:] = 1
    length = np.array([s, 29, 33, 20], np.int32)
    picks = [sample_anchors(loss_mask[i], length[i], n, rng) for i in range(b)]
    batch = {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "length": length,
        "anchors": np.stack([a for a, _ in picks]).astype(np.int32),
        "anchor_valid": np.stack([v for _, v in picks]),
    }
    opt = OptimizerConfig(1e-2, 0, 3, 0.9, 0.999, 1e-8, 0.0, 1.0)
    out = {}
    for impl in ("xla", "pallas"):
        tcfg, dcfg = _pair(impl)
        tp, params = _params(tcfg, dcfg)
        state = {"step": jnp.zeros((), jnp.int32), "params": params}
        state["opt_state"] = opt.build().init(params)
        settings = dict(
            target_config=tcfg, drafter_config=dcfg, optimizer=opt, loss_gamma=7.0,
            ce_chunk_rows=64,
        )  # fmt: skip
        step, args = functools.partial(train_step, **settings), (state, tp, batch)
        if impl == "pallas":
            mesh = sharding.mesh_from_spec(TRAIN_MESH)
            args = (
                sharding.put(state, sharding.state_shardings(state, mesh)),
                sharding.put(tp, sharding.param_shardings(tp, mesh)),
                sharding.put(batch, sharding.batch_shardings(batch, mesh)),
            )
            step = train_step_on_mesh(mesh, *args, **settings)
            out["kernels"] = kernel_calls(step.trace(*args).jaxpr.jaxpr)
        losses = []
        for _ in range(3):
            state, metrics = step(*args)
            args = (state, *args[1:])
            losses.append(float(metrics["loss"]))
        out[impl] = losses
    return out


@pytest.fixture(scope="module")
def decoded():
    return _run_checks("decode_checks")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", DECODE_MESHES)
def test_greedy_decode_with_kernels_on_a_mesh_gives_the_one_device_xla_tokens(decoded, mesh):
    assert decoded[mesh]["tokens"] == decoded["reference"]
    kernels = decoded[mesh]["kernels"]
    assert kernels["in_shard_map"] > 0 and kernels["outside"] == 0, kernels


@pytest.mark.slow  # test_kernels' one-device kernel losses + test_sharding_mesh's XLA mesh run
def test_training_steps_with_kernels_on_a_mesh_give_the_xla_losses():
    out = _run_checks("train_checks")
    assert out["xla"][0] > out["xla"][-1]  # the steps did something
    np.testing.assert_allclose(out["pallas"], out["xla"], rtol=1e-5)
    assert out["kernels"]["in_shard_map"] > 0 and out["kernels"]["outside"] == 0, out


# --- splits, on an abstract mesh (no devices needed to trace) ---------------------------------


def _abstract_mesh(data=1, fsdp=1, tensor=1):
    return jax.sharding.AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


def _causal_inputs(batch, heads, kv_heads, t=4, s=24, h=16):
    q = jax.ShapeDtypeStruct((batch, t, heads, h), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, kv_heads, s, h), jnp.float32)
    return q, kv, kv, jax.ShapeDtypeStruct((batch,), jnp.int32)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(dispatch, "_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(sharding, "_WARNED", set())


def test_query_heads_split_without_their_kv_heads_refused_or_done_by_xla(fake_gpu, caplog):
    """tensor=2 splits 6 query heads but not their 3 KV heads, and a device's 3 query heads
    span two KV heads. "pallas" refuses; "auto" logs one line and traces no kernel."""
    inputs = _causal_inputs(batch=2, heads=6, kv_heads=3)
    attend = lambda impl: lambda *a: dispatch.causal_attention(*a, impl=impl)
    with jax.sharding.use_abstract_mesh(_abstract_mesh(tensor=2)):
        with pytest.raises(ConfigError, match="6 query heads split over tensor=2 but 3 KV heads"):
            jax.make_jaxpr(attend("pallas"))(*inputs)
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                jaxpr = jax.make_jaxpr(attend("auto"))(*inputs)
    assert kernel_calls(jaxpr.jaxpr) == {"in_shard_map": 0, "outside": 0}
    logged = [r.getMessage() for r in caplog.records if "query heads split" in r.getMessage()]
    assert logged == [
        "attention_impl=auto: target attention uses xla (6 query heads split over tensor=2 but 3 "
        "KV heads not, and a device's 3 query heads span several KV heads (a kernel keeps a "
        "query head's KV head on its device: tensor must divide the KV heads or be a multiple "
        "of them))"
    ]


def test_kv_heads_fewer_than_tensor_keep_the_kernels_on(fake_gpu, caplog):
    """tensor=8 over 8 query and 4 KV heads (Qwen3-Coder-30B-A3B's 32 and 4 at tensor=8 alike):
    "auto" keeps the kernels, inside the shard_map, q split and the KV heads whole in its specs,
    and logs no fallback; each device's kernel reads one KV head of [B,1,S,H]."""
    P = jax.sharding.PartitionSpec
    attend = lambda *a: dispatch.causal_attention(*a, impl="auto")
    with jax.sharding.use_abstract_mesh(_abstract_mesh(tensor=8)):
        with caplog.at_level(logging.WARNING):
            jaxpr = jax.make_jaxpr(attend)(*_causal_inputs(batch=2, heads=8, kv_heads=4))
    assert kernel_calls(jaxpr.jaxpr) == {"in_shard_map": 1, "outside": 0}
    assert not [r for r in caplog.records if "uses xla" in r.getMessage()]
    q, whole = P(None, None, ("tensor",), None), P(None, None, None, None)
    assert _shard_map_specs(jaxpr.jaxpr) == [((q, whole, whole, P(None, None)), (q,))]
    (call,) = _pallas_calls(jaxpr.jaxpr)
    # q folded to [B,K,rows,H] for its one KV head; k and v that head of 24 slots
    assert [v.aval.shape[1:3] for v in call.invars[1:3]] == [(1, 24), (1, 24)]
    assert call.invars[0].aval.shape[1] == 1


def _pallas_calls(jaxpr) -> list:
    found = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    for eqn in jaxpr.eqns:
        for sub in _subjaxprs(eqn.params):
            found += _pallas_calls(sub)
    return found


def _shard_map_specs(jaxpr) -> list:
    return [
        (tuple(eqn.params["in_specs"]), eqn.params["out_specs"])
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "shard_map"
    ]


def test_kernel_specs_follow_the_table_and_warn_once_where_it_replicates(fake_gpu, caplog):
    """data=2 x tensor=4: a batch of 4 and 8 query / 4 KV heads are split; a batch of 1 and
    6 query / 3 KV heads (SmolLM2's split 4 ways) stay whole on every device, as the table
    leaves every other array of theirs, with one warning per dim of more than one element (a
    batch of one is whole anyway: `sharding.logical_to_spec` does not warn for it)."""
    P = jax.sharding.PartitionSpec
    attend = lambda *a: dispatch.causal_attention(*a, impl="pallas")
    with jax.sharding.use_abstract_mesh(_abstract_mesh(data=2, tensor=4)):
        split = jax.make_jaxpr(attend)(*_causal_inputs(batch=4, heads=8, kv_heads=4))
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                whole = jax.make_jaxpr(attend)(*_causal_inputs(batch=1, heads=6, kv_heads=3))
    batch = ("data", "fsdp")
    q, kv = P(batch, None, ("tensor",), None), P(batch, ("tensor",), None, None)
    assert _shard_map_specs(split.jaxpr) == [((q, kv, kv, P(batch, None)), (q,))]
    none = P(None, None, None, None)
    assert _shard_map_specs(whole.jaxpr) == [((none, none, none, P(None, None)), (none,))]
    assert kernel_calls(whole.jaxpr) == {"in_shard_map": 1, "outside": 0}
    messages = [r.getMessage() for r in caplog.records]
    warned = sorted(m.split(":")[1] for m in messages if m.startswith("sharding:"))
    assert warned == [
        " heads of size 6 is not divisible by mesh axes tensor (4 ways)",
        " kv_heads of size 3 is not divisible by mesh axes tensor (4 ways)",
    ], warned


# --- the cache is written once per step --------------------------------------------------------


KERNELS = {
    # name: (module, its `interpret` argument on CPU, cache slots, head dim, kernel options)
    # The GPU cases name their splits: a decode pass takes DECODE_SPLITS, a pass over the
    # written cache (`causal_attention`, a prefill's kernel) splits by its keys.
    "gpu": (pallas_gpu, True, 100, 16, dict(tiles=pallas_gpu.Tiles(rows=16, keys=16, splits=1))),
    "gpu_default_tiles": (
        pallas_gpu,
        True,
        150,
        64,
        dict(tiles=pallas_gpu.Tiles(splits=pallas_gpu.DECODE_SPLITS)),
    ),
    # 24 key tiles: 3 splits in the AR step and in the verify's 4 row tiles alike.
    "gpu_split": (
        pallas_gpu,
        True,
        384,
        16,
        dict(tiles=pallas_gpu.Tiles(rows=16, keys=16, splits=3)),
    ),
    # Two whole 512-slot blocks (a grid step's keys) and a partial one.
    "tpu": (pallas_tpu_decode, pallas_tpu_decode.INTERPRET, 1100, 64, {}),
}


# The default suite runs each kernel set in one dtype: the GPU defaults and the TPU kernel in
# bf16 (how they run), the split GPU tiles in fp32. Slow: the other dtype, and 16-wide tiles
# without splits (gpu_split runs the same tiles with splits).
# one GPU kernel case and the TPU one by default (suite budget); the rest run in CI's slow step
_DEFAULT_CASES = {("gpu_split", "float32"), ("tpu", "bfloat16")}


@pytest.mark.parametrize(
    "kernels,dtype",
    [
        pytest.param(
            k, dt, marks=() if (k, jnp.dtype(dt).name) in _DEFAULT_CASES else pytest.mark.slow
        )
        for dt in (jnp.float32, jnp.bfloat16)
        for k in KERNELS
    ],
)
def test_appended_attention_is_bitwise_the_attention_over_the_written_cache(kernels, dtype):
    """Rows of 0 slots, slots ending just before a key-tile edge (the 16 new rows then span two
    tiles), a few tiles, and a full buffer. On the GPU kernels a position's result in a 16-row
    verify then equals the AR step's over the same keys, bit for bit."""
    module, interpret, s, h, opts = KERNELS[kernels]
    tile = opts["tiles"].keys if "tiles" in opts else module.BLOCK  # the TPU kernel's step
    rng = np.random.default_rng(11)
    b, t, kv_heads, groups = 4, 16, 2, 4
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    cache = [normal(b, kv_heads, s, h) for _ in range(2)]
    rows = [normal(b, kv_heads, t, h) for _ in range(2)]
    q = normal(b, t, kv_heads * groups, h)
    lengths = jnp.array([0, tile - 3, 2 * tile + 5, s - t], jnp.int32)

    def appended(q, cache, rows, lengths):
        return module.appended_attention(q, *cache, *rows, lengths, interpret=interpret, **opts)

    def written(q, cache, rows, lengths):
        k, v = (write_rows(c, r, lengths) for c, r in zip(cache, rows, strict=True))
        bounds = xla.causal_cache_bounds(lengths, q.shape[1])
        return module.causal_attention(q, k, v, bounds, interpret=interpret, **opts)

    verify = jax.jit(appended)(q, cache, rows, lengths)
    np.testing.assert_array_equal(verify, jax.jit(written)(q, cache, rows, lengths))
    want = xla.attention(
        q, *(write_rows(c, r, lengths) for c, r in zip(cache, rows, strict=True)),
        xla.causal_cache_mask(lengths, t, s),
    )  # fmt: skip
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.float32(verify), np.float32(want), atol=tol, rtol=tol)
    if module is not pallas_gpu:
        # The TPU kernel's matmuls have T x G rows (one tile), so whether a position's bits
        # depend on T is the matrix unit's business; interpret mode has XLA:CPU's GEMMs,
        # whose kernel changes with the row count (ops/invariance.py). The GPU kernels' row
        # tile is fixed.
        return
    # The last query as an AR step: the first t-1 rows already in the cache.
    before = [write_rows(c, r[:, :, :-1], lengths) for c, r in zip(cache, rows, strict=True)]
    last = [r[:, :, -1:] for r in rows]
    step = jax.jit(appended)(q[:, -1:], before, last, lengths + t - 1)
    np.testing.assert_array_equal(step[:, 0], verify[:, -1])


def _opaque_kernel(q, *operands, **_):
    """A stand-in kernel that XLA cannot see into, as it cannot see into a Triton or Mosaic
    call: a host callback reading every operand whole (compiled here, never run)."""
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.pure_callback(lambda *a: np.zeros(q.shape, q.dtype), out, q, *operands)


def _hlo_counts(hlo: str, shape: str) -> dict:
    """Per step of the compiled module's decode loop (the while loop in its entry computation):
    `copy` instructions and writes (scatter, dynamic-update-slice) that produce an f32 array of
    `shape`. Computations a step calls count once; of a conditional's branches (the adaptive
    step kinds) only the largest, since one runs per step."""
    comps, entry = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            name = head.group(2)
            entry = name if head.group(1) else entry
            comps[name] = []
        elif comps and line.startswith("  "):
            comps[name].append(line)
    result = re.compile(rf"= f32\[{shape}\]\{{[^}}]*\}} (copy|scatter|dynamic-update-slice)\(")

    def count(name: str) -> Counter:
        found = Counter()
        for line in comps[name]:
            op = result.search(line)
            if op:
                found["writes" if op.group(1) != "copy" else "copies"] += 1
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                per_branch = [count(b.strip().lstrip("%")) for b in branches.group(1).split(",")]
                for key in ("copies", "writes"):
                    found[key] += max(c[key] for c in per_branch)
            for callee in re.findall(r"(?:calls|to_apply|body)=%([\w.\-]+)", line):
                found.update(count(callee))
        return found

    loops = [
        re.search(r"body=%([\w.\-]+)", line).group(1)
        for line in comps[entry]
        if re.search(r" while\(", line)
    ]
    assert len(loops) == 1, loops
    got = count(loops[0])
    return {"copies": got["copies"], "writes": got["writes"]}


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["gpu", "tpu"])
def test_kernel_decode_step_writes_each_cache_once_and_copies_none(monkeypatch, request, kernels):
    """The adaptive speculative loop on the kernels: each step writes each of the target's
    2 x layers cache buffers once (after acceptance) and copies none, even inside the
    `lax.switch` over step kinds. On the commit before, the kernels read a cache written for
    them while the loop still held the old one for its deferred write: a copy of every buffer
    in every kind, and two writes."""
    from dflash_jax.decoding import speculative

    module = pallas_gpu if kernels == "gpu" else pallas_tpu_decode
    jax.clear_caches()  # no trace of the real kernels is reused, nor one of these left behind
    request.addfinalizer(jax.clear_caches)
    monkeypatch.setattr(dispatch, "_backend", lambda: kernels)
    for name in ("block_attention", "causal_attention", "appended_attention"):
        monkeypatch.setattr(module, name, _opaque_kernel)
    # Head dim 64: both kernel families take it; the drafter's context cache of another shape.
    tcfg, dcfg = _pair("pallas", num_layers=3, head_dim=64, drafter_kv_heads=2)
    tp, dp = _params(tcfg, dcfg)
    cfg = DecodeConfig(max_new_tokens=12, block_size=4, adaptive=True)
    kw = dict(target_config=tcfg, drafter_config=dcfg, decode_config=cfg)
    args = (tp, dp, PROMPT, LENS, jax.random.key(0), speculative.step_cost_array(cfg))
    hlo = speculative.speculative_jit.lower(*args, np.int32(-1), np.int32(9), **kw)
    cache_len = caches.tile_slots(PROMPT.shape[1] + cfg.max_new_tokens + 2 * cfg.block_size)
    shape = f"{len(LENS)},{tcfg.num_kv_heads},{cache_len},{tcfg.head_dim}"
    counts = _hlo_counts(hlo.compile().as_text(), shape)
    assert counts == {"copies": 0, "writes": 2 * tcfg.num_layers}, counts
