"""Convenience layer over the jitted decoders: prompt encoding, bucketing, timed runs and
`generate` for lists of strings. Entry points and notebooks use this; nothing here is needed to
call `speculative_decode` directly."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from dflash_jax.config import DecodeConfig
from dflash_jax.decoding import loop
from dflash_jax.decoding.loop import DecodeOutput

MIN_BUCKET = 32


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """Prompt buffers are padded to powers of two so a few compiled shapes serve all prompts."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def render_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """Token ids of one prompt: the chat template with the generation prompt (encoded without
    extra special tokens, as the reference does), or the raw text. `prompt` may be a string
    (one user turn) or a list of chat messages."""
    if tokenizer is None:
        raise ValueError("this target has no tokenizer: pass token ids instead of text")
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target's tokenizer has no chat template; use chat=False")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        if not isinstance(prompt, str):
            raise ValueError("a list of chat messages needs chat=True")
        text = prompt
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    return ids


def pad_prompts(token_lists: list[list[int]], bucket: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into int32 [B, P] (P a power-of-two bucket) plus lengths [B]."""
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(t) for t in token_lists)
    width = bucket_length(longest) if bucket else longest
    prompt = np.zeros((len(token_lists), width), np.int32)
    for i, toks in enumerate(token_lists):
        prompt[i, : len(toks)] = toks
    return prompt, np.array([len(t) for t in token_lists], np.int32)


def stop_token_ids(target) -> tuple[int, ...]:
    """The target's end-of-sequence ids (config, generation config and tokenizer)."""
    ids = list(target.config.eos_token_ids)
    eos = getattr(target.tokenizer, "eos_token_id", None) if target.tokenizer else None
    if eos is not None:
        ids.append(int(eos))
    return tuple(dict.fromkeys(ids))


def load_pair(target_source: str, drafter_source: str, dtype: str = "float32"):
    """(target, drafter or None for drafter_source == "none"), as the CLIs accept them."""
    from dflash_jax.io import load_target
    from dflash_jax.io.drafter_io import load_drafter

    target = load_target(target_source, dtype=dtype)
    drafter = None if drafter_source == "none" else load_drafter(drafter_source, target)
    return target, drafter


@dataclasses.dataclass
class TimedRun:
    output: DecodeOutput
    compile_s: float  # lowering + XLA compilation (0 when the executable was cached)
    run_s: float  # device time of the call, synchronised


_COMPILED: dict = {}


def check_inputs(target, drafter, prompt, lengths, cfg: DecodeConfig) -> None:
    """The checks `speculative_decode`/`autoregressive_decode` make, without running them:
    raises ConfigError/ValueError naming the problem."""
    if drafter is not None:
        loop.check_decode_inputs(target.config, drafter.config, cfg)
    loop.check_prompt(np.asarray(prompt), np.asarray(lengths), target.config, cfg)


def timed_decode(target, drafter, prompt, lengths, seed: int, cfg: DecodeConfig) -> TimedRun:
    """Runs `speculative_decode` (or `autoregressive_decode` when drafter is None) with
    compilation timed apart from execution. Compiled executables are cached per shape/config."""
    rng = jax.random.key(seed)
    prompt, lengths = np.asarray(prompt, np.int32), np.asarray(lengths, np.int32)
    check_inputs(target, drafter, prompt, lengths, cfg)
    if drafter is None:
        fn, args = loop._autoregressive_jit, (target.params, prompt, lengths, rng)
        statics = dict(target_config=target.config, decode_config=loop.autoregressive_config(cfg))
    else:
        fn = loop._speculative_jit
        args = (target.params, drafter.params, prompt, lengths, rng)
        statics = dict(
            target_config=target.config, drafter_config=drafter.config, decode_config=cfg
        )
    key = (fn, prompt.shape, tuple(sorted((k, v) for k, v in statics.items())))
    compile_s = 0.0
    if key not in _COMPILED:
        t0 = time.perf_counter()
        _COMPILED[key] = fn.lower(*args, **statics).compile()
        compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(_COMPILED[key](*args))
    return TimedRun(out, compile_s, time.perf_counter() - t0)


def generate(
    target,
    drafter,
    prompts: list[str],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    block_size: int | None = None,
    seed: int = 0,
    chat: bool = True,
) -> list[str]:
    """Decodes a batch of text prompts with DFlash (or the target alone when drafter is None)
    and returns the generated texts (stop token removed)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if block_size is None:
        block_size = drafter.config.block_size if drafter is not None else 1
    cfg = DecodeConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        block_size=block_size,
        stop_token_ids=stop_token_ids(target),
    )
    prompt, lengths = pad_prompts([render_prompt(target.tokenizer, p, chat) for p in prompts])
    out = timed_decode(target, drafter, prompt, lengths, seed, cfg).output
    return [
        target.tokenizer.decode(toks[:n], skip_special_tokens=True)
        for toks, n in zip(np.asarray(out.tokens), np.asarray(out.lengths), strict=True)
    ]
