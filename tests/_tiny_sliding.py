"""Tiny random HF targets of the sliding-window families (gemma3_text, gemma4_text, gpt_oss), saved with
`save_pretrained`, shared by the tests.

    path = make_tiny_sliding(tmp_path, "gemma3")   # an HF directory
    model = load_torch(path)                       # the PyTorch reference (fp32, eval)

Each has window 8, sliding and full layers alternating, and weights random at scales that
make a misplaced norm, bias, sink or expert change the output.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Gemma4TextConfig, GptOssConfig

torch.set_num_threads(1)

FAMILIES = ("gemma3", "gemma4", "gpt_oss")
WINDOW = 8

_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    eos_token_id=None,  # generate(min_new_tokens=...) would mask an eos id's logit
    bos_token_id=None,
    pad_token_id=None,
)


def hf_config(family: str, **overrides):
    if family == "gemma3":
        kw = dict(_BASE, intermediate_size=48, query_pre_attn_scalar=24, rms_norm_eps=1e-6)
        return Gemma3TextConfig(**{**kw, **overrides})
    if family == "gemma4":
        # full layers 32-dim heads, one kv head whose keys are its values; logits capped at 1;
        # per-layer inputs of 8; layers 2 and 3 reuse the K/V of layers 0 and 1 (their MLPs
        # twice as wide); an MoE block of 2 of 4 experts beside every MLP
        kw = dict(_BASE, intermediate_size=48, global_head_dim=32, num_global_key_value_heads=1,
                  attention_k_eq_v=True, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=96, num_kv_shared_layers=2, use_double_wide_mlp=True,
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8,
                  final_logit_softcapping=1.0, rms_norm_eps=1e-6)  # fmt: skip
        return Gemma4TextConfig(**{**kw, **overrides})
    kw = dict(_BASE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2,
              rms_norm_eps=1e-5)  # fmt: skip
    # YaRN whose ramp lies inside the head's 8 frequencies (original context 64)
    kw["rope_parameters"] = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, beta_fast=8.0,
                                 beta_slow=1.0, original_max_position_embeddings=64,
                                 truncate=False)  # fmt: skip
    return GptOssConfig(**{**kw, **overrides})


def default_config(family: str):
    """A config of the family's transformers class with only sizes, the window and the layer
    count set (7 layers: Gemma's default 5:1 pattern, Gemma 4's last layer full; every other
    field, per-layer inputs and proportional RoPE included, the class default)."""
    ids = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    sizes = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, sliding_window=WINDOW, max_position_embeddings=256, **ids)  # fmt: skip
    if family == "gemma3":
        return Gemma3TextConfig(**sizes, intermediate_size=48, num_hidden_layers=7)
    if family == "gemma4":
        return Gemma4TextConfig(**sizes, intermediate_size=48, num_hidden_layers=7,
                                global_head_dim=32, hidden_size_per_layer_input=8,
                                vocab_size_per_layer_input=96)  # fmt: skip
    return GptOssConfig(**sizes, intermediate_size=16, num_hidden_layers=4, num_local_experts=4,
                        num_experts_per_tok=2)  # fmt: skip


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")
    zero_centred = model.config.model_type == "gemma3_text"
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_((0.0 if zero_centred else 1.0) + 0.2 * noise)
        elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's router
            p.copy_(1.0 + 0.3 * noise)
        elif name.endswith(("router.weight", "router.proj.weight", "sinks")):
            p.copy_(0.5 * noise)
        elif name.endswith("embed_tokens.weight") and gemma:
            p.copy_(0.12 * noise / model.config.hidden_size**0.5)  # x sqrt(D) at the input
        elif name.endswith("lm_head.weight"):
            p.copy_(0.3 * noise)
        else:
            p.copy_(0.12 * noise)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):  # Gemma 4's per-layer output multiplier (saved)
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def make_tiny_sliding(tmp_path, family: str, seed: int = 0, config=None, **overrides) -> Path:
    """Saves a random fp32 `family` CausalLM (of `config`, else `hf_config`) and returns its
    directory."""
    torch.manual_seed(seed)
    suffix = "-default" if config else ""
    config = config or hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model.eval(), seed)
    path = Path(tmp_path) / f"tiny-{family}-{seed}{suffix}"
    model.save_pretrained(path)
    return path


def load_torch(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
