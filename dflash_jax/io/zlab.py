"""z-lab HF drafter format: `config.json` (Qwen3Config + `dflash_config`) + `model.safetensors`.

Tensor table (dflash-spec §8.2), torch layout [out, in], optional leading `model.`:
  fc.weight [D, F]; hidden_norm.weight, norm.weight [D];
  layers.{i}.{input,post_attention}_layernorm.weight [D];
  layers.{i}.self_attn.q_proj.weight [N*H, D], {k,v}_proj.weight [K*H, D], o_proj.weight [D, N*H],
  layers.{i}.self_attn.{q,k}_norm.weight [H]; layers.{i}.mlp.{gate,up}_proj.weight [I, D],
  down_proj.weight [D, I].
DFlash2 adds layers.{i}.{attention,mlp}_conv.base_kernel [2, O, D] and .kernel_projection.weight
[2*O*G, D], candidate_selector.{predecessor,successor}_codebook [V, R] (no `.weight`: the names
the reference's `from_pretrained` key mapping reads and its `save_pretrained` writes; a
`.weight` suffix is accepted) and candidate_selector.hidden_projection.weight [R, D].
DSpark's heads (written to `speculators` checkpoints only; `write_zlab` refuses a DSpark drafter):
markov_head.markov_w1.weight [V, R], markov_w2.weight [U, R] (U the draft vocabulary or V),
gated: markov_head.gate_proj.{weight [R, D+R], bias [R]}, rnn: markov_head.joint_proj.{weight
[3R, 2R+D], bias [3R]}; confidence_head.proj.{weight [1, D(+R)], bias [1]}.
Our params mirror these names (`layers.{i}` -> `layers_{i}`, `weight` -> `kernel`/`scale`/
`embedding`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from dflash_jax.config import ConfigError, DrafterConfig
from dflash_jax.io import paths
from dflash_jax.io.drafter_config import drafter_from_zlab, drafter_to_zlab
from dflash_jax.io.hf import CheckpointError, canonical_name, read_safetensors_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def np_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    if dtype == "float32":
        return np.dtype(np.float32)
    raise ValueError(f"dtype {dtype!r} is not supported (bfloat16 or float32)")


def _table(config: DrafterConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], str]]:
    """z-lab key -> (our param path, z-lab shape [out, in] or [n], how to convert)."""
    c = config
    d, h, i = c.hidden_size, c.head_dim, c.intermediate_size
    nq, nk = c.num_heads, c.num_kv_heads
    table = {
        "fc.weight": (("fc", "kernel"), (d, c.num_taps * d), "dense"),
        "hidden_norm.weight": (("hidden_norm", "scale"), (d,), "norm"),
        "norm.weight": (("norm", "scale"), (d,), "norm"),
    }
    for l in range(c.num_layers):
        hf, ours = f"layers.{l}.", f"layers_{l}"
        attn = (ours, "self_attn")
        table |= {
            hf + "input_layernorm.weight": ((ours, "input_layernorm", "scale"), (d,), "norm"),
            hf + "post_attention_layernorm.weight": (
                (ours, "post_attention_layernorm", "scale"),
                (d,),
                "norm",
            ),
            hf + "self_attn.q_proj.weight": ((*attn, "q_proj", "kernel"), (nq * h, d), "heads"),
            hf + "self_attn.k_proj.weight": ((*attn, "k_proj", "kernel"), (nk * h, d), "heads"),
            hf + "self_attn.v_proj.weight": ((*attn, "v_proj", "kernel"), (nk * h, d), "heads"),
            hf + "self_attn.o_proj.weight": ((*attn, "o_proj", "kernel"), (d, nq * h), "o_proj"),
            hf + "self_attn.q_norm.weight": ((*attn, "q_norm", "scale"), (h,), "norm"),
            hf + "self_attn.k_norm.weight": ((*attn, "k_norm", "scale"), (h,), "norm"),
            hf + "mlp.gate_proj.weight": ((ours, "mlp", "gate_proj", "kernel"), (i, d), "dense"),
            hf + "mlp.up_proj.weight": ((ours, "mlp", "up_proj", "kernel"), (i, d), "dense"),
            hf + "mlp.down_proj.weight": ((ours, "mlp", "down_proj", "kernel"), (d, i), "dense"),
        }
        if c.is_dflash2:
            taps, groups = c.conv_kernel_size, d // c.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                table |= {
                    f"{hf}{conv}.base_kernel": ((ours, conv, "base_kernel"), (2, taps, d), "raw"),
                    f"{hf}{conv}.kernel_projection.weight": (
                        (ours, conv, "kernel_projection", "kernel"),
                        (2 * taps * groups, d),
                        "dense",
                    ),
                }
    if c.is_dflash2:
        sel, r = "candidate_selector", c.selector_rank
        for book in ("predecessor_codebook", "successor_codebook"):
            table[f"{sel}.{book}"] = ((sel, book, "embedding"), (c.vocab_size, r), "raw")
        table[f"{sel}.hidden_projection.weight"] = (
            (sel, "hidden_projection", "kernel"),
            (r, d),
            "dense",
        )
    return table | _dspark_table(c)


def _dspark_table(c: DrafterConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], str]]:
    """A DSpark drafter's heads (`speculators`' names; no z-lab checkpoint holds them)."""
    d, r, table = c.hidden_size, c.markov_rank, {}
    if c.markov_rank:
        table |= {
            "markov_head.markov_w1.weight": (
                ("markov_head", "markov_w1", "embedding"), (c.vocab_size, r), "raw"
            ),
            "markov_head.markov_w2.weight": (
                ("markov_head", "markov_w2", "kernel"), (c.draft_vocab_size or c.vocab_size, r),
                "dense",
            ),
        }  # fmt: skip
    projections = {"gated": ("gate_proj", r, d + r), "rnn": ("joint_proj", 3 * r, 2 * r + d)}
    if c.markov_rank and c.markov_head_type in projections:
        name, out, width = projections[c.markov_head_type]
        table |= {
            f"markov_head.{name}.weight": (("markov_head", name, "kernel"), (out, width), "dense"),
            f"markov_head.{name}.bias": (("markov_head", name, "bias"), (out,), "raw"),
        }
    if c.enable_confidence_head:
        width = d + (r if c.confidence_head_with_markov else 0)
        table |= {
            "confidence_head.proj.weight": (("confidence_head", "proj", "kernel"), (1, width),
                                            "dense"),
            "confidence_head.proj.bias": (("confidence_head", "proj", "bias"), (1,), "raw"),
        }  # fmt: skip
    return table


def _bare_codebooks(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The selector codebooks under their module names: `....codebook.weight` (a freshly built
    reference model's `save_pretrained`) renamed to `....codebook`."""
    return {
        k.removesuffix(".weight")
        if k.startswith("candidate_selector.") and "codebook" in k
        else k: v
        for k, v in tensors.items()
    }


