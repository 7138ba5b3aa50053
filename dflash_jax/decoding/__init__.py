"""Jitted decoding: `speculative_decode` (DFlash) and `autoregressive_decode` (the baseline)."""

from dflash_jax.decoding.loop import DecodeOutput, autoregressive_decode, speculative_decode

__all__ = ["DecodeOutput", "autoregressive_decode", "speculative_decode"]
