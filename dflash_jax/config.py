"""Frozen, hashable configurations for targets, drafters and decoding.

Every config is a frozen dataclass so it can be a static argument of `jax.jit`. Targets and
drafters read from and write back to HF `config.json` dictionaries (transformers v4 and v5 keys).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_TARGET_ARCHS = ("llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
# Families whose layers are built per layer kind (`models/hybrid.py`): MoE MLPs and/or Gated
# DeltaNet linear-attention layers beside (gated) full attention.
LAYERED_ARCHS = ("qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
# Hybrid families: zero-centred RMSNorms (x * (1 + w)), gated full attention, partial RoPE.
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# HF model_type (text model or its multimodal wrapper) -> arch.
_TARGET_MODEL_TYPES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
_HF_MODEL_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Attention implementations (ops/dispatch.py): "xla" is the reference that defines every mask,
# "pallas" the kernels, "auto" pallas on GPU/TPU and xla on CPU.
ATTENTION_IMPLS = ("auto", "xla", "pallas")
# Quantized target weights (ops/quant.py): int8 and fp8 (float8_e4m3fn) per output channel, int4
# per block of 32 contracted values.
QUANT_SCHEMES = ("int8", "int4", "fp8")


class ConfigError(ValueError):
    """A configuration that cannot be used, with the reason in the message."""


CACHE_DIR_ENV = "DFLASH_JAX_CACHE"


def cache_root() -> Path:
    """Where this machine's converted targets, step costs and row rules are kept:
    $DFLASH_JAX_CACHE, else $XDG_CACHE_HOME/dflash_jax, else ~/.cache/dflash_jax."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dflash_jax"


