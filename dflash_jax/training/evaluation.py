"""Real acceptance during training: greedy `speculative_decode` with the current params on
prompts the drafter never trains on (held-out records, or the shipped dev set)."""

from __future__ import annotations

import jax
import numpy as np

from dflash_jax.config import DecodeConfig, DrafterConfig
from dflash_jax.decoding import speculative_decode
from dflash_jax.training import data

EVAL_SOURCES = ("held_out", "dev")


def eval_prompts(source: str, target, held_out_records) -> list[list[int]]:
    """Token ids of the evaluation prompts: the held-out records' prompts, or the 24 prompts of
    the dev set rendered with the target's chat template."""
    if source == "held_out":
        return [data.prompt_tokens(r) for r in held_out_records]
    if source == "dev":
        from dflash_jax.io.assets import load_dev_prompts
        from dflash_jax.io.tokenizer import render_prompt

        return [render_prompt(target.tokenizer, r["prompt"]) for r in load_dev_prompts()]
    raise ValueError(f"config.eval_prompts must be one of {EVAL_SOURCES}, got {source!r}")


def evaluate_acceptance(
    target,
    drafter_config: DrafterConfig,
    params,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int | None = None,
    mesh=None,
) -> float:
    """Greedy `speculative_decode` on `prompts` (one batch; on `mesh` when given) -> mean tau
    (tokens per verify step, bonus included), averaged per prompt then over prompts."""
    width = max(len(p) for p in prompts)
    prompt_bp = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        prompt_bp[i, : len(p)] = p
    lengths_b = np.asarray([len(p) for p in prompts], np.int32)
    decode_config = DecodeConfig(
        max_new_tokens=max_new_tokens,
        block_size=block_size or drafter_config.block_size,
        stop_token_ids=target.config.eos_token_ids,
    )
    out = speculative_decode(
        target.params,
        params,
        prompt_bp,
        lengths_b,
        jax.random.key(0),
        target_config=target.config,
        drafter_config=drafter_config,
        decode_config=decode_config,
        mesh=mesh,
    )
    acc = np.asarray(out.acceptance_lengths)
    steps = np.asarray(out.num_steps)
    ran = steps > 0
    return float(np.mean(acc[ran].sum(axis=1) / steps[ran])) if ran.any() else float("nan")
