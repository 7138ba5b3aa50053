"""Llama-3.1-8B-Instruct drafter: 5 layers at the target's shape (4096 wide, 32/8 heads x 128,
FFN 14336), taps [1, 8, 15, 22, 29] (the reference rule for 32 layers), block 10 as inferred for
z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (loss gamma 5), paper recipe otherwise.
Mask token: id 128002, `<|reserved_special_token_0|>`, an untrained reserved row of the
128256-row embedding that chat text never contains."""

from dflash_jax.training.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.target = "meta-llama/Llama-3.1-8B-Instruct"
    cfg.data = "data/llama31_8b"
    cfg.drafter.hidden_size = 4096
    cfg.drafter.intermediate_size = 14336
    cfg.drafter.num_layers = 5
    cfg.drafter.num_heads = 32
    cfg.drafter.num_kv_heads = 8
    cfg.drafter.head_dim = 128
    cfg.drafter.mask_token_id = 128002
    cfg.drafter.target_layer_ids = (1, 8, 15, 22, 29)
    cfg.block_size = 10
    # Global batch 32, as SpecForge's Qwen3-8B DFlash example (8 GPUs x --batch-size 4);
    # grad_accum_steps where a device cannot hold its rows at once (docs/training.md).
    cfg.batch_size = 32
    return cfg
