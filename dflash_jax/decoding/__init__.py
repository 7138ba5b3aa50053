"""Jitted decoding: `speculative_decode` (DFlash) and `autoregressive_decode` (the baseline).

state.py           the loop state, its output and shardings; commit, finish, the step key
phases.py          prefill, drafter context, draft, verify, accept: the pieces of a step
autoregressive.py  the target alone, one token per step (`autoregressive_decode`)
speculative.py     draft -> verify -> accept per step (`speculative_decode`)
settings.py        DecodeConfig and its groups (Sampling, Controller, Numerics), step kinds
programs.py        jitting, mesh placement and input checks shared by both decodes
plan.py            a run's plan: its checks and resolved configs and options, made once
adaptive.py        the on-device controller's rules: step values, estimates, the probe clock
proposers.py       the proposers (plain, drafted, copy, tree): one registry entry each
lookup.py          prompt lookup: drafts copied from the text so far
tree.py            tree verification: a best-first token tree per step, one pass, a path
sampling.py        logit processing, sampling, greedy and rejection acceptance
runner.py          the decodes as start/advance halves: timed, streamed, step-limited
calibration.py     each step kind's measured cost, cached on disk
breakdown.py       each phase of a step (a chain's, a tree's) timed apart
floors.py          the GEMM floors a step is judged against, and the in-loop timing
"""

from dflash_jax.decoding.autoregressive import autoregressive_decode
from dflash_jax.decoding.speculative import speculative_decode
from dflash_jax.decoding.state import DecodeOutput

__all__ = ["DecodeOutput", "autoregressive_decode", "speculative_decode"]
