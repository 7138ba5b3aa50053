"""Target configs to and from HF `config.json` dicts (transformers v4 and v5 keys), and the
RoPE and field readers the drafter formats share (io/drafter_config.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_jax.config import (
    ARCHS,
    HYBRID_ARCHS,
    LAYERED_ARCHS,
    SUPPORTED_ROPE_TYPES,
    SUPPORTED_TARGET_ARCHS,
    ConfigError,
    TargetConfig,
    thaw,
)


def freeze(value: Any) -> Any:
    """Turns nested dicts/lists into sorted tuples so configs stay hashable."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def rope_from_hf(cfg: Mapping[str, Any], where: str) -> tuple[float, tuple | None]:
    """Returns (theta, frozen scaling or None) from v4 `rope_theta`/`rope_scaling` or v5
    `rope_parameters`; refuses scaling types we do not implement."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        theta = 10000.0
    if scaling is None and params:
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        if rest.get("rope_type", rest.get("type", "default")) != "default":
            scaling = rest
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{where}: rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            scaling = None
        else:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return float(theta), (freeze(scaling) if scaling else None)


def rope_to_hf(theta: float, scaling: tuple | None) -> dict[str, Any]:
    """The inverse of `rope_from_hf` (v4 keys)."""
    out: dict[str, Any] = {"rope_theta": theta}
    if scaling:
        out["rope_scaling"] = thaw(scaling)
    return out


def as_int_tuple(value: Any) -> tuple[int, ...]:
    """An HF int-or-list field (eos_token_id, mlp_only_layers) as a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def target_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> TargetConfig:
    """Builds a config from an HF `config.json` dict; refuses what we cannot run."""
    if hf.get("text_config") and hf.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
        # A multimodal checkpoint (Qwen3_5ForConditionalGeneration): its language model.
        hf = {**hf["text_config"], "model_type": hf["model_type"]}
    model_type = hf.get("model_type")
    arch = next((a for a, f in ARCHS.items() if model_type in f.model_types), None)
    if arch is None:
        archs = hf.get("architectures") or []
        raise ConfigError(
            f"unsupported target: model_type={model_type!r}, architectures={archs}; "
            f"supported model_type values: {', '.join(SUPPORTED_TARGET_ARCHS)}"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{model_type}: attention_bias/mlp_bias=True is not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{model_type}: hidden_act={act!r} is not supported (only silu)")
    theta, scaling = rope_from_hf(hf, f"target {model_type}")
    n_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // n_heads
    eos = as_int_tuple(hf.get("eos_token_id"))
    return TargetConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        # Qwen3.5-MoE has no dense MLP width (every layer is sparse).
        intermediate_size=int(hf.get("intermediate_size") or hf["moe_intermediate_size"])
        if arch == "qwen3_5_moe"
        else int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=n_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
        dtype=dtype,
        **_layered_from_hf(hf, arch),
    )


def target_to_hf(c: TargetConfig) -> dict[str, Any]:
    """The HF `config.json` dict of a target config (`target_from_hf` reads it back)."""
    return {
        "architectures": [ARCHS[c.arch].hf_class],
        "model_type": ARCHS[c.arch].model_types[0],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
        **rope_to_hf(c.rope_theta, c.rope_scaling),
        **_layered_to_hf(c),
    }


_MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
)
_LINEAR_KEYS = (
    "layer_types",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _layered_from_hf(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The MoE and hybrid fields of a LAYERED_ARCHS config.json (empty for the dense ones)."""
    if arch not in LAYERED_ARCHS:
        return {}
    out: dict[str, Any] = {}
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts:
        out["num_experts"] = int(experts)
        out["num_experts_per_tok"] = int(hf["num_experts_per_tok"])
        out["moe_intermediate_size"] = int(hf["moe_intermediate_size"])
        # Qwen3.5-MoE's router always renormalises its top-k (no config key).
        out["norm_topk_prob"] = bool(hf.get("norm_topk_prob", arch == "qwen3_5_moe"))
        out["decoder_sparse_step"] = int(hf.get("decoder_sparse_step") or 1)
        out["mlp_only_layers"] = as_int_tuple(hf.get("mlp_only_layers"))
        out["shared_expert_intermediate_size"] = int(hf.get("shared_expert_intermediate_size") or 0)
    if arch in HYBRID_ARCHS:
        n = int(hf["num_hidden_layers"])
        types = hf.get("layer_types")
        if not types:  # older configs: every full_attention_interval-th layer is full attention
            every = int(hf.get("full_attention_interval", 4))
            types = [
                "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
            ]
        out["layer_types"] = tuple(types)
        for key in _LINEAR_KEYS[1:]:
            if hf.get(key) is not None:
                out[key] = int(hf[key])
        rope = hf.get("rope_parameters") or {}
        out["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        )
    return out


def _layered_to_hf(c: TargetConfig) -> dict[str, Any]:
    """The inverse of `_layered_from_hf`."""
    if not c.layered:
        return {}
    out: dict[str, Any] = {}
    if c.num_experts:
        out |= {k: getattr(c, k) for k in _MOE_KEYS}
        out["mlp_only_layers"] = list(c.mlp_only_layers)
        out["moe_intermediate_size"] = c.moe_intermediate_size
    if c.hybrid:
        out |= {k: getattr(c, k) for k in _LINEAR_KEYS}
        out["layer_types"] = list(c.layer_types)
        out["partial_rotary_factor"] = c.partial_rotary_factor
    return out
