"""HF checkpoints of the MoE and hybrid families (config.LAYERED_ARCHS): their tensor names,
shapes and transforms for `hf.convert_to_params`, and the renames that come first.

  * Per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, as Qwen3-MoE, Qwen3-Next and
    Qwen3.5-MoE checkpoints store them) are stacked into one [E, ...] tensor per layer and
    projection, read lazily (`stack_experts`); a missing expert is named.
  * Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` (grouped per key head) are regrouped into
    Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, so one layer serves both;
    `in_proj_qkv` and `conv1d` (all queries | all keys | all values) are then grouped per key
    head, [.., Hk, 2Dk + rDv], the layout that splits over `tensor` (`models.linear_attention`).
  * A multimodal checkpoint (`Qwen3_5ForConditionalGeneration`: `model.language_model.*`,
    `model.visual.*`, `lm_head`) loads its language model; vision and MTP tensors are skipped
    (Gemma 3's vision tower and projector too).
  * gpt-oss's experts: the fused gate_up_proj [E, D, 2F] (gate and up interleaved, column
    2j the gate, 2j+1 the up) and its bias are split into gate_proj / up_proj; MXFP4 experts
    (`*_blocks` uint8 [E, out, in/32, 16], two e2m1 values a byte, low nibble first, and
    `*_scales` uint8 [E, out, in/32], a power of two biased by 127) are dequantized at load
    (`dequantize_mxfp4`, one log line) to the float layout, or kept as stored
    (`mxfp4_experts`, the loader's quantize="mxfp4").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from absl import logging

from dflash_jax.config import TargetConfig

# Tensors of a published checkpoint that the text model never reads.
SKIPPED_PREFIXES = ("visual.", "mtp.", "model.visual.", "model.mtp.", "vision_tower.",
                    "multi_modal_projector.", "embed_vision.", "audio_tower.",
                    "embed_audio.")  # fmt: skip
# A KV-sharing layer's k/v tensors, which checkpoints may carry and HF ignores.
_SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight")


def canonical(name: str) -> str:
    """Without a `model.` prefix (as `hf.canonical_name`)."""
    return name.removeprefix("model.")


_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _t(w):
    return w.T


def _keep(w):
    return w


def _heads_in(n: int, h: int) -> Callable[[np.ndarray], np.ndarray]:
    """[n*h, D] -> [D, n, h]"""
    return lambda w: w.reshape(n, h, w.shape[1]).transpose(2, 0, 1)


def _heads_out(n: int, h: int) -> Callable[[np.ndarray], np.ndarray]:
    """[D, n*h] -> [n, h, D]"""
    return lambda w: w.reshape(w.shape[0], n, h).transpose(1, 2, 0)


def _key_head_groups(hk: int, dk: int, r: int, dv: int) -> Callable[[np.ndarray], np.ndarray]:
    """[2HkDk + HkrDv, X] in Qwen3.5's channel order (all queries, all keys, all values) ->
    [X, Hk, 2Dk + rDv]: key head i's query, key and value heads i*r .. i*r+r-1 together."""

    def group(w):
        q, k, v = np.split(w, [hk * dk, 2 * hk * dk])
        heads = [x.reshape(hk, -1, w.shape[1]) for x in (q, k, v)]  # [Hk, Dk|Dk|rDv, X]
        return np.concatenate(heads, axis=1).transpose(2, 0, 1)

    return group


def _swap_last(w):
    """[E, out, in] -> [E, in, out]"""
    return w.transpose(0, 2, 1)


