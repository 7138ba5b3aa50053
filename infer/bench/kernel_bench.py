r"""Attention kernels against XLA (and cuDNN where it applies), one layer at Qwen3-8B shapes.

  python -m infer.bench.kernel_bench --output=results/kernel_bench_h200.json          # on a GPU
  python -m infer.bench.kernel_bench --what=memory --output=results/kernel_memory.json  # anywhere

Cases (--what):
  train   the drafter's training attention: batch x (num_anchors x block_size) queries over
          seq_len context slots plus their own blocks (anchors sorted, random); forward, and
          forward + backward (gradients of q and the context and block k/v).
  draft   one drafting step: decode_batch rows, one block of block_size queries over a
          cache_len context cache (rows' live lengths spread over [cache_len/2, cache_len -
          2*block_size]) plus the block.
  verify  one verify step: decode_batch rows, block_size causal queries over a cache_len
          target cache, same live lengths.
  memory  temporary bytes of the training attention's forward + backward: the XLA path from
          the compiled executable's memory_analysis() on this backend; the kernel path the
          same way on GPU, and elsewhere (where it only runs interpreted) from the kernel's
          buffer arithmetic (ops.pallas_gpu.training_buffers). The JSON says which.
Implementations (--impls): xla (ops/attention.py, the reference), pallas (ops/pallas_gpu.py;
GPU only: off-GPU it would time the interpreter), cudnn (jax.nn.dot_product_attention with
implementation="cudnn" and a dense mask, GPU only; keys in its [B,S,K,H] layout, prepared
outside the timed call). A failing implementation is recorded with its error, not fatal.
Timing: ahead-of-time compile, --warmup calls, then the median of --repeats synchronised calls.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dflash_jax.ops import attention as xla
from dflash_jax.ops import pallas_gpu
from infer import cli

CASES = ("train", "draft", "verify", "memory")
SETTINGS = (
    "what", "impls", "batch", "seq_len", "num_anchors", "block_size", "decode_batch", "cache_len",
    "num_heads", "num_kv_heads", "head_dim", "dtype", "rows", "keys", "block_keys", "splits",
    "bwd_rows", "bwd_keys", "num_warps", "num_stages", "warmup", "repeats",
)  # fmt: skip
IMPLS = ("xla", "pallas", "cudnn")

FLAGS = flags.FLAGS
flags.DEFINE_list("what", list(CASES), f"Cases to run, from {CASES}.")
flags.DEFINE_list("impls", list(IMPLS), f"Implementations to time, from {IMPLS}.")
flags.DEFINE_string("output", None, "Write the results here (JSON).")
flags.DEFINE_integer("batch", 1, "Training sequences per call.", lower_bound=1)
flags.DEFINE_integer("seq_len", 3072, "Training context slots per sequence.", lower_bound=1)
flags.DEFINE_integer("num_anchors", 512, "Training blocks per sequence.", lower_bound=1)
flags.DEFINE_integer("block_size", 16, "Tokens per block (training and decode).", lower_bound=2)
flags.DEFINE_integer("decode_batch", 1, "Rows per decode step.", lower_bound=1)
flags.DEFINE_integer("cache_len", 4096, "Cache slots in the decode cases.", lower_bound=64)
flags.DEFINE_integer("num_heads", 32, "Query heads (Qwen3-8B: 32).", lower_bound=1)
flags.DEFINE_integer("num_kv_heads", 8, "KV heads (Qwen3-8B: 8).", lower_bound=1)
flags.DEFINE_integer("head_dim", 128, "Head dim (Qwen3-8B: 128).", lower_bound=1)
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Input dtype.")
flags.DEFINE_integer("rows", 64, "Pallas tile: folded query rows per program.")
flags.DEFINE_integer("keys", 64, "Pallas tile: context/cache slots per loop step.")
flags.DEFINE_integer("block_keys", 16, "Pallas tile: block keys per loop step.")
flags.DEFINE_integer("splits", 0, "Pallas: context splits per row tile (0 = from the shapes).")
flags.DEFINE_integer(
    "bwd_rows", 0, "Pallas backward tile: query rows (0 = from the head dim: 32 at head dim 128)."
)
flags.DEFINE_integer(
    "bwd_keys", 0, "Pallas backward tile: context keys (0 = from the head dim: 32 at head dim 128)."
)
flags.DEFINE_integer(
    "num_warps", 0, "Pallas/Triton: warps per program (0 = 4 up to head_dim 64, else 8)."
)
flags.DEFINE_integer("num_stages", 2, "Pallas/Triton: software pipeline stages.")
flags.DEFINE_integer("warmup", 3, "Untimed calls after compiling.", lower_bound=0)
flags.DEFINE_integer("repeats", 20, "Timed calls (the median is reported).", lower_bound=1)
flags.mark_flag_as_required("output")


def _tiles() -> pallas_gpu.Tiles:
    return pallas_gpu.Tiles(
        rows=FLAGS.rows, keys=FLAGS.keys, block_keys=FLAGS.block_keys, splits=FLAGS.splits,
        bwd_rows=FLAGS.bwd_rows, bwd_keys=FLAGS.bwd_keys, num_warps=FLAGS.num_warps,
        num_stages=FLAGS.num_stages,
    )  # fmt: skip


def _normal(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(FLAGS.dtype)


def _timed(fn, args) -> dict:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(FLAGS.warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "compile_s": compile_s,
    }


def _each_impl(fns: dict, args_for: dict) -> dict:
    out = {}
    for impl in FLAGS.impls:
        if impl not in fns:
            continue
        try:
            out[impl] = _timed(fns[impl], args_for[impl])
        except Exception as e:  # noqa: BLE001 - a failing implementation is a result
            out[impl] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(impl, out[impl], flush=True)
    return out


def _with_grad(fn):
    """fn -> forward + backward: gradients of sum(out) with respect to every array input."""
    return lambda *a: jax.grad(lambda *x: jnp.sum(fn(*x).astype(jnp.float32)), range(len(a)))(*a)


def _to_bshk(x_bksh):
    return jnp.swapaxes(x_bksh, 1, 2)


def _train_inputs():
    b, n, kh, h = FLAGS.batch, FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    s, j = FLAGS.seq_len, FLAGS.block_size
    q_len = FLAGS.num_anchors * j
    keys = jax.random.split(jax.random.key(0), 6)
    arrays = (
        _normal(keys[0], (b, q_len, n, h)),
        _normal(keys[1], (b, kh, s, h)),
        _normal(keys[2], (b, kh, s, h)),
        _normal(keys[3], (b, kh, q_len, h)),
        _normal(keys[4], (b, kh, q_len, h)),
    )
    anchors = jnp.sort(jax.random.randint(keys[5], (b, FLAGS.num_anchors), 0, s), axis=1)
    return arrays, jnp.full((b,), s, jnp.int32), anchors


def _train_fns(lengths, anchors):
    j, s = FLAGS.block_size, FLAGS.seq_len
    ctx_mask, blk_mask = xla.context_mask(lengths, anchors, j, s), xla.block_mask(j)
    lo, hi = xla.context_bounds(lengths, anchors, j)
    dense_mask = xla.drafter_mask(lengths, anchors, j, s)[:, None]

    def cudnn(q, k_bshk, v_bshk):
        return jax.nn.dot_product_attention(
            q, k_bshk, v_bshk, mask=dense_mask, implementation="cudnn"
        )

    return {
        "xla": lambda *a: xla.block_attention(*a, ctx_mask, blk_mask),
        "pallas": lambda *a: pallas_gpu.block_attention(*a, lo, hi, block_size=j, tiles=_tiles()),
        "cudnn": cudnn,
    }


def _case_train() -> dict:
    arrays, lengths, anchors = _train_inputs()
    q, ck, cv, bk, bv = arrays
    fns = _train_fns(lengths, anchors)
    kv_bshk = tuple(_to_bshk(jnp.concatenate(p, axis=2)) for p in ((ck, bk), (cv, bv)))
    args = {"xla": arrays, "pallas": arrays, "cudnn": (q, *kv_bshk)}
    # Visible (query, key) pairs x 4 flops x H x N: the forward's useful matmul work.
    lo, hi = xla.context_bounds(lengths, anchors, FLAGS.block_size)
    pairs = float(jnp.sum(jnp.maximum(hi - lo, 0))) + q.shape[0] * q.shape[1] * FLAGS.block_size
    print("train forward", flush=True)
    forward = _each_impl(fns, args)
    print("train forward+backward", flush=True)
    backward = _each_impl({k: _with_grad(f) for k, f in fns.items()}, args)
    return {
        "forward": forward,
        "forward_backward": backward,
        "useful_forward_tflop": 4 * pairs * FLAGS.num_heads * FLAGS.head_dim / 1e12,
    }


def _decode_lengths():
    spread = np.linspace(FLAGS.cache_len // 2, FLAGS.cache_len - 2 * FLAGS.block_size,
                         FLAGS.decode_batch)  # fmt: skip
    return jnp.asarray(spread.astype(np.int32))


def _case_draft() -> dict:
    b, n, kh, h = FLAGS.decode_batch, FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    s, j = FLAGS.cache_len, FLAGS.block_size
    keys = jax.random.split(jax.random.key(1), 5)
    q = _normal(keys[0], (b, j, n, h))
    ck, cv = _normal(keys[1], (b, kh, s, h)), _normal(keys[2], (b, kh, s, h))
    bk, bv = _normal(keys[3], (b, kh, j, h)), _normal(keys[4], (b, kh, j, h))
    drf_len = _decode_lengths()
    anchors = drf_len[:, None]
    ctx_mask, blk_mask = xla.context_mask(drf_len, anchors, j, s), xla.block_mask(j)
    lo, hi = xla.context_bounds(drf_len, anchors, j)
    dense_mask = xla.drafter_mask(drf_len, anchors, j, s)[:, None]
    fns = {
        "xla": lambda *a: xla.block_attention(*a, ctx_mask, blk_mask),
        "pallas": lambda *a: pallas_gpu.block_attention(*a, lo, hi, block_size=j, tiles=_tiles()),
        "cudnn": lambda q_, k_, v_: jax.nn.dot_product_attention(
            q_, k_, v_, mask=dense_mask, implementation="cudnn"
        ),
    }
    kv_bshk = tuple(_to_bshk(jnp.concatenate(p, axis=2)) for p in ((ck, bk), (cv, bv)))
    arrays = (q, ck, cv, bk, bv)
    return _each_impl(fns, {"xla": arrays, "pallas": arrays, "cudnn": (q, *kv_bshk)})


def _case_verify() -> dict:
    b, n, kh, h = FLAGS.decode_batch, FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    s, t = FLAGS.cache_len, FLAGS.block_size
    keys = jax.random.split(jax.random.key(2), 3)
    q = _normal(keys[0], (b, t, n, h))
    k, v = _normal(keys[1], (b, kh, s, h)), _normal(keys[2], (b, kh, s, h))
    lengths = _decode_lengths()
    mask = xla.causal_cache_mask(lengths, t, s)
    hi = xla.causal_cache_bounds(lengths, t)
    fns = {
        "xla": lambda *a: xla.attention(*a, mask),
        "pallas": lambda *a: pallas_gpu.causal_attention(*a, hi, tiles=_tiles()),
        "cudnn": lambda *a: jax.nn.dot_product_attention(
            *a, mask=mask[:, None], implementation="cudnn"
        ),
    }
    args = (q, k, v)
    return _each_impl(fns, {"xla": args, "pallas": args, "cudnn": (q, _to_bshk(k), _to_bshk(v))})


def _case_memory() -> dict:
    arrays, lengths, anchors = _train_inputs()
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    fns = _train_fns(lengths, anchors)
    result = {}
    impls = ["xla", "pallas"] if jax.default_backend() == "gpu" else ["xla"]
    for impl in impls:
        compiled = jax.jit(_with_grad(fns[impl])).lower(*shapes).compile()
        stats = compiled.memory_analysis()
        result[impl] = {
            "source": f"memory_analysis() of the compiled {jax.default_backend()} executable",
            "temp_bytes": int(stats.temp_size_in_bytes),
            "argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes),
        }
    if "pallas" not in result:
        q = arrays[0]
        buffers = pallas_gpu.training_buffers(
            FLAGS.batch, q.shape[1], FLAGS.seq_len, FLAGS.num_heads, FLAGS.num_kv_heads,
            FLAGS.head_dim, FLAGS.dtype, _tiles(),
        )  # fmt: skip
        on_chip = buffers.pop("on_chip_per_program")
        result["pallas"] = {
            "source": "kernel buffer arithmetic (ops.pallas_gpu.training_buffers): the kernels "
            f"compile for GPU only, and this backend is {jax.default_backend()}",
            "temp_bytes": sum(buffers.values()),
            "buffers": buffers,
            "on_chip_bytes_per_program": on_chip,
        }
        # Cross-check: the same kernels compiled in interpret mode for this backend (the
        # interpreter adds copies of its own: an upper bound, not the GPU figure).
        lo, hi = xla.context_bounds(lengths, anchors, FLAGS.block_size)
        interpreted = lambda *a: pallas_gpu.block_attention(
            *a, lo, hi, block_size=FLAGS.block_size, interpret=True, tiles=_tiles()
        )
        stats = jax.jit(_with_grad(interpreted)).lower(*shapes).compile().memory_analysis()
        result["pallas_interpret"] = {
            "source": f"memory_analysis() of the interpret-mode {jax.default_backend()} executable",
            "temp_bytes": int(stats.temp_size_in_bytes),
        }
    result["ratio_xla_over_pallas"] = result["xla"]["temp_bytes"] / result["pallas"]["temp_bytes"]
    for impl in ("xla", "pallas", "pallas_interpret"):
        if impl not in result:
            continue
        print(f"{impl}: {result[impl]['temp_bytes'] / 2**20:.1f} MiB temporaries "
              f"({result[impl]['source']})")  # fmt: skip
    return result


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    bad = sorted(set(FLAGS.what) - set(CASES)) + sorted(set(FLAGS.impls) - set(IMPLS))
    if bad:
        raise app.UsageError(f"unknown --what/--impls values {bad}; cases {CASES}, impls {IMPLS}")
    if FLAGS.num_heads % FLAGS.num_kv_heads:
        raise app.UsageError("--num_heads must be a multiple of --num_kv_heads")
    results = {
        "settings": {name: FLAGS[name].value for name in SETTINGS},
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "host": platform.node(),
    }  # fmt: skip
    runners = {
        "train": _case_train,
        "draft": _case_draft,
        "verify": _case_verify,
        "memory": _case_memory,
    }
    for case in FLAGS.what:
        print(f"== {case}", flush=True)
        results[case] = runners[case]()
    path = Path(FLAGS.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    cli.run(main)
