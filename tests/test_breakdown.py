"""The benchmark's measurements: the prompt-lookup baseline on hand-built answers, and the
step breakdown (floors and phases) running on tiny models."""

import types

import numpy as np
import pytest
from _decode import make_pair

from dflash_jax.decoding import breakdown
from dflash_jax.decoding.lookup import prompt_lookup_taus
from dflash_jax.decoding.settings import DecodeConfig


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


@pytest.mark.slow  # 22 s; the floors' tests stay in the default suite
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


@pytest.mark.slow
def test_baseline_of_an_adaptive_config_is_a_plain_decode_with_the_same_output():
    """The AR baseline the benchmark times against an adaptive run is a valid target-only
    config (it was a ConfigError), and its output equals the adaptive DFlash run's."""
    import jax

    from dflash_jax import api
    from dflash_jax.decoding import autoregressive_decode, speculative_decode

    tcfg, tp, dcfg, dp = make_pair("qwen3")
    cfg = DecodeConfig(
        max_new_tokens=12, block_size=8, adaptive=True, temperature=0.0, lookup_kinds=(4,)
    )
    base = api.baseline_config(cfg)
    assert (base.block_size, base.adaptive, base.all_kinds) == (1, False, ())
    assert (base.max_new_tokens, base.temperature) == (cfg.max_new_tokens, cfg.temperature)
    prompt, lens = np.arange(3, 12, dtype=np.int32)[None], np.array([9], np.int32)
    key = jax.random.key(0)
    ar = autoregressive_decode(tp, prompt, lens, key, target_config=tcfg, decode_config=base)
    sp = speculative_decode(
        tp, dp, prompt, lens, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        step_costs=(1.0, 1.5, 2.0, 1.4),
    )  # fmt: skip
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    kinds = np.asarray(sp.block_sizes[0, : int(sp.num_steps[0])])
    assert set(kinds.tolist()) <= set(cfg.all_kinds)


def test_floors_bracketing_a_run_are_averaged_and_their_drift_kept():
    before = {"gemm_floor_ar_s": 0.02, "gemm_floor_step_s": 0.06}
    after = {"gemm_floor_ar_s": 0.03, "gemm_floor_step_s": 0.06, "phase_commit_s": 1.0}
    out = breakdown.bracket_floors(before, after)
    assert np.isclose(out["gemm_floor_ar_s"], 0.025) and np.isclose(out["gemm_floor_step_s"], 0.06)
    assert out["gemm_floor_ar_before_s"] == 0.02 and out["gemm_floor_ar_after_s"] == 0.03
    assert np.isclose(out["gemm_floor_drift"]["ar"], 1.5) and out["gemm_floor_drift"]["step"] == 1
    assert np.isclose(out["break_even_tau"], 0.06 / 0.025)
    assert "phase_commit_s" not in out  # only the floors and what derives from them


def _largest_constant(lowered) -> int:
    """Elements in the largest constant of a lowered function's StableHLO."""
    import re

    sizes = [1]
    for shape in re.findall(r"stablehlo\.constant dense<[^>]*>\s*:\s*tensor<([0-9x]+)x\w+>",
                            lowered.as_text()):  # fmt: skip
        sizes.append(int(np.prod([int(d) for d in shape.split("x")])))
    return max(sizes)


@pytest.mark.slow
def test_floors_by_dtype_time_each_setting_as_its_decode_computes():
    """Each dtype plain and batch-invariant: a plain AR floor runs one row, an invariant one the
    row rule's minimum (the rule that `run_target_config` gives that dtype)."""
    import dataclasses

    from dflash_jax.decoding import programs

    tcfg, tp, dcfg, dp = make_pair("qwen3")
    out = breakdown.floors_by_dtype(tp, tcfg, dp, rows=8, repeats=3)
    names = {f"{d} {s}" for d in ("float32", "bfloat16") for s in ("plain", "batch-invariant")}
    assert set(out) == names
    for dtype in ("float32", "bfloat16"):
        plain = dataclasses.replace(tcfg, dtype=dtype, invariant_rows=None)
        rule = programs.run_target_config(plain, DecodeConfig(batch_invariant=True))
        assert out[f"{dtype} plain"]["ar_rows"] == 1
        assert out[f"{dtype} plain"]["row_rule"] is None
        assert out[f"{dtype} batch-invariant"]["row_rule"] == list(rule.invariant_rows)
        assert out[f"{dtype} batch-invariant"]["ar_rows"] == rule.invariant_rows[0]
    for floors in out.values():
        for name in ("gemm_floor_ar_s", "gemm_floor_step_s"):
            assert floors[name] > 0, name
        assert floors["break_even_tau"] == floors["gemm_floor_step_s"] / floors["gemm_floor_ar_s"]


