"""Frozen, hashable configurations for targets, drafters and decoding, and the target families
(`ARCHS`).

Every config is a frozen dataclass so it can be a static argument of `jax.jit`. Reading and
writing them as HF / z-lab `config.json` dicts: io/hf_config.py, io/drafter_config.py.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Arch:
    """One target family: how HF names it, and which layer kinds its model code builds. Adding a
    family is a row of `ARCHS` and its model code (docs/development.md)."""

    hf_class: str  # config.json "architectures"
    model_types: tuple[str, ...]  # the HF model_type values read as this arch; the first is written
    # Layers built per layer kind (`models/hybrid.py`): MoE MLPs and/or Gated DeltaNet
    # linear-attention layers beside (gated) full attention.
    layered: bool = False
    # Zero-centred RMSNorms (x * (1 + w)), gated full attention, partial RoPE.
    hybrid: bool = False
    qk_norm: bool = True  # a per-head RMSNorm on q and k (llama has none)
    # "sliding_attention" layers beside full ones (`models/sliding.py`); also layered.
    sliding: bool = False


# The target families, by arch name. (A multimodal wrapper's model_type, such as qwen3_5's, is
# read as its text model's.)
ARCHS = {
    "llama": Arch("LlamaForCausalLM", ("llama",), qk_norm=False),
    "qwen3": Arch("Qwen3ForCausalLM", ("qwen3",)),
    "qwen3_moe": Arch("Qwen3MoeForCausalLM", ("qwen3_moe",), layered=True),
    "qwen3_next": Arch("Qwen3NextForCausalLM", ("qwen3_next",), layered=True, hybrid=True),
    "qwen3_5": Arch("Qwen3_5ForCausalLM", ("qwen3_5_text", "qwen3_5"), layered=True, hybrid=True),
    "qwen3_5_moe": Arch(
        "Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text", "qwen3_5_moe"), layered=True, hybrid=True
    ),
    "gemma3": Arch("Gemma3ForCausalLM", ("gemma3_text", "gemma3"), layered=True, sliding=True),
    "gemma4": Arch("Gemma4ForCausalLM", ("gemma4_text", "gemma4"), layered=True, sliding=True),
    "gpt_oss": Arch("GptOssForCausalLM", ("gpt_oss",), layered=True, sliding=True),
}
SUPPORTED_TARGET_ARCHS = tuple(ARCHS)
LAYERED_ARCHS = tuple(name for name, arch in ARCHS.items() if arch.layered)
HYBRID_ARCHS = tuple(name for name, arch in ARCHS.items() if arch.hybrid)
SLIDING_ARCHS = tuple(name for name, arch in ARCHS.items() if arch.sliding)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Targets also take linear (Gemma 3's global layers), YaRN (gpt-oss) and proportional (Gemma 4's
# global layers: RoPE on the first partial_rotary_factor of each head's frequencies) scaling.
TARGET_ROPE_TYPES = SUPPORTED_ROPE_TYPES + ("linear", "yarn", "proportional")
# Attention implementations (ops/dispatch.py): "xla" is the reference that defines every mask,
# "pallas" the kernels, "auto" pallas on GPU/TPU and xla on CPU.
ATTENTION_IMPLS = ("auto", "xla", "pallas")
# Quantized target weights (ops/quant.py): int8 and fp8 (float8_e4m3fn) per output channel, int4
# per block of 32 contracted values; mxfp4 (gpt-oss's experts only: e2m1 values, a power-of-two
# scale per block of 32 contracted values, as its checkpoints store them).
QUANT_SCHEMES = ("int8", "int4", "fp8", "mxfp4")


class ConfigError(ValueError):
    """A configuration that cannot be used, with the reason in the message."""


def check_attention_impl(impl: str) -> None:
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl={impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")


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
    # Sliding-window families (SLIDING_ARCHS, `models/sliding.py`; layer_types names each layer
    # sliding_attention or full_attention): a sliding layer's query at position p sees keys at
    # p - sliding_window < s <= p. Gemma 3: its sliding layers' RoPE base local_rope_theta,
    # scores scaled by query_pre_attn_scalar ** -0.5 (0: head_dim), tanh-capped at
    # attn_logit_softcapping (0: none), the MLP's activation hidden_act. gpt-oss: projection
    # biases, per-head attention sinks, experts' SwiGLU clamped at swiglu_limit with swiglu_alpha.
    # Gemma 4: full layers with their own head dim and kv heads (0: as the sliding ones), keys
    # doubling as values there (attention_k_eq_v), logits tanh-capped (final_logit_softcapping).
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0
    hidden_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    global_head_dim: int = 0
    global_kv_heads: int = 0
    attention_k_eq_v: bool = False
    final_logit_softcapping: float = 0.0
    # Gemma 4 as released: per-layer input embeddings of per_layer_input_size per layer (0:
    # none; a table of per_layer_vocab_size rows); the last kv_shared_layers layers reuse the
    # K/V of the last earlier layer of their kind (`kv_source`), their MLPs twice as wide with
    # double_wide_mlp; num_experts > 0: every layer's MoE block beside its MLP (top
    # num_experts_per_tok of num_experts experts of width moe_intermediate_size).
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False

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
        return ARCHS[self.arch].qk_norm

    def _check_layers(self) -> None:
        types = self.layer_types
        kinds = {"linear_attention", "full_attention"} | (
            {"sliding_attention"} if self.sliding else set()
        )
        if types and (len(types) != self.num_layers or set(types) - kinds):
            raise ConfigError(
                f"layer_types={types} must give one of {'/'.join(sorted(kinds))} per layer"
            )
        if self.sliding and "sliding_attention" in types and self.sliding_window < 1:
            raise ConfigError("sliding_attention layers need sliding_window >= 1")
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
        return ARCHS[self.arch].layered

    @property
    def hybrid(self) -> bool:
        return ARCHS[self.arch].hybrid

    @property
    def sliding(self) -> bool:
        return ARCHS[self.arch].sliding

    @property
    def zero_centred_norms(self) -> bool:
        """RMSNorms that scale by (1 + w) (the hybrid families and Gemma)."""
        return self.hybrid or self.arch == "gemma3"

    def layer_heads(self, i: int) -> tuple[int, int]:
        """(kv heads, head dim) of layer i (Gemma 4's full layers have their own)."""
        if self.window(i) is None and self.global_head_dim:
            return self.global_kv_heads or self.num_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    def kv_source(self, i: int) -> int:
        """The layer whose K/V layer i attends over: itself, or for one of the last
        kv_shared_layers, the last layer of its kind before them (as HF's "store" layer)."""
        first = self.num_layers - self.kv_shared_layers
        if not self.kv_shared_layers or i < first:
            return i
        kind = self.layer_types[i]
        return max(j for j in range(first) if self.layer_types[j] == kind)

    def mlp_width(self, i: int) -> int:
        """Layer i's MLP width (Gemma 4's KV-sharing layers twice it with double_wide_mlp)."""
        wide = self.double_wide_mlp and self.kv_source(i) != i
        return self.intermediate_size * (2 if wide else 1)

    def window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it sees every earlier position)."""
        sliding = bool(self.layer_types) and self.layer_types[i] == "sliding_attention"
        return self.sliding_window if sliding else None

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
        """Layer i's sliding window (None: none, as a sliding layer's without `sliding_window`,
        causal in the block only, as Qwen3Config reads one); `window_from_anchor` says from
        where it is measured."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
