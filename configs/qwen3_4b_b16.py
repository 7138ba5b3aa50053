"""Qwen3-4B drafter with the paper's recipe: the shape of z-lab/Qwen3-4B-DFlash-b16 (5 layers,
2560 wide, 32/8 heads x 128 (q_proj 2560 -> 4096), FFN 9728, taps [1, 9, 17, 25, 33], mask id
151669), 3072-token rows, 512 anchors, lr 6e-4, 6 epochs, bf16 compute, fp32 master weights.
Qwen3-4B ties its embeddings: the frozen head is the embedding matrix."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "Qwen/Qwen3-4B"
    cfg.data = "data/qwen3_4b"
    cfg.drafter.hidden_size = 2560
    cfg.drafter.intermediate_size = 9728
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 32
    cfg.drafter.num_kv_heads = 8
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = 151669
    cfg.drafter.target_layer_ids = (1, 9, 17, 25, 33)
    return cfg