def write_json_atomic(path: Path, obj) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and a rename, so a reader never
    sees half a file; an unwritable cache (read-only, full) is left as it is: what it keeps is
    measured or computed again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def check_attention_impl(impl: str) -> None:
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl={impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")


def _freeze(value: Any) -> Any:
    """Turns nested dicts/lists into sorted tuples so configs stay hashable."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of `_freeze`: tuples of (str, value) pairs back into dicts, other tuples into
    lists, recursively (a config's frozen `rope_scaling` -> its HF JSON form)."""
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in value)
    ):
        return {k: thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def _rope_from_hf(cfg: Mapping[str, Any], where: str) -> tuple[float, tuple | None]:
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
    return float(theta), (_freeze(scaling) if scaling else None)


def _rope_to_hf(theta: float, scaling: tuple | None) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": theta}
    if scaling:
        out["rope_scaling"] = thaw(scaling)
    return out


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A causal LM of the Llama or Qwen3 family.

    `arch` selects the per-head q/k RMSNorm (qwen3) or none (llama).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    attention_impl: str = "auto"  # a run setting: never read from or written to config.json
    # A run setting too: (min_rows, max_rows) of the row rule every matmul of a pass keeps to
    # (`ops.invariance.RowRule`; the decodes' is one fixed tile, min = max), which makes each
    # position's result independent of the pass it is in. None: matmuls as XLA picks them.
    # The decodes fill it from `DecodeConfig.batch_invariant` and `row_tile`
    # (`decoding.programs.run_target_config`).
    invariant_rows: tuple[int, int] | None = None
    # How the decoder layers' projection kernels are stored (QUANT_SCHEMES; None: float), as
    # the params hold them (`models.quantized`): set by the loader, never read from or written
    # to config.json.
    quantize: str | None = None
    # MoE (qwen3_moe, qwen3_next, qwen3_5_moe; 0 experts: dense MLPs): top-k of num_experts
    # routed experts of width moe_intermediate_size, renormalised when norm_topk_prob; a layer is
    # sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step; an optional gated
    # shared expert of width shared_expert_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # Hybrid (HYBRID_ARCHS): "linear_attention" / "full_attention" per layer (() = all full);
    # Gated DeltaNet sizes; RoPE on the first partial_rotary_factor of each head.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        check_attention_impl(self.attention_impl)
        self._check_layers()
        if self.invariant_rows is not None:
            lo, hi = self.invariant_rows
            if lo < 1 or (hi and hi < lo):
                raise ConfigError(f"invariant_rows={self.invariant_rows}: need 1 <= min <= max")
        if self.quantize is not None and self.quantize not in QUANT_SCHEMES:
            raise ConfigError(
                f"quantize={self.quantize!r} is not a supported scheme; use one of "
                f"{', '.join(QUANT_SCHEMES)} or none for float weights"
            )
        if self.arch not in SUPPORTED_TARGET_ARCHS:
            raise ConfigError(
                f"target architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_TARGET_ARCHS)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def use_qk_norm(self) -> bool:
        return self.arch != "llama"

    def _check_layers(self) -> None:
        types = self.layer_types
        if types and (
            len(types) != self.num_layers or set(types) - {"linear_attention", "full_attention"}
        ):
            raise ConfigError(
                f"layer_types={types} must give one of linear_attention/full_attention per layer"
            )
        if "linear_attention" in types and not (
            self.linear_num_key_heads and self.linear_key_head_dim
        ):
            raise ConfigError(
                "linear_attention layers need linear_num_key_heads and linear_key_head_dim"
            )
        if self.linear_num_key_heads and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]"
            )
        if (types or self.num_experts) and self.arch not in LAYERED_ARCHS:
            raise ConfigError(f"{self.arch}: layer_types / experts need one of {LAYERED_ARCHS}")

    @property
    def layered(self) -> bool:
        """Layers built per kind (`models/hybrid.py`) instead of the dense `DecoderLayer`."""
        return self.arch in LAYERED_ARCHS

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHS

    def layer_kind(self, i: int) -> tuple[str, str]:
        """(mixer, mlp) of layer i: mixer "attention" | "linear", mlp "dense" | "moe"."""
        linear = bool(self.layer_types) and self.layer_types[i] == "linear_attention"
        sparse = (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )
        return ("linear" if linear else "attention", "moe" if sparse else "dense")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i)[0] == "attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i)[0] == "linear")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def first_layers(self, num_layers: int) -> TargetConfig:
        """The target cut after its first `num_layers` layers, per-layer fields cut to match
        (a forward that stops at the last tap: the layers above cannot change the taps; their
        params are left unused). Layer i keeps its kind (`layer_kind`)."""
        if not 1 <= num_layers <= self.num_layers:
            raise ConfigError(
                f"first_layers({num_layers}) of a {self.num_layers}-layer target: need "
                f"1 <= num_layers <= {self.num_layers}"
            )
        return dataclasses.replace(
            self,
            num_layers=num_layers,
            layer_types=self.layer_types[:num_layers],
            mlp_only_layers=tuple(i for i in self.mlp_only_layers if i < num_layers),
        )

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], dtype: str = "float32") -> TargetConfig:
        """Builds a config from an HF `config.json` dict; refuses what we cannot run."""
        if hf.get("text_config") and hf.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
            # A multimodal checkpoint (Qwen3_5ForConditionalGeneration): its language model.
            hf = {**hf["text_config"], "model_type": hf["model_type"]}
        model_type = hf.get("model_type")
        arch = _TARGET_MODEL_TYPES.get(model_type)
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
        theta, scaling = _rope_from_hf(hf, f"target {model_type}")
        n_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // n_heads
        eos = _as_int_tuple(hf.get("eos_token_id"))
        return cls(
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

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": [_ARCH_CLASSES[self.arch]],
            "model_type": _HF_MODEL_TYPE.get(self.arch, self.arch),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            **_rope_to_hf(self.rope_theta, self.rope_scaling),
            **_layered_to_hf(self),
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
        out["mlp_only_layers"] = _as_int_tuple(hf.get("mlp_only_layers"))
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


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference tap rule: one tap at N//2 for a 1-layer drafter, else L taps spread over
    [1, N-3] with banker's rounding (np.round), exactly as z-lab's `build_target_layer_ids`."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(
        int(np.round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
    )


# DFlash2's `dflash_config` keys, named as the reference `dflash.DFlash2DraftModel` reads them.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DSpark's additions to a DFlash drafter, named as `speculators` names them (io/speculators.py)
DSPARK_FIELDS = ("sample_from_anchor", "markov_rank", "markov_head_type",
                 "enable_confidence_head", "confidence_head_with_markov")  # fmt: skip
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (Qwen3-style layers with K/V injection), as in z-lab's config.json.

    DFlash2 (`DFlash2DraftModel`) when the four `dflash_config` fields below are set (all or
    none): a grouped dynamic causal convolution (`conv_kernel_size` taps, dynamic kernels shared
    by `conv_group_size` channels) around each layer's attention and MLP, and a candidate
    selector over each slot's `selector_top_k` candidates with rank-`selector_rank` codebooks.

    `draft_vocab_size` > 0: the drafter drafts over a vocabulary of its own, a subset of the
    target's (`speculators`' d2t/t2d maps): its params gain `lm_head` (kernel [D, draft vocab])
    and `draft_to_target` (int32 [draft vocab], each draft id's target id, ascending); 0: it
    drafts through the target's lm_head over the target's vocabulary.

    Sliding layers (`layer_types`, `sliding_window` W) bound what a block sees of the context.
    z-lab's window (the reference `dflash` package, HF's sliding window) is measured from each
    query: slot j at position p sees keys at p - W < position (so its own block too, within W).
    `window_from_anchor` (the `speculators` format's window) measures it from the block's
    anchor a: every slot of the block sees context positions a - W .. a - 1 and its whole block
    (or its earlier slots, when causal). Either way a windowed layer drafts over at most W
    context rows, whatever the context's length.

    DSpark (`speculators`' `DSparkDraftModel`, `config.is_dspark`) when any of the
    `DSPARK_FIELDS` below is set: a DFlash drafter whose draft at position anchor+i+1 gets a
    low-rank Markov logit bias from the token at anchor+i (`markov_rank` > 0; the
    `markov_head_type` variant: "vanilla", "gated" by the slot's hidden state, or "rnn" with a
    state carried along the block), a confidence head (`enable_confidence_head`: one logit per
    draft, its predicted acceptance; its input the hidden state, with the Markov embedding of
    the previous token when `confidence_head_with_markov`), and with `sample_from_anchor` the
    anchor slot drafts too (block_size drafts, slot j predicting anchor+j+1; otherwise slot j
    predicts anchor+j, j >= 1). See `models/dspark.py`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    window_from_anchor: bool = False
    causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    draft_vocab_size: int = 0
    sample_from_anchor: bool = False
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    dtype: str = "float32"
    attention_impl: str = "auto"  # a run setting: never read from or written to config.json
    # Run settings too (`DecodeConfig.draft_window`, set by the decode): drafting one block,
    # each full-attention layer sees the first `draft_sinks` context rows and the
    # `draft_window` before the anchor (0: all of them). Sliding layers keep their own window.
    draft_window: int = 0
    draft_sinks: int = 0

    def __post_init__(self):
        check_attention_impl(self.attention_impl)
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"drafter layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ConfigError(f"drafter layer type {t!r} is not supported")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("drafter has sliding_attention layers but no sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"drafter num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if not self.target_layer_ids:
            raise ConfigError("drafter has no target_layer_ids")
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size={self.block_size} must be at least 2")
        self._check_dflash2()
        if self.draft_vocab_size and not 0 < self.draft_vocab_size < self.vocab_size:
            raise ConfigError(
                f"drafter draft_vocab_size={self.draft_vocab_size} must lie in (0, "
                f"vocab_size={self.vocab_size}); 0 drafts over the target's vocabulary"
            )
        if self.draft_vocab_size and self.is_dflash2:
            raise ConfigError(
                "a DFlash2 drafter drafts over the target's vocabulary (its selector's "
                "codebooks cover it); set draft_vocab_size=0"
            )
        self._check_dspark()

    def _check_dflash2(self) -> None:
        sizes = {name: getattr(self, name) for name in DFLASH2_FIELDS}
        if any(sizes.values()) and not all(v > 0 for v in sizes.values()):
            raise ConfigError(f"a DFlash2 drafter needs all of {sizes} positive")
        if self.is_dflash2 and self.hidden_size % self.conv_group_size:
            raise ConfigError(
                f"drafter hidden_size={self.hidden_size} is not a multiple of "
                f"conv_group_size={self.conv_group_size}"
            )
        if self.is_dflash2 and self.selector_top_k > self.vocab_size:
            raise ConfigError(
                f"drafter selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}"
            )

    def _check_dspark(self) -> None:
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"drafter markov_head_type={self.markov_head_type!r} is not one of "
                f"{list(MARKOV_HEAD_TYPES)}"
            )
        if self.markov_rank < 0:
            raise ConfigError(f"drafter markov_rank={self.markov_rank} must be >= 0 (0: no bias)")
        with_markov = self.enable_confidence_head and self.confidence_head_with_markov
        if with_markov and not self.markov_rank:
            raise ConfigError(
                "drafter confidence_head_with_markov=true needs a Markov head (markov_rank > 0); "
                "set confidence_head_with_markov=false or a markov_rank"
            )
        if self.is_dspark and self.is_dflash2:
            raise ConfigError(
                "a DSpark drafter is built on DFlash layers, not DFlash2's; set the DFlash2 "
                f"sizes {list(DFLASH2_FIELDS)} to 0 or the DSpark fields {list(DSPARK_FIELDS)} off"
            )

    @property
    def is_dspark(self) -> bool:
        """A DSpark drafter: a Markov bias, a confidence head or drafts from the anchor slot."""
        return self.sample_from_anchor or self.markov_rank > 0 or self.enable_confidence_head

    @property
    def num_drafts(self) -> int:
        """Drafts per block: block_size - 1, or block_size when the anchor slot drafts too."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def is_dflash2(self) -> bool:
        """A DFlash2 drafter: convolutions around each sublayer and a candidate selector."""
        return self.conv_kernel_size > 0

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, i: int) -> bool:
        """`causal` overrides per-layer types; sliding layers are causal inside the block."""
        if self.causal is not None:
            return self.causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: full attention); `window_from_anchor` says from
        where it is measured."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_zlab(cls, hf: Mapping[str, Any], dtype: str = "float32") -> DrafterConfig:
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
            raise ConfigError(
                f"drafter config lacks {missing}; pass a DFlash drafter's config.json"
            )
        num_layers = int(hf["num_hidden_layers"])
        num_target_layers = int(lookup("num_target_layers", 0) or 0)
        tap_ids = _as_int_tuple(lookup("target_layer_ids"))
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
        theta, scaling = _rope_from_hf(hf, "drafter")
        n_heads = int(hf["num_attention_heads"])
        is_causal = lookup("causal", hf.get("is_causal"))
        return cls(
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
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
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

    def to_zlab(self) -> dict[str, Any]:
        """The z-lab `config.json` dict that the reference `dflash` package loads."""
        dflash_config: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                dflash_config[name] = getattr(self, name)
        if self.draft_vocab_size:  # ours (Orbax) only: write_zlab refuses it
            dflash_config["draft_vocab_size"] = self.draft_vocab_size
        if self.window_from_anchor:  # ours (Orbax) only: write_zlab refuses it
            dflash_config["window_from_anchor"] = True
        arch = "DFlash2DraftModel" if self.is_dflash2 else "DFlashDraftModel"
        if self.is_dflash2:
            dflash_config |= {name: getattr(self, name) for name in DFLASH2_FIELDS}
        if self.is_dspark:  # ours (Orbax) only: write_zlab refuses it
            arch = "DSparkDraftModel"
            dflash_config |= {name: getattr(self, name) for name in DSPARK_FIELDS}
        out = {
            "architectures": [arch],
            "auto_map": {"AutoModel": f"dflash.{arch}"},
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "layer_types": list(self.layer_types),
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16" if self.dtype == "bfloat16" else "float32",
            "dflash_config": dflash_config,
            **_rope_to_hf(self.rope_theta, self.rope_scaling),
        }
        if self.causal is not None:
            # The reference, vLLM and SGLang read the top-level `is_causal`.
            out["is_causal"] = self.causal
        if self.sliding_window:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_zlab(), indent=2, sort_keys=True)


def _dspark_fields(lookup) -> dict[str, Any]:
    """A DSpark drafter's `DSPARK_FIELDS` from a config lookup (off where absent)."""
    return {
        "sample_from_anchor": bool(lookup("sample_from_anchor", False)),
        "markov_rank": int(lookup("markov_rank", 0)),
        "markov_head_type": str(lookup("markov_head_type", "vanilla")),
        "enable_confidence_head": bool(lookup("enable_confidence_head", False)),
        "confidence_head_with_markov": bool(lookup("confidence_head_with_markov", False)),
    }


# A tree step of N nodes is recorded (`DecodeOutput.block_sizes`, `DecodeConfig.all_kinds`) as
# TREE_KIND_BASE + N: above every block size (a drafting kind is its block size, a copy its
# negative), so one int still names any step kind. `kind_label` names it "treeN".
TREE_KIND_BASE = 1000


def tree_kind(num_nodes: int) -> int:
    """The recorded kind of a tree step of `num_nodes` tokens."""
    return TREE_KIND_BASE + num_nodes


def kind_label(kind: int) -> str:
    """A step kind as text: its block size ("8"; "1" a plain step), "-8" for a copied block,
    "tree16" for a tree of 16 tokens."""
    kind = int(kind)
    return f"tree{kind - TREE_KIND_BASE}" if kind >= TREE_KIND_BASE else str(kind)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static decoding settings. `temperature == 0` is greedy; otherwise sampling with
    top-k (0 = off) and top-p (1 = off), applied identically to target and draft."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    block_size: int = 16
    stop_token_ids: tuple[int, ...] = ()
    # Adaptive draft length (decoding/adaptive.py): each loop step picks one of `step_kinds`
    # block sizes (1 = a plain target step, no drafting) by expected tokens per unit of cost.
    adaptive: bool = False
    step_kinds: tuple[int, ...] = ()  # () with adaptive: 1, 4, 8 and block_size (those <= it)
    adaptive_rate: float = 0.2  # weight of the newest step in the acceptance estimates
    adaptive_prior: float = 0.3  # initial per-position acceptance estimate (see adaptive.py)
    probe_every: int = 16  # after this many plain steps in a row, draft once to re-measure
    probe_backoff: int = 4  # a failed probe doubles the wait, up to probe_every * this
    # Prompt-lookup step kinds (adaptive only; decoding/lookup.py): block sizes whose drafts are
    # copied from the prompt and the text so far (the longest suffix match of up to
    # `lookup_ngram` tokens, then what followed it) instead of drafted; verified the same way.
    lookup_kinds: tuple[int, ...] = ()
    lookup_ngram: int = 3
    # Every target pass batch-invariant (`ops.invariance`): a position's logits are bitwise the
    # same in an AR step, a verify, a prefill or a batch, so greedy speculative output equals
    # greedy AR output in any dtype. False: the passes as XLA picks them (fastest; a verify and
    # an AR step may then round a near-tie apart: ~1e-6 apart in fp32, where no benchmark
    # prompt has flipped, but often in bf16). None: on for every dtype but float32
    # (`decoding.programs.run_target_config`).
    batch_invariant: bool | None = None
    # The row tile of a batch-invariant decode: every GEMM of every target pass runs at exactly
    # this many rows (`ops.invariance.RowRule.fixed`; 0: `ops.invariance.ROW_TILE`, 32). Runs
    # at one tile give a position the same bits, whatever their batch; a run whose passes are
    # all wide (a server's slots x 16, `ops.invariance.row_tile_for`) sets a wider one, which
    # runs them as one tile instead of several.
    row_tile: int = 0
    # Tree verification (decoding/tree.py): a step that verifies a tree of this many tokens (the
    # anchor and tree_nodes - 1 drafted nodes, grown best-first from the drafter's per-position
    # distributions) in one target pass and commits its longest accepted path. Fixed mode: every
    # step is one. Adaptive: one more step kind (`tree_kind(tree_nodes)`, last in `all_kinds`)
    # the controller chooses beside the chains and copies. 0: no tree.
    tree_nodes: int = 0
    # Each row carries its own request's settings in the loop state (`sampling.RowSettings`:
    # temperature, top-k, top-p, PRNG key, token limit up to max_new_tokens), so the rows of one
    # running decode can be different requests (a server's slots, `decoding.slots`). The start
    # gives every row this config's settings; greedy rows keep the argmax of the greedy path.
    row_settings: bool = False
    # DSpark's confidence cut (a drafter with a confidence head, `models/dspark.py`): a step
    # keeps its drafts only while the product of their predicted acceptance probabilities
    # stays >= this; the drafts after the cut are not offered to the verify (the step commits
    # the kept drafts the target accepts, then one target token: at the cut a sample of the
    # target itself). A fixed-block decode verifies at the narrowest compiled width holding
    # every active row's kept drafts (`decoding/cut.py`: what a cut saves); adaptive kinds
    # apply the cut to their own drafts. 0: no cut (the measured default, docs/results.md).
    confidence_cut: float = 0.0
    # Prompts longer than this are prefilled in chunks of this many tokens (`phases.prompt_pass`),
    # each a pass over the cache written so far: a layer's prefill holds scores for
    # prefill_chunk x prompt slots, not prompt x prompt (32k tokens of Qwen3-8B: 267 GiB of
    # fp32 scores whole). 0: the whole prompt in one pass.
    prefill_chunk: int = 256
    # Bounded drafting for drafters trained without a window (`models.drafter`): every
    # full-attention draft layer sees the first `draft_sinks` context rows and the last
    # `draft_window` before the block's anchor, so a draft's cost stops growing with the
    # context. Lossless (the target verifies); acceptance may change. 0: the whole context.
    draft_window: int = 0
    draft_sinks: int = 4

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not 0 <= self.row_tile <= 1024:
            raise ConfigError(f"row_tile={self.row_tile}: give 1 to 1024 rows (0: the default, 32)")
        if self.tree_nodes and (self.tree_nodes < 2 or self.block_size < 2):
            raise ConfigError(
                f"tree_nodes={self.tree_nodes} needs at least 2 nodes (the anchor and one "
                f"draft) and block_size >= 2 (got {self.block_size}); 0 = a chain"
            )
        if self.tree_nodes and self.row_settings:
            raise ConfigError(
                f"tree_nodes={self.tree_nodes} with row_settings: per-row sampling settings are "
                "not implemented for tree steps; use tree_nodes=0"
            )
        if self.tree_nodes and self.block_size >= TREE_KIND_BASE:
            raise ConfigError(
                f"block_size={self.block_size} with a tree: block sizes below {TREE_KIND_BASE} "
                "(a tree step's recorded kind lies above them)"
            )
        kinds = self.step_kinds
        if self.adaptive and not kinds:
            kinds = tuple(sorted({1, *(b for b in (4, 8) if b < self.block_size), self.block_size}))
        if kinds and (min(kinds) < 1 or max(kinds) != self.block_size or len(set(kinds)) < 2):
            raise ConfigError(
                f"step_kinds={kinds} must be distinct block sizes >= 1 (at least two), the "
                f"largest equal to block_size={self.block_size}"
            )
        object.__setattr__(self, "step_kinds", tuple(sorted(kinds)) if self.adaptive else ())
        if not 0.0 < self.adaptive_rate <= 1.0 or not 0.0 <= self.adaptive_prior <= 1.0:
            raise ConfigError(
                f"adaptive_rate={self.adaptive_rate} must be in (0, 1] and "
                f"adaptive_prior={self.adaptive_prior} in [0, 1]"
            )
        if self.probe_every < 1:
            raise ConfigError(f"probe_every={self.probe_every} must be at least 1")
        if not 0.0 <= self.confidence_cut < 1.0:
            raise ConfigError(f"confidence_cut={self.confidence_cut} must be in [0, 1) (0: no cut)")
        lookup = tuple(sorted({int(b) for b in self.lookup_kinds}))
        if lookup and (not self.adaptive or min(lookup) < 2 or max(lookup) > self.block_size):
            raise ConfigError(
                f"lookup_kinds={self.lookup_kinds} need adaptive=True and block sizes in "
                f"[2, block_size={self.block_size}]"
            )
        object.__setattr__(self, "lookup_kinds", lookup)
        if self.lookup_ngram < 1:
            raise ConfigError(f"lookup_ngram={self.lookup_ngram} must be at least 1")
        if self.probe_backoff < 1:
            raise ConfigError(f"probe_backoff={self.probe_backoff} must be at least 1")
        if self.prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk={self.prefill_chunk} must be >= 0 (0: whole)")
        if self.draft_window < 0 or self.draft_sinks < 0:
            raise ConfigError(
                f"draft_window={self.draft_window} and draft_sinks={self.draft_sinks} must be "
                ">= 0 (draft_window 0: the drafter sees the whole context)"
            )
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.block_size < 1:
            raise ConfigError(f"block_size={self.block_size} must be at least 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def all_kinds(self) -> tuple[int, ...]:
        """Every adaptive step kind, in the order of the controller's costs and of a forced
        kind index: the drafter's `step_kinds`, then the lookup kinds as negative block sizes,
        then the tree kind `tree_kind(tree_nodes)` when there is a tree (how
        `DecodeOutput.block_sizes` records them)."""
        tree = (tree_kind(self.tree_nodes),) if self.adaptive and self.tree_nodes else ()
        return self.step_kinds + tuple(-b for b in self.lookup_kinds) + tree

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
