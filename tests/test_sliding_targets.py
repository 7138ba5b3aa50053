"""The sliding-window targets (gemma3_text, gemma4_text, gpt_oss) against transformers: tiny
random models of configs unlike the project's fixtures (window 8, sliding and full layers
alternating, Gemma's own RoPE base per kind, Gemma 4's wider full-layer heads whose keys are
their values and its capped logits, gpt-oss's sinks, YaRN and clamped-SwiGLU experts), saved by
transformers and loaded by our loader; prompts of 6 to 40 tokens, longer than the window.

The target's lm_head row 0 is amplified so it often emits token 0, and the random z-lab
drafter's final norm is zeroed so it always proposes token 0: acceptance then varies.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _tiny_sliding import (
    FAMILIES,
    WINDOW,
    default_config,
    hf_config,
    load_torch,
    make_tiny_sliding,
)

from dflash_jax import sharding
from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.decoding import autoregressive_decode, speculative_decode
from dflash_jax.decoding.phases import prefill
from dflash_jax.decoding.programs import check_tree_target
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import load_target
from dflash_jax.io.drafter_io import load_drafter
from dflash_jax.io.hf_config import target_from_hf, target_to_hf
from dflash_jax.io.hf_layered import dequantize_mxfp4
from dflash_jax.io.speculators import write_speculators
from dflash_jax.io.zlab import write_zlab
from dflash_jax.models.drafter import Drafter, draft_logits, init_drafter_params
from dflash_jax.models.target import Transformer, decoding_head, init_cache
from dflash_jax.ops import quant

PROMPTS = [
    [5, 17, 33, 3, 42, 7],
    [11, 2, 60, 31, 9, 9, 4, 70, 21, 13, 5, 6, 7, 8, 1, 2, 3],
    [(7 * i + 3) % 90 + 1 for i in range(40)],
]
MAX_NEW = 16
ZERO_BOOST = 3.0


@functools.cache
def _family(family: str, tmp: str):
    path = make_tiny_sliding(tmp, family)
    model = load_torch(path)
    with torch.no_grad():
        model.lm_head.weight[0] *= ZERO_BOOST  # tied (Gemma): the embedding row too
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path, model = _family(request.param, str(tmp_path_factory.mktemp(request.param)))
    return request.param, path, model, load_target(str(path), cache=False)


def _batch(prompts=PROMPTS):
    prompt = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, : len(p)] = p
    return prompt, np.array([len(p) for p in prompts], np.int32)


def test_logits_and_taps_match_transformers(family):
    name, _, model, target = family
    tokens = np.array([PROMPTS[2][:24]])  # 3 windows
    with torch.no_grad():
        ref = model(torch.tensor(tokens), output_hidden_states=True)
    positions = np.arange(tokens.shape[1])[None]
    taps = (0, 1, 2)
    logits, taps_btf, _ = Transformer(target.config).apply(
        {"params": target.params}, tokens, positions, tap_layers=taps
    )
    np.testing.assert_allclose(np.asarray(logits), ref.logits.numpy(), atol=2e-5, rtol=1e-4)
    want = np.concatenate([ref.hidden_states[i + 1].numpy() for i in taps], -1)
    np.testing.assert_allclose(np.asarray(taps_btf), want, atol=2e-5, rtol=1e-4)


def test_decodes_keep_a_ring_per_sliding_layer(family):
    """The decode's cache (its prefill's, traced only): a sliding layer keeps its window + the
    verify width (a ring), a full layer every position; the greedy tests decode through it
    (prompts of up to 40 tokens, window 8) and `test_sliding_layers_cache_a_ring` checks it
    step by step."""
    _, _, _, target = family
    c = target.config
    prompt, lengths = _batch()
    cfg = DecodeConfig(max_new_tokens=MAX_NEW, block_size=4)

    def start(params):
        head = decoding_head(params, c)
        return prefill(params, head, c, cfg, prompt, lengths, jax.random.key(0), 64, ())[0]

    slots = [k.shape[2] for k in jax.eval_shape(start, target.params).cache.k]
    assert slots == [WINDOW + 4 if c.window(i) else 64 for i in range(c.num_layers)]


@pytest.mark.slow
def test_sliding_layers_cache_a_ring(family):
    """A sliding layer's cache is a ring of window + verify slots, lossless on prompts longer
    than the ring: a ragged prefill (17 and 40 tokens, padded), a deferred verify of 4 rows of
    which 1 is committed (3 rejected rows written), then a 4-token pass give the hidden states
    of one pass over the committed tokens. Slow: it alone guards the ring outside the decode
    loop (a prefill longer than the ring, rejected rows at known slots), for each family; in
    the default suite the greedy tests decode gemma3 through its ring."""
    name, _, _, target = family
    c, verify, max_len = target.config, 4, 64
    cache = init_cache(c, 2, max_len, verify=verify)
    slots = [k.shape[2] for k in cache.k]
    assert slots == [WINDOW + verify if c.window(i) else max_len for i in range(c.num_layers)]
    prompt, lengths = _batch(PROMPTS[1:])
    rng = np.random.default_rng(0)
    rows = np.zeros((2, 45), np.int32)  # each row's committed tokens: its prompt, then 5
    for b, p in enumerate(PROMPTS[1:]):
        rows[b, : len(p) + 5] = p + rng.integers(1, 90, 5).tolist()
    at = lambda x, start: np.take_along_axis(x, np.asarray(start)[:, None] + np.arange(4), 1)
    model = Transformer(c)
    pos = lambda start, t: jnp.asarray(start)[:, None] + jnp.arange(t)[None]

    @jax.jit
    def run(params, cache):
        hidden = functools.partial(model.apply, {"params": params}, method="hidden")
        _, _, cache = hidden(prompt, pos([0, 0], 40), cache, None, (), lengths[:, None] - 1)
        verify_bt = at(rows, lengths) * (np.arange(4) == 0)  # its first token, 3 rejected
        _, _, new = hidden(verify_bt, pos(lengths, 4), cache, lengths, defer_cache_write=True)
        cache = cache.written(new.k, new.v, jnp.asarray(lengths))  # 4 rows, 1 committed
        got, _, _ = hidden(at(rows, lengths + 1), pos(lengths + 1, 4), cache, lengths + 1)
        want, _, _ = hidden(rows, pos([0, 0], 45))  # one pass, no cache
        return got, jnp.take_along_axis(want, pos(lengths + 1, 4)[..., None], 1)

    got, want = run(target.params, cache)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=name)


# gpt_oss in the default suite (window, sinks, experts); gemma3 and gemma4 (slow) alone guard
# their families' chunked prefill (softcapped scores; per-layer inputs and shared KV).
@pytest.mark.parametrize(
    "family",
    ["gpt_oss"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("gemma3", "gemma4")],
    indirect=True,
)
def test_chunked_prefill_equals_the_dense_one(family):
    """A prefill in chunks of 16 (rings of window + 4 slots, each chunk attending to the cache
    in key blocks of 8) gives the dense prefill's last hidden states, taps and written cache
    slots: the 17- and 40-token prompts padded to whole chunks, the padding never written to
    a ring."""
    from dflash_jax.decoding.phases import prompt_pass
    from dflash_jax.ops import attention, dispatch
    from dflash_jax.ops.caches import ring_positions

    name, _, _, target = family
    c = target.config
    prompt, lengths = _batch()
    last = jnp.asarray(lengths) - 1

    def run(params, chunk):
        cache = init_cache(c, 3, 64, verify=4)
        return prompt_pass(params, c, jnp.asarray(prompt), cache, (0, 2), last, chunk)

    dense = jax.jit(run, static_argnums=1)(target.params, 0)
    with pytest.MonkeyPatch.context() as mp:  # blocked scores with a 16-token chunk
        mp.setattr(dispatch, "PREFILL_QUERIES", 8)
        mp.setattr(attention, "PREFILL_KEY_BLOCK", 8)
        chunked = jax.jit(run, static_argnums=1)(target.params, 16)
    np.testing.assert_allclose(chunked[0], dense[0], atol=2e-5, rtol=1e-4, err_msg=name)
    real = np.arange(40)[None, :] < lengths[:, None]
    np.testing.assert_allclose(np.asarray(chunked[1])[real], np.asarray(dense[1])[real],
                               atol=2e-5, rtol=1e-4)  # fmt: skip
    pairs = zip(chunked[2].k + chunked[2].v, dense[2].k + dense[2].v, strict=True)
    for i, (got, want) in enumerate(pairs):
        slots = got.shape[2]
        held = np.asarray(ring_positions(jnp.asarray(lengths), slots)) >= 0  # [B,S]
        np.testing.assert_allclose(np.asarray(got).transpose(0, 2, 1, 3)[held],
                                   np.asarray(want).transpose(0, 2, 1, 3)[held], atol=2e-5,
                                   rtol=1e-4, err_msg=f"{name} buffer {i}")  # fmt: skip


def _drafter_config(c: TargetConfig, **overrides) -> DrafterConfig:
    kw = dict(
        hidden_size=c.hidden_size, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=8, vocab_size=c.vocab_size, mask_token_id=c.vocab_size - 1,
        target_layer_ids=(0, 1), num_target_layers=c.num_layers, block_size=4,
    )  # fmt: skip
    return DrafterConfig(**{**kw, **overrides})


def test_drafters_of_both_formats_load_fit_checked(family, tmp_path):
    """A z-lab drafter (a sliding-window drafter layer, window 8) and a speculators one load
    for the target; one tapping past its last layer is refused by the fit check."""
    _, _, _, target = family
    c = target.config
    zcfg = _drafter_config(c, layer_types=("sliding_attention",), sliding_window=WINDOW)
    write_zlab(tmp_path / "zlab", zcfg, init_drafter_params(zcfg, jax.random.key(1)), "float32")
    scfg = _drafter_config(c)
    write_speculators(tmp_path / "spec", scfg, init_drafter_params(scfg, jax.random.key(1)),
                      "float32")  # fmt: skip
    for fmt, want in (("zlab", zcfg), ("spec", scfg)):
        loaded = load_drafter(str(tmp_path / fmt), target)
        assert loaded.config.target_layer_ids == (0, 1), fmt
        assert loaded.config.sliding_window == want.sliding_window, fmt
    bad = _drafter_config(c, target_layer_ids=(0, c.num_layers))
    write_zlab(tmp_path / "bad", bad, init_drafter_params(bad, jax.random.key(1)), "float32")
    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_drafter(str(tmp_path / "bad"), target)


_draft_logits = jax.jit(draft_logits, static_argnums=(2, 3, 9))


# gemma3 in the default suite (the embedding scale and logit cap the drafter must not take);
# gemma4 and gpt_oss (slow) alone guard their families' block embedding against the reference.
@pytest.mark.parametrize(
    "family",
    ["gemma3"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("gemma4", "gpt_oss")],
    indirect=True,
)
def test_drafter_block_logits_match_reference_dflash(family, tmp_path):
    """Our drafter's block logits equal the reference `dflash` model's (same weights, taps and
    block; fp32): the block embedded from the raw table (not Gemma's sqrt(hidden)), logits from
    the raw lm_head (not Gemma 4's final_logit_softcapping)."""
    from _reference import reference_draft_logits, reference_taps
    from dflash.model import DFlashDraftModel

    _, _, model, target = family
    c = target.config
    dcfg = _drafter_config(c, block_size=4, mask_token_id=c.vocab_size - 1)
    write_zlab(tmp_path / "d", dcfg, init_drafter_params(dcfg, jax.random.key(3)), "float32")
    drafter = load_drafter(str(tmp_path / "d"), target)
    ref = DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float32).eval()
    tokens, block = np.array(PROMPTS[2][:20]), np.array([7, c.vocab_size - 1, 5, c.vocab_size - 1])
    taps_tf = reference_taps(model, ref, tokens)
    want = reference_draft_logits(model, ref, taps_tf, block)
    dc, dp = drafter.config, drafter.params
    ctx_k, ctx_v = jax.jit(Drafter(dc).apply, static_argnames="method")(
        {"params": dp}, jnp.asarray(taps_tf)[None], jnp.arange(20)[None], method="context_kv"
    )
    got = _draft_logits(dp, target.params, c, dc, jnp.asarray(block)[None], ctx_k, ctx_v,
                        jnp.array([20]), jnp.array([[20]]), 4)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got[0, 0]), want, atol=1e-4, rtol=0)


