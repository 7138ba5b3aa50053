"""Target configs to and from HF `config.json` dicts (transformers v4 and v5 keys), and the
RoPE and field readers the drafter formats share (io/drafter_config.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_jax.config import (
    ARCHS,
    HYBRID_ARCHS,
    LAYERED_ARCHS,
    SLIDING_ARCHS,
    SUPPORTED_ROPE_TYPES,
    SUPPORTED_TARGET_ARCHS,
    TARGET_ROPE_TYPES,
    ConfigError,
    TargetConfig,
)
from dflash_jax.models.layers import thaw


def freeze(value: Any) -> Any:
    """Turns nested dicts/lists into sorted tuples so configs stay hashable."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def rope_from_hf(
    cfg: Mapping[str, Any], where: str, types: tuple[str, ...] = SUPPORTED_ROPE_TYPES
) -> tuple[float, tuple | None]:
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
        if rope_type not in types:
            raise ConfigError(
                f"{where}: rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(types)})"
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
    wrappers = ("qwen3_5", "qwen3_5_moe", "gemma3", "gemma4")
    if hf.get("text_config") and hf.get("model_type") in wrappers:
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
    sliding = _sliding_from_hf(hf, arch) if arch in SLIDING_ARCHS else {}
    if (hf.get("attention_bias") and arch != "gpt_oss") or hf.get("mlp_bias"):
        raise ConfigError(f"{model_type}: attention_bias/mlp_bias=True is not supported")
    act = sliding.get("hidden_act", hf.get("hidden_act", "silu"))
    if act not in ("silu", "gelu_pytorch_tanh") or (act != "silu" and "gemma" not in arch):
        raise ConfigError(f"{model_type}: hidden_act={act!r} is not supported (only silu)")
    theta, scaling = sliding.pop("rope", None) or rope_from_hf(hf, f"target {model_type}")
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
        # HF's class defaults when absent: Gemma's configs tie, the others do not
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in ("gemma3", "gemma4"))),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
        dtype=dtype,
        **(sliding or _layered_from_hf(hf, arch)),
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
        **(_sliding_to_hf(c) if c.sliding else _layered_to_hf(c)),
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


def _sliding_from_hf(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The SLIDING_ARCHS fields of a config.json, and its RoPE as "rope": (theta, scaling)."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if not types:  # older configs: a pattern (Gemma 3: every 6th layer full; gpt-oss: every 2nd)
        every = int(hf.get("sliding_window_pattern") or (2 if arch == "gpt_oss" else 6))
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
    if arch == "gemma4":  # Gemma4TextConfig forces its last layer to full attention
        types = [*types[:-1], "full_attention"]
    # HF's class defaults when absent (Gemma3TextConfig 4096, Gemma4TextConfig 512, gpt-oss 128)
    window = hf.get("sliding_window", {"gemma3": 4096, "gemma4": 512}.get(arch, 128))
    out: dict[str, Any] = {"layer_types": tuple(types), "sliding_window": int(window or 0)}
    where = f"target {hf.get('model_type')}"
    if arch == "gpt_oss":
        e = int(hf.get("num_local_experts") or hf.get("num_experts"))
        out |= dict(num_experts=e, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]))  # fmt: skip
        out |= dict(swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)))  # fmt: skip
        if not hf.get("attention_bias", True):
            raise ConfigError(
                f"{where}: attention_bias=false is not supported (gpt-oss has biases)"
            )
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):  # GptOssConfig's
            yarn = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                        truncate=False, original_max_position_embeddings=4096)  # fmt: skip
            hf = {**hf, "rope_parameters": yarn}
        theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 150000.0))
        return out | {"rope": rope_from_hf({**hf, "rope_theta": theta}, where, TARGET_ROPE_TYPES)}
    params = hf.get("rope_parameters") or {}
    if arch == "gemma4" and not params and "rope_theta" not in hf:  # Gemma4TextConfig's
        params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0}}  # fmt: skip
    if "full_attention" in params:  # transformers v5: one RoPE per layer type
        full = rope_from_hf({"rope_parameters": params["full_attention"]}, where, TARGET_ROPE_TYPES)
        local = rope_from_hf({"rope_parameters": params.get("sliding_attention") or {}}, where)
        if local[1] is not None:
            raise ConfigError(f"{where}: RoPE scaling on sliding layers is not supported")
    else:
        full = rope_from_hf(
            {**hf, "rope_theta": hf.get("rope_theta", 1e6)}, where, TARGET_ROPE_TYPES
        )
        local = (float(hf.get("rope_local_base_freq", 10000.0)), None)
    if arch == "gemma4":
        return out | {"rope": full, "local_rope_theta": local[0], **_gemma4_from_hf(hf, where)}
    if hf.get("final_logit_softcapping"):
        raise ConfigError(
            f"{where}: final_logit_softcapping={hf['final_logit_softcapping']} is not supported "
            "(Gemma 3's released checkpoints have none)"
        )
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=true (not a causal LM)")
    return out | {
        "rope": full,
        "local_rope_theta": local[0],
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256) or 0),  # HF's default
        "attn_logit_softcapping": float(hf.get("attn_logit_softcapping") or 0),
        "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
    }


