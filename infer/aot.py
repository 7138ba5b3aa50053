"""The programs a decode or a training run compiles, built from shapes alone: no weight is read
and nothing is allocated. Params, optimizer state, caches and batches are `jax.eval_shape`
structures placed by the sharding table on a mesh of fake CPU devices, and each program is the
jitted function the run itself calls, with those structures as its arguments. `infer.memory_plan`
compiles them for their memory figures; `infer.lower` lowers them for a TPU or a GPU.

    mesh = fake_mesh("fsdp=4,tensor=2")          # before anything else starts a jax backend
    platform.TARGET = "tpu"                      # traced as for a TPU (ops.platform: its kernels)
    for program in speculative_programs(cfg, mesh, DecodeShape(batch=8), "auto", "tpu"):
        program.lower("tpu")

The target's shapes come from a local HF directory's config.json, a GGUF file's metadata (and
so the embedded `smollm2-135m-instruct`) or, offline, from `KNOWN_TARGETS` for the hub ids of
configs/*.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.config import QUANT_SCHEMES, TargetConfig
from dflash_jax.io import assets
from dflash_jax.io.gguf import read_gguf
from dflash_jax.io.hf import generation_eos_ids
from dflash_jax.io.hf_config import target_from_hf

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
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 10000000,
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # Qwen3.5-9B's shape (its config.json keeps these under text_config).
    "Qwen/Qwen3.5-9B": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
    },
    "google/gemma-3-1b-it": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
        "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "eos_token_id": [1, 106],
        "bos_token_id": 2,
    },
    # gpt-oss-20b's config.json, less its quantization_config (MXFP4 experts, dequantized at load).
    "openai/gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "attention_bias": True, "rms_norm_eps": 1e-05,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "swiglu_limit": 7.0,
        "rope_theta": 150000, "eos_token_id": 200002, "pad_token_id": 199999,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                         "truncate": False},
    },
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """What a decode is planned or lowered for: rows, prompt buffer width, new tokens per row,
    block size (0: the platform's default, `api.decode_mode`), the param and cache dtype, the
    target's quantization, the decode mode as `infer.generate`'s flags give it (--adaptive,
    --tree_nodes, --batch_invariant; None: the platform's default) and the row tile of a
    batch-invariant decode (--row_tile; 0: `ops.invariance.ROW_TILE`). The decode config is
    built from these by `api.generate_config`, as the runs build theirs; a batch-invariant
    program is the same for every platform (one fixed row tile, nothing probed), so it lowers
    for one on any other. There the default decode is the plain one
    (`programs.default_invariant`)."""

    batch: int = 32
    prompt_len: int = 1024
    max_new_tokens: int = 1024
    block_size: int = 0
    dtype: str = "bfloat16"
    quantize: str | None = None  # the target's quantized kernels (`TargetConfig.quantize`)
    adaptive: bool | None = None  # None: the platform's default (`api.decode_mode`)
    tree_nodes: int = 0
    batch_invariant: bool | None = None  # None: the platform's default (`default_invariant`)
    row_tile: int = 0  # 0: `ops.invariance.ROW_TILE`


def define_shape_flags(flags) -> None:
    """The decode-shape flags (--batch, --prompt_len, --max_new_tokens, --block_size, --dtype)
    of the commands that plan or lower a decode (infer.memory_plan, infer.lower), defaults
    from `DecodeShape`; read them back with `shape_from_flags`."""
    shape = DecodeShape()
    flags.DEFINE_integer("batch", shape.batch, "Decode: rows decoded together.", lower_bound=1)
    flags.DEFINE_integer(
        "prompt_len", shape.prompt_len, "Decode: prompt buffer width.", lower_bound=1
    )
    flags.DEFINE_integer(
        "max_new_tokens", shape.max_new_tokens, "Decode: new tokens per row.", lower_bound=1
    )
    flags.DEFINE_integer(
        "block_size", shape.block_size,
        "Decode: block size (0: the platform's default, as infer.generate: the config's, at most "
        "16 on a CPU).", lower_bound=0,
    )  # fmt: skip
    flags.DEFINE_enum(
        "dtype", shape.dtype, ["bfloat16", "float32"],
        "Decode: param and cache dtype (training uses the config's compute_dtype).",
    )  # fmt: skip
    flags.DEFINE_enum(
        "quantize", None, list(QUANT_SCHEMES),
        "Decode: the target's decoder-layer kernels quantized to this scheme (int8/fp8 per "
        "output channel, int4 per block of 32, mxfp4 gpt-oss's experts only; "
        "docs/quantization.md), sharded by the same table "
        "as the float kernels; the drafter, embedding and head stay in --dtype. Unset: float.",
    )  # fmt: skip
    flags.DEFINE_bool(
        "adaptive", None,
        "Decode: the adaptive draft length (infer.generate's --adaptive). Unset: the default "
        "of the platform the program is for (on a CPU, off on GPU and TPU).",
    )  # fmt: skip
    flags.DEFINE_integer(
        "tree_nodes", 0, "Decode: verify a token tree of this many tokens (0: a chain).",
        lower_bound=0,
    )  # fmt: skip
    flags.DEFINE_bool(
        "batch_invariant", None,
        "Decode: the batch-invariant program (infer.generate's --batch_invariant). Unset: the "
        "platform's default (bfloat16 on a CPU; off on GPU and TPU).",
    )  # fmt: skip
    flags.DEFINE_integer(
        "row_tile", 0,
        "Decode: the batch-invariant program's row tile, every matmul at exactly this many rows "
        "(infer.generate's --row_tile; 0: 32).", lower_bound=0, upper_bound=1024,
    )  # fmt: skip


def shape_from_flags(values) -> DecodeShape:
    """The `DecodeShape` the `define_shape_flags` flags in `values` (absl's FLAGS) name."""
    return DecodeShape(
        values.batch, values.prompt_len, values.max_new_tokens, values.block_size, values.dtype,
        values.quantize, values.adaptive, values.tree_nodes, values.batch_invariant,
        values.row_tile,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program, its abstract arguments (ShapeDtypeStructs, with shardings on a mesh),
    the static keyword arguments it is called with and the compiler options a run compiles it
    with (`programs.executable_options`)."""

    name: str
    fn: Any
    args: tuple
    statics: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)  # what a reader needs to know
    # -> the decode loop state it carries, for a program whose `statics` are bound (on a mesh)
    loop_state: Callable[[], Any] | None = None

    def lower(self, platform: str | None = None, mesh=None):
        """-> jax's Lowered for `platform` ("tpu", "cuda", ...; None: this process's backend).
        On a one-device `mesh` the arguments are unplaced, so they are traced with its device
        as the default one (a deviceless accelerator's chip, `chip_mesh`)."""
        platforms = None if platform is None else (platform,)
        one = mesh is not None and mesh.devices.size == 1
        with jax.default_device(mesh.devices.flat[0]) if one else contextlib.nullcontext():
            return self.fn.trace(*self.args, **self.statics).lower(lowering_platforms=platforms)

    def fingerprint(self, lowered) -> str:
        """`programs.fingerprint` of this program lowered (`lower`): what `infer.generate
        --json` reports for the program it compiled."""
        from dflash_jax.decoding import programs

        return programs.fingerprint(lowered, self.options)


def mesh_sizes(spec: str) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of a --mesh `spec` ("" = one device; an axis left out has size 1);
    ValueError naming what is wrong."""
    sizes = sharding.parse_mesh(spec) if spec.strip() else {}
    return sizes.get("data", 1), sizes.get("fsdp", 1), sizes.get("tensor", 1)


def fake_mesh(spec: str) -> jax.sharding.Mesh:
    """The mesh `spec` describes over exactly as many fake CPU devices as it needs. Call it
    before anything starts a jax backend; a bad spec raises ValueError naming what is wrong."""
    sizes = mesh_sizes(spec)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", math.prod(sizes))
    return sharding.make_mesh(*sizes)


def chip_mesh(spec: str, device) -> jax.sharding.Mesh:
    """The mesh `spec` describes over the chips of `device` (`infer.devices.Device`, a
    deviceless GPU or TPU slice: `devices.topology_devices`), no accelerator backend started.
    ValueError for a bad spec, RuntimeError naming the package when its compiler is absent."""
    from infer import devices

    sizes = mesh_sizes(spec)
    jax.config.update("jax_platforms", "cpu")  # no accelerator backend: compile-only devices
    return sharding.make_mesh(*sizes, devices=devices.topology_devices(device))


def target_config(source: str, dtype: str) -> TargetConfig:
    """The target's config from `source` (an HF directory, a .gguf file, the embedded
    `smollm2-135m-instruct`, or a hub id of `KNOWN_TARGETS`) without reading a weight;
    ValueError when it is none of these."""
    path = Path(source).expanduser()
    if source.lower() == assets.SMOLLM2_NAME:
        path = assets.smollm2_gguf_path()
    if path.is_file() and path.suffix == ".gguf":
        return target_from_hf(read_gguf(path)[0], dtype=dtype)
    if (path / "config.json").is_file():
        config = target_from_hf(json.loads((path / "config.json").read_text()), dtype=dtype)
        eos = tuple(dict.fromkeys(config.eos_token_ids + generation_eos_ids(path)))
        return dataclasses.replace(config, eos_token_ids=eos)  # as the loader reads them
    if source in KNOWN_TARGETS:
        return target_from_hf(KNOWN_TARGETS[source], dtype=dtype)
    raise ValueError(
        f"target {source!r}: give an HF directory (its config.json), a .gguf file, "
        f"{assets.SMOLLM2_NAME!r} or one of {sorted(KNOWN_TARGETS)}"
    )


def _put(tree, shardings_of, mesh):
    """`tree` placed by the table on `mesh` (`shardings_of(tree, mesh)`); mesh None: as it is."""
    return tree if mesh is None else sharding.put(tree, shardings_of(tree, mesh))


def abstract_params(init, config, dtype, mesh):
    """The params `init(config, rng)` makes, as `dtype` ShapeDtypeStructs placed on `mesh` by
    the sharding table (mesh None: unplaced)."""
    out = jax.eval_shape(functools.partial(init, config), jax.random.key(0))
    out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), out)
    return _put(out, sharding.param_shardings, mesh)


def _configs(cfg, dtype: str, attention_impl: str):
    """(target config, drafter config) of training config `cfg` in `dtype` with
    `attention_impl`."""
    from dflash_jax.training.trainer import drafter_config_for

    tcfg = dataclasses.replace(target_config(cfg.target, dtype), attention_impl=attention_impl)
    cfg = cfg.copy_and_resolve_references()
    cfg.compute_dtype, cfg.attention_impl = dtype, attention_impl
    return tcfg, drafter_config_for(cfg, tcfg)


def train_program(cfg, mesh, attention_impl: str) -> Program:
    """The training step of config `cfg` (`train_step_on_mesh`) on (train state, frozen target
    params, batch): the batch has the config's rows, sequence length and anchors, and its taps
    when `cfg.taps` is "cached" (otherwise the step runs the target for them)."""
    from dflash_jax.models.target import init_params
    from dflash_jax.training import checkpoint
    from dflash_jax.training.step import OptimizerConfig, train_step_on_mesh
    from dflash_jax.training.trainer import step_settings

    tcfg, dcfg = _configs(cfg, cfg.compute_dtype, attention_impl)
    optimizer = OptimizerConfig.from_config(cfg, cfg.num_steps or 1000)
    state = checkpoint.abstract_state(dcfg, optimizer, mesh)
    target = abstract_params(init_params, tcfg, cfg.compute_dtype, mesh)
    b, s, n = cfg.batch_size, cfg.seq_len, cfg.num_anchors
    batch = {
        "tokens": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "length": jax.ShapeDtypeStruct((b,), jnp.int32),
        "anchors": jax.ShapeDtypeStruct((b, n), jnp.int32),
        "anchor_valid": jax.ShapeDtypeStruct((b, n), jnp.bool_),
        "index": jax.ShapeDtypeStruct((b,), jnp.int32),
    }
    if cfg.taps == "cached":
        features = len(dcfg.target_layer_ids) * tcfg.hidden_size
        batch["taps"] = jax.ShapeDtypeStruct((b, s, features), jnp.dtype(cfg.tap_cache_dtype))
    batch = sharding.put(batch, sharding.batch_shardings(batch, mesh))
    settings = step_settings(cfg, tcfg, dcfg, optimizer)  # the trainer's, in full
    step = train_step_on_mesh(mesh, state, target, batch, **settings)
    return Program("train_step", step, (state, target, batch))


def train_programs(cfg, mesh, attention_impl: str, prompt_len: int) -> list[Program]:
    """Every program a training run of config `cfg` compiles on `mesh`, as `trainer.train`
    builds it: the step (`train_program`) and, with `cfg.eval_every`, the held-out metric
    (`evaluation.heldout_on_mesh`, when `cfg.heldout_metrics`) and the evaluation decode
    (greedy `speculative_decode` of the evaluation prompts, `evaluation.eval_decode_config`;
    their buffer is `prompt_len` wide: a run's is its longest prompt's)."""
    from dflash_jax.decoding import programs as decode_programs
    from dflash_jax.decoding import runner, speculative
    from dflash_jax.decoding.state import carry_shardings
    from dflash_jax.models.drafter import init_drafter_params
    from dflash_jax.models.target import init_params
    from dflash_jax.training import evaluation
    from dflash_jax.training.loss import default_gamma

    out = [train_program(cfg, mesh, attention_impl)]
    if not cfg.eval_every:
        return out
    tcfg, dcfg = _configs(cfg, cfg.compute_dtype, attention_impl)
    run_mesh = _run_mesh(mesh)
    target = abstract_params(init_params, tcfg, cfg.compute_dtype, run_mesh)
    drafter = abstract_params(init_drafter_params, dcfg, cfg.compute_dtype, run_mesh)
    if cfg.heldout_metrics:
        b, s, n = cfg.num_eval_prompts, cfg.seq_len, cfg.num_anchors
        batch = {
            "tokens": jax.ShapeDtypeStruct((b, s), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((b, s), jnp.int32),
            "length": jax.ShapeDtypeStruct((b,), jnp.int32),
            "anchors": jax.ShapeDtypeStruct((b, n), jnp.int32),
            "anchor_valid": jax.ShapeDtypeStruct((b, n), jnp.bool_),
        }
        settings = dict(
            target_config=tcfg,
            drafter_config=dcfg,
            loss_gamma=float(cfg.loss_gamma or default_gamma(cfg.block_size)),
            ce_chunk_rows=cfg.ce_chunk_rows,
        )
        if run_mesh is None:
            out.append(Program("heldout_metrics", evaluation.heldout_jit, (drafter, target, batch),
                               settings))  # fmt: skip
        else:
            batch = sharding.put(batch, sharding.batch_shardings(batch, run_mesh))
            fn = evaluation.heldout_on_mesh(run_mesh, drafter, target, batch, **settings)
            out.append(Program("heldout_metrics", fn, (drafter, target, batch)))
    rows = cfg.num_eval_prompts if cfg.eval_prompts == "held_out" else len(_dev_prompts())
    decode = evaluation.eval_decode_config(
        tcfg, dcfg, cfg.eval_max_new_tokens, cfg.eval_block_size or None
    )
    args = (
        target,
        drafter,
        jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
        jax.eval_shape(lambda: speculative.step_cost_array(decode)),
        jax.ShapeDtypeStruct((), jnp.int32),  # forced kind
        jax.ShapeDtypeStruct((), jnp.int32),  # step limit
    )
    statics = dict(
        target_config=decode_programs.run_target_config(tcfg, decode),
        drafter_config=dcfg,
        decode_config=decode,
    )

    def loop_state(args=args[:5], statics=statics):  # its per-device shapes, as the loop carries it
        state = speculative.start_speculative.eval_shape(*args, **statics)
        if run_mesh is None:
            return state
        put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return jax.tree.map(put, state, carry_shardings(state, run_mesh))

    fn, args, statics = runner.place_half(speculative.speculative_jit, args, statics, run_mesh)
    options = decode_programs.executable_options(tcfg)
    out.append(Program("eval_decode", fn, args, statics, options, loop_state=loop_state))
    return out


def _dev_prompts() -> list:
    from dflash_jax.io.assets import load_dev_prompts

    return load_dev_prompts()


def _run_mesh(mesh):
    """The mesh a run on `mesh` decodes on: None for one device (a run without --mesh calls
    the jitted functions as they are, `runner.place_half`)."""
    return None if mesh.devices.size == 1 else mesh


def _halves(names: tuple[str, str], halves, mesh, head: tuple, inputs: tuple, statics: dict):
    """[start, advance] of a decode as `decoding.runner` compiles them on `mesh`
    (`runner.place_half`): start on (*params, prompt, lengths, rng), advance on those,
    `inputs`, the step limit and the loop state start returns (donated)."""
    from dflash_jax.decoding import programs, runner
    from dflash_jax.decoding.state import carry_shardings

    start, advance = halves
    run_mesh = _run_mesh(mesh)
    options = programs.executable_options(statics["target_config"])
    start_fn, start_args, start_statics = runner.place_half(start, head, statics, run_mesh)
    state = start_fn.eval_shape(*start_args, **start_statics)
    if run_mesh is None:  # as `runner.compile_half` lowers it: types alone
        state = jax.tree.map(programs.unplaced, state)
    state = _put(state, carry_shardings, run_mesh)
    args = (*head, *inputs, jax.ShapeDtypeStruct((), jnp.int32), state)  # step limit, state
    advance_fn, advance_args, advance_statics = runner.place_half(advance, args, statics, run_mesh)
    about = decode_settings(statics["target_config"], statics["decode_config"])
    return [
        Program(names[0], start_fn, start_args, start_statics, options, about),
        Program(names[1], advance_fn, advance_args, advance_statics, options, about),
    ]


def decode_settings(tcfg, decode) -> dict:
    """What a decode program was built with, for `infer.lower`'s lines: block size, adaptive
    step kinds (`decoding.settings.kind_label`), tree size, stop tokens, the row rule (None: not
    batch-invariant), dtype."""
    from dflash_jax.decoding.settings import kind_label

    kinds = [kind_label(k) for k in decode.all_kinds] if decode.adaptive else []
    return {
        "block_size": decode.block_size, "adaptive_kinds": kinds, "tree_nodes": decode.tree_nodes,
        "stop_token_ids": list(decode.stop_token_ids), "invariant_rows": tcfg.invariant_rows,
        "dtype": tcfg.dtype,
    }  # fmt: skip


def _decode_head(tcfg, shape: DecodeShape, mesh) -> tuple:
    """(target params, prompt [B,P], lengths [B], rng) as ShapeDtypeStructs; with
    `shape.quantize` the layer kernels quantized (`models.quantized`), placed by the table."""
    from dflash_jax.models.target import init_params

    mesh = _run_mesh(mesh)
    params = abstract_params(init_params, tcfg, shape.dtype, mesh)
    if shape.quantize:
        from dflash_jax.models.quantized import quantize_params

        params = jax.eval_shape(lambda p: quantize_params(p, tcfg, shape.quantize), params)
        params = _put(params, sharding.param_shardings, mesh)
    return (
        params,
        jax.ShapeDtypeStruct((shape.batch, shape.prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((shape.batch,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )


@dataclasses.dataclass(frozen=True)
class _Model:
    """A target or drafter as `api.generate_config` reads it: its config (no tokenizer: the
    target's stop tokens are its config's, generation_config.json's included)."""

    config: Any
    tokenizer: Any = None


def decode_setup(cfg, shape: DecodeShape, attention_impl: str, platform: str | None):
    """(target config, drafter config, DecodeConfig) of a decode of training config `cfg`'s
    target and drafter in `shape` on `platform` (None: this process's backend), as a run
    builds them: the decode config by `api.generate_config` (the platform's default block
    size, adaptive and lookup kinds, the target's stop tokens, the tree, invariance by dtype
    and platform), the target config by `programs.run_target_config` (the row tile of
    `shape`)."""
    from dflash_jax import api
    from dflash_jax.decoding import programs

    tcfg, dcfg = _configs(cfg, shape.dtype, attention_impl)
    tcfg = dataclasses.replace(tcfg, quantize=shape.quantize)
    decode = api.generate_config(
        _Model(tcfg), _Model(dcfg), max_new_tokens=shape.max_new_tokens,
        block_size=shape.block_size or None, adaptive=shape.adaptive,
        tree_nodes=shape.tree_nodes, batch_invariant=shape.batch_invariant, platform=platform,
        row_tile=shape.row_tile,
    )  # fmt: skip
    return programs.run_target_config(tcfg, decode), dcfg, decode


def speculative_programs(
    cfg, mesh, shape: DecodeShape, attention_impl: str, platform: str | None = None
) -> list[Program]:
    """[start, advance] of the speculative decode of config `cfg`'s target and drafter
    (`decoding.speculative`) for `platform` (`decode_setup`), the programs `infer.generate`
    and `infer.benchmark` compile."""
    from dflash_jax.decoding import speculative
    from dflash_jax.decoding.programs import check_decode_inputs
    from dflash_jax.models.drafter import init_drafter_params

    tcfg, dcfg, decode = decode_setup(cfg, shape, attention_impl, platform)
    check_decode_inputs(tcfg, dcfg, decode)
    target, *rest = _decode_head(tcfg, shape, mesh)
    drafter = abstract_params(init_drafter_params, dcfg, shape.dtype, _run_mesh(mesh))
    inputs = (
        jax.eval_shape(lambda: speculative.step_cost_array(decode)),
        jax.ShapeDtypeStruct((), jnp.int32),  # forced kind
    )
    statics = dict(target_config=tcfg, drafter_config=dcfg, decode_config=decode)
    halves = (speculative.start_speculative, speculative.advance_speculative)
    names = ("start_speculative", "advance_speculative")
    return _halves(names, halves, mesh, (target, drafter, *rest), inputs, statics)


def autoregressive_programs(
    cfg, mesh, shape: DecodeShape, attention_impl: str, platform: str | None = None
) -> list[Program]:
    """[start, advance] of the autoregressive decode of config `cfg`'s target with the
    speculative decode's settings (`decode_setup`; `autoregressive_config`): the baseline of
    `infer.benchmark`, and what `infer.generate` compiles beside the speculative decode."""
    from dflash_jax.decoding import autoregressive

    tcfg, _, decode = decode_setup(cfg, shape, attention_impl, platform)
    statics = dict(target_config=tcfg, decode_config=autoregressive.autoregressive_config(decode))
    halves = (autoregressive.start_autoregressive, autoregressive.advance_autoregressive)
    names = ("start_autoregressive", "advance_autoregressive")
    return _halves(names, halves, mesh, _decode_head(tcfg, shape, mesh), (), statics)
