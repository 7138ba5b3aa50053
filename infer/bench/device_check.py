r"""One command that checks an accelerator stage by stage: are the kernels right, how close is
the decode to the roofline, does the compiled loop copy its caches.

  python -m infer.bench.device_check --output=results/device_check_h200.json     # a GPU or TPU
  JAX_PLATFORMS=cpu python -m infer.bench.device_check --tiny --output=/tmp/dc.json   # anywhere

Stages, in order, each with its own time budget (`BUDGET_S`; the cases left when it is spent
are listed as skipped), each written to the JSON as it finishes (written whole to a temporary
file and renamed: a run killed midway keeps the stages done, and names the one it was in):

  environment    device kind, platform, jax/jaxlib and backend versions, peak HBM bandwidth.
  kernels        every attention kernel decoding and training use on this platform (GPU:
                 ops.pallas_gpu; TPU: ops.pallas_tpu_decode and ops.pallas_tpu; CPU: the GPU
                 kernels in interpret mode) against the XLA reference (ops/attention.py) run in
                 fp32 on the same inputs: appended attention with 1 and 16 queries and several
                 splits, a 16-node tree, drafting, the training forward and backward; bf16 at
                 head dims 64 and 128, fp32 at 128; dead cache slots hold NaN. Each result:
                 name, max_abs_error, nan_count, ok (error within `TOLERANCE` of the output's
                 scale, no NaN), and the XLA reference's own error in the input dtype.
  kernel_timing  `appended_attention` at Qwen3-8B's heads (32 query, 8 KV, head dim 128, bf16),
                 batch {1, 8} x queries {1, 16} x live length {1k, 4k, 16k}: many calls chained
                 inside one jitted lax.fori_loop (each call's output is the next call's query, so
                 none is hoisted or skipped), us per call and GB/s of live K/V read against the
                 platform's peak; split and key-tile variants (GPU), and XLA's attention.
  decode         a random-weight Qwen3-8B in bf16 (no download): AR ms/token against the
                 roofline (every weight but the embedding table read once per token), a chain
                 step of block 16 (random drafter) in AR steps, compile seconds, and the same AR
                 with a 4096-token cache buffer (a cache copy per step shows up as extra ms).
  hlo            the compiled advance programs (AR and chain) of the decode stage: copies of
                 cache-sized buffers inside their while loop (`cache_copies_in_loop`, 0 when the
                 caches are updated in place), and a short profiler trace of AR steps saved
                 beside the JSON (<output stem>_trace/).

--tiny: every stage at toy shapes (a 2-layer target, toy timing shapes, the kernels in interpret
mode off an accelerator) in about 3 minutes on a CPU; CI runs it (.ci/run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import shutil
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

from dflash_jax.config import DrafterConfig
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io.hf_config import target_from_hf
from dflash_jax.ops import attention as xla
from dflash_jax.ops import pallas_gpu, pallas_tpu, pallas_tpu_decode
from infer import cli
from infer.hlo_scan import cache_copies_in_loop

STAGES = ("environment", "kernels", "kernel_timing", "decode", "hlo")
# Seconds per stage: 9 minutes in all on an H200 (the decode stage compiles six 8B programs).
BUDGET_S = {"environment": 20, "kernels": 100, "kernel_timing": 140, "decode": 220, "hlo": 60}
TINY_BUDGET_S = {"environment": 10, "kernels": 100, "kernel_timing": 25, "decode": 60, "hlo": 30}
# Peak HBM bandwidth (bytes/s) by device kind (a substring of jax's device_kind; the longest
# match wins): vendors' figures.
PEAK_BYTES_PER_S = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 819e9,  # v5e
    "TPU v5e": 819e9,
    "TPU v5": 2.765e12,  # v5p
    "TPU v6 lite": 1.64e12,  # v6e
}
# max |kernel - fp32 reference| / max(1, max |reference|) allowed, by input dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs as a program: the module is imported by tests
    beside other CLIs that define --output too (absl refuses a flag defined twice)."""
    flags.DEFINE_string("output", None, "Write the stages' JSON here (rewritten after each stage).")
    flags.DEFINE_bool("tiny", False, "Toy shapes for every stage (a CPU run in ~3 minutes).")
    flags.DEFINE_list("stages", list(STAGES), f"Stages to run, from {STAGES}.")
    flags.mark_flag_as_required("output")