def _gemma4_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma 4's own fields; refuses what `models/sliding.py` does not implement."""
    unsupported = {
        "use_bidirectional_attention": "bidirectional attention",
        "attention_bias": "attention biases",
    }
    for key, what in unsupported.items():
        if hf.get(key) and (key, hf[key]) != ("use_bidirectional_attention", "vision"):
            raise ConfigError(f"{where}: {key}={hf[key]!r} ({what}) is not supported")
    types = hf.get("layer_types") or ()
    per_layer = hf.get("per_layer_config") or {}
    heads = {(int(v.get("head_dim", 0)), int(v.get("num_key_value_heads", 0)))
             for i, v in per_layer.items()}  # fmt: skip
    if not per_layer:  # Gemma4TextConfig's: full layers' head dim 512 unless set, their kv
        # heads num_global_key_value_heads only with attention_k_eq_v
        global_kv = int(hf.get("num_global_key_value_heads") or 0)
        global_kv = global_kv if hf.get("attention_k_eq_v") else 0
        heads |= {(int(hf.get("global_head_dim", 512) or 0), global_kv)}
    heads.discard((0, 0))
    if len(heads) > 1 or any(types and types[int(i)] != "full_attention" for i in per_layer):
        raise ConfigError(f"{where}: per-layer head shapes other than one for full layers")
    head_dim, kv = heads.pop() if heads else (0, 0)
    kv_heads = int(hf.get("num_key_value_heads") or 0)
    if head_dim == int(hf.get("head_dim") or 0) and kv in (0, kv_heads):
        head_dim, kv = 0, 0  # full layers shaped as the sliding ones
    return {
        "global_head_dim": head_dim,
        "global_kv_heads": kv,
        "attention_k_eq_v": bool(hf.get("attention_k_eq_v")),
        "final_logit_softcapping": float(hf.get("final_logit_softcapping") or 0),
        "hidden_act": hf.get("hidden_activation") or "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 1.0,  # scores unscaled (q and k are RMS-normed)
        # Gemma4TextConfig's defaults: per-layer inputs of 256 from a 262144-row table
        "per_layer_input_size": int(hf.get("hidden_size_per_layer_input", 256) or 0),
        "per_layer_vocab_size": int(hf.get("vocab_size_per_layer_input", 262_144) or 0),
        "kv_shared_layers": int(hf.get("num_kv_shared_layers") or 0),
        "double_wide_mlp": bool(hf.get("use_double_wide_mlp")),
        **(_gemma4_moe(hf, where) if hf.get("enable_moe_block") else {}),
    }


def _gemma4_moe(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    try:
        return {"num_experts": int(hf["num_experts"]),
                "num_experts_per_tok": int(hf["top_k_experts"]),
                "moe_intermediate_size": int(hf["moe_intermediate_size"])}  # fmt: skip
    except (KeyError, TypeError) as e:
        raise ConfigError(
            f"{where}: enable_moe_block=true needs num_experts, top_k_experts and "
            f"moe_intermediate_size ({e!r} missing)"
        ) from None


def _sliding_to_hf(c: TargetConfig) -> dict[str, Any]:
    """The inverse of `_sliding_from_hf` (transformers v5 keys)."""
    out: dict[str, Any] = {"layer_types": list(c.layer_types), "sliding_window": c.sliding_window}
    if c.arch == "gpt_oss":
        rope = {"rope_theta": c.rope_theta, **(thaw(c.rope_scaling) if c.rope_scaling else {})}
        return out | {
            "num_local_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "intermediate_size": c.moe_intermediate_size,
            "swiglu_alpha": c.swiglu_alpha,
            "swiglu_limit": c.swiglu_limit,
            "attention_bias": True,
            "rope_parameters": rope | {"rope_type": rope.get("rope_type", "default")},
        }
    full = {"rope_type": "default", "rope_theta": c.rope_theta}
    full |= thaw(c.rope_scaling) if c.rope_scaling else {}
    if c.arch == "gemma4":
        full_layers = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
        shape = {"head_dim": c.global_head_dim or c.head_dim,
                 "num_key_value_heads": c.global_kv_heads or c.num_kv_heads}  # fmt: skip
        return out | {
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta},
            },
            "per_layer_config": {str(i): shape for i in full_layers},
            "attention_k_eq_v": c.attention_k_eq_v,
            "final_logit_softcapping": c.final_logit_softcapping or None,
            "hidden_activation": c.hidden_act,
            "hidden_size_per_layer_input": c.per_layer_input_size,
            "vocab_size_per_layer_input": c.per_layer_vocab_size,
            "num_kv_shared_layers": c.kv_shared_layers,
            "use_double_wide_mlp": c.double_wide_mlp,
            "enable_moe_block": bool(c.num_experts),
            "num_experts": c.num_experts or None,
            "top_k_experts": c.num_experts_per_tok or None,
            "moe_intermediate_size": c.moe_intermediate_size or None,
        }
    return out | {
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta},
        },
        "query_pre_attn_scalar": c.query_pre_attn_scalar or c.head_dim,
        "attn_logit_softcapping": c.attn_logit_softcapping or None,
        "hidden_activation": c.hidden_act,
    }
