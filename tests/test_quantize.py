"""Quantized targets (ops/quant.py, models/quantized.py): the quantized model is the target.

One tiny pair (tests/_decode.py's, drafter block 16) quantized once per scheme; its own AR
decode is the reference of every DFlash decode here. int4 runs by default (the coarsest scheme,
with both per-block and per-channel kernels at these shapes: down_proj contracts 64 values in
two blocks, the others 32 or fewer); int8 and fp8 are slow.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode import LENS, PROMPT, make_pair, two_token_tv
from _tiny_models import make_tiny_gguf, make_tiny_hf_model

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.decoding import autoregressive_decode, phases, sampling, speculative_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import load_target
from dflash_jax.io.target_orbax import save_target
from dflash_jax.models.quantized import quantize_params
from dflash_jax.models.target import Transformer
from dflash_jax.ops.quant import QWeight

DECODES = {
    "block16": DecodeConfig(max_new_tokens=24, block_size=16),
    "adaptive": DecodeConfig(max_new_tokens=24, block_size=16, adaptive=True, probe_every=2),
    "tree": DecodeConfig(max_new_tokens=24, block_size=16, tree_nodes=12),
}
STEP_COSTS = (1.0, 1.2, 1.4, 1.8)  # the adaptive decode's kinds 1, 4, 8, 16


@functools.cache
def quantized_pair(scheme: str, vocab: int = 64, seed: int = 0, zero_boost: float = 6.0):
    """(target config, quantized params, drafter config, params) of the tiny pair."""
    tcfg, tp, dcfg, dp = make_pair(vocab=vocab, seed=seed, zero_boost=zero_boost, block_size=16)
    return dataclasses.replace(tcfg, quantize=scheme), quantize_params(tp, tcfg, scheme), dcfg, dp


@functools.cache
def quantized_ar(scheme: str):
    tcfg, tp, _, _ = quantized_pair(scheme)
    out = autoregressive_decode(
        tp, PROMPT, LENS, jax.random.key(0), target_config=tcfg, decode_config=DECODES["block16"]
    )
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize(
    "scheme,mode",
    [("int4", "block16")]
    + [pytest.param("int4", m, marks=pytest.mark.slow) for m in ("adaptive", "tree")]
    + [pytest.param(s, "block16", marks=pytest.mark.slow) for s in ("int8", "fp8")],
)
def test_quantized_greedy_dflash_equals_quantized_ar(scheme, mode):
    """Greedy DFlash on the quantized target gives its own greedy AR tokens, and accepts drafts:
    int4 in a block-16 chain by default. Slow, each guarding only its own case (the quantized
    kernels enter every pass through the same dot as in the chain): the adaptive kinds, a tree
    verify, and the int8 and fp8 schemes."""
    tcfg, tp, dcfg, dp = quantized_pair(scheme)
    kernel = tp["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(kernel, QWeight) and kernel.q.qvalue.dtype.itemsize == 1
    cfg = DECODES[mode]
    extra = {"step_costs": STEP_COSTS} if cfg.adaptive else {}
    sp = speculative_decode(
        tp, dp, PROMPT, LENS, jax.random.key(0), target_config=tcfg, drafter_config=dcfg,
        decode_config=cfg, **extra,
    )  # fmt: skip
    ar = quantized_ar(scheme)
    np.testing.assert_array_equal(np.asarray(sp.tokens), ar.tokens)
    np.testing.assert_array_equal(np.asarray(sp.lengths), ar.lengths)
    assert np.asarray(sp.acceptance_lengths).max() > 1  # drafts were accepted


# Slow (CI's slow step), both: by default the quantized target's decode is guarded by the
# greedy equality above and the sampling rule by test_decoding's TV test (suite budget).
@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_quantized_sampling_is_lossless(broken, monkeypatch):
    """Sampled DFlash on the int4 target follows the int4 target's own law of the first two
    tokens (exact, from its forwards); an acceptance rule that accepts every draft is caught
    (slow: the control; test_decoding's TV test with the quantized target)."""
    tcfg, tp, dcfg, dp = quantized_pair("int4", vocab=12, seed=4, zero_boost=1.0)
    dp = {**dp, "norm": {"scale": jnp.full_like(dp["norm"]["scale"], 0.5)}}
    if broken:

        def accept_all(drafts, draft_logp, target_logits, key, cfg, kept=None):
            a, _ = sampling.accept_rejection(drafts, draft_logp, target_logits, key, cfg)
            bonus = jnp.argmax(target_logits[:, -1], -1).astype(jnp.int32)[:, None]
            return jnp.full_like(a, drafts.shape[1]), jnp.concatenate([drafts, bonus], 1)

        monkeypatch.setattr(phases, "accept_rejection", accept_all)
        jax.clear_caches()
    prompt, n = np.array([3, 1, 4], np.int32), 6000
    out = speculative_decode(
        tp, dp, np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32), jax.random.key(11),
        target_config=tcfg, drafter_config=dcfg,
        decode_config=DecodeConfig(max_new_tokens=2, block_size=4, temperature=1.0),
    )  # fmt: skip
    if broken:
        jax.clear_caches()
    tv = two_token_tv(tcfg, tp, prompt, 1.0, out.tokens)
    # The float target's law is another one: the test would see it (quantization moves it).
    float_tp = make_pair(vocab=12, seed=4, zero_boost=1.0, block_size=16)[1]
    assert two_token_tv(tcfg, float_tp, prompt, 1.0, out.tokens) != tv
    assert (tv > 0.15) if broken else (tv < 0.09), tv


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory):
    """A tiny Llama GGUF whose projections are Q4_1 (head dim 32: o_proj's blocks per head;
    every contracted dim a multiple of the 32-value block)."""
    model = make_tiny_hf_model("llama", hidden_size=128, head_dim=32)
    return make_tiny_gguf(tmp_path_factory.mktemp("q4"), model, quant="Q4_1")


