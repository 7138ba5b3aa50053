"""Greedy decoding vs the reference implementation (`dflash` 0.1.0) and transformers.

A tiny random Qwen3 target and reference drafter are saved to disk and loaded by our loaders.
Two variants: the plain random drafter, and one whose final norm is zeroed (it always proposes
token 0) beside a target whose lm_head row 0 is amplified, so that acceptance lengths vary.
"""

from __future__ import annotations

import time

import dflash.model
import jax
import numpy as np
import pytest
import torch
from _reference import load_reference_pair, make_reference_pair
from dflash.model import dflash_generate

from dflash_jax.decoding import autoregressive_decode, speculative_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import load_target
from dflash_jax.io.drafter_io import load_drafter

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 120, 64], [11, 2, 250, 31]]
MAX_NEW = 24


@pytest.fixture(autouse=True)
def _cpu_clock(monkeypatch):
    """The reference times with torch.cuda.synchronize; on CPU use the host clock."""
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module", params=["random", "accepting"])
def pair(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    target_dir, drafter_dir = make_reference_pair(tmp, block_size=8)
    target, drafter = load_reference_pair(target_dir, drafter_dir)
    if request.param == "accepting":
        with torch.no_grad():
            drafter.norm.weight.zero_()
            target.lm_head.weight[0] *= 25.0
        target.save_pretrained(target_dir)
        drafter.save_pretrained(drafter_dir)
    ours_t = load_target(str(target_dir))
    ours_d = load_drafter(str(drafter_dir), ours_t)
    return request.param, target, drafter, ours_t, ours_d


def _ours(ours_t, ours_d, stop=()):
    width = max(map(len, PROMPTS))
    prompt = np.zeros((len(PROMPTS), width), np.int32)
    for i, p in enumerate(PROMPTS):
        prompt[i, : len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    cfg = DecodeConfig(max_new_tokens=MAX_NEW, block_size=8, stop_token_ids=stop)
    key = jax.random.key(0)
    sp = speculative_decode(
        ours_t.params,
        ours_d.params,
        prompt,
        lengths,
        key,
        target_config=ours_t.config,
        drafter_config=ours_d.config,
        decode_config=cfg,
    )
    ar = autoregressive_decode(
        ours_t.params, prompt, lengths, key, target_config=ours_t.config, decode_config=cfg
    )
    return jax.tree.map(np.asarray, sp), jax.tree.map(np.asarray, ar)


@torch.no_grad()
def test_greedy_equals_reference_and_transformers(pair):
    kind, target, drafter, ours_t, ours_d = pair
    sp, ar = _ours(ours_t, ours_d)
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        ref = dflash_generate(
            drafter,
            target=target,
            input_ids=ids,
            max_new_tokens=MAX_NEW,
            stop_token_ids=None,
            temperature=0.0,
            block_size=8,
            return_stats=True,
        )
        ref_new = ref.output_ids[0, len(prompt) :].tolist()
        hf_new = target.generate(
            ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False
        )[0, len(prompt) :].tolist()
        n = int(sp.lengths[row])
        assert sp.tokens[row, :n].tolist() == ref_new == hf_new
        assert ar.tokens[row, : int(ar.lengths[row])].tolist() == hf_new
        steps = int(sp.num_steps[row])
        ours_acc = sp.acceptance_lengths[row, :steps].tolist()
        # The reference shortens its last block (non-causal drafts then differ); we keep the
        # block and cap what it commits: tokens agree, only the last step's tau may differ.
        assert ours_acc[:-1] == list(ref.acceptance_lengths)[:-1]
        assert sum(ours_acc) == sum(ref.acceptance_lengths)
        if kind == "accepting":
            assert max(ours_acc) > 2, ours_acc


@torch.no_grad()
def test_stop_token_matches_reference(pair):
    kind, target, drafter, ours_t, ours_d = pair
    if kind != "accepting":
        pytest.skip("the accepting pair commits multi-token blocks; that is the case to test")
    sp_free, _ = _ours(ours_t, ours_d)
    stop = int(sp_free.tokens[0, 9])
    sp, ar = _ours(ours_t, ours_d, stop=(stop,))
    for row, prompt in enumerate(PROMPTS):
        ref = dflash_generate(
            drafter,
            target=target,
            input_ids=torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            stop_token_ids=[stop],
            temperature=0.0,
            block_size=8,
            return_stats=True,
        )
        ref_new = ref.output_ids[0, len(prompt) :].tolist()
        n = int(sp.lengths[row])
        assert sp.tokens[row, :n].tolist() == ref_new
        assert ar.tokens[row, : int(ar.lengths[row])].tolist() == ref_new
        assert ref_new[-1] == stop or n == MAX_NEW
