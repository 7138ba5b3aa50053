"""Qwen3-8B drafter with the paper's recipe: the shape of z-lab/Qwen3-8B-DFlash-b16 (5 layers,
4096 wide, 32/8 heads x 128, FFN 12288, taps [1, 9, 17, 25, 33], mask id 151669 = the first
padding row after the tokenizer's 151669 entries), 3072-token rows, 512 anchors, lr 6e-4,
6 epochs, 4% warm-up then cosine, clip 1, bf16 compute with fp32 master weights."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "Qwen/Qwen3-8B"
    cfg.data = "data/qwen3_8b"
    cfg.drafter.hidden_size = 4096
    cfg.drafter.intermediate_size = 12288
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 32
    cfg.drafter.num_kv_heads = 8
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = 151669
    cfg.drafter.target_layer_ids = (1, 9, 17, 25, 33)
    # Global batch 32, as SpecForge's Qwen3-8B DFlash example (8 GPUs x --batch-size 4);
    # grad_accum_steps where a device cannot hold its rows at once (docs/training.md).
    cfg.batch_size = 32
    return cfg