def test_floors_compute_each_product_as_the_model_does():
    """In bf16 every floor product accumulates in fp32 (no bf16-result dot asked for); under a
    row rule the target's products and the head are the rule's isolated GEMMs (one row padded
    to the rule's minimum), the drafter's the plain policy's."""
    import dataclasses
    import re

    import jax

    tcfg, tp, dcfg, dp = make_pair("qwen3")
    cast = lambda tree: jax.tree.map(lambda w: w.astype("bfloat16"), tree)
    for rule in (None, (2, 8)):
        cfg = dataclasses.replace(tcfg, dtype="bfloat16", invariant_rows=rule)
        fns = breakdown.floor_fns(cast(tp), cfg, cast(dp), rows=8)
        for name, (step, carry, weights) in fns.items():
            text = jax.jit(lambda c, w, step=step: step(c, *w)).lower(carry, weights).as_text()
            dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
            assert dots and not [d for d in dots if re.search(r"-> tensor<[0-9x]*bf16>", d)]
            if rule is not None and name == "gemm_floor_ar_s":  # one row, padded to 2
                assert all("tensor<1x" not in d.split("->")[-1] for d in dots), name


def test_floors_and_phases_take_the_weights_as_arguments():
    """Weights closed over by a timed step become constants of its executable, which XLA:CPU
    multiplies faster than the decode's argument params: every timed step must take them as
    arguments, so no weight-sized constant may appear in its program."""
    import jax

    tcfg, tp, dcfg, dp = make_pair("qwen3")
    smallest_weight = min(x.size for x in jax.tree.leaves(tp) if x.ndim >= 2)
    prompt, lengths = np.ones((1, 16), np.int32), np.array([9], np.int32)
    cfg = DecodeConfig(max_new_tokens=16, block_size=8)
    fns = breakdown.phase_fns(tp, dp, prompt, lengths, tcfg, dcfg, cfg, live_length=14)
    assert set(fns) == set(breakdown.PHASES)
    fns.update(breakdown.floor_fns(tp, tcfg, dp, rows=8))
    for name, (step, carry, weights) in fns.items():
        lowered = jax.jit(lambda c, w, step=step: step(c, *w)).lower(carry, weights)
        assert _largest_constant(lowered) < smallest_weight, name
    # The check itself: a step closing over the params does carry them as constants.
    step, carry, weights = fns["verify_body"]
    closed = jax.jit(lambda c: step(c, *weights)).lower(carry)
    assert _largest_constant(closed) >= smallest_weight


def _tree_setup():
    tcfg, tp, dcfg, dp = make_pair("qwen3")
    prompt, lengths = np.ones((2, 16), np.int32), np.array([9, 12], np.int32)
    cfg = DecodeConfig(max_new_tokens=16, block_size=8, tree_nodes=24)
    return tcfg, tp, dcfg, dp, prompt, lengths, cfg


@pytest.mark.slow
def test_breakdown_names_a_tree_steps_phases():
    """With tree_nodes the phases include a tree step's own (its build, its verify of N nodes
    under the tree mask, its accept + cache move) and the floors a tree step's (N target rows);
    without, none of them. (Timing them: the slow test below.)"""
    tcfg, tp, dcfg, dp, prompt, lengths, cfg = _tree_setup()
    assert breakdown.TREE_PHASES[1:4] == ("tree_build", "tree_verify", "tree_accept_move")
    fns = breakdown.phase_fns(tp, dp, prompt, lengths, tcfg, dcfg, cfg, live_length=14)
    own = ("tree_build", "tree_verify", "tree_accept_move")
    assert tuple(fns) == breakdown.PHASES + own
    assert set(breakdown.TREE_PHASES) <= set(fns)
    floors = breakdown.floor_fns(tp, tcfg, dp, cfg.block_size, tree_rows=cfg.tree_nodes)
    assert "gemm_floor_tree_step_s" in floors
    _, carry, _ = floors["gemm_floor_tree_step_s"]
    assert carry[0].shape[0] == 24 and carry[1].shape[0] == 8  # N target rows, a drafter block
    assert "gemm_floor_tree_step_s" not in breakdown.floor_fns(tp, tcfg, dp, cfg.block_size)


@pytest.mark.slow
def test_breakdown_of_a_tree_step_sums_its_phases():
    """`breakdown` with a tree: every phase timed, the tree step's sum over `TREE_PHASES`, its
    floor and break-even tau."""
    tcfg, tp, dcfg, dp, prompt, lengths, cfg = _tree_setup()
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp)
    out = breakdown.breakdown(target, drafter, prompt, lengths, cfg, live_length=14, repeats=3)
    for name in (*breakdown.PHASES, *breakdown.TREE_PHASES):
        assert out[f"phase_{name}_s"] > 0, name
    assert np.isclose(
        out["tree_phases_sum_s"], sum(out[f"phase_{p}_s"] for p in breakdown.TREE_PHASES)
    )
    assert out["tree_nodes"] == 24 and out["gemm_floor_tree_step_s"] > 0
    assert out["break_even_tau_tree"] == out["gemm_floor_tree_step_s"] / out["gemm_floor_ar_s"]