def rename(tensors: Mapping[str, Any], config: TargetConfig, stored_tensor) -> dict[str, Any]:
    """Canonical names (no `model.`) of a layered checkpoint -> the names `layout` expects:
    the language-model prefix dropped, vision/MTP tensors skipped, experts stacked and
    Qwen3-Next's fused projections regrouped. stored_tensor: `hf.StoredTensor`."""
    out, skipped = {}, set()
    for name, t in tensors.items():
        if name.startswith(SKIPPED_PREFIXES):
            skipped.add(name.split(".")[0])
            continue
        if name.startswith("language_model."):  # Gemma 3's: language_model.model.layers...
            name = canonical(name.removeprefix("language_model."))
        shared = _SHARED_KV.fullmatch(name)
        if shared and config.kv_source(int(shared[1])) != int(shared[1]):
            continue
        out[name] = t
    if skipped:
        logging.info("target: loading the text model; skipped %s", ", ".join(sorted(skipped)))
    out = stack_experts(out, stored_tensor)
    if config.arch == "gpt_oss":
        out = _split_gate_up(out, stored_tensor)
    if config.arch == "qwen3_next":
        out = _split_next_projections(out, config, stored_tensor)
    return out


def stack_experts(tensors: dict[str, Any], stored_tensor) -> dict[str, Any]:
    """Replaces `...experts.{e}.{proj}.weight` tensors with one lazily stacked
    `...experts.{proj}` of shape [E, *shape] per layer and projection."""
    groups: dict[str, dict[int, Any]] = {}
    rest = {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            rest[name] = t
        else:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
    for name, by_expert in groups.items():
        parts = [by_expert.get(e) for e in range(max(by_expert) + 1)]
        if any(p is None for p in parts):
            e = parts.index(None)
            raise ValueError(f"{name}: expert {e} is missing from the checkpoint")
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{name}: experts have different shapes {sorted(shapes)}")
        read = lambda parts=parts: np.stack([p.read() for p in parts])
        rest[name] = stored_tensor(name, parts[0].file, (len(parts), *parts[0].shape), read)
    return rest


def _split_next_projections(tensors, c: TargetConfig, stored_tensor):
    """Qwen3-Next's in_proj_qkvz [Hk*(2Dk + 2rDv), D] and in_proj_ba [Hk*2r, D] (r = Hv/Hk,
    grouped per key head) -> in_proj_qkv [2HkDk + HvDv, D], in_proj_z [HvDv, D],
    in_proj_b / in_proj_a [Hv, D] in Qwen3.5's order."""
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // hk
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".linear_attn.in_proj_qkvz.weight")]:
        t, prefix = out.pop(name), name.removesuffix("in_proj_qkvz.weight")

        def grouped(i, t=t):
            w = t.read().reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            flat = lambda x: x.reshape(-1, x.shape[-1])
            return [np.concatenate([flat(q), flat(k), flat(v)]), flat(z)][i]

        d = t.shape[1]
        out[prefix + "in_proj_qkv.weight"] = stored_tensor(
            prefix + "in_proj_qkv.weight",
            t.file,
            (hk * (2 * dk + r * dv), d),
            lambda g=grouped: g(0),
        )
        out[prefix + "in_proj_z.weight"] = stored_tensor(
            prefix + "in_proj_z.weight", t.file, (hk * r * dv, d), lambda g=grouped: g(1)
        )
    for name in [n for n in tensors if n.endswith(".linear_attn.in_proj_ba.weight")]:
        t, prefix = out.pop(name), name.removesuffix("in_proj_ba.weight")
        ba = lambda i, t=t: t.read().reshape(hk, 2, r, -1)[:, i].reshape(hk * r, -1)
        for i, which in enumerate("ba"):
            key = f"{prefix}in_proj_{which}.weight"
            out[key] = stored_tensor(key, t.file, (hk * r, t.shape[1]), lambda i=i, f=ba: f(i))
    return out


# e2m1 (MXFP4's element type): sign, two exponent bits, one mantissa bit, by 4-bit code.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
                  -6.0], np.float32)  # fmt: skip


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks uint8 [E, out, G, 16] (32 values per block of the contracted dim, two per
    byte, low nibble first) and scales uint8 [E, out, G] (2^(scale - 127) per block) ->
    float32 [E, in = G * 32, out], the float checkpoint's layout."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    values = np.stack([_E2M1[blocks & 0x0F], _E2M1[blocks >> 4]], axis=-1)  # [E, out, G, 16, 2]
    values = values.reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


@functools.cache
def _log_dequantizing() -> None:
    logging.info(
        "gpt-oss: dequantizing its MXFP4 expert tensors to float at load (kept as float weights "
        "in the load's dtype; --quantize=mxfp4 keeps them as stored)"
    )


