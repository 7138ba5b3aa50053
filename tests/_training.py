"""The training tests' shared pieces: a tiny Llama target, a corpus it can learn, a tiny run's
config over it, the losses a run logged (`logged_losses`) and a random HF target directory
(`write_hf_dir`). The fixture that swaps the tiny target in for the
trainer's loader is `tiny_target` in tests/conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.io.hf import param_layout, write_safetensors
from dflash_jax.io.hf_config import target_to_hf
from dflash_jax.training import data, trainer

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


def train_config(data_path, **overrides):
    cfg = trainer.default_config()
    cfg.target = "tiny"
    cfg.data = str(data_path)
    cfg.compute_dtype = "float32"
    cfg.drafter.hidden_size = 32
    cfg.drafter.intermediate_size = 64
    cfg.drafter.num_layers = 2
    cfg.drafter.num_heads = 4
    cfg.drafter.num_kv_heads = 2
    cfg.drafter.head_dim = 8
    cfg.drafter.mask_token_id = 0
    cfg.drafter.target_layer_ids = (1, 2)
    cfg.block_size = 4
    cfg.loss_gamma = 4.0
    cfg.seq_len = 32
    cfg.num_anchors = 6
    cfg.ce_chunk_rows = 16
    cfg.batch_size = 4
    cfg.num_steps = 40
    cfg.learning_rate = 1e-2
    cfg.warmup_fraction = 0.1
    cfg.data_threads = 1
    cfg.num_eval_prompts = 2
    cfg.eval_every = 0
    cfg.eval_max_new_tokens = 12
    cfg.log_every = 1
    cfg.checkpoint_every = 20
    cfg.max_checkpoints = 10
    cfg.update(overrides)
    return cfg


def logged_losses(workdir):
    lines = [json.loads(x) for x in (workdir / trainer.METRICS_FILE).read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if "loss" in x}


class Killed(Exception):
    """Raised by a test's hook to kill a run mid-way."""


def write_hf_dir(directory: Path, config: TargetConfig) -> TargetConfig:
    """A random HF target directory of `config`'s shapes (config.json + model.safetensors)."""
    rng = np.random.default_rng(0)
    arrays = {
        f"model.{name}": (0.1 * rng.normal(size=shape)).astype(np.float32)
        for name, (_, shape, _) in param_layout(config).items()
    }
    directory.mkdir(parents=True)
    write_safetensors(directory / "model.safetensors", arrays)
    (directory / "config.json").write_text(json.dumps(target_to_hf(config)))
    return config
