"""The `speculators` drafter format (vllm-project/speculators, PyPI `speculators` 0.9.0).

A directory of `config.json` + `model.safetensors`, as `SpeculatorModel.save_pretrained` writes:
the config carries `speculators_model_type` ("dflash", "dflash2", "dspark"; EAGLE-3 and the rest
are other models), the draft layers' Qwen3 config under `transformer_layer_config`, and beside
it `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids`, `draft_vocab_size`,
`sample_from_anchor`, `sliding_window_non_causal`, DFlash2's four sizes, DSpark's
`markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`, and
`speculators_config` (algorithm, proposal method, verifier). The tensors are the z-lab ones
(`io/zlab.py`'s table: the reference's converter copies them as they are; DSpark's
`markov_head.*` and `confidence_head.*` are in the same table) plus, with a draft vocabulary
smaller than the target's, `lm_head.weight` [draft_vocab, D], `d2t` [draft_vocab] (target id =
draft id + d2t[draft id]) and `t2d` [V] bool.

What differs from z-lab, and how it maps:
  * `aux_hidden_state_layer_ids` index the target's hidden states with the embedding as 0
    (vLLM's auxiliary states: the input of layer i), ours (z-lab's) the layer whose output is
    tapped: ours = aux - 1. Aux id 0 is the embedding's output, our tap -1 (z-lab's -1 too:
    the reference reads hidden state id + 1).
  * Full-attention layers are always bidirectional in the block; sliding layers are causal
    unless `sliding_window_non_causal`. Ours: `causal` None (sliding layers causal) or False.
  * A sliding layer's window W is measured from the block's anchor a (the block sees context
    positions a - W .. a - 1 and its whole block), not from each query as z-lab's: ours
    `window_from_anchor`. Sliding layer types without `use_sliding_window` (HF then drops the
    window, and the reference runs them as full attention) are full-attention layers.
  * The embedding and lm_head are the verifier's (not stored, or stored and ignored, as the
    reference does on load); `verifier_norm` serves training only.
  * A draft vocabulary (`draft_vocab_size` < the target's): our params `lm_head` (kernel
    [D, draft vocab], the stored head transposed) and `draft_to_target` (int32 target ids,
    d2t + arange, which t2d must mark); decoding drafts over it and maps the drafts to target
    ids (`models.drafter.drafter_logits`).

  * DSpark: our config's `DSPARK_FIELDS` are the format's (absent ones take the reference's
    defaults: sample_from_anchor, rank 256, vanilla, a confidence head with the Markov input).

Refused, each with what to do: `sample_from_anchor` on a DFlash or DFlash2 drafter (the anchor
slot drafting too is DSpark's way, not our DFlash decode), a DFlash2 drafter with a draft
vocabulary (the reference refuses it too), and any other model type; on export, windows measured
from each query (z-lab's) and block-causal full-attention layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np

from dflash_jax.config import DFLASH2_FIELDS, DSPARK_FIELDS, ConfigError, DrafterConfig
from dflash_jax.io.drafter_config import drafter_from_zlab, drafter_to_zlab
from dflash_jax.io.hf import CheckpointError
from dflash_jax.io.zlab import (
    CONFIG_FILE,
    np_dtype,
    params_from_tensors,
    read_tensors,
    tensors_from_params,
    write_checkpoint,
)

VERSION = "0.9.0"  # the release whose format this module reads and writes
MODEL_TYPES = {"dflash": "DFlashSpeculator", "dflash2": "DFlash2DraftModel",
               "dspark": "DSparkSpeculator"}  # fmt: skip
# our z-lab-style architecture name of each model type (`drafter_from_zlab` reads it)
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",
                 "dspark": "DSparkDraftModel"}  # fmt: skip
# `DSparkSpeculatorConfig`'s defaults, for a checkpoint that leaves a field out
DSPARK_DEFAULTS = {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
                   "enable_confidence_head": True, "confidence_head_with_markov": True}  # fmt: skip
# Verifier-owned tensors a checkpoint may hold; the reference reloads them from the verifier
# (full vocabulary), so they are not the drafter's.
VERIFIER_TENSORS = frozenset(
    {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
)
VOCAB_MAPS = frozenset({"d2t", "t2d"})
_FIX = "pass a DFlash, DFlash2 or DSpark drafter (speculators, z-lab or Orbax)"
# what the draft layers' config must give (the rest has the z-lab reader's defaults)
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size")  # fmt: skip


def read_config_json(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"cannot read the drafter config {path}: {e}; pass a drafter directory with its "
            "config.json"
        ) from e


def is_speculators(config_json: dict) -> bool:
    """Whether a `config.json` dict is a `speculators` checkpoint's."""
    return "speculators_model_type" in config_json


