"""File formats and offline assets: HF safetensors, GGUF, tokenizers, benchmark prompt sets."""

from dflash_jax.io.assets import (
    SMOLLM2_NAME,
    AssetNotFoundError,
    humaneval_path,
    load_humaneval_prompts,
    load_mtbench_questions,
    mtbench_questions_path,
    smollm2_gguf_path,
)
from dflash_jax.io.hf import CheckpointError
from dflash_jax.io.target_loader import LoadedTarget, load_target

__all__ = [
    "SMOLLM2_NAME",
    "AssetNotFoundError",
    "CheckpointError",
    "LoadedTarget",
    "humaneval_path",
    "load_humaneval_prompts",
    "load_mtbench_questions",
    "load_target",
    "mtbench_questions_path",
    "smollm2_gguf_path",
]
