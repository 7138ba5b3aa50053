"""Tiny random HF targets of the MoE and hybrid families (qwen3_moe, qwen3_next, qwen3_5,
qwen3_5_moe), saved with `save_pretrained`, shared by the tests.

    path = make_tiny_layered(tmp_path, "qwen3_5")   # an HF directory
    model = load_torch(path)                        # the PyTorch reference (fp32, eval)

Weights are random with non-trivial scales (norms near 1, or near 0 for the zero-centred
ones), so a norm, gate or projection loaded into the wrong place changes the output. The
router weights are large enough that top-k choices differ from token to token.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from dflash_jax.config import DrafterConfig
from dflash_jax.models.drafter import init_drafter_params

torch.set_num_threads(1)

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")

_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=None,  # generate(min_new_tokens=...) would mask an eos id's logit
)
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
_LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)


def hf_config(family: str, **overrides):
    """The transformers config of a tiny `family` target (4 layers; hybrids alternate)."""
    if family == "qwen3_moe":
        kw = dict(_BASE, **_MOE, intermediate_size=48, num_hidden_layers=3, norm_topk_prob=True)
        return Qwen3MoeConfig(**{**kw, **overrides})
    kw = dict(_BASE, **_LINEAR, num_hidden_layers=4)
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**{**kw, "intermediate_size": 48, **overrides})
    kw |= dict(_MOE, shared_expert_intermediate_size=24)
    if family == "qwen3_next":
        # layer 1 dense (mlp_only_layers): both MLP kinds in one model
        kw |= dict(intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)
        return Qwen3NextConfig(**{**kw, **overrides})
    return Qwen3_5MoeTextConfig(**{**kw, **overrides})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            zero_centred = "linear_attn.norm" not in name and model.config.model_type != "qwen3_moe"
            p.copy_((0.0 if zero_centred else 1.0) + 0.2 * noise)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * noise)
        elif name.endswith("mlp.gate.weight"):
            p.copy_(0.5 * noise)
        else:
            p.copy_(0.12 * noise)


def make_tiny_layered(tmp_path, family: str, seed: int = 0, **overrides) -> Path:
    """Saves a random fp32 `family` CausalLM and returns its directory."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    randomize(model.eval(), seed)
    path = Path(tmp_path) / f"tiny-{family}-{seed}"
    model.save_pretrained(path)
    return path


def make_tiny_multimodal(tmp_path, text_dir: Path) -> Path:
    """A `Qwen3_5ForConditionalGeneration` (tiny vision tower) holding the text model saved at
    `text_dir`, saved as the published Qwen3.5 checkpoints are laid out."""
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    config = Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    missing = model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
    assert not missing.missing_keys
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    path = Path(tmp_path) / "tiny-qwen3_5-multimodal"
    model.save_pretrained(path)
    return path


def load_torch(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tiny_drafter(target, block_size=4):
    """A 1-layer random drafter over a loaded layered target, tapping layers 0 and 2, that
    always proposes token 0 -> (config, params)."""
    c = target.config
    dcfg = DrafterConfig(
        hidden_size=c.hidden_size,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=c.vocab_size,
        mask_token_id=c.vocab_size - 1,
        target_layer_ids=(0, 2),  # a linear-attention layer's output and a full one's
        num_target_layers=c.num_layers,
        block_size=block_size,
    )
    dp = init_drafter_params(dcfg, jax.random.key(1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])  # always proposes token 0
    return dcfg, dp
