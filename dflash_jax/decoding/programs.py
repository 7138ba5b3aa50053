"""The decodes as jitted programs: how they are compiled (`jit_decoder`), placed on a mesh
(`on_mesh`) and run (`run`), and the input checks every public decode makes first.

Each decode is jitted whole (prefill and the whole loop: `speculative_decode`) and as the same
two halves apart: start (prefill -> loop state) and advance (state, step limit -> state,
donated so the caches stay in place). The halves are what the CLIs, the benchmark and the
calibration run (`decoding.runner`): they stream by advancing a few steps at a time with no
host callback inside (which would keep JAX's persistent cache from storing them), and a step
limit is an input, so short calibration runs and whole decodes share one executable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dflash_jax import sharding
from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.state import DecodeOutput, carry_shardings, max_steps
from dflash_jax.models.drafter import check_fits
from dflash_jax.ops import invariance
from dflash_jax.ops import platform as ops_platform

# XLA:CPU's default copy insertion copies every loop-carried cache buffer that a step both
# reads and updates (twice per buffer and step: ~4 ms of a 15 ms SmolLM2 AR step at batch 1);
# region analysis proves the read comes first and updates in place. Other backends ignore it.
LOOP_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}

# XLA:CPU's YNNPACK fusions, which the executables of a run without a row rule do without
# (`executable_options`): loading a cached executable rebuilds each YNN fusion thunk by looking
# its instructions up one by one (~28 s of a 33 s load of the default adaptive loop, 2026-12-03,
# perf: xla::HloInstruction::unique_id), while fp32 decodes as fast without them. Programs under
# a row rule keep them: the rule's tile is tested on the kernels they select.
NO_YNN_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def enable_persistent_cache(root: str) -> str:
    """Points JAX's persistent compilation cache at a directory under `root` named for this
    jax, jaxlib, backend and device (on a CPU: its model and ISA flags), so that an entry is
    only ever loaded by the build and machine that wrote it (XLA:CPU loads code compiled for
    other ISA features only to recompile it). Every compile over a second is kept.
    -> the directory."""
    import hashlib
    import os
    import platform

    import jaxlib

    device = jax.devices()[0]
    machine = [device.platform, device.device_kind, platform.machine()]
    if device.platform == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        machine += sorted(set(lines))
    digest = hashlib.sha256("\n".join(machine).encode()).hexdigest()[:12]
    path = os.path.join(
        os.path.expanduser(root), f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{digest}"
    )
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


def executable_options(tcfg: TargetConfig) -> dict:
    """The compiler options of a decode executable for `tcfg` as it runs
    (`run_target_config`): `LOOP_COMPILER_OPTIONS`, and on a CPU (`ops.platform`: the platform
    compiled for), for a float32 target without a row rule, `NO_YNN_FUSIONS`, so that JAX's
    persistent cache loads it in seconds."""
    plain_fp32 = tcfg.invariant_rows is None and jnp.dtype(tcfg.dtype) == jnp.float32
    if plain_fp32 and ops_platform.is_cpu():
        return {**LOOP_COMPILER_OPTIONS, **NO_YNN_FUSIONS}
    return dict(LOOP_COMPILER_OPTIONS)


def fingerprint(lowered, options: dict) -> str:
    """A program's identity: sha256 (first 16 hex digits) of its lowered StableHLO (no debug
    locations) and the compiler options it is compiled with. `infer.lower` prints it for the
    programs it lowers, `infer.generate --json` for those it compiled: equal fingerprints, the
    same program."""
    import hashlib

    text = lowered.as_text() + repr(sorted(options.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unplaced(x) -> jax.ShapeDtypeStruct:
    """An array's (or ShapeDtypeStruct's) type without its placement: shape, dtype, weak type."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=jax.typeof(x).weak_type)


def program_name(jitted) -> str:
    """A `jit_decoder` function's name, e.g. "advance_speculative"."""
    return _DECODERS[jitted][0].__name__.lstrip("_")


# jitted decoder -> (its function, how many param trees lead its arguments, whether its last
# argument is a loop state, whether it returns one)
_DECODERS: dict = {}
_ON_MESH: dict = {}