# gemma3 in the default suite; gemma4 and gpt_oss (slow) alone guard their families' greedy
# decodes (Gemma 4's per-kind cache shapes and capped head; gpt-oss's sinks and experts in the
# cached verify and AR step) against transformers' generate.
@pytest.mark.parametrize(
    "family",
    ["gemma3"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("gemma4", "gpt_oss")],
    indirect=True,
)
@torch.no_grad()
def test_greedy_decodes_equal_transformers_generate(family, tmp_path):
    """Ragged batch of 6-, 17- and 40-token prompts (window 8): AR (prefilled in chunks of 16)
    equals transformers' greedy generate row by row; speculative with a random z-lab drafter
    (written, then loaded with the fit check; prefilled in chunks of 8, the drafter's context
    with them) equals AR token for token, with acceptance varying."""
    name, _, model, target = family
    _check_greedy_decodes(name, model, target, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_default_configs_decode_as_transformers(name, tmp_path):
    """Slow (three more targets compiled): alone guards each family as transformers builds it
    from its config class with only sizes, the window and the layer count set (Gemma's 5:1
    layer pattern, Gemma 4's last layer full, its per-layer inputs and proportional RoPE;
    gpt-oss's YaRN): logits, greedy AR against generate, speculative against AR."""
    path = make_tiny_sliding(tmp_path, name, config=default_config(name))
    model = load_torch(path)
    with torch.no_grad():
        model.lm_head.weight[0] *= ZERO_BOOST
    model.save_pretrained(path)
    target = load_target(str(path), cache=False)
    if name == "gemma4":
        assert target.config.per_layer_input_size == 8
        assert target.config.layer_types[-2:] == ("full_attention", "full_attention")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[2][:24]])).logits.numpy()
    logits = Transformer(target.config).apply(
        {"params": target.params}, np.array([PROMPTS[2][:24]]), np.arange(24)[None]
    )[0]
    np.testing.assert_allclose(np.asarray(logits), ref, atol=2e-5, rtol=1e-4)
    _check_greedy_decodes(name, model, target, tmp_path)


