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
    `model.visual.*`, `lm_head`) loads its language model; vision and MTP tensors are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dflash_jax.config import TargetConfig

# Tensors of a published checkpoint that the text model never reads.
SKIPPED_PREFIXES = ("visual.", "mtp.", "model.visual.", "model.mtp.")
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
    out = {}
    for name, t in tensors.items():
        if name.startswith(SKIPPED_PREFIXES):
            continue
        out[name.removeprefix("language_model.")] = t
    out = stack_experts(out, stored_tensor)
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
