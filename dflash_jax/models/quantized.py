"""Post-training quantization of a target's params (`ops.quant`): which kernels, contracted how.

The decoder layers' projections (q/k/v/o, gate/up/down) become `QWeight`s; the embedding, the
head (tied or not) and the norms stay in the compute dtype, as the drafter does: the embedding
is a gather, the head is one product per step whose logits decide every token, and both are
shared with the drafter. Only dense targets (Llama, Qwen3), and gpt-oss's experts in MXFP4 (the
format its checkpoints store them in, `quantize_params` or `io.hf_layered.mxfp4_experts`); the
other MoE experts' grouped matmuls and the linear-attention layers have no quantized path yet.
"""

from __future__ import annotations

import functools

import jax

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.ops import quant

# kernel name -> the dims a layer contracts (q/k/v [D,N,H], o [N,H,D], gate/up [D,F], down [F,D])
CONTRACTED = {
    "q_proj": (0,),
    "k_proj": (0,),
    "v_proj": (0,),
    "o_proj": (0, 1),
    "gate_proj": (0,),
    "up_proj": (0,),
    "down_proj": (0,),
}


def check_quantizable(config: TargetConfig, scheme: str | None) -> None:
    """Refuses a scheme we do not have, or a target whose layers have no quantized path
    (mxfp4: gpt-oss's experts only, the one MoE path that takes quantized kernels)."""
    quant.check_scheme(scheme)
    if (scheme == "mxfp4") != (scheme is not None and config.arch == "gpt_oss"):
        raise ConfigError(
            f"quantize={scheme!r} on a {config.arch} target: mxfp4 is gpt-oss's expert format "
            "and gpt-oss takes no other scheme; load gpt-oss with --quantize=mxfp4 or none, "
            "other targets with int8, int4, fp8 or none"
        )
    if scheme is not None and scheme != "mxfp4" and config.layered:
        raise ConfigError(
            f"quantize={scheme!r}: the {config.arch} target's MoE / linear-attention layers have "
            "no quantized path yet; load it with float weights (no --quantize), or quantize a "
            "dense Llama / Qwen3 target"
        )


@functools.cache
def _quantizer(scheme: str, contracted: tuple[int, ...]):
    return jax.jit(lambda w: quant.quantize(w, scheme, contracted))


def quantize_params(params: dict, config: TargetConfig, scheme: str) -> dict:
    """`params` with every decoder-layer projection kernel quantized to `scheme` (a kernel
    already a `QWeight`, e.g. read quantized from a GGUF, is kept). Other leaves are the same
    objects. Jitted per kernel shape; under `jax.eval_shape` it gives the abstract tree."""
    check_quantizable(config, scheme)
    if scheme == "mxfp4":
        return _quantize_experts(params)
    out = {}
    for name, sub in params.items():
        if not name.startswith("layers_"):
            out[name] = sub
            continue
        layer = {}
        for group, modules in sub.items():
            layer[group] = {}
            for module, leaves in modules.items():
                kernel = leaves.get("kernel") if isinstance(leaves, dict) else None
                if module in CONTRACTED and kernel is not None:
                    if not isinstance(kernel, quant.QWeight):
                        kernel = _quantizer(scheme, CONTRACTED[module])(kernel)
                    leaves = {**leaves, "kernel": kernel}
                layer[group][module] = leaves
        out[name] = layer
    return out


# gpt-oss's expert kernels ([E,D,F] gate/up, [E,F,D] down: each contracts dim 1).
EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")


def _quantize_experts(params: dict) -> dict:
    """gpt-oss `params` with each layer's expert kernels in MXFP4 (those already `QWeight`s,
    read as stored, kept); everything else the same objects."""
    out = dict(params)
    for name, sub in params.items():
        if not name.startswith("layers_"):
            continue
        experts = dict(sub["mlp"]["experts"])
        for k in EXPERT_KERNELS:
            if not isinstance(experts[k], quant.QWeight):
                experts[k] = _quantizer("mxfp4", (1,))(experts[k])
        out[name] = {**sub, "mlp": {**sub["mlp"], "experts": experts}}
    return out
