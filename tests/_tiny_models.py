"""Tiny random HF targets (Qwen3 / Llama) saved with `save_pretrained`, shared by the tests.

    path = make_tiny_hf_target(tmp_path, arch="llama", tie=True)   # an HF directory
    model = load_hf_torch(path)                                      # the PyTorch reference

Weights are random with non-trivial norms (scales around 1, not exactly 1), so a norm loaded
into the wrong place shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

TINY_DIMS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so the scaling changes most frequencies
}

_CONFIGS = {"qwen3": Qwen3Config, "llama": LlamaConfig}


def make_tiny_hf_model(arch: str = "qwen3", tie: bool = False, seed: int = 0, **overrides):
    """A random fp32 `Qwen3ForCausalLM` / `LlamaForCausalLM` in eval mode."""
    kwargs = {**TINY_DIMS, "tie_word_embeddings": tie, **overrides}
    config = _CONFIGS[arch](**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model


def make_tiny_hf_target(
    tmp_path,
    arch: str = "qwen3",
    tie: bool = False,
    seed: int = 0,
    max_shard_size=None,
    **overrides,
) -> Path:
    """Saves a tiny random model (config.json, generation_config.json, safetensors; sharded
    with an index when `max_shard_size` is given, e.g. "40KB") and returns its directory."""
    model = make_tiny_hf_model(arch, tie, seed, **overrides)
    path = Path(tmp_path) / f"tiny-{arch}{'-tied' if tie else ''}-{seed}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def load_hf_torch(path):
    """The PyTorch reference for a saved tiny target (fp32, eval mode)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits_and_hidden(model, tokens) -> tuple[np.ndarray, list[np.ndarray]]:
    """tokens [B,T] int -> (logits [B,T,V], hidden_states list of [B,T,D]) as numpy."""
    with torch.no_grad():
        out = model(
            torch.as_tensor(np.asarray(tokens), dtype=torch.long), output_hidden_states=True
        )
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation (what the GGUF loader undoes)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def make_tiny_gguf(tmp_path, model, arch: str = "llama", quant: str = "") -> Path:
    """Writes a tiny HF Llama model (from `make_tiny_hf_model(arch="llama")`) as an F32 GGUF the
    way llama.cpp converts it (renamed tensors, permuted q/k rows, no tokenizer metadata);
    `quant` (e.g. "Q4_1"): the layers' projection matrices in that block type (gguf's own
    quantizer), the rest F32."""
    import gguf

    c = model.config
    path = Path(tmp_path) / f"tiny-{arch}{'-' + quant if quant else ''}.gguf"
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                writer.add_tensor("output.weight", w)
        else:
            _, _, layer, *rest = name.split(".")
            short = names[".".join(rest[:-1])]
            if short == "attn_q":
                w = _llama_cpp_permute(w, c.num_attention_heads)
            elif short == "attn_k":
                w = _llama_cpp_permute(w, c.num_key_value_heads)
            if quant and w.ndim == 2:
                qtype = gguf.GGMLQuantizationType[quant]
                w = gguf.quants.quantize(w, qtype)
                writer.add_tensor(f"blk.{layer}.{short}.weight", w, raw_dtype=qtype)
                continue
            writer.add_tensor(f"blk.{layer}.{short}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