def _dequantized(blocks, scales) -> np.ndarray:
    _log_dequantizing()
    return dequantize_mxfp4(blocks.read(), scales.read())


def mxfp4_experts(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's MXFP4 expert tensors as stored, by the param name they fill
    (`layers.{i}.mlp.experts.gate_proj` ...) -> `ops.quant.mxfp4` QWeights in our layout: the
    e2m1 codes as float4_e2m1fn (the same 4 bits), scales 2^(stored - 127) per block of 32
    contracted values; gate_up's interleaved rows split. tensors: canonical name -> stored
    tensor (`hf.read_safetensors_dir`, names with or without `model.`)."""
    from dflash_jax.ops import quant

    out = {}
    for name in sorted(n for n in tensors if n.endswith("_blocks")):
        base = canonical(name.removesuffix("_blocks"))
        blocks = np.asarray(tensors[name].read(), np.uint8)  # [E, out, G, 16]
        exps = np.asarray(tensors[name.replace("_blocks", "_scales")].read(), np.int32) - 127
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:2], -1)
        values = codes.view(ml_dtypes.float4_e2m1fn)  # [E, out, in]
        ours = lambda v, x: quant.mxfp4(v.transpose(0, 2, 1), x.transpose(0, 2, 1), axis=1)
        if base.endswith(".gate_up_proj"):
            prefix = base.removesuffix("gate_up_proj")
            for i, which in enumerate(("gate_proj", "up_proj")):
                out[prefix + which] = ours(values[:, i::2], exps[:, i::2])
        else:
            out[base] = ours(values, exps)
    return out


def _split_gate_up(tensors: dict[str, Any], stored_tensor) -> dict[str, Any]:
    """gpt-oss experts: MXFP4 pairs dequantized when read (one log line), the fused
    gate_up_proj [E,D,2F] and gate_up_proj_bias [E,2F] split into gate / up (interleaved
    columns)."""
    out = dict(tensors)
    for name in sorted(n for n in out if n.endswith("_blocks")):
        blocks, base = out.pop(name), name.removesuffix("_blocks")
        scales = out.pop(base + "_scales")
        e, rows, g, _ = blocks.shape
        read = lambda b=blocks, s=scales: _dequantized(b, s)
        out[base] = stored_tensor(base, blocks.file, (e, g * 32, rows), read)
    for name in [n for n in out if n.endswith(".mlp.experts.gate_up_proj")]:
        t, prefix = out.pop(name), name.removesuffix("gate_up_proj")
        e, d, f2 = t.shape
        for i, which in enumerate(("gate_proj", "up_proj")):
            read = lambda t=t, i=i: np.asarray(t.read())[..., i::2]
            out[prefix + which] = stored_tensor(prefix + which, t.file, (e, d, f2 // 2), read)
        b = out.pop(prefix + "gate_up_proj_bias")
        for i, which in enumerate(("gate_bias", "up_bias")):
            read = lambda b=b, i=i: np.asarray(b.read())[..., i::2]
            out[prefix + which] = stored_tensor(prefix + which, b.file, (e, f2 // 2), read)
    return out


def _sliding_layout(c: TargetConfig, i: int) -> dict[str, tuple[tuple[str, ...], tuple, Any]]:
    """`layer_layout` of a SLIDING_ARCHS layer."""
    d, n = c.hidden_size, c.num_heads
    k, h = c.layer_heads(i)
    out = {
        "input_layernorm.weight": (("input_layernorm", "scale"), (d,), _keep),
        "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), (d,), _keep),
    }
    attn = {
        "q_proj.weight": (("q_proj", "kernel"), (n * h, d), _heads_in(n, h)),
        "k_proj.weight": (("k_proj", "kernel"), (k * h, d), _heads_in(k, h)),
        "v_proj.weight": (("v_proj", "kernel"), (k * h, d), _heads_in(k, h)),
        "o_proj.weight": (("o_proj", "kernel"), (d, n * h), _heads_out(n, h)),
    }
    if c.arch in ("gemma3", "gemma4"):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[f"{norm}.weight"] = ((norm, "scale"), (d,), _keep)
        attn["q_norm.weight"] = (("q_norm", "scale"), (h,), _keep)
        attn["k_norm.weight"] = (("k_norm", "scale"), (h,), _keep)
        if c.arch == "gemma4":
            out |= _gemma4_extras(c, i)
            if c.attention_k_eq_v and c.window(i) is None:  # the keys are the values
                del attn["v_proj.weight"]
            if c.kv_source(i) != i:  # a KV-sharing layer: no k/v of its own
                for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
                    attn.pop(name, None)
        out |= _under("self_attn", ("self_attn",), attn)
        return out | _under("mlp", ("mlp",), _swiglu(c.mlp_width(i), d))
    heads = lambda m: lambda b: b.reshape(m, h)
    attn |= {
        "q_proj.bias": (("q_proj", "bias"), (n * h,), heads(n)),
        "k_proj.bias": (("k_proj", "bias"), (k * h,), heads(k)),
        "v_proj.bias": (("v_proj", "bias"), (k * h,), heads(k)),
        "o_proj.bias": (("o_proj", "bias"), (d,), _keep),
        "sinks": (("sinks",), (n,), _keep),
    }
    e, f = c.num_experts, c.moe_intermediate_size
    out |= _under("self_attn", ("self_attn",), attn)
    return out | _under("mlp", ("mlp",), {
        "router.weight": (("router", "kernel"), (e, d), _t),
        "router.bias": (("router", "bias"), (e,), _keep),
        "experts.gate_proj": (("experts", "gate_proj"), (e, d, f), _keep),
        "experts.up_proj": (("experts", "up_proj"), (e, d, f), _keep),
        "experts.down_proj": (("experts", "down_proj"), (e, f, d), _keep),
        "experts.gate_bias": (("experts", "gate_bias"), (e, f), _keep),
        "experts.up_bias": (("experts", "up_bias"), (e, f), _keep),
        "experts.down_proj_bias": (("experts", "down_bias"), (e, d), _keep),
    })  # fmt: skip


def _gemma4_extras(c: TargetConfig, i: int) -> dict:
    """A Gemma 4 layer's layer_scalar, per-layer input projections and MoE block."""
    d, p = c.hidden_size, c.per_layer_input_size
    out = {"layer_scalar": (("layer_scalar",), (1,), _keep)}
    if p:
        out |= {
            "per_layer_input_gate.weight": (("per_layer_input_gate", "kernel"), (p, d), _t),
            "per_layer_projection.weight": (("per_layer_projection", "kernel"), (d, p), _t),
            "post_per_layer_input_norm.weight": (("post_per_layer_input_norm", "scale"), (d,),
                                                 _keep),
        }  # fmt: skip
    if c.num_experts:
        e, f = c.num_experts, c.moe_intermediate_size
        for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):  # fmt: skip
            out[f"{norm}.weight"] = ((norm, "scale"), (d,), _keep)
        out |= {
            "router.proj.weight": (("experts", "proj", "kernel"), (e, d), _t),
            "router.scale": (("experts", "scale"), (d,), _keep),
            "router.per_expert_scale": (("experts", "per_expert_scale"), (e,), _keep),
            "experts.gate_up_proj": (("experts", "gate_up_proj"), (e, 2 * f, d), _swap_last),
            "experts.down_proj": (("experts", "down_proj"), (e, d, f), _swap_last),
        }
    return out