def jit_decoder(
    fn, statics: tuple[str, ...], *, num_params: int, takes_state=False, gives_state=False
):
    """`fn` (param trees, prompt, lengths, rng, *inputs[, state]) jitted with the keyword
    arguments `statics` static and its `state` argument donated when it takes one, and
    registered for `on_mesh`. -> the jitted function."""
    jitted = jax.jit(
        fn,
        static_argnames=statics,
        donate_argnames=("state",) if takes_state else (),
        compiler_options=LOOP_COMPILER_OPTIONS,
    )
    _DECODERS[jitted] = (fn, num_params, takes_state, gives_state)
    return jitted


def on_mesh(jitted, mesh, args: tuple, statics: dict):
    """`jitted` (one of the `jit_decoder` functions) for a run on `mesh`. -> (its function
    jitted for `mesh` with in/out shardings from the logical table and the statics bound, args
    placed on those shardings, {} for the statics). In: params as `sharding.param_shardings`
    places them (heads, MLP and vocab over `tensor`, model dim over `fsdp`), prompt [B,P] and
    lengths [B] split over the batch axes, a loop state as `carry_shardings` places it, the rest
    replicated; params already there (`load_target(..., mesh=mesh)`) are not moved. Out: a loop
    state where it came from, an output replicated, so that every process can read the tokens."""
    fn, num_params, takes_state, gives_state = _DECODERS[jitted]
    params = args[:num_params]
    rest = args[num_params + 2 : len(args) - int(takes_state)]
    in_shardings = (
        *(sharding.param_shardings(p, mesh) for p in params),
        *sharding.batch_shardings(args[num_params : num_params + 2], mesh),
        *(jax.tree.map(lambda _: sharding.replicated(mesh), r) for r in rest),  # None: none
        *((carry_shardings(args[-1], mesh),) if takes_state else ()),
    )
    leaves, treedef = jax.tree.flatten(in_shardings)
    key = (fn, mesh, treedef, tuple(leaves), tuple(sorted(statics.items())))
    if key not in _ON_MESH:
        bound = functools.partial(sharding.traced_under(mesh, fn), **statics, mesh=mesh)
        if takes_state:
            out_shardings = in_shardings[-1]
        elif gives_state:
            out_shardings = carry_shardings(jax.eval_shape(bound, *args), mesh)
        else:
            out_shardings = sharding.replicated(mesh)
        # jit takes no keyword arguments beside in_shardings: the statics are bound here.
        _ON_MESH[key] = jax.jit(
            bound,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=(len(args) - 1,) if takes_state else (),
            compiler_options=LOOP_COMPILER_OPTIONS,
        )
    return _ON_MESH[key], sharding.put(args, in_shardings), {}


def run(jitted, args: tuple, statics: dict, mesh) -> DecodeOutput:
    """Calls `jitted` on `args`: on `mesh` when given, else on the one set by `jax.set_mesh`
    (through `on_mesh`), else as it is."""
    mesh = mesh if mesh is not None else sharding.current_mesh()
    if mesh is None:
        return jitted(*args, **statics)
    fn, args, statics = on_mesh(jitted, mesh, args, statics)
    return fn(*args, **statics)


def run_target_config(tcfg: TargetConfig, cfg: DecodeConfig) -> TargetConfig:
    """The target config a decode compiles with: under `cfg.batch_invariant` (None:
    `default_invariant`), every GEMM at one fixed row tile (`cfg.row_tile`, 0:
    `ops.invariance.ROW_TILE`) unless the config already names a rule; without, with none.
    Nothing is probed: the same on every platform, this process's or another's (infer.lower).
    A MoE or hybrid target (`TargetConfig.layered`) runs without (one log line when it was
    asked for): its experts' grouped products and its Gated DeltaNet chunks are not built to
    the rule, so the run reports itself not batch-invariant instead of claiming it."""
    invariant = cfg.batch_invariant
    if invariant is None:
        invariant = default_invariant(tcfg)
    if invariant and tcfg.layered:
        _log_layered_once(tcfg)
        invariant = False
    if not invariant:
        return dataclasses.replace(tcfg, invariant_rows=None)
    if tcfg.invariant_rows is not None:
        return tcfg
    tile = cfg.row_tile or invariance.ROW_TILE
    return dataclasses.replace(tcfg, invariant_rows=(tile, tile))


_OFF_LOGGED: set[str] = set()  # the platforms and target archs whose invariance-off line was logged


