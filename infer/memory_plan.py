r"""Per-device memory of a training step or a decode on a device mesh, planned on this CPU.

  python -m infer.memory_plan --mode=train --config=configs/qwen3_8b_b16.py --mesh=fsdp=8
  python -m infer.memory_plan --mode=decode --config=configs/qwen3_8b_b16.py --mesh=data=1 \
      --batch=32 --prompt_len=1024 --max_new_tokens=1024

Nothing is allocated: the mesh is made of fake CPU devices, params, optimizer state, caches and
batches are `jax.eval_shape` structures placed by the same sharding table the run uses, and the
step (`train_step_on_mesh`) or the decode (`decoding.programs.on_mesh`) is lowered and compiled
ahead of time.
Per device it prints params, optimizer state, caches (the decode loop's carry: KV caches, drafter
context caches and token buffers) and activations (the compiled program's temporaries, from
XLA's memory_analysis). The temporaries are the CPU compiler's; a GPU build fuses and schedules
differently, and `--attention_impl=xla` (the default here) materialises attention scores that
the Pallas kernels of a GPU run never hold, so that line is an upper bound.

The target's shapes come from a local HF directory's config.json or, offline, from the table
below for the hub ids of configs/*.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from infer import distributed  # noqa: F401  (--mesh)

# config.json fields of the targets configs/*.py name, for planning without the hub.
KNOWN_TARGETS = {
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-4B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
        "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000,
        "max_position_embeddings": 40960, "tie_word_embeddings": True,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    },
}  # fmt: skip

CPU_ONLY = "of which f32 weight copies (CPU only)"

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None,
    "Training config (configs/*.py): the target, the drafter and, for --mode=train, the batch.",
)  # fmt: skip
flags.DEFINE_enum("mode", "train", ["train", "decode"], "Plan a training step or a decode.")
flags.DEFINE_integer("batch", 32, "Decode: rows decoded together.", lower_bound=1)
flags.DEFINE_integer("prompt_len", 1024, "Decode: prompt buffer width.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 1024, "Decode: new tokens per row.", lower_bound=1)
flags.DEFINE_integer("block_size", 0, "Decode: block size (0: the config's).", lower_bound=0)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Decode: param and cache dtype.")
flags.DEFINE_enum(
    "attention_impl", "xla", ["xla", "pallas"],
    "Attention lowered for the plan ('pallas' runs the kernels' interpret mode: slow).",
)  # fmt: skip
flags.DEFINE_bool("compile", True, "Compile for the activations line (slow for big models).")
flags.DEFINE_float("device_gb", 141.0, "Memory of one device in GB (1e9 bytes); H200: 141.")
flags.mark_flag_as_required("config")


def target_config(source: str, dtype: str):
    from dflash_jax.config import TargetConfig

    path = Path(source).expanduser() / "config.json"
    if path.is_file():
        return TargetConfig.from_hf(json.loads(path.read_text()), dtype=dtype)
    if source in KNOWN_TARGETS:
        return TargetConfig.from_hf(KNOWN_TARGETS[source], dtype=dtype)
    raise app.UsageError(
        f"target {source!r}: give an HF directory (its config.json) or one of "
        f"{sorted(KNOWN_TARGETS)}"
    )


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    import jax
    import numpy as np

    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def _params(init, config, dtype):
    """The shapes `init(config, rng)` gives, in `dtype`."""
    import functools

    import jax

    out = jax.eval_shape(functools.partial(init, config), jax.random.key(0))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), out)


def _activations(lowered) -> int | None:
    if not FLAGS.compile:
        return None
    analysis = lowered.compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def plan_train(cfg, mesh) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dflash_jax import sharding
    from dflash_jax.models.target import init_params
    from dflash_jax.training import checkpoint
    from dflash_jax.training.loss import default_gamma
    from dflash_jax.training.step import OptimizerConfig, train_step_on_mesh
    from dflash_jax.training.trainer import drafter_config_for

    tcfg = target_config(cfg.target, cfg.compute_dtype)
    tcfg = dataclasses.replace(tcfg, attention_impl=FLAGS.attention_impl)
    cfg.attention_impl = FLAGS.attention_impl
    dcfg = drafter_config_for(cfg, tcfg)
    optimizer = OptimizerConfig.from_config(cfg, cfg.num_steps or 1000)
    state = checkpoint.abstract_state(dcfg, optimizer, mesh)
    target = _params(init_params, tcfg, jnp.dtype(cfg.compute_dtype))
    target = sharding.put(target, sharding.param_shardings(target, mesh))
    b, s, n = cfg.batch_size, cfg.seq_len, cfg.num_anchors
    batch = {
        "tokens": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "length": jax.ShapeDtypeStruct((b,), jnp.int32),
        "anchors": jax.ShapeDtypeStruct((b, n), jnp.int32),
        "anchor_valid": jax.ShapeDtypeStruct((b, n), jnp.bool_),
        "index": jax.ShapeDtypeStruct((b,), jnp.int32),
    }
    batch = sharding.put(batch, sharding.batch_shardings(batch, mesh))
    step = train_step_on_mesh(
        mesh, state, target, batch,
        target_config=tcfg, drafter_config=dcfg, optimizer=optimizer,
        loss_gamma=float(cfg.loss_gamma or default_gamma(cfg.block_size)),
        ce_chunk_rows=cfg.ce_chunk_rows, vocab_negatives=cfg.vocab_negatives,
    )  # fmt: skip
    return {
        "params (target, frozen)": per_device_bytes(target),
        "params (drafter, fp32 master)": per_device_bytes(state["params"]),
        "optimizer state": per_device_bytes(state["opt_state"]),
        "caches": 0,
        "batch": per_device_bytes(batch),
        "activations (temporaries)": _activations(step.lower(state, target, batch)),
        "shape": f"batch {b} x {s} tokens, {n} anchors, block {cfg.block_size}",
    }


def plan_decode(cfg, mesh) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dflash_jax import sharding
    from dflash_jax.config import DecodeConfig
    from dflash_jax.decoding import phases, programs, speculative
    from dflash_jax.decoding.state import carry_shardings
    from dflash_jax.models.drafter import init_drafter_params
    from dflash_jax.models.target import Head, init_params
    from dflash_jax.training.trainer import drafter_config_for

    dtype = jnp.dtype(FLAGS.dtype)
    tcfg = dataclasses.replace(
        target_config(cfg.target, FLAGS.dtype), attention_impl=FLAGS.attention_impl
    )
    cfg.compute_dtype, cfg.attention_impl = FLAGS.dtype, FLAGS.attention_impl
    dcfg = drafter_config_for(cfg, tcfg)
    decode = DecodeConfig(
        max_new_tokens=FLAGS.max_new_tokens, block_size=FLAGS.block_size or dcfg.block_size
    )
    b, p = FLAGS.batch, FLAGS.prompt_len
    target = _params(init_params, tcfg, dtype)
    drafter = _params(init_drafter_params, dcfg, dtype)
    args = (
        target,
        drafter,
        jax.ShapeDtypeStruct((b, p), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
        jax.ShapeDtypeStruct((1,), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),  # forced kind
        jax.ShapeDtypeStruct((), jnp.int32),  # step limit
    )
    statics = dict(target_config=tcfg, drafter_config=dcfg, decode_config=decode)
    fn, placed, _ = programs.on_mesh(speculative.speculative_jit, mesh, args, statics)

    def carry(target, drafter, prompt, lengths, rng):
        head = Head(dv=jnp.zeros((tcfg.hidden_size, tcfg.vocab_size), dtype))
        return phases.init_speculative(
            target, drafter, head, tcfg, dcfg, decode, prompt, lengths, rng
        )

    state = jax.eval_shape(carry, *args[:5])
    state = sharding.put(state, carry_shardings(state, mesh))
    params = per_device_bytes(placed[:2])
    plan = {
        "params (target)": per_device_bytes(placed[0]),
        "params (drafter)": per_device_bytes(placed[1]),
        "optimizer state": 0,
        "caches (loop carry)": per_device_bytes(state),
        "batch": per_device_bytes(placed[2:4]),
        "activations (temporaries)": _activations(fn.lower(*placed)),
        "shape": f"batch {b}, prompt {p} + {FLAGS.max_new_tokens} new tokens, block "
        f"{decode.block_size}, {FLAGS.dtype}",
    }
    if FLAGS.compile and dtype == jnp.bfloat16:
        # XLA:CPU computes bf16 matmuls in f32 and hoists each weight's conversion out of the
        # loop: f32 copies of every weight (2x the bf16 bytes) sit in the temporaries. A GPU
        # multiplies in bf16 and makes none.
        plan[CPU_ONLY] = 2 * params
    return plan


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import jax

    from dflash_jax import sharding

    spec = FLAGS.mesh or "data=1"
    try:
        sizes = sharding.parse_mesh(spec)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from e
    count = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("tensor", 1)
    # Fake CPU devices, set before any backend starts.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)
    mesh = sharding.mesh_from_spec(spec)
    cfg = FLAGS.config
    plan = (plan_train if FLAGS.mode == "train" else plan_decode)(cfg, mesh)
    shape = plan.pop("shape")
    cpu_only = plan.pop(CPU_ONLY, 0)
    total = sum(v for v in plan.values() if v is not None)
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:.2f} GiB"
    print(f"{FLAGS.mode} {cfg.target} on mesh {dict(mesh.shape)} ({count} devices): {shape}")
    for name, value in plan.items():
        print(f"  {name:38s}{gib(value):>12s}")
    if cpu_only:
        print(f"    {CPU_ONLY:36s}{gib(cpu_only):>12s}")
    rows = [("total per device", total)]
    if cpu_only:
        rows.append(("total less the CPU-only copies", total - cpu_only))
    for name, value in rows:
        fits = "fits" if value <= FLAGS.device_gb * 1e9 else "does NOT fit"
        print(f"  {name:38s}{gib(value):>12s}  ({fits} in {FLAGS.device_gb:g} GB)")


if __name__ == "__main__":
    app.run(main)