def per_layer_input_layout(c: TargetConfig) -> dict:
    """Gemma 4's model-level per-layer input tensors (`sliding.PerLayerInputs`)."""
    lp, p = c.num_layers * c.per_layer_input_size, c.per_layer_input_size
    at = lambda *path: ("per_layer_inputs", *path)
    return {
        "embed_tokens_per_layer.weight": (at("embed_tokens_per_layer", "embedding"),
                                          (c.per_layer_vocab_size, lp), _keep),
        "per_layer_model_projection.weight": (at("per_layer_model_projection", "kernel"),
                                              (lp, c.hidden_size), _t),
        "per_layer_projection_norm.weight": (at("per_layer_projection_norm", "scale"), (p,),
                                             _keep),
    }  # fmt: skip


def _under(hf: str, path: tuple[str, ...], entries: dict) -> dict:
    """Entries named relative to a submodule -> full layer-relative names and paths."""
    return {f"{hf}.{k}": ((*path, *p), shape, fn) for k, (p, shape, fn) in entries.items()}


def _swiglu(f: int, d: int) -> dict:
    return {
        "gate_proj.weight": (("gate_proj", "kernel"), (f, d), _t),
        "up_proj.weight": (("up_proj", "kernel"), (f, d), _t),
        "down_proj.weight": (("down_proj", "kernel"), (d, f), _t),
    }