@dataclasses.dataclass
class Clock:
    """A stage's time budget: `left()` seconds remain (negative once spent)."""

    budget_s: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def _write(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def peak_bytes_per_s(device_kind: str) -> float | None:
    """The peak HBM bandwidth of a device kind (`PEAK_BYTES_PER_S`), None when unknown."""
    hits = [k for k in PEAK_BYTES_PER_S if k.lower() in device_kind.lower()]
    return PEAK_BYTES_PER_S[max(hits, key=len)] if hits else None


def _platform() -> str:
    """ "gpu", "tpu" or "cpu": whose kernels run (CPU: the GPU kernels, interpreted)."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


# --- environment ---------------------------------------------------------------------------


def stage_environment(ctx, clock: Clock) -> dict:
    import jaxlib

    device = jax.devices()[0]
    return {
        "ok": True,
        "platform": _platform(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "platform_version": getattr(device.client, "platform_version", None),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "peak_bytes_per_s": peak_bytes_per_s(device.device_kind),
        "tiny": ctx.tiny,
    }


# --- kernels -------------------------------------------------------------------------------


def _kernels(plat: str) -> dict:
    """name -> the kernel functions of this platform (interpret mode off an accelerator)."""
    if plat == "tpu":
        return {
            "appended": pallas_tpu_decode.appended_attention,
            "block": pallas_tpu_decode.block_attention,
            "train": pallas_tpu.block_attention,
        }
    interpret = {"interpret": plat != "gpu"}
    wrap = lambda f: lambda *a, **k: f(*a, **interpret, **k)
    return {
        "appended": wrap(pallas_gpu.appended_attention),
        "block": wrap(pallas_gpu.block_attention),
        "train": wrap(pallas_gpu.block_attention),
    }


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _errors(got, want) -> tuple[float, int, float]:
    """(max |got - want| over the finite entries, NaN count of got, max |want|)."""
    got = [np.asarray(g, np.float32) for g in jax.tree.leaves(got)]
    want = [np.asarray(w, np.float32) for w in jax.tree.leaves(want)]
    nans = sum(int(np.sum(~np.isfinite(g))) for g in got)
    pairs = zip(got, want, strict=True)
    err = max(float(np.max(np.abs(np.nan_to_num(g) - w), initial=0)) for g, w in pairs)
    scale = max(float(np.max(np.abs(w), initial=0)) for w in want)
    return err, nans, scale


def _result(name, dtype, got, want, low) -> dict:
    """One kernel result: the kernel's output `got` and the XLA reference in the input dtype
    `low` against the fp32 reference `want`."""
    err, nans, scale = _errors(got, want)
    low_err, _, _ = _errors(low, want)
    tol = TOLERANCE[dtype] * max(1.0, scale)
    return {
        "name": name,
        "max_abs_error": err,
        "nan_count": nans,
        "ok": bool(nans == 0 and err <= tol),
        "tolerance": tol,
        "reference_scale": scale,
        "xla_same_dtype_error": low_err,
    }


def _kernel_cases(plat: str, dtype: str, h: int):
    """(the core cases, split variants): (name, thunk -> (kernel output, fp32 reference, XLA
    reference in `dtype`)) pairs for one dtype and head dim. Caches of 256 slots, 2 rows, 2 KV
    heads of 4 query heads; slots past a row's live length hold NaN in the kernel's input and
    zeros in the reference's."""
    rng = np.random.default_rng(h)
    kern = _kernels(plat)
    b, kh, g, s = 2, 2, 4, 256
    f32 = jnp.float32
    cast = lambda tree, dt: jax.tree.map(lambda x: x.astype(dt) if x.dtype == f32 else x, tree)

    def both(ref_fn, args):  # the reference in fp32 and in `dtype`
        return jax.jit(ref_fn)(*cast(args, f32)), jax.jit(ref_fn)(*args)

    def appended(t, splits, tree=False):
        q = _normal(rng, (b, t, kh * g, h), dtype)
        k, v = _normal(rng, (b, kh, s, h), dtype), _normal(rng, (b, kh, s, h), dtype)
        nk, nv = _normal(rng, (b, kh, t, h), dtype), _normal(rng, (b, kh, t, h), dtype)
        lengths = jnp.asarray([s // 2 - 3, s - t], jnp.int32)  # mid-tile, at the buffer's end
        tree_mask = None
        if tree:
            parents = [[0] + [int(rng.integers(0, i)) for i in range(1, t)] for _ in range(b)]
            tree_mask = xla.tree_attention_mask(jnp.asarray(parents, jnp.int32))
        live = jnp.arange(s)[None, None, :, None] < lengths[:, None, None, None]
        k, v = jnp.where(live, k, 0).astype(dtype), jnp.where(live, v, 0).astype(dtype)
        kn, vn = jnp.where(live, k, jnp.nan), jnp.where(live, v, jnp.nan)
        opts = {} if plat == "tpu" or not splits else {"tiles": pallas_gpu.Tiles(splits=splits)}
        got = jax.jit(lambda *a: kern["appended"](*a, **opts))(
            q, kn, vn, nk, nv, lengths, tree_mask
        )
        ref = lambda *a: xla.append_attention(*a)
        return (got, *both(ref, (q, k, v, nk, nv, lengths, tree_mask)))

    def drafter(blocks, j, grad):
        q_len = blocks * j
        q = _normal(rng, (b, q_len, kh * g, h), dtype)
        ck, cv = _normal(rng, (b, kh, s, h), dtype), _normal(rng, (b, kh, s, h), dtype)
        bk, bv = _normal(rng, (b, kh, q_len, h), dtype), _normal(rng, (b, kh, q_len, h), dtype)
        lengths = jnp.asarray([s - 5, s // 3], jnp.int32)
        anchors = jnp.sort(jnp.asarray(rng.integers(1, s, (b, blocks)), jnp.int32), axis=1)
        if blocks == 1:
            anchors = lengths[:, None]
        live = jnp.arange(s)[None, None, :, None] < lengths[:, None, None, None]
        ck, cv = jnp.where(live, ck, 0).astype(dtype), jnp.where(live, cv, 0).astype(dtype)
        ckn, cvn = jnp.where(live, ck, jnp.nan), jnp.where(live, cv, jnp.nan)
        lo, hi = xla.context_bounds(lengths, anchors, j)
        ctx_mask, blk_mask = xla.context_mask(lengths, anchors, j, s), xla.block_mask(j)
        name = "train" if grad else "block"
        fwd = lambda *a: kern[name](*a, lo, hi, block_size=j)
        ref = lambda *a: xla.block_attention(*a, ctx_mask, blk_mask)
        arrays = (q, ck, cv, bk, bv)
        if not grad:
            got = jax.jit(fwd)(q, ckn, cvn, bk, bv)
            return (got, *both(ref, arrays))
        cot = _normal(rng, q.shape, f32)

        def grads(fn):
            loss = lambda *a: jnp.sum(fn(*a).astype(f32) * cot)
            return jax.jit(jax.grad(loss, argnums=range(5)))

        got = grads(fwd)(q, ckn, cvn, bk, bv)
        return got, grads(ref)(*cast(arrays, f32)), grads(ref)(*arrays)

    tag = f"{dtype}_h{h}"
    core = [
        (f"appended_q1_{tag}", lambda: appended(1, 0)),
        (f"appended_q16_{tag}", lambda: appended(16, 0)),
        (f"tree16_{tag}", lambda: appended(16, 0, tree=True)),
        (f"drafting_block16_{tag}", lambda: drafter(1, 16, False)),
        # The TPU training kernel takes >= MIN_QUERIES queries: 8 blocks of 16.
        (f"training_forward_{tag}", lambda: drafter(8, 16, False)),
        (f"training_backward_{tag}", lambda: drafter(8, 16, True)),
    ]
    if plat == "tpu":  # the forward of 8 blocks is the training kernel's, not the decode one's
        core[4] = (core[4][0], lambda: _tpu_training_forward(kern, drafter))
        return core, []
    # Split counts chosen by hand (the GPU kernels; 4 key tiles of 64 in the 256-slot cache).
    extra = [(f"appended_q1_splits{p}_{tag}", lambda p=p: appended(1, p)) for p in (1, 3)]
    extra += [(f"appended_q16_splits{p}_{tag}", lambda p=p: appended(16, p)) for p in (1, 2, 4)]
    return core, extra


def _tpu_training_forward(kern, drafter):
    saved = kern["block"]
    kern["block"] = kern["train"]
    try:
        return drafter(8, 16, False)
    finally:
        kern["block"] = saved


def stage_kernels(ctx, clock: Clock) -> dict:
    plat = _platform()
    results, skipped = [], []
    combos = (("bfloat16", 64), ("bfloat16", 128), ("float32", 128))
    cases = [_kernel_cases(plat, dtype, h) for dtype, h in combos]
    # Every kernel at every dtype and head dim first, kernel by kernel (a budget spent midway
    # leaves each dtype some), then the split variants (--tiny: those of the first only).
    order = [core[i] for i in range(len(cases[0][0])) for core, _ in cases]
    order += [c for _, extra in cases[: 1 if ctx.tiny else None] for c in extra]
    for name, thunk in order:
        dtype = "float32" if "float32" in name else "bfloat16"
        if clock.left() < 0:
            skipped.append(name)
            continue
        t0 = time.perf_counter()
        try:
            got, want, low = thunk()
            row = _result(name, dtype, got, want, low)
        except Exception as e:  # noqa: BLE001 - a failing kernel is a result
            row = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:800]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(row)
        print(f"  {name}: {'ok' if row['ok'] else 'FAILED'} {row.get('max_abs_error')}")
    ok = bool(results) and all(r["ok"] for r in results)
    return {
        "ok": ok,
        "kernels": "interpret" if plat == "cpu" else plat,
        "results": results,
        "skipped": skipped,
    }


# --- kernel_timing -------------------------------------------------------------------------


def _chained(fn, calls: int):
    """jit of q -> fn(q, *rest) applied `calls` times in a fori_loop, each output the next q."""

    def loop(q, *rest):
        return lax.fori_loop(0, calls, lambda i, x: fn(x, *rest).astype(x.dtype), q)

    return jax.jit(loop)


def _time_chained(fn, args, calls: int, repeats: int = 3) -> tuple[float, float]:
    """(compile seconds, best seconds per call) of `calls` chained calls of fn."""
    t0 = time.perf_counter()
    compiled = _chained(fn, calls).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    return compile_s, best / calls


def _tpu_steps(keys: int, heads: int, q, k, *rest):
    """The TPU decode kernel with `keys` cache slots and `heads` KV heads per grid step (0: as
    many as `heads_per_step` gives)."""
    heads = heads or pallas_tpu_decode.heads_per_step(k.shape[1], k.shape[3], k.dtype)
    return pallas_tpu_decode.appended_attention(q, k, *rest, steps=(keys, heads))


def _timing_variants(plat: str) -> dict:
    """variant name -> appended_attention with its options (None: XLA's attention)."""
    if plat == "tpu":
        variants = {"kernel": lambda *a: pallas_tpu_decode.appended_attention(*a)}
        # The grid step as it was (128 keys of one KV head), 512 keys of one, 1024 of the
        # default's group: (cache slots, KV heads) per step, 0 heads the default's.
        for keys, heads in ((128, 1), (512, 1), (1024, 0)):
            variants[f"keys{keys}_heads{heads or 'auto'}"] = functools.partial(
                _tpu_steps, keys, heads
            )
        variants["xla"] = None
        return variants
    interpret = plat != "gpu"
    variants = {"kernel": lambda *a: pallas_gpu.appended_attention(*a, interpret=interpret)}
    if plat == "gpu":
        for splits in (1, 4, 16):
            tiles = pallas_gpu.Tiles(splits=splits, keys=128)
            variants[f"splits{splits}_keys128"] = lambda *a, t=tiles: pallas_gpu.appended_attention(
                *a, tiles=t
            )
    variants["xla"] = None
    return variants


def stage_kernel_timing(ctx, clock: Clock) -> dict:
    plat = _platform()
    if ctx.tiny:
        heads, batches, queries, lives, calls = (8, 2, 64), (1, 2), (1, 16), (256, 1024), 4
    else:
        heads, batches, queries, lives, calls = (
            (32, 8, 128),
            (1, 8),
            (1, 16),
            (1024, 4096, 16384),
            200,
        )
    n, kh, h = heads
    dtype = jnp.bfloat16
    peak = peak_bytes_per_s(jax.devices()[0].device_kind)
    variants = _timing_variants(plat)
    rows, skipped = [], []
    rng = np.random.default_rng(0)
    for b in batches:
        for t in queries:
            for live in lives:
                s = live + 128  # room past the live slots, as a decode's buffer has
                q = _normal(rng, (b, t, n, h), dtype)
                k, v = _normal(rng, (b, kh, s, h), dtype), _normal(rng, (b, kh, s, h), dtype)
                nk, nv = _normal(rng, (b, kh, t, h), dtype), _normal(rng, (b, kh, t, h), dtype)
                lengths = jnp.full((b,), live - t, jnp.int32)
                args = (q, k, v, nk, nv, lengths)
                read = 2 * b * kh * live * h * 2  # live K and V, bf16
                for name, fn in variants.items():
                    label = f"b{b}_q{t}_live{live}_{name}"
                    one = name == "kernel" or (b == 1 and t == 1)  # variants: one case only
                    if not one and name != "xla":
                        continue
                    if clock.left() < 0:
                        skipped.append(label)
                        continue
                    if fn is None:
                        fn = lambda q_, k_, v_, nk_, nv_, l_: xla.append_attention(
                            q_, k_, v_, nk_, nv_, l_
                        )
                    try:
                        compile_s, per_call = _time_chained(fn, args, calls)
                    except Exception as e:  # noqa: BLE001 - a failing variant is a result
                        rows.append({"case": label, "error": f"{type(e).__name__}: {e}"[:500]})
                        continue
                    gbs = read / per_call / 1e9
                    rows.append({
                        "case": label, "batch": b, "queries": t, "live": live, "variant": name,
                        "us_per_call": round(per_call * 1e6, 2), "gb_per_s": round(gbs, 1),
                        "of_peak": None if peak is None else round(gbs * 1e9 / peak, 3),
                        "compile_s": round(compile_s, 2),
                    })  # fmt: skip
                    print(f"  {label}: {per_call * 1e6:.1f} us/call, {gbs:.1f} GB/s")
    ok = bool(rows) and all("error" not in r for r in rows if r["variant"] == "kernel")
    return {
        "ok": ok,
        "heads": {"query": n, "kv": kh, "head_dim": h},
        "calls_per_loop": calls,
        "peak_bytes_per_s": peak,
        "results": rows,
        "skipped": skipped,
    }


# --- decode --------------------------------------------------------------------------------

TINY_TARGET = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
}  # fmt: skip


def _decode_dtype() -> str:
    """The decode stages' dtype: bf16 on an accelerator; float32 on a CPU, the dtype CPU runs
    decode in (bf16 is emulated there; its AR loop's cache copy is reported apart, `stage_hlo`)."""
    return "float32" if _platform() == "cpu" else "bfloat16"


def _models(ctx):
    """(target, drafter) with random bf16 weights: Qwen3-8B and a 1-layer drafter of its shape
    (toy ones under --tiny), made once per run."""
    if ctx.models is not None:
        return ctx.models
    from dflash_jax.models.drafter import init_drafter_params
    from dflash_jax.models.target import init_params
    from infer.aot import KNOWN_TARGETS

    hf = TINY_TARGET if ctx.tiny else KNOWN_TARGETS["Qwen/Qwen3-8B"]
    dtype = _decode_dtype()
    tcfg = target_from_hf(hf, dtype=dtype)
    tcfg = dataclasses.replace(tcfg, eos_token_ids=())
    layers = tcfg.num_layers
    dcfg = DrafterConfig(
        hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_layers=1,
        num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
        vocab_size=tcfg.vocab_size, mask_token_id=tcfg.vocab_size - 1,
        target_layer_ids=(1, layers // 2, layers - 2) if layers > 4 else (0, layers - 1),
        num_target_layers=layers, block_size=16, dtype=dtype,
    )  # fmt: skip
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    tparams = jax.jit(lambda r: cast(init_params(tcfg, r)))(jax.random.key(0))
    dparams = jax.jit(lambda r: cast(init_drafter_params(dcfg, r)))(jax.random.key(1))
    ctx.models = (
        SimpleNamespace(config=tcfg, params=tparams),
        SimpleNamespace(config=dcfg, params=dparams),
    )
    return ctx.models


def _weight_bytes(params) -> int:
    """Bytes a token's forward reads: every weight but the embedding table (gathered)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(x.nbytes for path, x in flat if "embed" not in jax.tree_util.keystr(path))


def _decode_config(new_tokens: int, block: int) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=new_tokens, block_size=block, stop_token_ids=())


def _timed(ctx, drafter, cfg, steps: int) -> dict:
    """A decode run twice (the second timed): per-step ms, compile seconds."""
    from dflash_jax.decoding import runner

    target = ctx.models[0]
    p = ctx.prompt.shape[1]
    lengths = np.full((1,), p, np.int32)
    runs = [
        runner.timed_decode(target, drafter, ctx.prompt, lengths, 0, cfg, step_limit=steps)
        for _ in range(2)
    ]
    run = runs[-1]
    done = int(np.max(run.output.num_steps))
    tokens = int(np.max(run.output.lengths))
    return {
        "ms_per_step": 1e3 * (run.run_s - run.start_s) / max(done, 1),
        "steps": done,
        "tokens": tokens,
        "prefill_ms": 1e3 * run.start_s,
        "compile_s": round(runs[0].compile_s, 2),
        "cache_slots": None,
    }


def stage_decode(ctx, clock: Clock) -> dict:
    target, drafter = _models(ctx)
    tcfg = target.config
    p, new, steps = (32, 24, 16) if ctx.tiny else (128, 160, 128)
    rng = np.random.default_rng(0)
    ctx.prompt = rng.integers(0, tcfg.vocab_size - 2, (1, p)).astype(np.int32)
    weight_bytes = _weight_bytes(target.params)
    peak = peak_bytes_per_s(jax.devices()[0].device_kind)
    roofline_ms = None if peak is None else 1e3 * weight_bytes / peak
    out = {
        "target": "toy qwen3 (2 layers)" if ctx.tiny else "Qwen3-8B, random weights",
        "dtype": tcfg.dtype,
        "prompt_tokens": p,
        "weight_bytes_per_token": weight_bytes,
        "roofline_ms_per_token": roofline_ms,
        "skipped": [],
    }
    ar = _timed(ctx, None, _decode_config(new, 1), steps)
    ar["cache_slots"] = p + new + 2
    out["ar"] = ar
    out["ar_ms_per_token"] = ar["ms_per_step"]
    if roofline_ms:
        out["ar_over_roofline"] = ar["ms_per_step"] / roofline_ms
    print(f"  AR: {ar['ms_per_step']:.2f} ms/token (roofline {roofline_ms})")
    if clock.left() > 0:
        chain = _timed(ctx, drafter, _decode_config(new, 16), steps)
        chain["cache_slots"] = p + new + 32
        out["chain16"] = chain
        out["chain16_step_in_ar_steps"] = chain["ms_per_step"] / ar["ms_per_step"]
        print(f"  chain 16: {out['chain16_step_in_ar_steps']:.2f} AR steps")
    else:
        out["skipped"].append("chain16")
    if clock.left() > 0:
        long = _timed(ctx, None, _decode_config(4096 - p - 2, 1), steps)
        long["cache_slots"] = 4096
        out["ar_buffer4096"] = long
        out["buffer4096_over_short"] = long["ms_per_step"] / ar["ms_per_step"]
        print(f"  AR, 4096-slot buffer: {long['ms_per_step']:.2f} ms/token")
    else:
        out["skipped"].append("ar_buffer4096")
    out["ok"] = all(np.isfinite(out[k]["ms_per_step"]) for k in ("ar", "chain16") if k in out)
    return out


# --- hlo -----------------------------------------------------------------------------------


def _advance_copies(target, drafter, block: int, new: int, p: int) -> dict:
    """The cache copies in the loop of the advance program of a decode (AR when drafter is
    None, else chains of `block`) as `decoding.runner` compiles it (the decode stage's
    executable when it ran the same one: compiled once per process)."""
    from dflash_jax.decoding import runner

    prompt, lengths = np.zeros((1, p), np.int32), np.full((1,), p, np.int32)
    cfg = _decode_config(new, block)
    start, advance, head, inputs, statics, _ = runner.decode_halves(
        target, drafter, prompt, lengths, 0, cfg, None, -1, None
    )
    start_x, _, _ = runner.compile_half(start, head, statics, None)
    state = start_x.out_info
    compiled, _, _ = runner.compile_half(
        advance, (*head, *inputs, np.int32(0), state), statics, None
    )
    cache = jax.tree.leaves(state.cache.k)[0]
    hlo = compiled.as_text()
    return {
        "cache_shape": list(cache.shape),
        "cache_dtype": str(cache.dtype),
        "cache_copies_in_loop": cache_copies_in_loop(hlo, int(np.prod(cache.shape))),
        "while_loops": hlo.count(" while("),
    }


def stage_hlo(ctx, clock: Clock, trace_dir: Path) -> dict:
    from dflash_jax.decoding import runner

    target, drafter = _models(ctx)
    p = ctx.prompt.shape[1] if ctx.prompt is not None else 32
    new = 24 if ctx.tiny else 160
    out = {"programs": {}}
    for name, d, block in (
        ("advance_autoregressive", None, 1),
        ("advance_speculative", drafter, 16),
    ):
        out["programs"][name] = _advance_copies(target, d, block, new, p)
        print(f"  {name}: {out['programs'][name]['cache_copies_in_loop']} cache copies in loop")
    out["cache_copies_in_loop"] = sum(v["cache_copies_in_loop"] for v in out["programs"].values())
    if _platform() == "cpu" and clock.left() > 0:
        # Not counted above: XLA:CPU emulates bf16, and its AR loop copies each layer's K and
        # V cache every step (the one-row write; docs/kernels.md). Reported, so a fix shows.
        cast = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
        bf16 = SimpleNamespace(
            config=dataclasses.replace(target.config, dtype="bfloat16"),
            params=cast(target.params),
        )
        out["cpu_bfloat16_ar"] = _advance_copies(bf16, None, 1, new, p)
    # A short profiler trace of AR steps, beside the JSON.
    prompt, lengths = np.zeros((1, p), np.int32), np.full((1,), p, np.int32)
    cfg = _decode_config(new, 1)
    try:
        runner.timed_decode(target, None, prompt, lengths, 0, cfg, step_limit=2)
        with jax.profiler.trace(str(trace_dir)):
            runner.timed_decode(target, None, prompt, lengths, 0, cfg, step_limit=8)
        out["trace_dir"] = str(trace_dir)
        out["trace_files"] = sorted(
            str(f.relative_to(trace_dir)) for f in trace_dir.rglob("*") if f.is_file()
        )
    except Exception as e:  # noqa: BLE001 - a missing trace does not void the count
        out["trace_error"] = f"{type(e).__name__}: {e}"[:500]
    out["ok"] = out["cache_copies_in_loop"] == 0
    return out


# --- the run -------------------------------------------------------------------------------


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    bad = sorted(set(FLAGS.stages) - set(STAGES))
    if bad:
        raise app.UsageError(f"unknown --stages {bad}; the stages are {STAGES}")
    path = Path(FLAGS.output)
    trace_dir = path.with_name(path.stem + "_trace")
    shutil.rmtree(trace_dir, ignore_errors=True)  # this run's trace only
    ctx = SimpleNamespace(tiny=FLAGS.tiny, models=None, prompt=None)
    budgets = TINY_BUDGET_S if FLAGS.tiny else BUDGET_S
    runners = {
        "environment": stage_environment,
        "kernels": stage_kernels,
        "kernel_timing": stage_kernel_timing,
        "decode": stage_decode,
        "hlo": lambda c, clock: stage_hlo(c, clock, trace_dir),
    }
    data = {"command": "infer.bench.device_check", "tiny": FLAGS.tiny, "stages": {}}
    t_all = time.perf_counter()
    for name in (s for s in STAGES if s in FLAGS.stages):
        print(f"== {name} (budget {budgets[name]} s)", flush=True)
        data["stages"][name] = {"ok": False, "status": "running"}
        _write(path, data)
        clock = Clock(budgets[name])
        try:
            result = runners[name](ctx, clock)
        except Exception as e:  # noqa: BLE001 - a failing stage is recorded, the next ones run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        result["seconds"] = round(time.perf_counter() - clock.start, 2)
        result["budget_s"] = budgets[name]
        data["stages"][name] = result
        data["seconds"] = round(time.perf_counter() - t_all, 2)
        _write(path, data)
        print(
            f"== {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", flush=True
        )
    data["ok"] = all(s["ok"] for s in data["stages"].values())
    _write(path, data)
    print(f"wrote {path}: {'every stage ok' if data['ok'] else 'FAILED'} in {data['seconds']} s")
    if not data["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