def _to_ours(w: np.ndarray, kind: str, config: DrafterConfig) -> np.ndarray:
    if kind in ("norm", "raw"):
        return w
    if kind == "dense":
        return w.T
    if kind == "heads":
        return w.T.reshape(config.hidden_size, -1, config.head_dim)
    return w.T.reshape(config.num_heads, config.head_dim, config.hidden_size)


def _get(tree: dict, path: tuple[str, ...]):
    for name in path:
        tree = tree[name]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def read_zlab_config(directory: str | Path, dtype: str = "float32") -> DrafterConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read the drafter config {path}: {e}") from e
    return drafter_from_zlab(hf, dtype=dtype)


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of the directory (sharded or not), `model.` stripped, duplicates refused."""
    try:
        stored = read_safetensors_dir(directory)
    except CheckpointError:
        raise
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"cannot read drafter weights in {directory}: {e}") from e
    tensors: dict[str, np.ndarray] = {}
    for key, st in stored.items():
        name = canonical_name(key)
        if name in tensors:
            raise CheckpointError(f"{st.file}: tensor {name!r} appears twice (as {key!r})")
        try:
            tensors[name] = np.asarray(st.read())
        except (OSError, ValueError) as e:  # a truncated file fails when mapped
            raise CheckpointError(f"cannot read tensor {key!r} from {st.file}: {e}") from e
    return tensors


def read_zlab(directory: str | Path, dtype: str = "float32") -> tuple[DrafterConfig, dict]:
    """Reads a z-lab drafter directory -> (DrafterConfig, params as numpy arrays in `dtype`).

    Refuses unmapped, missing or duplicate tensors and wrong shapes, naming the key."""
    directory = Path(directory)
    config = read_zlab_config(directory, dtype)
    return config, params_from_tensors(directory, config, read_tensors(directory), dtype)


def params_from_tensors(
    directory: Path, config: DrafterConfig, tensors: dict[str, np.ndarray], dtype: str
) -> dict:
    """The drafter's params (numpy, `dtype`) from its z-lab tensors (`read_tensors`), which the
    `speculators` format shares; refuses unmapped, missing and misshapen ones, naming the key
    (and `directory`)."""
    if config.is_dflash2:
        tensors = _bare_codebooks(tensors)
    table = _table(config)
    unmapped = sorted(set(tensors) - set(table))
    if unmapped:
        raise CheckpointError(
            f"{directory}: unmapped drafter tensors {unmapped[:8]}"
            f"{' ...' if len(unmapped) > 8 else ''} (DFlash2 or a different architecture?)"
        )
    missing = sorted(set(table) - set(tensors))
    if missing:
        raise CheckpointError(
            f"{directory}: missing drafter tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; config.json expects "
            f"{config.num_layers} layers"
        )
    cast_to = np_dtype(dtype)
    params: dict = {}
    for key, (path, shape, kind) in table.items():
        w = tensors[key]
        if tuple(w.shape) != shape:
            raise CheckpointError(
                f"{directory}: tensor {key!r} has shape {list(w.shape)}; expected {list(shape)} "
                f"from config.json"
            )
        _set(params, path, np.ascontiguousarray(_to_ours(w, kind, config)).astype(cast_to))
    return params


def tensors_from_params(config: DrafterConfig, params: dict, dtype: str) -> dict[str, np.ndarray]:
    """The z-lab tensors (torch layout, `dtype`) of a drafter's params; `read_zlab`'s inverse."""
    cast_to = np_dtype(dtype)
    tensors = {}
    for key, (path, shape, kind) in _table(config).items():
        try:
            w = np.asarray(jax.device_get(_get(params, path)), dtype=np.float32)
        except KeyError as e:
            raise ConfigError(f"drafter params lack {'/'.join(path)} (for {key})") from e
        if kind in ("norm", "raw"):
            hf = w
        elif kind == "o_proj":
            hf = w.reshape(-1, config.hidden_size).T
        else:
            hf = w.reshape(w.shape[0], -1).T
        if tuple(hf.shape) != shape:
            raise ConfigError(
                f"drafter param {'/'.join(path)} gives {key} of shape {list(hf.shape)}; "
                f"expected {list(shape)}"
            )
        tensors[key] = np.ascontiguousarray(hf).astype(cast_to)
    return tensors


def write_checkpoint(directory, config_json: dict, tensors: dict[str, np.ndarray]) -> None:
    """`config.json` + `model.safetensors` into `directory` (local or a URL)."""
    directory = paths.path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with paths.written_locally(directory / WEIGHTS_FILE) as file:
        save_file(tensors, str(file), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")


def write_zlab(
    directory: str | os.PathLike, config: DrafterConfig, params: dict, dtype: str = "bfloat16"
) -> None:
    """Writes `config.json` + `model.safetensors` that `dflash.DFlashDraftModel.from_pretrained`
    (and vLLM/SGLang) load; `directory` may be a URL."""
    if config.draft_vocab_size:
        raise ConfigError(
            f"this drafter drafts over a vocabulary of its own ({config.draft_vocab_size} "
            "ids), which the z-lab format cannot hold; export it with --format=speculators"
        )
    if config.window_from_anchor and "sliding_attention" in config.layer_types:
        raise ConfigError(
            "this drafter's sliding-window layers measure their window from the block's anchor "
            "(the speculators format's window), which z-lab's measures from each query; export "
            "it with --format=speculators"
        )
    if config.is_dspark:
        raise ConfigError(
            "this is a DSpark drafter (a Markov head, a confidence head or drafts from the "
            "anchor slot), which the z-lab format cannot hold; export it with "
            "--format=speculators"
        )
    tensors = tensors_from_params(config, params, dtype)
    write_checkpoint(directory, drafter_to_zlab(dataclasses.replace(config, dtype=dtype)), tensors)
