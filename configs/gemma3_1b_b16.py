"""Gemma 3 1B (text: 26 layers 1152 wide, 4/1 heads x 256, five sliding layers (window 512) to
one global, vocabulary 262144, tied head) drafter in the shape of the z-lab b16 drafters: 5
Qwen3-style layers at the target's width (8/2 heads x 128, FFN 3072), taps [1, 6, 12, 18, 23]
(the reference rule for 26 layers), mask id 4 (the Gemma tokenizer's `<mask>`), paper recipe
otherwise. The target's shape for offline planning is in `infer.aot.KNOWN_TARGETS`."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "google/gemma-3-1b-it"
    cfg.data = "data/gemma3_1b"
    cfg.drafter.hidden_size = 1152
    cfg.drafter.intermediate_size = 3072
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 8
    cfg.drafter.num_kv_heads = 2
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = 4
    cfg.drafter.target_layer_ids = (1, 6, 12, 18, 23)
    return cfg
