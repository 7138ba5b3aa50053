"""A training run's starting drafter params: random, initialised from the target, or warm-started
from an exported drafter (`config.init_from`).

From the target (`config.init_from_target`), for a drafter of L layers over an N-layer target:
  * drafter layer i <- target layer N - L + i (attention, MLP and norms; q/k norms from the
    target where it has them, else ones);
  * `fc` picks one tap unchanged (identity block, zeros elsewhere) and `hidden_norm` takes the
    input norm of target layer N - L, so the context rows are exactly the normalised input that
    layer sees when the picked tap is its input (tap N - L - 1): drafter layer 0's context K/V
    then start as the target layer's own. Without that tap the nearest one is used (the
    residual stream changes slowly from layer to layer), and the log says so;
  * the final `norm` <- the target's final norm (both feed the same frozen lm_head).

Growing (`config.init_from` with `config.init_grow_layers`): an exported L-layer drafter starts
a run of L' > L layers. Its layers become layers 0..L-1 and the added ones keep their random
initialisation except their two residual outputs (attention `o_proj`, MLP `down_proj`), which
start at zero: an added layer adds nothing to the residual stream, so step 0 is the exported
drafter, to the bit, and training can only start from its acceptance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dflash_jax.config import ConfigError, DrafterConfig
from dflash_jax.models.drafter import init_drafter_params

LAYER_KEYS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


def _copy(x, dtype) -> jax.Array:
    # Always a fresh buffer: the train state is donated, the target keeps its own.
    return jnp.array(x, dtype=dtype, copy=True)


def final_norm_scale(target_config, target_params: dict) -> jax.Array:
    """The target's final-norm multiplier as the drafter's RMSNorm holds it (`x * scale`): the
    stored scale, or 1 + it for the hybrid families' zero-centred norms (`x * (1 + w)`)."""
    scale = target_params["norm"]["scale"]
    return 1.0 + scale.astype(jnp.float32) if target_config.hybrid else scale


def check_init_from_target(target_config) -> None:
    """Refuses `init_from_target` for a target whose layers the drafter's cannot hold: the MoE
    and hybrid families (sparse MLPs, linear attention, gated full attention)."""
    if target_config.layered:
        raise ConfigError(
            f"init_from_target copies the target's top decoder layers into the drafter's dense "
            f"Qwen3 layers; a {target_config.arch} target's layers (MoE MLPs and/or linear or "
            "gated attention) have no such counterpart. Use a random init (the default), "
            "config.init_norm_from_target or config.init_from instead"
        )


def _check_same_shapes(target_config, drafter_config: DrafterConfig) -> None:
    check_init_from_target(target_config)
    pairs = {
        "hidden_size": (drafter_config.hidden_size, target_config.hidden_size),
        "intermediate_size": (drafter_config.intermediate_size, target_config.intermediate_size),
        "num_heads": (drafter_config.num_heads, target_config.num_heads),
        "num_kv_heads": (drafter_config.num_kv_heads, target_config.num_kv_heads),
        "head_dim": (drafter_config.head_dim, target_config.head_dim),
    }
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        detail = ", ".join(f"{k} {d} vs the target's {t}" for k, (d, t) in bad.items())
        raise ConfigError(
            f"init_from_target needs drafter layers shaped like the target's: {detail}"
        )
    if drafter_config.num_layers > target_config.num_layers:
        raise ConfigError(
            f"init_from_target: a {drafter_config.num_layers}-layer drafter cannot copy the top "
            f"layers of a {target_config.num_layers}-layer target"
        )


def context_tap_for(drafter_config: DrafterConfig, num_target_layers: int) -> int:
    """Index into target_layer_ids of the tap that `fc` passes through: the input of the first
    copied layer (tap N - L - 1) if it is tapped, else the tap nearest to it (the earlier one
    on a tie)."""
    wanted = num_target_layers - drafter_config.num_layers - 1
    taps = list(drafter_config.target_layer_ids)
    return min(range(len(taps)), key=lambda i: (abs(taps[i] - wanted), taps[i] > wanted))


