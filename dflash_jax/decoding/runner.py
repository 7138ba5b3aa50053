"""Running a decode as its two halves, `start` (prefill -> loop state) and `advance` (state,
step limit -> state), the way the CLIs, the benchmark and the calibration do: each compiled
once per shape and config (timed apart from the run), the loop streamed a few steps at a time,
or stopped after a number of steps.

Neither half holds a host callback, so JAX's persistent compilation cache keeps both across
processes (an `io_callback` inside the loop would keep it from storing the executable), and
the step limit is an input: a short calibration run and a whole decode share one executable.
Streaming costs one host round trip per chunk of steps, not per step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sharding
from dflash_jax.decoding import autoregressive, grammar, programs, speculative
from dflash_jax.decoding.plan import Plan, make_plan
from dflash_jax.decoding.settings import DecodeConfig, autoregressive_config
from dflash_jax.decoding.state import DecodeOutput, finish, max_steps

# Steps per advance call while streaming: text shows up every few steps, and the round trips
# (one per chunk) stay a small part of the decode.
STREAM_CHUNK_STEPS = 8


@dataclasses.dataclass
class TimedRun:
    output: DecodeOutput
    compile_s: float  # lowering + XLA compilation of both halves (0 when already compiled)
    run_s: float  # the whole decode, start included, synchronised
    start_s: float  # the start half alone: the target prefill (and the drafter's prompt pass)


_COMPILED: dict = {}
# Lowering one program at a time (`api.compile_decodes` compiles in threads): two threads
# tracing the same nested jit (a target layer) at once each got their own trace of it, and
# the program lowered it as two identical private functions, a different StableHLO (and
# persistent-cache key) from run to run. XLA's compiles, the slow part, still overlap.
_LOWERING = threading.Lock()
# program name ("advance_speculative", ...) -> the `programs.fingerprint` of the last one of
# that name compiled in this process (`infer.generate --json` prints them)
FINGERPRINTS: dict[str, str] = {}


def decode_params(drafter) -> dict:
    """The params a decode takes from a drafter: `LoadedDrafter.decode_params` (its corpus table
    beside its params), or the params of any object with `.params`."""
    return getattr(drafter, "decode_params", drafter.params)


def place_half(jitted, args: tuple, statics: dict, mesh):
    """(the function a run compiles for `jitted`, a `jit_decoder` function, args placed for it,
    the statics to call it with): on `mesh`, `programs.on_mesh`; without one, as it is.
    `infer.aot` builds the programs it lowers here too."""
    if mesh is None:
        return jitted, args, statics
    return programs.on_mesh(jitted, mesh, args, statics)


def compile_half(jitted, args: tuple, statics: dict, mesh, options: dict | None = None):
    """(executable, args placed for it, compile seconds); compiled once per function, shapes
    and statics in this process (and, through JAX's persistent cache, across processes), with
    `options` (a plan's; None: `programs.executable_options`); its `programs.fingerprint`
    kept in FINGERPRINTS."""
    t0 = time.perf_counter()
    if options is None:
        options = programs.executable_options(statics["target_config"])
    key, lowered, args = _lower_half(jitted, args, statics, mesh, options)
    if lowered is None:
        return _COMPILED[key], args, 0.0
    _finish_half(key, lowered, options)
    return _COMPILED[key], args, time.perf_counter() - t0


def _lower_half(jitted, args: tuple, statics: dict, mesh, options: dict):
    """(key, lowered program or None when already compiled, args placed for it)."""
    fn, args, run_statics = place_half(jitted, args, statics, mesh)
    shapes = tuple(
        (tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in jax.tree.leaves(args)
    )
    key = (fn, shapes, tuple(sorted(run_statics.items())))
    if key in _COMPILED:
        return key, None, args
    # One device: lowered from the arguments' types alone, so that the program does not
    # depend on which loader committed its arrays to the device (infer.aot lowers the same).
    avals = args if mesh is not None else jax.tree.map(programs.unplaced, args)
    with _LOWERING:
        lowered = fn.lower(*avals, **run_statics)
    FINGERPRINTS[programs.program_name(jitted)] = programs.fingerprint(lowered, options)
    return key, lowered, args


def _finish_half(key, lowered, options: dict) -> None:
    _COMPILED[key] = lowered.compile(compiler_options=options)


def precompile(decodes, pool: concurrent.futures.Executor) -> list[list[concurrent.futures.Future]]:
    """Starts compiling both halves of each decode in `decodes` ((target, drafter or None,
    prompt, lengths, cfg), as `timed_decode` takes them) for `timed_decode` to find: lowered
    one after the other here, each handed to `pool` to compile as soon as it is lowered, so a
    long compile (or persistent-cache load: the adaptive loop's is ~5 s on XLA:CPU) overlaps
    the lowering and compiling of the rest. The advance half is lowered against the start
    half's lowered output types, so it need not wait for the start's compile. On a mesh: one
    half after the other, as timed_decode would. -> per decode, the futures to wait for before
    running it (none when it was compiled already)."""
    pending = []
    for target, drafter, prompt, lengths, cfg in decodes:
        start, advance, head, inputs, plan = plan_halves(
            target, drafter, prompt, lengths, 0, cfg, None, -1, None
        )
        statics, options = plan.statics, plan.compiler_options
        if plan.mesh is not None:
            args = (start, advance, head, inputs, statics, plan.mesh, options)
            pending.append([pool.submit(_compile_both, *args)])
            continue
        futures = []
        key, lowered, _ = _lower_half(start, head, statics, None, options)
        if lowered is None:
            state_info = _COMPILED[key].out_info
        else:
            state_info = lowered.out_info
            futures.append(pool.submit(_finish_half, key, lowered, options))
        adv_head = (*head, *inputs, np.int32(0), state_info)
        key, lowered, _ = _lower_half(advance, adv_head, statics, None, options)
        if lowered is not None:
            futures.append(pool.submit(_finish_half, key, lowered, options))
        pending.append(futures)
    return pending


def _compile_both(start, advance, head, inputs, statics, mesh, options) -> None:
    start_x, _, _ = compile_half(start, head, statics, mesh, options)
    adv_args = (*head, *inputs, np.int32(0), start_x.out_info)
    compile_half(advance, adv_args, statics, mesh, options)


@functools.cache
def _readers(mesh):
    """Jitted views of a loop state that every process can read (replicated on a mesh):
    (peek: state -> (gen, n_gen, step, all done), finish: (state, cfg) -> DecodeOutput)."""
    out = {} if mesh is None else {"out_shardings": sharding.replicated(mesh)}
    peek = jax.jit(lambda s: (s.gen, s.n_gen, s.step, jnp.all(s.done)), **out)
    finished = jax.jit(finish, static_argnames=("cfg",), **out)
    return peek, finished


def timed_run(
    start,
    advance,
    lead: tuple,
    prompt,
    lengths,
    rng,
    inputs: tuple,
    statics: dict,
    *,
    step_limit: int,
    mesh=None,
    on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
    chunk_steps: int = STREAM_CHUNK_STEPS,
    start_inputs: tuple = (),
    options: dict | None = None,
) -> TimedRun:
    """Runs `start` then `advance` (the halves in `decoding.autoregressive` or
    `decoding.speculative`) on (*lead params, prompt, lengths, rng[, *inputs, step_limit,
    state]) with `statics`, for at most `step_limit` loop steps. on_tokens(tokens [B,T],
    counts [B]): called with the prefill's tokens and then after every `chunk_steps` steps with
    what each row committed since (row b's new tokens are tokens[b, :counts[b]]); without it
    the loop runs in one call. start_inputs: `start`'s arguments after the rng (a token
    budget: `timed_decode`'s max_new); options: the executables' (`compile_half`)."""
    cfg: DecodeConfig = statics["decode_config"]
    head = (*lead, prompt, lengths, programs.typed_key(rng))
    start_x, start_args, start_compile = compile_half(
        start, (*head, *start_inputs), statics, mesh, options
    )
    state_info = start_x.out_info
    adv_head = (*head, *inputs, np.int32(0))
    advance_x, adv_args, adv_compile = compile_half(
        advance, (*adv_head, state_info), statics, mesh, options
    )
    adv_args = adv_args[:-2]  # the step limit and the state change from call to call
    peek, finished = _readers(mesh)

    t0 = time.perf_counter()
    state = jax.block_until_ready(start_x(*start_args))
    start_s = time.perf_counter() - t0
    sent = np.zeros(prompt.shape[0], np.int64)
    if on_tokens is not None:
        sent = _send(peek(state), sent, on_tokens)
    step_limit = min(step_limit, max_steps(cfg))
    steps = 0
    while steps < step_limit:
        upto = step_limit if on_tokens is None else min(steps + chunk_steps, step_limit)
        state = advance_x(*adv_args, np.int32(upto), state)
        view = peek(state)
        if on_tokens is not None:
            sent = _send(view, sent, on_tokens)
        steps = step_limit if bool(view[3]) else int(view[2])
    output = jax.block_until_ready(finished(state, cfg))
    return TimedRun(output, start_compile + adv_compile, time.perf_counter() - t0, start_s)


def _send(view, sent: np.ndarray, on_tokens) -> np.ndarray:
    """Sends each row's tokens committed since `sent` to on_tokens; -> the new counts."""
    gen_bw, n_gen_b = np.asarray(view[0]), np.asarray(view[1]).astype(np.int64)
    counts_b = n_gen_b - sent
    width = int(counts_b.max(initial=0))
    if width > 0:
        cols_bt = np.minimum(sent[:, None] + np.arange(width)[None, :], gen_bw.shape[1] - 1)
        on_tokens(np.take_along_axis(gen_bw, cols_bt, 1).astype(np.int32), counts_b)
    return n_gen_b


def check_inputs(target, drafter, prompt, lengths, cfg: DecodeConfig) -> None:
    """The checks `speculative_decode`/`autoregressive_decode` make, without running them:
    raises ConfigError/ValueError naming the problem."""
    if drafter is not None:
        programs.check_decode_inputs(target.config, drafter.config, cfg)
    programs.check_prompt(np.asarray(prompt), np.asarray(lengths), target.config, cfg)


def timed_decode(
    target,
    drafter,
    prompt,
    lengths,
    seed: int,
    cfg: DecodeConfig,
    *,
    step_costs=None,
    forced_kind: int = -1,
    mesh=None,
    step_limit: int | None = None,
    on_tokens=None,
    chunk_steps: int = STREAM_CHUNK_STEPS,
    max_new: int | None = None,
    plan: Plan | None = None,
    constraint=None,
) -> TimedRun:
    """Runs the speculative decode (or the autoregressive one when drafter is None) as the
    jitted halves `decoding.runner` times, compilation apart from execution; executables are
    cached per shape/config (in the process, and on disk through JAX's persistent cache when
    enabled). Adaptive mode: `step_costs` as in `speculative_decode`; `forced_kind` >= 0 runs
    that step kind at every step (calibration). step_limit: at most this many loop steps (None:
    all). on_tokens(tokens [B,T], counts [B]): streams the committed tokens a few steps at a
    time (`chunk_steps` of them, `timed_run`). `mesh`: where to run; by default the target's
    (loaded with one), else the one set by `jax.set_mesh`, else one device. max_new: each
    row's token budget, 1 to `cfg.max_new_tokens` (which sizes the buffers), as an input of
    the start half: every budget up to the buffer's runs one compiled pair of halves (the
    output's buffers keep `cfg`'s length); None: `cfg.max_new_tokens`, as a constant.
    plan: this decode's (`plan_run`), when the caller resolved it already (then `mesh` is
    the plan's). constraint: structured output (`grammar.constraint`), an input of the start
    half: a new grammar in the same buckets runs the programs already compiled."""
    start, advance, head, inputs, plan = plan_halves(
        target, drafter, prompt, lengths, seed, cfg, step_costs, forced_kind, mesh, plan
    )
    start_inputs = ()
    if max_new is not None:
        if not 1 <= max_new <= cfg.max_new_tokens:
            raise ValueError(f"max_new={max_new}: between 1 and {cfg.max_new_tokens}")
        start_inputs = (np.int32(max_new),)
    if constraint is not None:
        if cfg.tree_nodes and drafter is not None:
            raise ValueError(grammar.TREE_REFUSED)
        start_inputs = (start_inputs[0] if start_inputs else None, constraint)
    limit = max_steps(cfg) if step_limit is None else step_limit
    return timed_run(
        start,
        advance,
        head[:-3],
        *head[-3:],
        inputs,
        plan.statics,
        step_limit=limit,
        mesh=plan.mesh,
        on_tokens=on_tokens,
        chunk_steps=chunk_steps,
        start_inputs=start_inputs,
        options=plan.compiler_options,
    )


def plan_run(target, drafter, cfg: DecodeConfig, mesh=None) -> Plan:
    """The checked, resolved plan (`decoding.plan`) of decoding `cfg` with `target` and
    `drafter` (None: the target alone) on `mesh`: by default the target's (loaded with one),
    else the one set by `jax.set_mesh`, else one device."""
    if mesh is None:
        mesh = getattr(target, "mesh", None)
    if mesh is None:
        mesh = sharding.current_mesh()
    dcfg = None if drafter is None else drafter.config
    return make_plan(target.config, dcfg, cfg, mesh)


def _planned(drafter, cfg: DecodeConfig) -> dict:
    """What a plan for decoding `cfg` with `drafter` (None: the target alone) holds of them."""
    if drafter is None:
        return dict(drafter_config=None, decode_config=autoregressive_config(cfg))
    return dict(drafter_config=drafter.config, decode_config=cfg)


def decode_halves(target, drafter, prompt, lengths, seed, cfg, step_costs, forced_kind, mesh):
    """(start, advance, head arguments (*params, prompt, lengths, rng), advance's inputs,
    statics, mesh) of the decode `timed_decode` runs; the inputs checked first."""
    start, advance, head, inputs, plan = plan_halves(
        target, drafter, prompt, lengths, seed, cfg, step_costs, forced_kind, mesh
    )
    return start, advance, head, inputs, plan.statics, plan.mesh


def plan_halves(
    target, drafter, prompt, lengths, seed, cfg, step_costs, forced_kind, mesh, plan=None
):
    """(start, advance, head arguments (*params, prompt, lengths, rng), advance's inputs,
    plan) of the decode `timed_decode` runs: the inputs checked, the plan resolved
    (`plan_run`) unless given."""
    rng = jax.random.key(seed)
    prompt, lengths = np.asarray(prompt, np.int32), np.asarray(lengths, np.int32)
    if plan is None:
        plan = plan_run(target, drafter, cfg, mesh)
    elif plan != dataclasses.replace(plan, **_planned(drafter, cfg)):
        raise ValueError(
            "plan= was made for another decode (its drafter or DecodeConfig differ): make it "
            "with runner.plan_run(target, drafter, cfg) for this one"
        )
    programs.check_prompt(prompt, lengths, target.config, cfg)
    if drafter is None:
        ar = autoregressive
        halves, lead, inputs = (ar.start_autoregressive, ar.advance_autoregressive), (), ()
    else:
        sp = speculative
        halves, lead = (sp.start_speculative, sp.advance_speculative), (decode_params(drafter),)
        inputs = (sp.step_cost_array(cfg, step_costs), np.int32(forced_kind))
    head = (target.params, *lead, prompt, lengths, rng)
    return (*halves, head, inputs, plan)
