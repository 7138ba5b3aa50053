"""A target saved with Orbax, float or quantized (`ops.quant.QWeight` kernels kept as stored):

    <dir>/target_config.json   the TargetConfig's fields (dtype and quantize included)
    <dir>/params/              an `ocp.StandardCheckpointer` pytree (int4 / int8 / float8 qvalues,
                               their scales and offsets as they are)
    <dir>/tokenizer/           the tokenizer (`save_pretrained`), when the target has one

    save_target("/ckpt/smollm2-int4", dj.load_target("smollm2-135m-instruct", quantize="int4"))
    target = dj.load_target("/ckpt/smollm2-int4")   # or restore_target(...)

Restored without an abstract tree (a GGUF-native int4 kernel has offsets and fp16 scales that a
float target's PTQ would not make): every {q: {qvalue, scale}, offset} node becomes a `QWeight`
again, and the params are placed on a `mesh` by the sharding table.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import qwix

from dflash_jax import sharding
from dflash_jax.config import TargetConfig
from dflash_jax.io.hf import CheckpointError
from dflash_jax.io.loaded_target import LoadedTarget
from dflash_jax.ops.quant import QWeight

CONFIG_FILE = "target_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


def is_saved_target(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def save_target(directory: str | os.PathLike, target) -> None:
    """Writes a `LoadedTarget`'s config, params (quantized ones as stored) and tokenizer; never
    overwrites a saved target."""
    directory = Path(directory).expanduser()
    if (directory / PARAMS_DIR).exists():
        raise CheckpointError(f"{directory} already holds a saved target; pick a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory.resolve() / PARAMS_DIR, target.params)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))
    config = dataclasses.asdict(target.config)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))


def restore_target(directory: str | os.PathLike, dtype: str | None = None, mesh=None):
    """The `LoadedTarget` `save_target` wrote. dtype: the compute dtype to run it in (None: the
    saved one); float leaves are cast to it, quantized kernels stay as stored."""
    from dflash_jax.io.tokenizer import load_hf_tokenizer

    directory = Path(directory).expanduser().resolve()
    try:
        fields = json.loads((directory / CONFIG_FILE).read_text())
        config = TargetConfig(**{k: _tuples(v) for k, v in fields.items()})
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"cannot read the target config in {directory}: {e}") from e
    from dflash_jax.io.drafter_io import ignore_closed_loop_callbacks

    ignore_closed_loop_callbacks()  # a damaged file's late callbacks can beat the except
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.restore(directory / PARAMS_DIR)
    except Exception as e:  # orbax/tensorstore raise many types for missing or corrupt files
        raise CheckpointError(f"cannot restore target params from {directory}: {e}") from e
    dtype = dtype or config.dtype
    params = _rebuild(tree, jnp.dtype(dtype))
    if mesh is not None:
        params = sharding.put(params, sharding.param_shardings(params, mesh))
    config = dataclasses.replace(config, dtype=dtype)
    tokenizer = None
    if (directory / TOKENIZER_DIR).is_dir():
        tokenizer = load_hf_tokenizer(directory / TOKENIZER_DIR)
    template = getattr(tokenizer, "chat_template", None)
    return LoadedTarget(config, params, tokenizer, template, str(directory), mesh)


def _rebuild(tree, dtype):
    """Orbax's restored nested dicts -> params: QWeight nodes rebuilt, float leaves in `dtype`."""
    if isinstance(tree, dict) and set(tree) >= {"q"} and isinstance(tree["q"], dict):
        q = tree["q"]
        qarray = qwix.QArray(jnp.asarray(q["qvalue"]), jnp.asarray(q["scale"]))
        offset = tree.get("offset")
        return QWeight(qarray, None if offset is None else jnp.asarray(offset))
    if isinstance(tree, dict):
        return {k: _rebuild(v, dtype) for k, v in tree.items()}
    return jax.device_put(jnp.asarray(tree, dtype))


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
