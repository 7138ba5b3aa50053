"""Flags shared by infer.generate and infer.benchmark, validated at parse time, and the
conversion of bad-input errors into absl usage errors (a message, not a traceback)."""

from __future__ import annotations

import contextlib

from absl import app, flags, logging

from dflash_jax.config import ConfigError, DecodeConfig

flags.DEFINE_string(
    "target", "smollm2-135m-instruct",
    "Target model: 'smollm2-135m-instruct' (embedded, offline), an HF directory, a .gguf file "
    "or a hub id such as Qwen/Qwen3-8B (needs a network).",
)  # fmt: skip
flags.DEFINE_string(
    "drafter", "default",
    "Drafter: 'default' (the one shipped for SmolLM2), our Orbax directory, a z-lab HF "
    "directory, a hub id such as z-lab/Qwen3-8B-DFlash-b16, or 'none' for the target alone.",
)  # fmt: skip
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute/parameter dtype.")
flags.DEFINE_integer(
    "max_new_tokens", 256, "Most new tokens per answer (stop token included).", lower_bound=1
)
flags.DEFINE_float(
    "temperature",
    0.0,
    "0 = greedy; > 0 samples (lossless speculative rejection sampling).",
    lower_bound=0.0,
)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 disables it.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 disables it.", lower_bound=0)
flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
flags.DEFINE_integer(
    "block_size", 0,
    "Tokens per draft block (anchor + drafts), at most the drafter's trained size; "
    "0 = the trained size.",
    lower_bound=0,
)  # fmt: skip
flags.register_validator("top_p", lambda p: 0.0 < p <= 1.0, "--top_p must be in (0, 1]")

FLAGS = flags.FLAGS


def quiet_library_logs() -> None:
    """Libraries (orbax, grain) log every step at INFO: show warnings only, unless the user
    passed --verbosity."""
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def decode_config(block_size: int, stop_token_ids: tuple[int, ...]) -> DecodeConfig:
    return DecodeConfig(
        max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
        top_p=FLAGS.top_p, block_size=block_size, stop_token_ids=stop_token_ids,
    )  # fmt: skip


@contextlib.contextmanager
def usage_errors():
    """Bad input (a misfit drafter, a missing file, a prompt too long for the cache, ...) ends
    the program with its message as a usage error."""
    try:
        yield
    except (ConfigError, ValueError, OSError) as e:
        raise app.UsageError(f"{type(e).__name__}: {e}") from e
