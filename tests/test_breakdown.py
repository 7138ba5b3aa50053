"""The benchmark's measurements: the prompt-lookup baseline on hand-built answers, and the
step breakdown (floors and phases) running on tiny models."""

import types

import numpy as np
from test_decoding import make_pair

from dflash_jax.config import DecodeConfig
from dflash_jax.decoding import breakdown
from dflash_jax.decoding.lookup import prompt_lookup_taus


def test_prompt_lookup_copies_what_came_after_the_last_match():
    prompt = [1, 2, 3, 4, 5, 9]
    # The answer repeats the prompt's 2 3 4 5 after a 1: a copier accepts it whole.
    answer = [1, 2, 3, 4, 5, 6]
    taus = prompt_lookup_taus(prompt, answer, block_size=8)
    assert sum(taus) == len(answer) - 1  # every token but the prefill's is committed by steps
    assert taus[0] == 5  # proposes 2 3 4 5 9 ...: four accepted, then the target's 6
    # Nothing to copy: one token per step.
    assert prompt_lookup_taus([7], [8, 9, 10, 11], block_size=4) == [1, 1, 1]
    # The block size caps a step.
    assert prompt_lookup_taus(list(range(5, 30)), list(range(5, 14)), block_size=4) == [4, 4]


def test_breakdown_reports_every_phase_and_floor():
    tcfg, tp, dcfg, dp = make_pair("qwen3")
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp)
    prompt, lengths = np.ones((1, 16), np.int32), np.array([9], np.int32)
    cfg = DecodeConfig(max_new_tokens=16, block_size=8)
    out = breakdown.breakdown(target, drafter, prompt, lengths, cfg, live_length=14, repeats=3)
    for name in breakdown.PHASES:
        assert out[f"phase_{name}_s"] > 0
    assert out["gemm_floor_step_s"] > 0 and out["gemm_floor_ar_s"] > 0
    assert np.isclose(out["phases_sum_s"], sum(out[f"phase_{p}_s"] for p in breakdown.PHASES))
    assert out["break_even_tau"] == out["gemm_floor_step_s"] / out["gemm_floor_ar_s"]


def test_benchmark_turn_in_adaptive_mode_times_a_plain_ar_baseline():
    """The AR baseline of an adaptive run is a plain decode (no step kinds), and its output
    equals the adaptive DFlash run's."""
    from absl import flags

    from dflash_jax.decoding.adaptive import default_step_costs
    from infer import benchmark

    flags.FLAGS.mark_as_parsed()
    tcfg, tp, dcfg, dp = make_pair("qwen3")
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp)
    cfg = DecodeConfig(max_new_tokens=12, block_size=8, adaptive=True)
    costs = default_step_costs(cfg.step_kinds)
    stats, answer = benchmark.run_turn(target, drafter, list(range(3, 12)), cfg, set(), costs)
    assert stats["outputs_identical"] and len(answer) == stats["ar_tokens"] == 12
    assert set(stats["block_sizes"]) <= set(cfg.step_kinds)
