"""A tiny training config (configs/*.py style) over a tiny target known only by its
config.json, for the CLIs that need shapes and no weights (infer.lower, infer.memory_plan).

Head dim 64 and 128 drafter queries per training row (16 anchors x block 8), so that every
kernel the dispatch has for TPU and GPU takes these shapes; 2 KV heads split over tensor=2.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_TARGET = {
    "model_type": "qwen3", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 1024, "tie_word_embeddings": False,
}  # fmt: skip


def write_tiny_config(directory: Path) -> Path:
    """Writes directory/tiny_hf/config.json and directory/tiny_config.py; -> the config's path."""
    (directory / "tiny_hf").mkdir()
    (directory / "tiny_hf" / "config.json").write_text(json.dumps(TINY_TARGET))
    config = directory / "tiny_config.py"
    config.write_text(
        "from dflash_jax.training.trainer import default_config\n\n\n"
        "def get_config():\n"
        "    cfg = default_config()\n"
        f"    cfg.target = {str(directory / 'tiny_hf')!r}\n"
        "    cfg.drafter.update(dict(hidden_size=128, intermediate_size=256, num_layers=1,\n"
        "        num_heads=4, num_kv_heads=2, head_dim=64, mask_token_id=0,\n"
        "        target_layer_ids=(0, 1)))\n"
        "    cfg.block_size, cfg.seq_len, cfg.num_anchors, cfg.batch_size = 8, 128, 16, 8\n"
        "    return cfg\n"
    )
    return config