@torch.no_grad()
def _check_greedy_decodes(name, model, target, tmp_path):
    prompt, lengths = _batch()
    cfg = DecodeConfig(max_new_tokens=MAX_NEW, block_size=4)
    key = jax.random.key(0)
    chunked = dataclasses.replace(cfg, prefill_chunk=16)  # prompts of 17 and 40 chunked
    ar = autoregressive_decode(
        target.params, prompt, lengths, key, target_config=target.config, decode_config=chunked
    )
    for row, p in enumerate(PROMPTS):
        ids = torch.tensor([p])
        hf = model.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        assert np.asarray(ar.tokens[row]).tolist() == hf[0, len(p) :].tolist(), (name, row)
    c = target.config
    dcfg = _drafter_config(c)
    dp = init_drafter_params(dcfg, jax.random.key(1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])  # always proposes token 0
    write_zlab(tmp_path / "drafter", dcfg, dp, dtype="float32")
    drafter = load_drafter(str(tmp_path / "drafter"), target)
    sp = speculative_decode(
        target.params, drafter.params, prompt, lengths, key,
        target_config=c, drafter_config=drafter.config,
        decode_config=dataclasses.replace(cfg, prefill_chunk=8),  # chunked, the drafter's too
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
    acc = np.asarray(sp.acceptance_lengths)
    assert acc.max() > 1 and (acc[acc > 0] == 1).any(), acc  # partial acceptance happened


def test_config_round_trips_and_refusals(family):
    """to_hf / from_hf round-trip; every param has a sharding rule; the kernels and token trees
    refuse these attentions."""
    name, _, _, target = family
    c = target.config
    assert target_from_hf(target_to_hf(c)) == c
    sharding.param_logical_axes(target.params)  # every param has a rule (raises otherwise)
    assert c.window(0) == WINDOW and c.window(1) is None
    tokens = np.array([PROMPTS[0]])
    pallas = Transformer(c.__class__(**{**c.__dict__, "attention_impl": "pallas"}))
    with pytest.raises(ConfigError, match="sliding window, sinks"):
        pallas.apply({"params": target.params}, tokens, np.arange(6)[None])
    with pytest.raises(ConfigError, match="tree verification is not implemented"):
        check_tree_target(c, DecodeConfig(block_size=4, tree_nodes=4))


@torch.no_grad()
def test_bf16_norms_round_as_transformers(family):
    """Loaded in bf16, every norm kind of the family (the final norm, a layer's input norm and,
    for Gemma, the q norm) gives transformers' bf16 output bitwise: Gemma 3's (1 + w) in fp32 of
    the bf16 weight, gpt-oss's and Gemma 4's weight multiplied in fp32 before the cast."""
    from transformers import AutoModelForCausalLM

    from dflash_jax.models import sliding

    name, path, _, _ = family
    ours = load_target(str(path), dtype="bfloat16", cache=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = np.random.default_rng(0).normal(0, 3, (3, 5, 32)).astype(np.float32)
    xt = torch.tensor(x).to(torch.bfloat16)
    cases = [
        (hf.model.norm, ours.params["norm"], 32),
        (hf.model.layers[0].input_layernorm, ours.params["layers_0"]["input_layernorm"], 32),
    ]
    if name != "gpt_oss":
        cases.append((hf.model.layers[0].self_attn.q_norm,
                      ours.params["layers_0"]["self_attn"]["q_norm"], 16))  # fmt: skip
    for module, params, d in cases:
        want = module(xt[..., :d]).float().numpy()
        got = sliding.final_norm(ours.config).apply(
            {"params": params}, jnp.asarray(x[..., :d], jnp.bfloat16)
        )
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want, err_msg=name)


def test_missing_config_keys_default_as_transformers(family):
    """A config.json without the keys transformers fills from its class defaults (ties, the
    window, Gemma 3's query_pre_attn_scalar, gpt-oss's YaRN) reads as the one transformers
    completes."""
    name, _, model, _ = family
    full = {**model.config.to_dict(), "model_type": model.config.model_type}
    keys = ("tie_word_embeddings", "sliding_window", "query_pre_attn_scalar", "rope_parameters")
    if name == "gemma4":
        keys = keys[:3]  # its RoPE defaults: `test_gemma4_default_config_matches_transformers`
    bare = {k: v for k, v in full.items() if k not in keys}
    completed = type(model.config)(**{k: v for k, v in bare.items() if k != "model_type"})
    want = target_from_hf({**completed.to_dict(), "model_type": model.config.model_type})
    assert target_from_hf(bare) == want
    assert want.tie_word_embeddings == (name != "gpt_oss")


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 10, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(
        torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32
    ).numpy()
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 64, 10)
    np.testing.assert_array_equal(got, want)