def test_gguf_q4_1_loads_as_int4(q4_1_gguf):
    """Q4_1 blocks load as int4 kernels as stored (qvalue, fp16 scale and offset per block of 32,
    no float copy), and the int4 target's logits equal those of the GGUF dequantised to fp32
    (within fp32 rounding: w = q*d + m is computed as (q-8)*d + (m+8d))."""
    dequantized = load_target(str(q4_1_gguf), cache=False)
    native = load_target(str(q4_1_gguf), cache=False, quantize="int4")
    assert native.config.quantize == "int4"
    for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        kernel = native.params["layers_1"]["self_attn"][module]["kernel"]
        assert kernel.q.qvalue.dtype == jnp.int4 and kernel.q.scale.dtype == jnp.float16
        assert kernel.offset is not None and kernel.offset.shape == kernel.q.scale.shape
    tokens = jnp.array([[1, 5, 9, 2, 7, 3, 3, 8]], jnp.int32)
    positions = jnp.arange(8)[None]
    logits = [
        Transformer(t.config).apply({"params": t.params}, tokens, positions)[0]
        for t in (dequantized, native)
    ]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_native_gguf_blocks_are_the_projections_only(q4_1_gguf):
    """The native path is for projections stored in the scheme's block type: the shipped
    SmolLM2 GGUF (Q4_1 projections, a Q8_0 embedding) takes it for int4, not for int8, whose
    load then goes through the converted-target cache like any other (it counted the
    embedding, and re-quantized every projection from floats on every load)."""
    from dflash_jax.io import assets
    from dflash_jax.io.gguf import has_native_blocks

    shipped = assets.smollm2_gguf_path()
    assert not has_native_blocks(shipped, "int8")
    assert has_native_blocks(q4_1_gguf, "int4") and not has_native_blocks(q4_1_gguf, "int8")


