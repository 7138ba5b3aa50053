"""Reference oracle helpers: a tiny random transformers Qwen3 target and a z-lab
`dflash.DFlashDraftModel` (dflash 0.1.0) with random weights, saved to disk, plus functions that
run the reference drafter the way `dflash_generate` does. Everything is fp32 and CPU.

    target_dir, drafter_dir = make_reference_pair(tmp_path, block_size=8, num_kv_heads=2)
    hf_target, hf_drafter = load_reference_pair(target_dir, drafter_dir)
    taps_tf = reference_taps(hf_target, hf_drafter, tokens_t)
    logits = reference_draft_logits(hf_target, hf_drafter, taps_tf, block_tokens_j)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from dflash.model import (
    DFlash2DraftModel,
    DFlashDraftModel,
    _draft_value,
    _output_head,
    _raw_input_embeddings,
    extract_context_feature,
)
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)  # tiny models; the test machine's few cores are shared

VOCAB_SIZE = 512
MASK_TOKEN_ID = 511


def _randomize(model: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """Replaces every weight: matrices ~ N(0, scale), norm weights ~ 1 + N(0, scale), so that a
    wrong transpose, a skipped norm or a swapped tensor changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def make_reference_pair(
    tmp_path: str | Path,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tap_ids: tuple[int, ...] = (1, 3),
    target_layers: int = 6,
    hidden_size: int = 64,
    head_dim: int = 16,
    vocab_size: int = VOCAB_SIZE,
    mask_token_id: int = MASK_TOKEN_ID,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    tie_word_embeddings: bool = False,
    dflash_extra: dict | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Saves a random Qwen3ForCausalLM target (theta 1e4) and a random DFlashDraftModel (theta 1e6,
    so a drafter that used the target's theta would fail) under tmp_path; returns their dirs.
    `dflash_extra` with DFlash2's `conv_kernel_size` makes it a DFlash2DraftModel."""
    tmp_path = Path(tmp_path)
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target_cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=target_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(target_cfg).float().eval()
    _randomize(target, seed)
    target.save_pretrained(target_dir)

    dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(tap_ids)}
    dflash_config |= dflash_extra or {}
    extra = {} if is_causal is None else {"is_causal": is_causal}
    drafter_cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=1e6,
        max_position_embeddings=512,
        layer_types=list(layer_types) if layer_types else None,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        num_target_layers=target_layers,
        block_size=block_size,
        dflash_config=dflash_config,
        **extra,
    )
    model_class = DFlash2DraftModel if "conv_kernel_size" in dflash_config else DFlashDraftModel
    drafter = model_class(drafter_cfg).float().eval()
    _randomize(drafter, seed + 1)
    drafter.save_pretrained(drafter_dir)
    return target_dir, drafter_dir


def load_reference_pair(target_dir, drafter_dir) -> tuple[Qwen3ForCausalLM, DFlashDraftModel]:
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    dflash2 = "DFlash2DraftModel" in (Path(drafter_dir) / "config.json").read_text()
    model_class = DFlash2DraftModel if dflash2 else DFlashDraftModel
    drafter = model_class.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    return target, drafter


@torch.no_grad()
def reference_taps(target, drafter, tokens_t: np.ndarray) -> np.ndarray:
    """Target taps for one sequence [T] -> [T, len(tap_ids) * D] (HF hidden_states[l + 1])."""
    ids = torch.as_tensor(np.asarray(tokens_t), dtype=torch.long)[None]
    out = target(ids, output_hidden_states=True)
    return extract_context_feature(out.hidden_states, drafter.target_layer_ids)[0].numpy()


@torch.no_grad()
def reference_draft_logits(
    target, drafter, taps_tf: np.ndarray, block_tokens_j: np.ndarray
) -> np.ndarray:
    """One block drafted as `dflash_generate` does, with context rows 0..T-1 at positions 0..T-1
    and the block at T..T+bs-1 (anchor = T). -> logits [bs - 1, V] for slots 1..bs-1."""
    t, bs = taps_tf.shape[0], len(block_tokens_j)
    block = torch.as_tensor(np.asarray(block_tokens_j), dtype=torch.long)[None]
    scale = float(_draft_value(drafter.config, "input_embedding_scale", 1.0))
    hidden = drafter(
        target_hidden=torch.as_tensor(np.asarray(taps_tf, np.float32))[None],
        noise_embedding=_raw_input_embeddings(target, block, scale),
        position_ids=torch.arange(t + bs)[None],
    )[:, 1:, :]
    return drafter.compute_logits(hidden, _output_head(target))[0].numpy()
