"""DecodeConfig's groups (issue 59): a setting spelled flat or in its group is one config (equal,
same hash and repr: one compiled program), flat names still read and `dataclasses.replace`, and
`generate`'s keywords reach the DecodeConfig it decodes with. Nothing here compiles."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from _chat_tokenizer import CHATML, char_tokenizer

from dflash_jax import api
from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.decoding import runner
from dflash_jax.decoding.plan import make_plan
from dflash_jax.decoding.settings import (
    Controller,
    DecodeConfig,
    Numerics,
    Sampling,
    autoregressive_config,
)


def test_flat_and_grouped_spellings_are_one_config():
    flat = DecodeConfig(
        block_size=8, stop_token_ids=[2], temperature=0.7, top_k=5, adaptive=True,
        lookup_kinds=[8, 4], tree_nodes=4, row_tile=8, draft_window=64,
    )  # fmt: skip
    grouped = DecodeConfig(
        block_size=8,
        stop_token_ids=(2,),
        sampling=Sampling(temperature=0.7, top_k=5),
        controller=Controller(adaptive=True, step_kinds=(8, 4, 1), lookup_kinds=(4, 8)),
        numerics=Numerics(row_tile=8, draft_window=64),
        tree_nodes=4,  # a flat name beside its group sets the group's field
    )
    assert flat == grouped and hash(flat) == hash(grouped) and repr(flat) == repr(grouped)
    assert (flat.temperature, flat.row_tile, flat.step_kinds, flat.greedy) == (
        0.7, 8, (1, 4, 8), False,
    )  # fmt: skip
    assert flat.all_kinds == (1, 4, 8, -4, -8, 1004)
    hotter = dataclasses.replace(flat, temperature=1.0, row_tile=16)
    assert (hotter.sampling.temperature, hotter.numerics.row_tile, hotter.top_k) == (1.0, 16, 5)
    assert dataclasses.replace(hotter, temperature=0.7, row_tile=8) == flat
    with pytest.raises(dataclasses.FrozenInstanceError):
        flat.temperature = 0.0
    with pytest.raises(TypeError, match="temprature"):
        DecodeConfig(temprature=0.7)
    with pytest.raises(ConfigError, match="give a Sampling"):
        DecodeConfig(sampling={"temperature": 0.7})
    with pytest.raises(ConfigError, match="row_tile=2000"):  # each group checks its fields
        dataclasses.replace(flat, row_tile=2000)


def test_generate_keywords_reach_the_decode_config(monkeypatch):
    tok = char_tokenizer()
    tcfg = TargetConfig(
        arch="llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
        eos_token_ids=(2,),
    )  # fmt: skip
    dcfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, vocab_size=len(tok), mask_token_id=0, target_layer_ids=(0, 1),
        num_target_layers=2, block_size=8,
    )  # fmt: skip
    target = types.SimpleNamespace(config=tcfg, tokenizer=tok, chat_template=CHATML)
    drafter = types.SimpleNamespace(config=dcfg)
    seen = []

    def decode(target, drafter, prompt, lengths, seed, cfg, **kw):
        seen.append((cfg, kw["plan"]))
        out = types.SimpleNamespace(tokens=np.full((1, 4), 5), lengths=np.array([2]))
        return types.SimpleNamespace(output=out)

    monkeypatch.setattr(api, "timed_decode", decode)
    monkeypatch.setattr(api.calibration, "calibrate_step_costs", lambda *a, **k: None)
    text = api.generate(
        target, drafter, ["hi"], max_new_tokens=40, chat=False, block_size=8, adaptive=True,
        temperature=0.5, top_p=0.9, lookup_kinds=(4,), tree_nodes=6, row_tile=4,
        draft_window=32, probe_every=3, sampling=Sampling(top_k=7),
    )  # fmt: skip
    assert text == ["22"]  # id 5 is "2"; the fake decode kept two tokens
    ((cfg, plan),) = seen
    assert plan.decode_config == cfg and plan.target_config.invariant_rows is None  # fp32
    assert cfg.max_new_tokens == api.budget_bucket(40)
    assert cfg.sampling == Sampling(temperature=0.5, top_k=7, top_p=0.9)
    assert (cfg.block_size, cfg.adaptive, cfg.lookup_kinds, cfg.tree_nodes) == (8, True, (4,), 6)
    assert (cfg.probe_every, cfg.row_tile, cfg.draft_window) == (3, 4, 32)
    assert cfg.stop_token_ids == api.stop_token_ids(target)
    # As the CLIs' flags give them (`infer.common`): None lookup kinds and no step kinds are
    # the defaults, not values.
    cli = api.generate_config(
        target, drafter, block_size=8, adaptive=True, step_kinds=(), lookup_kinds=None,
        batch_invariant=None, tree_nodes=0, max_new_tokens=16,
    )  # fmt: skip
    assert cli.lookup_kinds == api.default_lookup_kinds(8) and cli.step_kinds == (1, 4, 8)
    assert cli.batch_invariant is None and cli.max_new_tokens == 16


def test_a_plan_resolves_the_run_once():
    """`make_plan` checks the pair and resolves what the programs read: the run's target config
    (bf16: the row rule at the config's tile), the statics, the options; the target alone's
    plan is the same resolution with the drafting fields reset."""
    from dflash_jax.decoding.programs import executable_options, run_target_config

    tcfg = TargetConfig(
        arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, dtype="bfloat16",
    )  # fmt: skip
    dcfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, vocab_size=64, mask_token_id=0, target_layer_ids=(0, 1),
        num_target_layers=2, block_size=8,
    )  # fmt: skip
    cfg = DecodeConfig(block_size=8, adaptive=True, row_tile=8)
    plan = make_plan(tcfg, dcfg, cfg)
    run = run_target_config(tcfg, cfg)
    assert run.invariant_rows == (8, 8)
    assert plan.statics == dict(target_config=run, drafter_config=dcfg, decode_config=cfg)
    assert plan.compiler_options == executable_options(run)
    alone = plan.target_alone()
    assert alone.statics == dict(target_config=run, decode_config=autoregressive_config(cfg))
    assert make_plan(tcfg, None, cfg) == alone
    with pytest.raises(ConfigError, match="trained block size"):
        make_plan(tcfg, dcfg, DecodeConfig(block_size=16))
    # a plan given to a decode of other settings is refused, not run with the plan's
    target, drafter = types.SimpleNamespace(config=tcfg), types.SimpleNamespace(config=dcfg)
    hotter = dataclasses.replace(cfg, temperature=1.0)
    prompt, lengths = np.ones((1, 4), np.int32), np.array([4], np.int32)
    for d, p in ((drafter, alone), (None, plan), (drafter, plan)):
        with pytest.raises(ValueError, match="made for another decode"):
            runner.timed_decode(target, d, prompt, lengths, 0, hotter if p is plan else cfg, plan=p)
