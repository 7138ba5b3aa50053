"""The tiny training run as a configs/*.py file, for runs through `python -m
train.train_drafter` in a fresh process (the pod test): the settings of `_training.train_config`,
its target as an HF directory, and a head-dim-16 variant for the Pallas kernels."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from _training import TINY_TARGET, corpus, write_hf_dir

# The run's settings beside default_config's (what `config` and `write_config_file` set).
SETTINGS = dict(
    target="tiny", compute_dtype="float32", block_size=4, loss_gamma=4.0, seq_len=32,
    num_anchors=6, ce_chunk_rows=16, batch_size=4, num_steps=40, learning_rate=1e-2,
    warmup_fraction=0.1, data_threads=1, num_eval_prompts=2, eval_every=0,
    eval_max_new_tokens=12, log_every=1, checkpoint_every=20, max_checkpoints=10,
)  # fmt: skip
DRAFTER = dict(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mask_token_id=0, target_layer_ids=(1, 2),
)  # fmt: skip


# Head dim 16: the smallest the Pallas kernels take (attention_impl="pallas", interpreted on CPU).
KERNEL_TARGET = dataclasses.replace(TINY_TARGET, hidden_size=64, head_dim=16)
KERNEL_DRAFTER = dict(DRAFTER, hidden_size=64, head_dim=16)


def write_config_file(directory: Path, kernels: bool = False, **overrides) -> Path:
    """directory/tiny_hf (`write_hf_dir`), directory/data.jsonl (`corpus`) and
    directory/tiny_config.py: `config`'s run on them, with `overrides`, for train.train_drafter's
    --config; `kernels`: the target and drafter at head dim 16 (`KERNEL_TARGET`). -> the config
    file."""
    write_hf_dir(directory / "tiny_hf", KERNEL_TARGET if kernels else TINY_TARGET)
    corpus(directory / "data.jsonl")
    settings = {**SETTINGS, "target": str(directory / "tiny_hf"), **overrides}
    settings["data"] = str(directory / "data.jsonl")
    drafter = KERNEL_DRAFTER if kernels else DRAFTER
    path = directory / "tiny_config.py"
    path.write_text(
        "from dflash_jax.training.trainer import default_config\n\n\n"
        "def get_config():\n"
        "    cfg = default_config()\n"
        f"    cfg.update({settings!r})\n"
        f"    cfg.drafter.update({drafter!r})\n"
        "    return cfg\n"
    )
    return path
