"""Qwen3.5-9B (hybrid: 32 layers 4096 wide, every 4th gated full attention with 16/4 heads x 256
and RoPE on a quarter of each head, the rest Gated DeltaNet with 16 key / 32 value heads x 128)
drafter: 5 layers at the target's width (32/8 heads x 128, FFN 12288), taps [1, 8, 15, 22, 29]
(the reference rule for 32 layers), paper recipe otherwise. The mask id is a placeholder, the
embedding's last row (248319): set it to the released drafter's `dflash_config.mask_token_id`.
The target's shape for offline planning is in `infer.aot.KNOWN_TARGETS`."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "Qwen/Qwen3.5-9B"
    cfg.data = "data/qwen35_9b"
    cfg.drafter.hidden_size = 4096
    cfg.drafter.intermediate_size = 12288
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 32
    cfg.drafter.num_kv_heads = 8
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = 248319
    cfg.drafter.target_layer_ids = (1, 8, 15, 22, 29)
    return cfg