def _log_layered_once(tcfg: TargetConfig) -> None:
    if tcfg.arch in _OFF_LOGGED:
        return
    _OFF_LOGGED.add(tcfg.arch)
    logging.warning(
        "batch invariance is not built for %s's MoE and linear-attention layers: its passes run "
        "as XLA picks them (reported batch_invariant: false), so %s greedy DFlash output may "
        "differ from AR; float32 keeps the differences at ~1e-6",
        tcfg.arch,
        tcfg.dtype,
    )


def default_invariant(tcfg: TargetConfig) -> bool:
    """Whether a decode is batch-invariant when the user does not say: in every dtype but
    float32, on a CPU (the platform compiled for, `ops.platform`), where the tests prove the
    row rule (tests/test_batch_invariance.py); on a GPU or TPU off, with one log line, since
    nothing has checked it on one yet (`--batch_invariant` turns it on).

    Why not in float32: the invariant AR step pads its one row to the row tile, and in fp32 a
    GEMM's cost grows with its rows (SmolLM2's products, an Intel Xeon with AMX, 2026-12-04: a
    pass at 2 rows 35 ms, at 32 rows 79 ms), which the adaptive decode's AR steps would pay;
    fp32's rounding differences (~1e-6) have not flipped a token on any benchmark prompt.
    bf16's do."""
    if jnp.dtype(tcfg.dtype) == jnp.float32:
        return False
    compiled_for = ops_platform.current()
    if compiled_for == "cpu":
        return True
    if compiled_for not in _OFF_LOGGED:
        _OFF_LOGGED.add(compiled_for)
        logging.warning(
            "batch invariance off by default on %s (no test has checked the row rule there): "
            "%s greedy DFlash output may differ from AR; --batch_invariant turns it on",
            compiled_for,
            tcfg.dtype,
        )
    return False


def step_limit_array(cfg: DecodeConfig, step_limit: int | None) -> jax.Array:
    """A decode's `step_limit` argument (None: `max_steps`) as the int32 its loop takes;
    refuses a negative one."""
    if step_limit is None:
        return jnp.int32(max_steps(cfg))
    if step_limit < 0:
        raise ValueError(f"step_limit={step_limit} must be >= 0")
    return jnp.int32(min(step_limit, max_steps(cfg)))


def check_prompt(prompt, prompt_lengths, tcfg: TargetConfig, cfg: DecodeConfig) -> None:
    """Refuses a prompt [B,P] and lengths [B] the decode cannot take (a bad shape, an empty row,
    a length past the buffer, more tokens than the target's context), naming the problem. The
    context holds each row's real length plus max_new_tokens: the buffer's padding (P is a
    power-of-two bucket, `api.bucket_length`) takes no position. Traced lengths (the decode
    jitted whole) are not known here: then the buffer width stands in for them."""
    if prompt.ndim != 2:
        raise ValueError(f"prompt must be int32 [batch, length], got shape {prompt.shape}")
    if prompt_lengths.shape != prompt.shape[:1]:
        raise ValueError(
            f"prompt_lengths must have shape [{prompt.shape[0]}], got {prompt_lengths.shape}"
        )
    if prompt.shape[1] == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    context = tcfg.max_position_embeddings
    if isinstance(prompt_lengths, jax.core.Tracer):
        longest, what = prompt.shape[1], "prompt buffer width"
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.min() < 1:
            raise ValueError("prompt is empty: every row needs at least one token")
        if lengths.max() > prompt.shape[1]:
            raise ValueError(
                f"prompt_lengths {lengths.max()} exceeds the prompt buffer width {prompt.shape[1]}"
            )
        longest = int(lengths.max())
        row = f" (row {int(lengths.argmax())})" if len(lengths) > 1 else ""
        what = f"prompt length{row}"
    if longest + cfg.max_new_tokens > context:
        raise ValueError(
            f"{what} {longest} + max_new_tokens {cfg.max_new_tokens} = "
            f"{longest + cfg.max_new_tokens} exceeds the target's context of {context} tokens; "
            f"shorten the prompt or ask for at most {max(context - longest, 0)} new tokens"
        )