def zlab_config(spec: dict, where: str) -> dict:
    """A `speculators` config.json dict -> the z-lab dict `drafter_from_zlab` reads;
    refuses what our decode cannot run, naming the field and what to do."""
    kind = spec.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(
            f"{where}: a speculators {kind!r} model, not a DFlash, DFlash2 or DSpark drafter "
            f"(speculators_model_type must be one of {sorted(MODEL_TYPES)}); {_FIX}"
        )
    layer = spec.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: no transformer_layer_config dict; {_FIX}")
    missing = [name for name in REQUIRED if layer.get(name) is None]
    if missing:
        raise ConfigError(f"{where}: transformer_layer_config lacks {missing}; {_FIX}")
    vocab = layer.get("vocab_size")
    draft_vocab = spec.get("draft_vocab_size", 32000)  # the reference's default
    if spec.get("sample_from_anchor", False) and kind != "dspark":
        raise ConfigError(
            f"{where}: sample_from_anchor=true on a {kind} drafter (the anchor slot drafts "
            "too), which our DFlash decoding does not do; use a drafter trained with "
            "sample_from_anchor=false"
        )
    types = list(layer.get("layer_types") or ())
    sliding = "sliding_attention" in types
    if sliding and not (layer.get("use_sliding_window", True) and layer.get("sliding_window")):
        # transformers' Qwen3Config drops the window: the reference's layers are full ones
        types, sliding = ["full_attention"] * len(types), False
    rope = layer.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(
            f"{where}: rope_parameters per layer type {sorted(rope)}, which our drafter does not "
            "take (one RoPE for every layer); use a drafter with one rope_parameters"
        )
    for name in ("attention_bias", "mlp_bias"):
        if layer.get(name):
            raise ConfigError(f"{where}: transformer_layer_config.{name}=true; {_FIX}")
    if layer.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={layer['hidden_act']!r}, not silu; {_FIX}")
    aux = spec.get("aux_hidden_state_layer_ids")
    if not aux or min(aux) < 0:
        raise ConfigError(
            f"{where}: aux_hidden_state_layer_ids={aux}: each id is a hidden state of the "
            "target, from 0 (the embedding); set the ids the drafter was trained on"
        )
    if spec.get("mask_token_id") is None:
        raise ConfigError(f"{where}: no mask_token_id; set it in config.json")
    dflash = {
        "mask_token_id": int(spec["mask_token_id"]),
        "target_layer_ids": [int(a) - 1 for a in aux],
        "block_size": int(spec.get("block_size", 8)),
    }
    if draft_vocab != vocab:
        dflash["draft_vocab_size"] = int(draft_vocab)
    if sliding:
        dflash["window_from_anchor"] = True
    if kind == "dflash2":
        defaults = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                    "selector_top_k": 16}  # fmt: skip
        dflash |= {name: int(spec.get(name, defaults[name])) for name in DFLASH2_FIELDS}
    if kind == "dspark":
        dflash |= {name: spec.get(name, DSPARK_DEFAULTS[name]) for name in DSPARK_FIELDS}
    # full-attention layers are bidirectional whatever the layer config says
    dropped = ("architectures", "auto_map", "is_causal", "causal", "layer_types")
    out = {k: v for k, v in layer.items() if k not in dropped}
    if types:
        out["layer_types"] = types
    if sliding and spec.get("sliding_window_non_causal", kind == "dflash2"):
        out["is_causal"] = False  # sliding layers bidirectional in the block, as full ones are
    return out | {
        "architectures": [ARCHITECTURES[kind]],
        "dflash_config": dflash,
        "block_size": dflash["block_size"],
    }


def speculators_config(config: DrafterConfig, verifier: str | None = None) -> dict:
    """The `speculators` config.json of our drafter; refuses what the format cannot say.
    verifier: the target's hub id or path (the reference loads its embedding and head from it)."""
    z = drafter_to_zlab(config)
    sliding = "sliding_attention" in config.layer_types
    if sliding and not config.window_from_anchor:
        raise ConfigError(
            "this drafter's sliding-window layers measure their window from each query (z-lab's "
            "window), which the speculators format measures from the block's anchor; export "
            "it with --format=zlab"
        )
    if config.causal:
        raise ConfigError(
            "this drafter's layers are causal in the block (is_causal=true), which the "
            "speculators format cannot say; export it with --format=zlab"
        )
    extra = [n for n in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
             if getattr(config, n) is not None]  # fmt: skip
    if extra:
        raise ConfigError(
            f"this drafter sets {extra}, which the speculators format has no field for; "
            "export it with --format=zlab"
        )
    kind = "dflash2" if config.is_dflash2 else "dspark" if config.is_dspark else "dflash"
    # num_target_layers stays in the layer config (the reference ignores it), so it round-trips
    not_layer = ("architectures", "auto_map", "dflash_config", "block_size", "torch_dtype")
    layer = {k: v for k, v in z.items() if k not in not_layer}
    # rope_parameters for transformers 5 readers, rope_theta and rope_scaling (as z-lab writes
    # them) for transformers 4 ones
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta} | (
        dict(z["rope_scaling"]) if "rope_scaling" in z else {}
    )
    out = {
        "architectures": [MODEL_TYPES[kind]],
        "speculators_model_type": kind,
        "speculators_version": VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        # matters for sliding layers only: they are causal in the block unless it is true
        "sliding_window_non_causal": config.causal is False if sliding else config.is_dflash2,
        "sample_from_anchor": config.sample_from_anchor,
        "torch_dtype": z["torch_dtype"],
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": config.num_drafts}
            ],  # fmt: skip
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }
    if config.is_dflash2:
        out |= {name: getattr(config, name) for name in DFLASH2_FIELDS}
    if config.is_dspark:
        out |= {name: getattr(config, name) for name in DSPARK_FIELDS}
    return out