def test_quantized_params_orbax_round_trip(q4_1_gguf, tmp_path):
    """A quantized target saved with Orbax (int4 with fp16 scales and offsets from a GGUF; fp8
    from PTQ) restores to the same kernels, bit for bit, and the same config."""
    targets = {
        "int4": load_target(str(q4_1_gguf), cache=False, quantize="int4"),
        "fp8": load_target(str(q4_1_gguf), cache=False, quantize="fp8"),
    }
    for scheme, target in targets.items():
        save_target(tmp_path / scheme, target)
        back = load_target(str(tmp_path / scheme))
        assert back.config == target.config and back.config.quantize == scheme
        assert jax.tree.structure(back.params) == jax.tree.structure(target.params)
        for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(target.params), strict=True):
            assert a.dtype == b.dtype and np.array_equal(
                np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
            )


def test_bad_quantize_is_refused(q4_1_gguf):
    """An unknown scheme and a target without a quantized path are refused, naming the fix."""
    with pytest.raises(ValueError, match="quantize='int3'.*int8, int4, fp8"):
        load_target(str(q4_1_gguf), cache=False, quantize="int3")
    with pytest.raises(ConfigError, match="int3"):
        TargetConfig("llama", 64, 32, 64, 2, 4, 2, 8, quantize="int3")
    moe = TargetConfig(
        "qwen3_moe", 64, 32, 64, 2, 4, 2, 8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="qwen3_moe.*no quantized path"):
        quantize_params({}, moe, "int8")
    with pytest.raises(ConfigError, match="mxfp4 is gpt-oss's expert format"):
        quantize_params({}, moe, "mxfp4")


@pytest.mark.slow
def test_quantized_passes_are_batch_invariant():
    """Guards only the invariance claim: under the decodes' fixed row tile, an int8 target in bf16
    gives every position the AR step's bits in a prefill and in verifies of 4, 8 and 16 tokens
    (tests/test_batch_invariance.py's check, at SmolLM2's shapes, with quantized kernels)."""
    from _invariance import logits_five_ways, random_tokens, smollm2_config

    from dflash_jax.models.target import init_params
    from dflash_jax.ops.invariance import ROW_TILE, RowRule

    cfg = smollm2_config("bfloat16")
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda w: (w * 4).astype(jnp.bfloat16), params)
    params = quantize_params(params, cfg, "int8")
    rule = RowRule.fixed(ROW_TILE)
    inv = dataclasses.replace(cfg, invariant_rows=(rule.min_rows, rule.max_rows), quantize="int8")
    ways = logits_five_ways(inv, params, random_tokens())
    for name, logits in ways.items():
        np.testing.assert_array_equal(logits, ways["ar"], err_msg=f"{name} vs ar ({rule})")


def test_qwen3_8b_int8_kernels_shard_by_the_table():
    """Qwen3-8B's int8 kernels (shapes only) get the float kernels' shardings from the one
    table, their scales the same on the dims they keep, and a device holds half the bf16
    kernels' bytes (what infer.memory_plan and infer.lower plan with)."""
    from _shapes import QWEN3_8B
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec

    from dflash_jax.models.target import init_params
    from dflash_jax.sharding import MESH_AXES, logical_to_spec, param_logical_axes

    cfg = TargetConfig(**{**QWEN3_8B, "dtype": "bfloat16"})
    mesh = AbstractMesh((1, 4, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    floats = jax.eval_shape(
        lambda: jax.tree.map(lambda w: w.astype(jnp.bfloat16), init_params(cfg, jax.random.key(0)))
    )
    quantized = jax.eval_shape(lambda p: quantize_params(p, cfg, "int8"), floats)
    spec = lambda tree: jax.tree.map(
        lambda x, ax: logical_to_spec(ax, x.shape, mesh), tree, param_logical_axes(tree)
    )
    up = spec(quantized)["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert (
        up.q.qvalue
        == PartitionSpec(("fsdp",), ("tensor",))
        == spec(floats)["layers_0"]["mlp"]["up_proj"]["kernel"]
    )
    assert up.q.scale == PartitionSpec(None, ("tensor",))  # [1, F]: one scale per column
    o = spec(quantized)["layers_0"]["self_attn"]["o_proj"]["kernel"]
    assert o.q.qvalue == PartitionSpec(("tensor",), None, ("fsdp",))
    layer = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree["layers_0"]))
    assert 0.5 <= layer(quantized) / layer(floats) < 0.51
