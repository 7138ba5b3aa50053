"""Drafter configs to and from z-lab `config.json` dicts (Qwen3Config + `dflash_config`), the
form the reference `dflash` package loads; `speculators` configs go through it
(io/speculators.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_jax.config import (
    DFLASH2_FIELDS,
    DSPARK_FIELDS,
    ConfigError,
    DrafterConfig,
)
from dflash_jax.io.hf_config import as_int_tuple, rope_from_hf, rope_to_hf
from dflash_jax.models.drafter import default_target_layer_ids


def drafter_from_zlab(hf: Mapping[str, Any], dtype: str = "float32") -> DrafterConfig:
    """Reads a z-lab drafter `config.json`. Lookup order for DFlash keys: `dflash_config`,
    then top level, then the default."""
    archs = hf.get("architectures") or ["DFlashDraftModel"]
    dflash2 = "DFlash2DraftModel" in archs
    dspark = "DSparkDraftModel" in archs  # ours (Orbax) only: write_zlab refuses it
    if not (dflash2 or dspark) and "DFlashDraftModel" not in archs:
        raise ConfigError(
            f"not a DFlash drafter config: architectures={archs}; pass a DFlash drafter "
            "(z-lab, speculators or Orbax)"
        )
    dcfg = hf.get("dflash_config") or {}

    def lookup(name, default=None):
        if name in dcfg and dcfg[name] is not None:
            return dcfg[name]
        if name in hf and hf[name] is not None:
            return hf[name]
        return default

    if lookup("mask_token_id") is None:
        raise ConfigError("drafter config has no dflash_config.mask_token_id")
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")  # fmt: skip
    missing = [name for name in sizes if hf.get(name) is None]
    if missing:
        raise ConfigError(f"drafter config lacks {missing}; pass a DFlash drafter's config.json")
    num_layers = int(hf["num_hidden_layers"])
    num_target_layers = int(lookup("num_target_layers", 0) or 0)
    tap_ids = as_int_tuple(lookup("target_layer_ids"))
    if not tap_ids:
        if not num_target_layers:
            raise ConfigError(
                "drafter config has neither dflash_config.target_layer_ids nor "
                "num_target_layers to derive them from"
            )
        tap_ids = default_target_layer_ids(num_target_layers, num_layers)
    v2 = {name: int(lookup(name, 0) or 0) for name in DFLASH2_FIELDS} if dflash2 else {}
    if dflash2 and not all(v2.values()):
        missing = [name for name, v in v2.items() if not v]
        raise ConfigError(f"DFlash2DraftModel config lacks dflash_config {missing}")
    theta, scaling = rope_from_hf(hf, "drafter")
    n_heads = int(hf["num_attention_heads"])
    is_causal = lookup("causal", hf.get("is_causal"))
    return DrafterConfig(
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads),
        vocab_size=int(hf["vocab_size"]),
        mask_token_id=int(lookup("mask_token_id")),
        target_layer_ids=tap_ids,
        num_target_layers=num_target_layers or (max(tap_ids) + 1),
        block_size=int(lookup("block_size", 16)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
        layer_types=tuple(hf.get("layer_types") or ()),
        # Qwen3Config: without use_sliding_window=true its sliding layers have no window
        sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", False) else None,
        window_from_anchor=bool(lookup("window_from_anchor", False)),
        causal=None if is_causal is None else bool(is_causal),
        input_embedding_scale=lookup("input_embedding_scale"),
        output_multiplier=lookup("output_multiplier"),
        final_logit_softcapping=lookup("final_logit_softcapping"),
        **v2,
        draft_vocab_size=int(lookup("draft_vocab_size", 0) or 0),
        **(_dspark_fields(lookup) if dspark else {}),
        dtype=dtype,
    )


def drafter_to_zlab(c: DrafterConfig) -> dict[str, Any]:
    """The z-lab `config.json` dict that the reference `dflash` package loads."""
    dflash_config: dict[str, Any] = {
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids),
    }
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        if getattr(c, name) is not None:
            dflash_config[name] = getattr(c, name)
    if c.draft_vocab_size:  # ours (Orbax) only: write_zlab refuses it
        dflash_config["draft_vocab_size"] = c.draft_vocab_size
    if c.window_from_anchor:  # ours (Orbax) only: write_zlab refuses it
        dflash_config["window_from_anchor"] = True
    arch = "DFlash2DraftModel" if c.is_dflash2 else "DFlashDraftModel"
    if c.is_dflash2:
        dflash_config |= {name: getattr(c, name) for name in DFLASH2_FIELDS}
    if c.is_dspark:  # ours (Orbax) only: write_zlab refuses it
        arch = "DSparkDraftModel"
        dflash_config |= {name: getattr(c, name) for name in DSPARK_FIELDS}
    out = {
        "architectures": [arch],
        "auto_map": {"AutoModel": f"dflash.{arch}"},
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "num_target_layers": c.num_target_layers,
        "block_size": c.block_size,
        "layer_types": list(c.layer_types),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16" if c.dtype == "bfloat16" else "float32",
        "dflash_config": dflash_config,
        **rope_to_hf(c.rope_theta, c.rope_scaling),
    }
    if c.causal is not None:
        # The reference, vLLM and SGLang read the top-level `is_causal`.
        out["is_causal"] = c.causal
    if c.sliding_window:
        out["sliding_window"] = c.sliding_window
        out["use_sliding_window"] = True
    return out


def _dspark_fields(lookup) -> dict[str, Any]:
    """A DSpark drafter's `DSPARK_FIELDS` from a config lookup (off where absent)."""
    return {
        "sample_from_anchor": bool(lookup("sample_from_anchor", False)),
        "markov_rank": int(lookup("markov_rank", 0)),
        "markov_head_type": str(lookup("markov_head_type", "vanilla")),
        "enable_confidence_head": bool(lookup("enable_confidence_head", False)),
        "confidence_head_with_markov": bool(lookup("confidence_head_with_markov", False)),
    }
