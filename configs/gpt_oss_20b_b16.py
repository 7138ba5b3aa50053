"""gpt-oss-20b (24 layers 2880 wide, 64/8 heads x 64, sliding window 128 on every other layer,
attention sinks, YaRN, 32 experts of width 2880, top-4) drafter in the shape of the z-lab b16
drafters: 5 Qwen3-style layers at the target's width (64/8 heads x 64, FFN 7680), taps
[1, 6, 11, 16, 21] (the reference rule for 24 layers), mask id 200017 (a reserved id of the
o200k_harmony tokenizer as we read it: check it against the tokenizer you train with), paper
recipe otherwise. The target's shape for offline planning is in `infer.aot.KNOWN_TARGETS`; its
MXFP4 experts are dequantized at load (docs/models.md)."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "openai/gpt-oss-20b"
    cfg.data = "data/gpt_oss_20b"
    cfg.drafter.hidden_size = 2880
    cfg.drafter.intermediate_size = 7680
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 64
    cfg.drafter.num_kv_heads = 8
    cfg.drafter.head_dim = 64
    cfg.drafter.mask_token_id = 200017
    cfg.drafter.target_layer_ids = (1, 6, 11, 16, 21)
    return cfg