def test_dtype_auto_picks_the_fastest_predicted_decode_and_remembers_it(tmp_path, monkeypatch):
    """`api.choose_decode` (--dtype=auto for a stream) predicts each candidate's tokens/s from
    stand-in GEMM floors (no compile) and picks the highest: a bf16 row tile where a small tile
    drafts cheaply, the target alone (no drafter) where no DFlash setting beats the fastest
    AR. The floors are measured once per machine and shapes (a second call with other timings
    keeps the first), and the dtype is kept under the caller's name for `remembered_dtype`; a
    server (slots > 1) is still judged by its served plain step, under its own key."""
    from dflash_jax import api
    from dflash_jax.config import TargetConfig
    from dflash_jax.decoding import floors

    monkeypatch.setattr(api, "cache_root", lambda: tmp_path)  # the table alone
    pair = (
        types.SimpleNamespace(config=TargetConfig("qwen3", 64, 32, 64, 2, 2, 1, 16), params={}),
        types.SimpleNamespace(config=types.SimpleNamespace(num_layers=1, block_size=16,
                                                            draft_vocab_size=0),
                              params={}),
    )  # fmt: skip
    # ms: (one row, a step of the tile's rows; 4 rows without a rule), by (dtype, tile)
    timings = {("float32", 0): (23.5, 37.2), ("bfloat16", 0): (19.3, 26.3),
               ("bfloat16", 4): (21.8, 26.7), ("bfloat16", 8): (29.6, 31.9),
               ("bfloat16", 16): (30.3, 37.0)}  # fmt: skip

    def stand_in(t, cfg, d, rows, *a, **k):
        tile = cfg.invariant_rows[1] if cfg.invariant_rows else 0
        assert rows == (tile or 4)
        ar, step = timings[(cfg.dtype, tile)]
        return {"gemm_floor_ar_s": ar / 1e3, "gemm_floor_step_s": step / 1e3}

    monkeypatch.setattr(floors, "gemm_floors", stand_in)
    assert api.remembered_dtype("smol|default") is None
    choice = api.choose_decode(*pair, remember="smol|default")
    tau = lambda rows, a=0.4: sum(a**j for j in range(rows))  # api.DRAFT_ACCEPTANCE
    expected = {  # each the best of its kinds: plain, a drafted block, a copy (a rule's tile)
        "AR float32": 1e3 / 23.5, "AR bfloat16": 1e3 / 19.3,
        "float32 plain": max(1e3 / 23.5, 1e3 * tau(4) / 37.2),
        "bfloat16 tile 4": max(1e3 * tau(4) / 26.7, 1e3 * tau(4, 0.28) / 21.8),
        "bfloat16 tile 8": max(1e3 * tau(8) / 31.9, 1e3 * tau(8, 0.28) / 29.6),
        "bfloat16 tile 16": max(1e3 * tau(16) / 37.0, 1e3 * tau(16, 0.28) / 30.3),
    }  # fmt: skip
    assert choice.speeds == pytest.approx(expected)
    assert (choice.dtype, choice.row_tile, choice.drafter) == ("bfloat16", 4, True)
    assert choice.why().startswith("bfloat16 tile 4: 63.") and "AR bfloat16) 51.8" in choice.why()
    assert api.remembered_dtype("smol|default") == "bfloat16"
    timings[("bfloat16", 4)] = (30.0, 45.0)  # not measured again: the first measurement stands
    assert api.choose_decode(*pair, remember="smol|default").row_tile == 4
    assert api.remembered_dtype("other|request") is None

    # Where no DFlash setting beats the fastest AR, the choice is that AR, without a drafter.
    timings[("bfloat16", 8)] = (35.0, 40.0)
    (tmp_path / "dtype_floors.json").unlink()
    choice = api.choose_decode(*pair, remember="smol|default")
    assert (choice.dtype, choice.row_tile, choice.drafter) == ("bfloat16", 0, False)
    assert choice.why().startswith("the target alone (AR bfloat16")
    # A rule the user named: only that tile competes.
    assert {k for k in api.choose_decode(*pair, row_tile=8).speeds if "tile" in k} == {
        "bfloat16 tile 8"
    }

    # A server (slots > 1) is judged by its served plain step instead, kept under its own key.
    served = {"float32": 1.0, "bfloat16": 3.0}
    monkeypatch.setattr(floors, "served_step_floor", lambda t, cfg, n: served[cfg.dtype] * n)
    dtype, measured = api.fastest_dtype(*pair, 8, False, slots=4)
    assert dtype == "float32" and sorted(measured.values()) == [4.0, 12.0]
    (tmp_path / "dtype_floors.json").write_text("{not json")
    assert api.remembered_dtype("smol|default") is None


def test_served_step_floor_times_a_plain_step_over_the_slots():
    """`floors.served_step_floor` (what --dtype=auto compares for infer.serve) runs a real
    target's one-token forward over its slots' caches and head: a positive time, and the
    shapes are the ones asked for (a small cache here)."""
    from dflash_jax.decoding import floors

    tcfg, tp, _, _ = make_pair()
    assert 0 < floors.served_step_floor(tp, tcfg, 3, repeats=2, cache_len=64, live=20) < 5
