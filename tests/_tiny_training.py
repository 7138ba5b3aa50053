"""A tiny training setup shared by the training tests: the target, a corpus that a drafter
learns in a few steps, the run config, the logged losses, and (for runs in a fresh process or
through the CLI) the target as an HF directory and the config as a configs/*.py file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dflash_jax.config import TargetConfig

TINY_TARGET = TargetConfig(
    arch="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    eos_token_ids=(1,),
)


def corpus(path, num_records=48, seed=0):
    """A small repeating corpus: every record walks one fixed cycle of 8 tokens from a random
    start, so the token at p+k is a function of the anchor token alone."""
    from dflash_jax.training import data

    rng = np.random.default_rng(seed)
    cycle = rng.permutation(np.arange(2, 64))[:8]
    records = []
    for i in range(num_records):
        start, prompt_len, length = int(rng.integers(8)), 4, int(rng.integers(20, 33))
        tokens = [int(cycle[(start + t) % 8]) for t in range(length)]
        records.append(
            {
                "tokens": tokens,
                "loss_mask": [0] * prompt_len + [1] * (length - prompt_len),
                "source": "test",
                "prompt": f"p{i}",
            }
        )
    data.write_shard(path, records)


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


def config(data_path, **overrides):
    from dflash_jax.training import trainer

    cfg = trainer.default_config()
    cfg.update(SETTINGS)
    cfg.drafter.update(DRAFTER)
    cfg.data = str(data_path)
    cfg.update(overrides)
    return cfg


def losses(workdir) -> dict[int, float]:
    from dflash_jax.training import trainer

    lines = [json.loads(x) for x in (Path(workdir) / trainer.METRICS_FILE).read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if "loss" in x}


def write_hf_dir(directory: Path, config: TargetConfig = TINY_TARGET) -> TargetConfig:
    """A tiny random HF target directory (config.json + model.safetensors)."""
    from dflash_jax.io.hf import param_layout, write_safetensors

    rng = np.random.default_rng(0)
    arrays = {
        f"model.{name}": (0.1 * rng.normal(size=shape)).astype(np.float32)
        for name, (_, shape, _) in param_layout(config).items()
    }
    directory.mkdir(parents=True)
    write_safetensors(directory / "model.safetensors", arrays)
    (directory / "config.json").write_text(json.dumps(config.to_hf()))
    return config


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
