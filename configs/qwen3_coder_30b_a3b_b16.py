"""Qwen3-Coder-30B-A3B (MoE: 48 layers 2048 wide, 32/4 heads x 128, 128 experts of width 768,
top-8 renormalised) drafter in the shape of the z-lab b16 drafters: 5 layers at the target's
width (32/4 heads x 128, FFN 6144), taps [1, 12, 23, 34, 45] (the reference rule for 48
layers), mask id 151669 (the first padding row after the Qwen3 tokenizer's 151669 entries),
paper recipe otherwise. The target's shape for offline planning is in
`infer.aot.KNOWN_TARGETS`."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    cfg.data = "data/qwen3_coder_30b_a3b"
    cfg.drafter.hidden_size = 2048
    cfg.drafter.intermediate_size = 6144
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 32
    cfg.drafter.num_kv_heads = 4
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = 151669
    cfg.drafter.target_layer_ids = (1, 12, 23, 34, 45)
    return cfg