def read_speculators(directory: str | Path, dtype: str = "float32") -> tuple[DrafterConfig, dict]:
    """Reads a `speculators` DFlash, DFlash2 or DSpark directory -> (DrafterConfig, numpy params in
    `dtype`), refusing what `zlab_config` refuses and, like `read_zlab`, unmapped, missing or
    misshapen tensors."""
    directory = Path(directory)
    spec = read_config_json(directory)
    config = drafter_from_zlab(zlab_config(spec, str(directory / CONFIG_FILE)), dtype=dtype)
    tensors = read_tensors(directory)
    ours = {k: v for k, v in tensors.items() if k not in VERIFIER_TENSORS | VOCAB_MAPS}
    params = params_from_tensors(directory, config, ours, dtype)
    if config.draft_vocab_size:
        params |= _draft_vocab_params(directory, config, tensors, dtype)
    return config, params


def _draft_vocab_params(directory: Path, config: DrafterConfig, tensors: dict, dtype: str):
    """A draft vocabulary's head and map from `lm_head.weight` [U, D], `d2t` [U] (offsets:
    target id = draft id + d2t) and `t2d` [V] (the target ids drafted), which must agree.
    -> {"lm_head": {"kernel": [D, U]}, "draft_to_target": int32 [U]}."""
    u, d, v = config.draft_vocab_size, config.hidden_size, config.vocab_size
    expected = {"lm_head.weight": (u, d), "d2t": (u,), "t2d": (v,)}
    for key, shape in expected.items():
        if key not in tensors:
            raise CheckpointError(
                f"{directory}: a draft vocabulary of {u} ids without its {key!r} tensor; "
                "export the drafter again with its vocabulary maps"
            )
        if tuple(tensors[key].shape) != shape:
            raise CheckpointError(
                f"{directory}: tensor {key!r} has shape {list(tensors[key].shape)}; expected "
                f"{list(shape)} from config.json"
            )
    ids = np.arange(u, dtype=np.int64) + tensors["d2t"].astype(np.int64)
    drafted = np.flatnonzero(tensors["t2d"])
    if not np.array_equal(ids, drafted):
        raise CheckpointError(
            f"{directory}: d2t and t2d disagree (d2t maps the draft ids onto other target ids "
            "than t2d marks, or not in ascending order); export the drafter again"
        )
    kernel = np.ascontiguousarray(tensors["lm_head.weight"].T).astype(np_dtype(dtype))
    return {"lm_head": {"kernel": kernel}, "draft_to_target": ids.astype(np.int32)}


def _vocab_tensors(config: DrafterConfig, params: dict, dtype: str) -> dict[str, np.ndarray]:
    """`_draft_vocab_params`' inverse: lm_head.weight, d2t (int64 offsets), t2d (bool)."""
    ids = np.asarray(jax.device_get(params["draft_to_target"]), np.int64)
    kernel = np.asarray(jax.device_get(params["lm_head"]["kernel"]), np.float32)
    t2d = np.zeros(config.vocab_size, np.bool_)
    t2d[ids] = True
    return {
        "lm_head.weight": np.ascontiguousarray(kernel.T).astype(np_dtype(dtype)),
        "d2t": ids - np.arange(len(ids), dtype=np.int64),
        "t2d": t2d,
    }


def write_speculators(
    directory: str | os.PathLike,
    config: DrafterConfig,
    params: dict,
    dtype: str = "bfloat16",
    verifier: str | None = None,
) -> None:
    """Writes `config.json` + `model.safetensors` that `speculators`' `from_pretrained` loads
    (its embedding and lm_head then come from `verifier`); `directory` may be a URL."""
    spec = speculators_config(dataclasses.replace(config, dtype=dtype), verifier)
    tensors = tensors_from_params(config, params, dtype)
    if config.draft_vocab_size:
        tensors |= _vocab_tensors(config, params, dtype)
    write_checkpoint(directory, spec, tensors)
