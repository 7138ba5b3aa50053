"""Target parity with transformers on tiny random Qwen3/Llama models (fp32, CPU): full forward,
taps, and prefill + cached steps with per-row lengths; plus eval_shape of the real Qwen3-8B."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tiny_models import (
    LLAMA3_ROPE,
    TINY_DIMS,
    load_hf_torch,
    make_tiny_hf_target,
    torch_logits_and_hidden,
)

from dflash_jax.io import load_target
from dflash_jax.io.hf_config import target_from_hf
from dflash_jax.models.target import Transformer, init_cache, init_params

TOL = 1e-4
CASES = {
    "qwen3": ("qwen3", False, {}),
    "qwen3-tied": ("qwen3", True, {}),
    "llama": ("llama", False, {}),
    "llama-tied": ("llama", True, {}),
    "llama3-rope": ("llama", False, {"rope_scaling": LLAMA3_ROPE}),
}


# qwen3 and llama (with llama3 rope scaling) by default; the tied-head and plain-llama variants
# of the same loader claims are slow (suite budget; CI runs them).
DEFAULT_CASES = ("qwen3", "llama3-rope")


@pytest.fixture(
    scope="module",
    params=[c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def tiny(request, tmp_path_factory):
    arch, tie, overrides = CASES[request.param]
    path = make_tiny_hf_target(tmp_path_factory.mktemp(request.param), arch, tie, **overrides)
    return load_target(str(path)), load_hf_torch(path)


def _forward(target, tokens_bt, positions_bt, **kwargs):
    return Transformer(target.config).apply(
        {"params": target.params}, jnp.asarray(tokens_bt), jnp.asarray(positions_bt), **kwargs
    )


def test_config_matches_case(tiny):
    target, torch_model = tiny
    c = target.config
    assert c.tie_word_embeddings == torch_model.config.tie_word_embeddings
    assert ("lm_head" in target.params) != c.tie_word_embeddings
    assert (c.num_heads, c.num_kv_heads) == (4, 2)
    assert c.eos_token_ids == (TINY_DIMS["eos_token_id"],)


def test_full_forward_logits_and_taps_match_torch(tiny):
    target, torch_model = tiny
    b, t, d = 2, 48, TINY_DIMS["hidden_size"]
    tokens = np.random.RandomState(0).randint(0, TINY_DIMS["vocab_size"], (b, t))
    ref_logits, ref_hidden = torch_logits_and_hidden(torch_model, tokens)
    # HF's last hidden state is after the final norm, so taps are compared below the top layer.
    taps_layers = tuple(range(target.config.num_layers - 1))
    positions = np.broadcast_to(np.arange(t), (b, t))
    logits, taps, cache = _forward(target, tokens, positions, tap_layers=taps_layers)
    assert cache is None
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=TOL, rtol=0)
    assert taps.shape == (b, t, len(taps_layers) * d)
    for i, layer in enumerate(taps_layers):
        np.testing.assert_allclose(
            np.asarray(taps[..., i * d : (i + 1) * d]), ref_hidden[layer + 1], atol=TOL, rtol=0
        )


def test_prefill_then_cached_steps_match_torch(tiny):
    """Right-padded prompts of different lengths, then 1- and multi-token steps per row at
    position lengths[b]; every valid logit equals HF's on the row's unpadded sequence."""
    target, torch_model = tiny
    rng = np.random.RandomState(1)
    vocab = TINY_DIMS["vocab_size"]
    lengths = np.array([5, 11, 8], np.int32)
    b, p = len(lengths), int(lengths.max())
    steps = [1, 3, 1, 3, 1]  # two step shapes: one compile each
    prompt = rng.randint(0, vocab, (b, p)).astype(np.int32)
    prompt[np.arange(p)[None, :] >= lengths[:, None]] = 0  # padding, overwritten later

    fwd = jax.jit(functools.partial(Transformer(target.config).apply, tap_layers=(1,)))
    cache = init_cache(target.config, b, p + sum(steps) + 8)
    positions = np.broadcast_to(np.arange(p, dtype=np.int32), (b, p))
    logits, _, cache = fwd(
        {"params": target.params}, prompt, positions, cache, jnp.zeros((b,), jnp.int32)
    )
    rows = [list(prompt[r, : lengths[r]]) for r in range(b)]
    ours = [[np.asarray(logits[r, : lengths[r]])] for r in range(b)]
    cur = lengths.copy()
    for t in steps:
        new = rng.randint(0, vocab, (b, t)).astype(np.int32)
        pos = cur[:, None] + np.arange(t, dtype=np.int32)[None, :]
        logits, taps, cache = fwd({"params": target.params}, new, pos, cache, jnp.asarray(cur))
        assert taps.shape == (b, t, TINY_DIMS["hidden_size"])
        for r in range(b):
            rows[r] += list(new[r])
            ours[r].append(np.asarray(logits[r]))
        cur += t
    for r in range(b):
        ref_logits, _ = torch_logits_and_hidden(torch_model, np.array([rows[r]]))
        np.testing.assert_allclose(np.concatenate(ours[r]), ref_logits[0], atol=TOL, rtol=0)


def test_logit_indices_pick_rows_last_tokens(tiny):
    target, _ = tiny
    tokens = np.random.RandomState(2).randint(0, TINY_DIMS["vocab_size"], (2, 10))
    positions = np.broadcast_to(np.arange(10), (2, 10))
    full, _, _ = _forward(target, tokens, positions)
    idx = np.array([[3], [9]])
    picked, _, _ = _forward(target, tokens, positions, logit_indices=jnp.asarray(idx))
    np.testing.assert_allclose(
        np.asarray(picked[:, 0]), np.asarray(full)[[0, 1], [3, 9]], atol=1e-6, rtol=0
    )


QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "eos_token_id": 151645,
}


def test_qwen3_8b_eval_shape():
    config = target_from_hf(QWEN3_8B, dtype="bfloat16")
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert count == 8_190_735_360
    layer = shapes["layers_0"]["self_attn"]
    assert layer["q_proj"]["kernel"].shape == (4096, 32, 128)
    assert layer["k_proj"]["kernel"].shape == (4096, 8, 128)
    assert layer["o_proj"]["kernel"].shape == (32, 128, 4096)
    assert shapes["lm_head"]["kernel"].shape == (4096, 151936)