def _mxfp4_checkpoint(tmp_path):
    """A tiny gpt-oss saved by transformers, its experts then stored as MXFP4 blocks and scales
    (random codes) as the released checkpoints store them. -> (path, {name: dequantized})."""
    from dflash_jax.io.hf import read_safetensors_dir, write_safetensors

    path = make_tiny_sliding(tmp_path, "gpt_oss", intermediate_size=32)
    tensors = {n: np.array(t.read()) for n, t in read_safetensors_dir(path).items()}  # copies
    rng = np.random.default_rng(0)
    want = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, out = tensors.pop(name).shape  # stored [E, in, out]
        blocks = rng.integers(0, 256, (e, out, rows_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(124, 130, (e, out, rows_in // 32), dtype=np.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        want[name] = dequantize_mxfp4(blocks, scales)
    write_safetensors(path / "model.safetensors", tensors)
    return path, want


def test_mxfp4_checkpoint_loads_dequantized(tmp_path):
    """A gpt-oss checkpoint whose experts are stored as MXFP4 blocks and scales (as the released
    ones are) loads with them dequantized and the fused gate_up split into gate / up, or with
    them kept as stored (quantize="mxfp4"), the same target."""
    path, want = _mxfp4_checkpoint(tmp_path)
    target = load_target(str(path), cache=False)
    experts = target.params["layers_1"]["mlp"]["experts"]
    gate_up = want["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(np.asarray(experts["gate_proj"]), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(experts["up_proj"]), gate_up[..., 1::2])
    down = want["model.layers.1.mlp.experts.down_proj"]
    np.testing.assert_array_equal(np.asarray(experts["down_proj"]), down)
    # Kept as stored (quantize="mxfp4"): 4-bit values and block scales whose product is the
    # dequantized kernel.
    kept = load_target(str(path), cache=False, quantize="mxfp4")
    assert kept.config.quantize == "mxfp4"
    q = kept.params["layers_1"]["mlp"]["experts"]
    assert q["gate_proj"].q.qvalue.dtype == jnp.float4_e2m1fn
    assert q["gate_proj"].q.scale.shape == (6, 1, 32)  # [E, D / 32, F]
    for k in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(q[k].dequantize(jnp.float32), experts[k])
    axes = sharding.param_logical_axes(kept.params)["layers_1"]["mlp"]["experts"]["gate_proj"]
    assert axes.q.qvalue == axes.q.scale == ("expert", "embed", None)  # as the float kernel


@pytest.mark.slow
def test_mxfp4_target_gives_the_dequantized_logits(tmp_path):
    """Slow (two compiles of the MoE target): alone guards that the experts' products take
    MXFP4 kernels (`quant.weight` in `sliding.expert_rows`) and give the dequantized target's
    logits bitwise."""
    path, _ = _mxfp4_checkpoint(tmp_path)
    target = load_target(str(path), cache=False)
    kept = load_target(str(path), cache=False, quantize="mxfp4")
    tokens, positions = np.array([PROMPTS[1]]), np.arange(17)[None]
    logits = [
        Transformer(t.config).apply({"params": t.params}, tokens, positions)[0]
        for t in (target, kept)
    ]
    np.testing.assert_array_equal(*logits)


def test_mxfp4_quantization_rounds_to_the_block_grid():
    """Post-training MXFP4 (`quantize="mxfp4"` on float experts): a kernel already on an MXFP4
    grid (each block's largest value 6 x 2^k) comes back exactly; others within half an e2m1
    step of their block's scale."""
    rng = np.random.default_rng(0)
    values = rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0], (2, 64, 3)).astype(np.float32)
    values[:, ::32] = 6.0  # each block of 32 along dim 1 reaches 6
    exps = rng.integers(-4, 4, (2, 2, 3))
    w = values * np.exp2(np.repeat(exps, 32, axis=1)).astype(np.float32)
    round_trip = jax.jit(lambda w: quant.quantize_mxfp4(w, 1).dequantize(jnp.float32))
    np.testing.assert_array_equal(round_trip(w), w)
    noisy = w * (1 + rng.uniform(-0.05, 0.05, w.shape)).astype(np.float32)
    back = np.asarray(round_trip(noisy))
    scale = np.exp2(np.repeat(exps, 32, axis=1) + 1)  # the largest e2m1 step (4 -> 6)
    assert (np.abs(back - noisy) <= scale / 2 + 1e-6).all()


def test_unsupported_gemma4_features_are_refused():
    base = {**hf_config("gemma4").to_dict(), "model_type": "gemma4_text"}
    target_from_hf(base)
    for key, value in (("use_bidirectional_attention", "all"), ("attention_bias", True)):
        with pytest.raises(ConfigError, match=key):
            target_from_hf({**base, key: value})
    with pytest.raises(ConfigError, match="enable_moe_block=true needs"):
        target_from_hf({**base, "num_experts": None})


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A `Gemma3ForConditionalGeneration` save (language_model.model.*, a vision tower and a
    projector) loads as its text model: the same config and params."""
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    text_dir = make_tiny_sliding(tmp_path, "gemma3")
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision,
                          mm_tokens_per_image=4, image_token_index=90, boi_token_index=91,
                          eoi_token_index=92)  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
    model.save_pretrained(tmp_path / "mm")
    a, b = load_target(str(text_dir), cache=False), load_target(str(tmp_path / "mm"), cache=False)
    assert b.config == a.config
    jax.tree.map(np.testing.assert_array_equal, b.params, a.params)


def test_gemma4_multimodal_checkpoint_loads_its_text_model(tmp_path, caplog):
    """A `Gemma4ForConditionalGeneration` save (a vision and an audio tower and their
    embedders beside language_model.*) loads as its text model, the towers skipped (said once
    in the log)."""
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

    text_dir = make_tiny_sliding(tmp_path, "gemma4")
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)  # fmt: skip
    audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 subsampling_conv_channels=[4, 4])  # fmt: skip
    ids = dict(boi_token_id=90, eoi_token_id=91, image_token_id=92, video_token_id=93,
               boa_token_id=94, eoa_token_index=95, audio_token_id=89)  # fmt: skip
    config = Gemma4Config(text_config=text.config.to_dict(), vision_config=vision,
                          audio_config=audio, **ids)  # fmt: skip
    model = Gemma4ForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
    model.save_pretrained(tmp_path / "mm")
    a = load_target(str(text_dir), cache=False)
    with caplog.at_level("INFO"):
        b = load_target(str(tmp_path / "mm"), cache=False)
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert said == ["target: loading the text model; skipped audio_tower, embed_audio, "
                    "embed_vision, vision_tower"]  # fmt: skip
    assert b.config == a.config
    jax.tree.map(np.testing.assert_array_equal, b.params, a.params)