def params_from_target(
    params: dict, drafter_config: DrafterConfig, target_config, target_params: dict
) -> dict:
    """`params` (a random drafter init, for its structure) with the target's weights copied in
    as the module docstring describes."""
    _check_same_shapes(target_config, drafter_config)
    dtype = jnp.dtype(drafter_config.dtype)
    n, num = target_config.num_layers, drafter_config.num_layers
    out = dict(params)
    for i in range(num):
        source = target_params[f"layers_{n - num + i}"]
        layer = dict(params[f"layers_{i}"])
        for key in LAYER_KEYS:
            copied = jax.tree.map(lambda x: _copy(x, dtype), source[key])
            if key == "self_attn":
                # q/k norms: the target's (Qwen3) or the fresh ones (Llama has none).
                copied = {**params[f"layers_{i}"]["self_attn"], **copied}
            layer[key] = copied
        out[f"layers_{i}"] = layer
    tap = context_tap_for(drafter_config, n)
    d = drafter_config.hidden_size
    fc = np.zeros((drafter_config.num_taps * d, d), np.float32)
    fc[tap * d : (tap + 1) * d] = np.eye(d, dtype=np.float32)
    out["fc"] = {"kernel": jnp.asarray(fc, dtype)}
    first = target_params[f"layers_{n - num}"]
    out["hidden_norm"] = {"scale": _copy(first["input_layernorm"]["scale"], dtype)}
    out["norm"] = {"scale": _copy(final_norm_scale(target_config, target_params), dtype)}
    layer_id = drafter_config.target_layer_ids[tap]
    if layer_id != n - num - 1:
        logging.info(
            "init_from_target: tap %d feeds the context (layer %d's input is not tapped)",
            layer_id,
            n - num,
        )
    # Master weights in the fresh init's dtypes (fp32 under a bf16 compute dtype).
    return jax.tree.map(lambda x, fresh: x.astype(fresh.dtype), out, params)


def _with_fresh_dflash2_parts(loaded: dict, drafter_config: DrafterConfig, seed: int) -> dict:
    """A DFlash drafter's params inside a fresh DFlash2 drafter's: every leaf the DFlash drafter
    has is taken from it, the DFlash2 additions (convolutions, candidate selector) keep their
    initialisation, which makes step 0 the DFlash drafter (`models/dflash2.py`)."""
    fresh = init_drafter_params(drafter_config, jax.random.key(seed))

    def merge(fresh_node, loaded_node):  # loaded leaves DFlash2 lacks stay: refused by shape
        if not isinstance(fresh_node, dict) or not isinstance(loaded_node, dict):
            return loaded_node
        return {**loaded_node, **{
            k: merge(v, loaded_node[k]) if k in loaded_node else v for k, v in fresh_node.items()
        }}  # fmt: skip

    return merge(fresh, loaded)


def with_fresh_dspark_heads(loaded: dict, drafter_config: DrafterConfig, seed: int) -> dict:
    """A DFlash drafter's params as a DSpark drafter's backbone: every DFlash leaf is kept as it
    is, the heads the run's config has (markov_head, confidence_head) start as a fresh run's
    from `seed` (`init_drafter_params`). Step 0 is then the DFlash drafter plus a
    near-zero Markov bias (markov_w1 ~ N(0, 0.01))."""
    if drafter_config.is_dflash2 or drafter_config.draft_vocab_size:
        raise ConfigError("a DSpark warm start takes a DFlash drafter over the target's vocabulary")
    fresh = init_drafter_params(drafter_config, jax.random.key(seed))
    heads = {k: fresh[k] for k in ("markov_head", "confidence_head") if k in fresh}
    logging.info(
        "init_from: a DFlash drafter; the DSpark heads %s start fresh, its params are kept",
        sorted(heads),
    )
    return {**loaded, **heads}


