"""The decoding tests' shared pieces: a tiny random (target, drafter) pair whose acceptance
varies, its prompts, the one greedy-equals-AR harness (`assert_greedy_equals_ar`), the total
variation of the first two sampled tokens against the target's exact law, and a DSpark variant
of the pair.

make_pair: the drafter's final norm is zeroed so it always proposes token 0, and the target's
lm_head column 0 is amplified so the target emits 0 about half the time: acceptance lengths
then vary between 1 and the block size, which exercises partial acceptance, the bonus token,
stops inside accepted blocks and the max_new_tokens cap.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import autoregressive_decode, speculative_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.models import dspark
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import Transformer, init_params


@functools.cache
def _cached_pair(arch, vocab, zero_boost, seed, block_size, kv_heads):
    tcfg = TargetConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=256,
    )
    dcfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=vocab,
        mask_token_id=vocab - 1,
        target_layer_ids=(1, 2),
        num_target_layers=4,
        block_size=block_size,
    )
    tp = init_params(tcfg, jax.random.key(seed))
    tp = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, tp)
    tp["lm_head"]["kernel"] = tp["lm_head"]["kernel"].at[:, 0].mul(zero_boost)
    dp = init_drafter_params(dcfg, jax.random.key(seed + 1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])
    return tcfg, tp, dcfg, dp


def make_pair(arch="qwen3", vocab=64, zero_boost=6.0, seed=0, block_size=8, kv_heads=2):
    """(target config, params, drafter config, params); fresh dicts over cached arrays."""
    tcfg, tp, dcfg, dp = _cached_pair(arch, vocab, zero_boost, seed, block_size, kv_heads)
    copy = lambda t: jax.tree.map(lambda x: x, t)
    return tcfg, copy(tp), dcfg, copy(dp)


PROMPT = np.array([[5, 9, 3, 7, 1, 2, 8], [4, 4, 6, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0]], np.int32)
LENS = np.array([7, 3, 5], np.int32)

# Eight rows (the mesh tests split them over data=2 or more): PROMPT's three and a 1-token row,
# twice.
PROMPT8 = np.array(
    [[5, 9, 3, 7, 1, 2, 8], [4, 4, 6, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0], [7, 0, 0, 0, 0, 0, 0]]
    * 2,
    np.int32,
)
LENS8 = np.array([7, 3, 5, 1, 7, 3, 5, 1], np.int32)


def run_both(tcfg, tp, dcfg, dp, cfg, prompt=PROMPT, lens=LENS, seed=0, reference_config=None):
    """(AR, speculative) decodes of `prompt` with one key, as numpy. reference_config: the
    target config AR decodes with (default tcfg; e.g. the same model under another attention
    implementation)."""
    key = jax.random.key(seed)
    ar = autoregressive_decode(
        tp, prompt, lens, key, target_config=reference_config or tcfg, decode_config=cfg
    )
    sp = speculative_decode(
        tp, dp, prompt, lens, key, target_config=tcfg, drafter_config=dcfg, decode_config=cfg
    )
    return jax.tree.map(np.asarray, ar), jax.tree.map(np.asarray, sp)


def assert_greedy_equals_ar(
    tcfg, tp, dcfg, dp, cfg, prompt=PROMPT, lens=LENS, seed=0, reference_config=None, ar=None
):
    """The one greedy-equals-AR check: the speculative decode under `cfg` gives the AR decode's
    tokens and lengths, row for row -> (ar, speculative), as numpy. ar: an AR result to compare
    against (several modes against one AR decode) instead of decoding it again."""
    if ar is None:
        ar, sp = run_both(tcfg, tp, dcfg, dp, cfg, prompt, lens, seed, reference_config)
    else:
        sp = speculative_decode(
            tp, dp, prompt, lens, jax.random.key(seed),
            target_config=tcfg, drafter_config=dcfg, decode_config=cfg,
        )  # fmt: skip
        sp = jax.tree.map(np.asarray, sp)
    np.testing.assert_array_equal(sp.tokens, ar.tokens, f"tokens differ from AR's under {cfg}")
    np.testing.assert_array_equal(sp.lengths, ar.lengths, f"lengths differ from AR's under {cfg}")
    return ar, sp


def assert_greedy_speculative_equals_ar(
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    reference_tcfg: TargetConfig,
    max_new_tokens: int,
    tree_nodes: int = 0,
) -> None:
    """Speculative decode with (tcfg, dcfg) gives the tokens of the autoregressive decode with
    `reference_tcfg` (the same model under another attention implementation), and accepts some
    drafts (the kernel tests' check). Sharp random weights; a drafter that always drafts token
    0, which the target's head favours, so acceptance varies. tree_nodes: every step a token
    tree of that many nodes."""
    tp = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, init_params(tcfg, jax.random.key(0)))
    tp["lm_head"]["kernel"] = tp["lm_head"]["kernel"].at[:, 0].mul(6.0)  # vary acceptance
    dp = init_drafter_params(dcfg, jax.random.key(1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])  # always drafts token 0
    prompt = jnp.array([[5, 9, 13, 2, 7, 7], [3, 8, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([6, 2], jnp.int32)
    cfg = DecodeConfig(
        max_new_tokens=max_new_tokens, block_size=dcfg.block_size, tree_nodes=tree_nodes
    )
    _, spec = assert_greedy_equals_ar(
        tcfg, tp, dcfg, dp, cfg, prompt, lengths, reference_config=reference_tcfg
    )
    assert spec.acceptance_lengths.max() > 1  # some drafts were accepted


def exact_two_token_distribution(tcfg, tp, prompt, temperature):
    """p(t1, t2 | prompt) for the whole tiny vocabulary, from full target forwards."""
    v = tcfg.vocab_size
    model = Transformer(tcfg)
    n = len(prompt)
    seqs = np.array([list(prompt) + [t1] for t1 in range(v)], np.int32)
    pos = np.broadcast_to(np.arange(n + 1), seqs.shape)
    logits = np.asarray(model.apply({"params": tp}, seqs, pos)[0], np.float64) / temperature
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    p1 = np.exp(logp[0, n - 1])
    p2_given_1 = np.exp(logp[:, n])
    return p1[:, None] * p2_given_1


def two_token_tv(tcfg, tp, prompt, temperature, tokens) -> float:
    """Total variation between the empirical joint law of `tokens[:, :2]` (one sample per row)
    and the target's exact law of the first two tokens after `prompt`."""
    toks = np.asarray(tokens)
    v = tcfg.vocab_size
    emp = np.zeros((v, v))
    np.add.at(emp, (toks[:, 0], toks[:, 1]), 1)
    exact = exact_two_token_distribution(tcfg, tp, prompt, temperature)
    return 0.5 * np.abs(emp / toks.shape[0] - exact).sum()


def dspark_pair(
    kind, from_anchor, draft_vocab=0, vocab=64, scale=1.0, seed=0, zero_boost=6.0, zeros=False
):
    """make_pair's tiny pair (block 8) as a DSpark drafter: Markov rank 8 of head `kind`,
    every head weight ~ N(0, scale) so the bias moves the drafts; the drafter's final norm at
    0.5 (not zero) so its slots differ; a draft vocabulary of every other id (and id 0).
    zeros: the final norm zero as make_pair's (base logits 0) and a Markov bias that
    favours token 0 (z > 0, column 0 of markov_w2 raised), so drafts are often the target's
    frequent 0 and get accepted, but not always."""
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, zero_boost=zero_boost, seed=seed)
    dcfg = dataclasses.replace(
        dcfg, markov_rank=8, markov_head_type=kind, sample_from_anchor=from_anchor,
        enable_confidence_head=True, confidence_head_with_markov=True,
        draft_vocab_size=draft_vocab,
    )  # fmt: skip
    keys = iter(jax.random.split(jax.random.key(seed + 5), 16))
    heads = dspark.init_dspark_params(dcfg, jax.random.key(seed + 2))
    dp = {**dp, **jax.tree.map(lambda w: scale * jax.random.normal(next(keys), w.shape), heads)}
    dp["norm"]["scale"] = jnp.full_like(dp["norm"]["scale"], 0.0 if zeros else 0.5)
    if zeros:
        head = dp["markov_head"]
        head["markov_w1"]["embedding"] = jnp.abs(head["markov_w1"]["embedding"])
        head["markov_w2"]["kernel"] = head["markov_w2"]["kernel"].at[:, 0].add(1.5)
        if kind == "rnn":  # o, the output's pre-tanh, positive
            head["joint_proj"]["bias"] = head["joint_proj"]["bias"].at[16:].add(3.0)
    if draft_vocab:
        ids = np.arange(0, 2 * draft_vocab, 2, dtype=np.int32)
        kernel = 0.3 * jax.random.normal(next(keys), (dcfg.hidden_size, draft_vocab))
        dp |= {"draft_to_target": jnp.asarray(ids), "lm_head": {"kernel": kernel}}
    return tcfg, tp, dcfg, dp
