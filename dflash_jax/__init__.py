"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

import dflash_jax as dj
target = dj.load_target("smollm2-135m-instruct")
drafter = dj.load_drafter("default", target)
out = dj.speculative_decode(target.params, drafter.decode_params, prompt, prompt_lengths, rng,
                            target_config=target.config, drafter_config=drafter.config,
                            decode_config=dj.DecodeConfig(max_new_tokens=128))
"""

from dflash_jax.api import generate
from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.decoding import DecodeOutput, autoregressive_decode, speculative_decode
from dflash_jax.decoding.settings import Controller, DecodeConfig, Numerics, Sampling
from dflash_jax.io import LoadedTarget, load_target
from dflash_jax.io.drafter_io import LoadedDrafter, load_drafter, restore_drafter, save_drafter

__all__ = [
    "ConfigError",
    "Controller",
    "DecodeConfig",
    "DecodeOutput",
    "DrafterConfig",
    "LoadedDrafter",
    "LoadedTarget",
    "Numerics",
    "Sampling",
    "TargetConfig",
    "autoregressive_decode",
    "generate",
    "load_drafter",
    "load_target",
    "restore_drafter",
    "save_drafter",
    "speculative_decode",
]