def grown_params(loaded: dict, loaded_layers: int, drafter_config: DrafterConfig, seed: int):
    """An L-layer drafter's params inside a fresh L'-layer drafter's (module docstring): its
    layers first, the added layers' o_proj and down_proj zero. Every other leaf (fc,
    hidden_norm, norm) is the loaded one; shapes are checked by the caller."""
    fresh = init_drafter_params(drafter_config, jax.random.key(seed))
    out = {k: v for k, v in loaded.items() if not k.startswith("layers_")}
    for i in range(drafter_config.num_layers):
        name = f"layers_{i}"
        if i < loaded_layers:
            out[name] = loaded[name]
            continue
        layer = fresh[name]
        attn, mlp = dict(layer["self_attn"]), dict(layer["mlp"])
        attn["o_proj"] = {"kernel": jnp.zeros_like(attn["o_proj"]["kernel"])}
        mlp["down_proj"] = {"kernel": jnp.zeros_like(mlp["down_proj"]["kernel"])}
        out[name] = {**layer, "self_attn": attn, "mlp": mlp}
    return out


def warm_start_params(
    path: str, drafter_config: DrafterConfig, seed: int = 0, grow_layers: bool = False
) -> dict:
    """Params of an exported drafter (`<workdir>/drafter` or any Orbax drafter directory), which
    must have the run's shapes; the optimizer state starts fresh. A DFlash drafter may start a
    DFlash2 run: its params are taken where they exist, the DFlash2 additions start as
    initialised (from `seed`), so the run begins at the DFlash drafter's acceptance. With
    `grow_layers` it may have fewer layers than the run (`grown_params`)."""
    from dflash_jax.io.drafter_io import read_drafter

    loaded = read_drafter(path, drafter_config.dtype)
    params = loaded.params
    if drafter_config.is_dflash2 and not loaded.config.is_dflash2:
        logging.info("init_from: a DFlash drafter; DFlash2's convolutions and selector start fresh")
        params = _with_fresh_dflash2_parts(params, drafter_config, seed)
    if drafter_config.is_dspark and not loaded.config.is_dspark:
        params = with_fresh_dspark_heads(params, drafter_config, seed)
    if grow_layers:
        have, want_layers = loaded.config.num_layers, drafter_config.num_layers
        if have >= want_layers:
            raise ConfigError(
                f"config.init_grow_layers: init_from={path} has {have} layers, not fewer than "
                f"this run's {want_layers}"
            )
        logging.info(
            "init_from: growing a %d-layer drafter to %d layers; the added layers start as "
            "identity (zero o_proj and down_proj)",
            have,
            want_layers,
        )
        params = grown_params(params, have, drafter_config, seed)
    expected = jax.eval_shape(lambda: init_drafter_params(drafter_config, jax.random.key(0)))
    want = jax.tree.map(lambda x: x.shape, expected)
    got = jax.tree.map(lambda x: x.shape, params)
    if want != got:
        raise ConfigError(
            f"init_from={path}: its params do not have this run's shapes "
            f"(drafter {loaded.config} vs {drafter_config})"
        )
    # Master weights in the fresh init's dtypes (fp32 under a bf16 compute dtype), as Adam's
    # state is created from them.
    return jax.tree.map(lambda x, e: _copy(x, e.dtype), params, expected)


def initial_params(cfg, drafter_config: DrafterConfig, target) -> dict:
    """The params a fresh run starts from (a resumed run restores its checkpoint instead)."""
    if cfg.init_from:
        logging.info("warm start from the drafter in %s", cfg.init_from)
        return warm_start_params(
            cfg.init_from, drafter_config, cfg.seed, grow_layers=cfg.init_grow_layers
        )
    params = init_drafter_params(drafter_config, jax.random.key(cfg.seed))
    if cfg.init_from_target:
        return params_from_target(params, drafter_config, target.config, target.params)
    if cfg.init_norm_from_target:
        dtype = params["norm"]["scale"].dtype
        scale = final_norm_scale(target.config, target.params)
        params = {**params, "norm": {"scale": _copy(scale, dtype)}}
    return params