def check_decode_inputs(tcfg: TargetConfig, dcfg: DrafterConfig, cfg: DecodeConfig) -> None:
    """Refuses a drafter that does not fit the target, a block size it was not trained for, a
    decode mode the target cannot run (`check_tree_target`) or one the drafter's kind does not
    implement (trees for DSpark and DFlash2, row_settings for both)."""
    check_fits(dcfg, tcfg)
    check_tree_target(tcfg, cfg)
    if dcfg.is_dspark and cfg.tree_nodes:
        raise ConfigError(
            f"tree_nodes={cfg.tree_nodes} (--tree_nodes): tree verification is not implemented "
            "for a DSpark drafter (its Markov head walks one chain of drafts); use tree_nodes=0"
        )
    if dcfg.is_dflash2 and cfg.tree_nodes:
        raise ConfigError(
            f"tree_nodes={cfg.tree_nodes} (--tree_nodes): tree verification is not implemented "
            "for a DFlash2 drafter: a tree is grown from each depth's unary logits, while a "
            "DFlash2 drafter's drafts come from its candidate selector's walk (each slot scored "
            "after the token before it), which a tree does not run; use tree_nodes=0 (chains, "
            "adaptive included) or a DFlash drafter for trees"
        )
    if cfg.confidence_cut and not (dcfg.is_dspark and dcfg.enable_confidence_head):
        raise ConfigError(
            f"confidence_cut={cfg.confidence_cut} (--confidence_cut) needs a DSpark drafter "
            "with a confidence head (its predicted acceptance of each draft); this drafter "
            "has none: use confidence_cut=0"
        )
    if cfg.row_settings and dcfg.is_dspark:
        raise ConfigError(
            "row_settings (per-row sampling settings, a server's slots) are not implemented "
            "for a DSpark drafter's Markov walk; use a DFlash drafter"
        )
    if cfg.row_settings and dcfg.is_dflash2:
        raise ConfigError(
            "row_settings (per-row sampling settings, a server's slots) are not implemented "
            "for a DFlash2 drafter's candidate selector; use a DFlash drafter"
        )
    if cfg.block_size > dcfg.num_drafts + 1:  # DSpark with sample_from_anchor: one more
        raise ConfigError(
            f"block_size={cfg.block_size} exceeds the drafter's trained block size "
            f"{dcfg.block_size}" + (" + 1 (its anchor slot drafts)" * dcfg.sample_from_anchor)
        )


def check_tree_target(tcfg: TargetConfig, cfg: DecodeConfig) -> None:
    """Refuses tree verification (`DecodeConfig.tree_nodes`, --tree_nodes) over a target with
    linear-attention layers: their recurrent state advances along one sequence of tokens, and a
    token tree's branches would each need their own (the layers refuse a tree mask when traced;
    this names the setting before anything is compiled)."""
    if cfg.tree_nodes and tcfg.sliding:
        raise ConfigError(
            f"tree_nodes={cfg.tree_nodes} (--tree_nodes): tree verification is not implemented "
            f"for a {tcfg.arch} target (its sliding-window / sink attention is built for a "
            "chain of tokens); use tree_nodes=0"
        )
    if cfg.tree_nodes and tcfg.linear_layers:
        raise ConfigError(
            f"tree_nodes={cfg.tree_nodes} (--tree_nodes): tree verification is not supported "
            f"for a {tcfg.arch} target, whose layers {list(tcfg.linear_layers)} are linear "
            "attention (a recurrent state follows one chain of tokens, not a tree); use "
            "tree_nodes=0 to verify a chain of block_size tokens"
        )


def typed_key(rng) -> jax.Array:
    """`rng` as a typed PRNG key: a typed key (`jax.random.key`) as it is, a classic one
    (`jax.random.PRNGKey`: uint32 [..., 2] for the default threefry) wrapped with
    `jax.random.wrap_key_data`, so both styles of the same seed give the same draws, per-row
    keys ([B] typed or [B, 2] classic) included."""
    if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    data = jnp.asarray(rng)
    width = jax.random.key_data(jax.random.key(0)).shape[-1]
    if data.dtype != jnp.uint32 or data.ndim < 1 or data.shape[-1] != width:
        raise ConfigError(
            f"rng: expected a PRNG key, jax.random.key(seed) or jax.random.PRNGKey(seed) "
            f"(uint32 [..., {width}]); got {data.dtype} {list(data.shape)}: make one with "
            "jax.random.key(seed)"
        )
    return jax.random.wrap_key_data(data)