def layer_layout(c: TargetConfig, i: int) -> dict[str, tuple[tuple[str, ...], tuple, Any]]:
    """HF name (under `layers.{i}.`) -> (param path under `layers_{i}`, HF shape, transform)."""
    if c.sliding:
        return _sliding_layout(c, i)
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    mixer, mlp = c.layer_kind(i)
    out: dict[str, tuple[tuple[str, ...], tuple, Any]] = {
        "input_layernorm.weight": (("input_layernorm", "scale"), (d,), _keep),
        "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), (d,), _keep),
    }
    if mixer == "attention":
        qw = 2 * h if c.hybrid else h  # hybrid: each head's query, then its output gate
        out |= _under("self_attn", ("self_attn",), {
            "q_proj.weight": (("q_proj", "kernel"), (n * qw, d), _heads_in(n, qw)),
            "k_proj.weight": (("k_proj", "kernel"), (k * h, d), _heads_in(k, h)),
            "v_proj.weight": (("v_proj", "kernel"), (k * h, d), _heads_in(k, h)),
            "o_proj.weight": (("o_proj", "kernel"), (d, n * h), _heads_out(n, h)),
            "q_norm.weight": (("q_norm", "scale"), (h,), _keep),
            "k_norm.weight": (("k_norm", "scale"), (h,), _keep),
        })  # fmt: skip
    else:
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv, w = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
        ch = 2 * hk * dk + hv * dv
        group = _key_head_groups(hk, dk, hv // hk, dv)
        out |= _under("linear_attn", ("linear_attn",), {
            "in_proj_qkv.weight": (("in_proj_qkv", "kernel"), (ch, d), group),
            "in_proj_z.weight": (("in_proj_z", "kernel"), (hv * dv, d), _heads_in(hv, dv)),
            "in_proj_b.weight": (("in_proj_b", "kernel"), (hv, d), _t),
            "in_proj_a.weight": (("in_proj_a", "kernel"), (hv, d), _t),
            "conv1d.weight": (("conv1d", "kernel"), (ch, 1, w), lambda x: group(x[:, 0])),
            "dt_bias": (("dt_bias",), (hv,), _keep),
            "A_log": (("A_log",), (hv,), _keep),
            "norm.weight": (("norm", "scale"), (dv,), _keep),
            "out_proj.weight": (("out_proj", "kernel"), (d, hv * dv), _heads_out(hv, dv)),
        })  # fmt: skip
    if mlp == "dense":
        return out | _under("mlp", ("mlp",), _swiglu(c.intermediate_size, d))
    e, f = c.num_experts, c.moe_intermediate_size
    out |= _under("mlp", ("mlp",), {
        "gate.weight": (("gate", "kernel"), (e, d), _t),
        "experts.gate_proj": (("experts", "gate_proj"), (e, f, d), _swap_last),
        "experts.up_proj": (("experts", "up_proj"), (e, f, d), _swap_last),
        "experts.down_proj": (("experts", "down_proj"), (e, d, f), _swap_last),
    })  # fmt: skip
    if c.shared_expert_intermediate_size:
        s = c.shared_expert_intermediate_size
        out |= _under("mlp.shared_expert", ("mlp", "shared_expert"), _swiglu(s, d))
        out["mlp.shared_expert_gate.weight"] = (("mlp", "shared_expert_gate", "kernel"), (1, d), _t)
    return out
