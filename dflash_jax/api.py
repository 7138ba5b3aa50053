"""Convenience layer over the jitted decoders: prompt encoding, bucketing, timed runs and
`generate` for lists of strings. Entry points and notebooks use this; nothing here is needed to
call `speculative_decode` directly."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ConfigError
from dflash_jax.decoding import calibration, grammar
from dflash_jax.decoding.autoregressive import autoregressive_config
from dflash_jax.decoding.runner import TimedRun as TimedRun
from dflash_jax.decoding.runner import check_inputs as check_inputs
from dflash_jax.decoding.runner import plan_run, precompile
from dflash_jax.decoding.runner import timed_decode as timed_decode
from dflash_jax.decoding.settings import GROUP_OF, DecodeConfig, group_of
from dflash_jax.files import cache_root, read_json_table, write_json_atomic
from dflash_jax.io import grammar as grammar_io
from dflash_jax.io.tokenizer import render_prompt as render_prompt

MIN_BUCKET = 32


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """Prompt buffers are padded to powers of two so a few compiled shapes serve all prompts.
    Only a buffer width: the target's context limits each row's real length plus its new
    tokens (`programs.check_prompt`), never the bucket."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


# The smallest token buffer `generate` compiles: budgets up to it share one program.
MIN_BUDGET_BUCKET = 32


def budget_bucket(max_new_tokens: int, room: int | None = None) -> int:
    """The token buffer `generate` compiles for a budget: the next power of two, at least
    MIN_BUDGET_BUCKET, so budgets within a bucket share one program (the budget itself is an
    input); at most `room` (the context left after the longest prompt), then the budget."""
    bucket = bucket_length(max_new_tokens, MIN_BUDGET_BUCKET)
    return bucket if room is None or bucket <= room else max_new_tokens


def pad_prompts(token_lists: list[list[int]], bucket: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into int32 [B, P] (P a power-of-two bucket) plus lengths [B]."""
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(t) for t in token_lists)
    width = bucket_length(longest) if bucket else longest
    prompt = np.zeros((len(token_lists), width), np.int32)
    for i, toks in enumerate(token_lists):
        prompt[i, : len(toks)] = toks
    return prompt, np.array([len(t) for t in token_lists], np.int32)


# How `generate` and `infer.generate` decode when the user does not say. On a CPU, which pays
# for every verified token, the adaptive decode with the lookup kinds is faster than the target
# alone where fixed blocks are slower (docs/results.md#speed-on-prompt-sets): adaptive, with the
# trained block as the largest kind. On GPU/TPU, where a block costs about one AR step: the
# trained block, fixed.
CPU_DEFAULT_BLOCK_SIZE = 16


def default_block_size(target, drafter, platform: str | None = None) -> int:
    """The block size to decode with when the user gives none (see CPU_DEFAULT_BLOCK_SIZE) on
    `platform` (None: this process's backend); on a CPU at most the row tile of a target
    config that names a rule (`choose_decode`'s choice): a wider block runs as several tiles."""
    trained = drafter.config.block_size
    if (platform or jax.default_backend()) == "cpu":
        rule = getattr(getattr(target, "config", None), "invariant_rows", None)
        return min(trained, CPU_DEFAULT_BLOCK_SIZE, *(rule[1:] if rule else ()))
    return trained


# The prompt-lookup step kinds an adaptive decode adds when the user does not say (those <= its
# block size): copies cost a verify and nothing else, and where text repeats they are accepted
# whole (docs/decoding.md#prompt-lookup).
DEFAULT_LOOKUP_KINDS = (8, 16)


def default_lookup_kinds(block_size: int) -> tuple[int, ...]:
    """The `DEFAULT_LOOKUP_KINDS` an adaptive decode at `block_size` can run; a block of 4 to 7
    (a small row tile's, `default_block_size`) copies blocks of its own size."""
    kinds = tuple(b for b in DEFAULT_LOOKUP_KINDS if b <= block_size)
    return kinds or ((block_size,) if block_size >= 4 else ())


def default_adaptive(target, drafter, platform: str | None = None) -> bool:
    """Whether to decode with the adaptive draft length when the user does not say: on CPU
    (`platform`; None: this process's backend)."""
    return drafter is not None and (platform or jax.default_backend()) == "cpu"


def default_step_kinds(block_size: int, plain: bool = True) -> tuple[int, ...]:
    """The drafter's step kinds of an adaptive decode whose user names none: a plain step (1;
    unless `plain` is False and two drafting kinds remain), the blocks of 4 and 8 below the
    block size, and the block size."""
    drafts = tuple(b for b in (4, 8) if b < block_size) + (block_size,)
    return ((1,) if plain or len(drafts) < 2 else ()) + drafts


# The widest row tile under which an adaptive decode's default kinds keep the plain step.
PLAIN_STEP_MAX_TILE = 8


def plain_steps_pay(
    target, batch_invariant: bool | None, platform: str | None = None, row_tile: int = 0
) -> bool:
    """Whether an adaptive decode's default kinds include a plain step: on a CPU (`platform`;
    None: this process's backend) not under a row rule (`batch_invariant`; None: by dtype,
    `programs.default_invariant`) of a tile wider than `PLAIN_STEP_MAX_TILE` (the target
    config's rule, else `row_tile`, else `ROW_TILE`). Under a wide tile a one-row target pass
    costs what a pass of the tile's rows does (its products pad the row to the tile, its
    attention and norms run whole tiles), so a block of 4 costs no more than a plain step and
    drafts besides, and the controller never picks the plain step (bf16 at a tile of 32, in AR
    steps: block 4 0.80 against a plain step's 1.00 on an AMD EPYC with avx512_bf16); leaving
    it out takes one of the loop's target passes out of the compiled program (docs/results.md).
    Under a small tile the plain step is the cheap one (tile 4, same CPU: block 4 1.29 against
    1.00), the step to fall back on where drafts fail."""
    from dflash_jax.decoding import programs
    from dflash_jax.ops.invariance import ROW_TILE

    if (platform or jax.default_backend()) != "cpu":
        return True
    invariant = batch_invariant
    if invariant is None:
        invariant = programs.default_invariant(target.config)
    rule = getattr(target.config, "invariant_rows", None)
    tile = rule[1] if rule else (row_tile or ROW_TILE)
    return not invariant or tile <= PLAIN_STEP_MAX_TILE


def decode_mode(
    target,
    drafter,
    block_size: int | None = None,
    adaptive: bool | None = None,
    platform: str | None = None,
) -> tuple[int, bool]:
    """(block size, adaptive) for a decode on `platform` (None: this process's backend), each
    None replaced by its measured default (`default_block_size`, `default_adaptive`): what
    `generate` and `infer.generate` run. Without a drafter: block 1, never adaptive; a block
    of 1 is never adaptive either."""
    if block_size is None:
        block_size = default_block_size(target, drafter, platform) if drafter is not None else 1
    if adaptive is None:
        adaptive = default_adaptive(target, drafter, platform)
    return block_size, bool(adaptive and drafter is not None and block_size > 1)


def baseline_config(cfg: DecodeConfig) -> DecodeConfig:
    """The target-only config matching `cfg`: same sampling, stops and lengths, no drafting
    (block 1, not adaptive). What the benchmark and --compare_ar time DFlash against; the
    autoregressive decode's own reset (`autoregressive_config`), so the two cannot drift."""
    return autoregressive_config(cfg)


def stop_token_ids(target) -> tuple[int, ...]:
    """The target's end-of-sequence ids (config, generation config and tokenizer; a target
    without a `tokenizer` attribute, as `infer.aot` plans one: the config's)."""
    ids = list(target.config.eos_token_ids)
    tokenizer = getattr(target, "tokenizer", None)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer else None
    if eos is not None:
        ids.append(int(eos))
    return tuple(dict.fromkeys(ids))


def load_pair(
    target_source: str,
    drafter_source: str,
    dtype: str = "float32",
    target_cache: bool = True,
    mesh=None,
    quantize: str | None = None,
):
    """(target, drafter or None for drafter_source == "none"), as the CLIs accept them;
    `target_cache` and `quantize` as in `load_target(cache=..., quantize=...)` (the drafter
    stays in `dtype`). With a `mesh`, both are placed on it shard by shard, and
    `timed_decode` runs on it."""
    from dflash_jax.io import load_target
    from dflash_jax.io.drafter_io import load_drafter

    target = load_target(
        target_source, dtype=dtype, cache=target_cache, mesh=mesh, quantize=quantize
    )
    drafter = None if drafter_source == "none" else load_drafter(drafter_source, target, mesh=mesh)
    return target, drafter


def recast_pair(target, drafter_source: str, dtype: str, target_cache: bool = True, mesh=None):
    """(target, drafter or None) as `load_pair(target.source, drafter_source, dtype, ...)` would
    load them, from a float32 `target` already loaded: its params cast (the same bits,
    `io.target_loader.recast`, which also fills the target cache for `dtype`), the drafter
    loaded for it. What `--dtype=auto` does when the dtype it chose is not the one it loaded
    first (a first run on a machine): the source is not read and converted twice."""
    from dflash_jax.io.drafter_io import load_drafter
    from dflash_jax.io.target_loader import recast

    target = recast(target, dtype, target_cache)
    drafter = None if drafter_source == "none" else load_drafter(drafter_source, target, mesh=mesh)
    return target, drafter


class TokenStream:
    """Collects the tokens a streamed decode sends (`timed_decode(..., on_tokens=stream)`), per
    row; with a tokenizer and `on_text(row, text)`, also reports each row's newly decoded text as
    it grows (decoding the whole row each time, so multi-token characters come out whole).

        stream = TokenStream(tok, lambda row, text: print(text, end=""))
        run = dj.api.timed_decode(target, drafter, prompt, lengths, 0, cfg, on_tokens=stream)
    """

    def __init__(self, tokenizer=None, on_text=None):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.rows: dict[int, list[int]] = {}
        self._text: dict[int, str] = {}

    def __call__(self, tokens_bt: np.ndarray, counts_b: np.ndarray) -> None:
        for row, (tokens, count) in enumerate(zip(tokens_bt, counts_b, strict=True)):
            if count <= 0:
                continue
            self.rows.setdefault(row, []).extend(int(t) for t in tokens[:count])
            if self.on_text is not None and self.tokenizer is not None:
                text = self.tokenizer.decode(self.rows[row], skip_special_tokens=True)
                old = self._text.get(row, "")
                # A partial multi-byte character decodes to U+FFFD: wait for the rest.
                if text.startswith(old) and not text.endswith("\ufffd") and text != old:
                    self.on_text(row, text[len(old) :])
                    self._text[row] = text


# The row tiles `choose_decode` judges a batch-invariant decode at (those up to the drafter's
# trained block): a small tile pads a one-row step less and cuts a wide verify into more tiles,
# so which one is fastest depends on the machine's GEMMs (bf16 SmolLM2, an AMD EPYC with
# avx512_bf16, 2026-12-06, GEMM floors in ms, one row / a step of the tile's rows: tile 4
# 21.8 / 26.7, 8 29.6 / 31.9, 16 30.3 / 37.0, 32 47.9 / 52.4; plain bf16 19.3 per row).
CANDIDATE_TILES = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    """What `choose_decode` picked: the dtype, the row tile of a batch-invariant decode (0: no
    row rule), whether to draft at all (False: the target alone is predicted fastest), and
    every candidate's predicted tokens/s ({"bfloat16 tile 4": ..., "float32 plain": ...,
    "AR bfloat16": ...}), from which `why` says it in one line."""

    dtype: str
    row_tile: int
    drafter: bool
    speeds: dict

    @property
    def name(self) -> str:
        return candidate_name(self.dtype, self.row_tile, self.drafter)

    def why(self) -> str:
        fastest_ar = max((k for k in self.speeds if k.startswith("AR ")), key=self.speeds.get)
        rest = [f"{k} {v:.1f}" for k, v in sorted(self.speeds.items(), key=lambda kv: -kv[1])
                if k not in (self.name, fastest_ar)]  # fmt: skip
        if self.drafter:
            head = (f"{self.name}: {self.speeds[self.name]:.1f} tok/s predicted against the "
                    f"fastest AR ({fastest_ar}) {self.speeds[fastest_ar]:.1f}")  # fmt: skip
        else:
            head = (f"the target alone ({fastest_ar}, {self.speeds[fastest_ar]:.1f} tok/s "
                    "predicted): no DFlash setting is predicted faster")  # fmt: skip
        return head + (f"; {', '.join(rest)}" if rest else "")


def candidate_name(dtype: str, row_tile: int, drafter: bool = True) -> str:
    """A decode setting in words: "bfloat16 tile 4", "float32 plain", "AR bfloat16"."""
    if not drafter:
        return f"AR {dtype}"
    return f"{dtype} tile {row_tile}" if row_tile else f"{dtype} plain"


def candidate_settings(
    batch_invariant: bool | None, row_tile: int, block_size: int
) -> list[tuple[str, int]]:
    """The (dtype, row tile; 0 = no rule) DFlash settings `choose_decode` compares: each dtype
    with the row rule where `batch_invariant` (None: in bf16 on a CPU, not in fp32 nor on a GPU
    or TPU, as `programs.default_invariant`) asks for it, at `row_tile` or else each of
    `CANDIDATE_TILES` up to `block_size` (the drafter's), else without."""
    out = []
    on_cpu = jax.default_backend() == "cpu"  # a GPU or TPU runs without the rule by default
    for dtype in ("float32", "bfloat16"):
        invariant = (on_cpu and dtype != "float32") if batch_invariant is None else batch_invariant
        if not invariant:
            out.append((dtype, 0))
            continue
        tiles = [row_tile] if row_tile else [t for t in CANDIDATE_TILES if t <= block_size]
        out += [(dtype, t) for t in tiles or [min(CANDIDATE_TILES)]]
    return out


# The acceptance per position `choose_decode` predicts with: a drafted token's (the shipped
# SmolLM2 drafter's block of 4 reached tau 1.59-1.68 on dev and HumanEval, ~0.4 a position;
# z-lab's drafters of larger targets accept far more, so this errs low), and a token copied
# from the text (prompt lookup alone: tau 1.39-1.58 on the same sets, offline, ~0.28).
DRAFT_ACCEPTANCE, COPY_ACCEPTANCE = 0.4, 0.28
# Rounds over every setting `choose_decode` times its floors in (the fastest of each kept).
FLOOR_ROUNDS = 2


def predicted_speed(ar_s: float, step_s: float, rows: int, row_tile: int) -> float:
    """Tokens/s a decode is expected to reach from its GEMM floors: the best of its kinds, a
    plain step (one token per `ar_s`), a drafted block of `rows` (E[tau] at
    `DRAFT_ACCEPTANCE`, `expected_tau`, per `step_s`) and, under a row rule, a copied block of
    the tile's rows (at `COPY_ACCEPTANCE`), whose verify costs what the padded plain step does.
    What decides between settings, not a figure to report: the measured speed is
    `infer.benchmark`'s."""
    speeds = [1.0 / ar_s, expected_tau(DRAFT_ACCEPTANCE, rows) / step_s]
    if row_tile:
        speeds.append(expected_tau(COPY_ACCEPTANCE, rows) / ar_s)
    return max(speeds)


def expected_tau(alpha: float, rows: int) -> float:
    """E[tokens per step] of a block of `rows` when each draft is accepted with chance `alpha`
    given the earlier ones: 1 + alpha + ... + alpha^(rows-1) (`decoding.adaptive`'s model)."""
    return float(sum(alpha**j for j in range(rows)))


def choose_decode(
    target,
    drafter,
    batch_invariant: bool | None = None,
    remember: str = "",
    row_tile: int = 0,
) -> DecodeChoice:
    """How to decode a stream when the user does not say (--dtype=auto): the setting with the
    highest predicted tokens/s (`predicted_speed`) among DFlash in each dtype, with the row
    rule at each candidate tile where the dtype needs it (`candidate_settings`), and the
    target alone in each dtype without the rule (the fastest AR this code runs). When no DFlash
    setting is predicted faster than the fastest AR, the choice is that AR (`drafter` False):
    the default never decodes slower than the target alone on purpose. Each prediction comes
    from GEMM floors computed as the model computes them in its setting (`floors.gemm_floors`
    under `floors.run_config`): one row, padded to the tile under a rule, and a step of the
    tile's rows (4 without a rule), the drafter's layers and head included, each the fastest of
    `FLOOR_ROUNDS` rounds over every setting (a passing slowdown of the machine hits one round
    of every setting alike); acceptance at `DRAFT_ACCEPTANCE` and `COPY_ACCEPTANCE`. Measured
    once per machine (its CPU features included), shapes and setting, kept in
    <cache_root>/dtype_floors.json. `remember`
    (the request as the caller names it): the dtype is also kept under that name, for
    `remembered_dtype` to tell the next run which dtype to load first."""
    from dflash_jax.decoding import floors as floors_lib
    from dflash_jax.ops.invariance import machine_name, software_name

    if drafter is None:
        return DecodeChoice("float32", 0, False, {})
    block = min(drafter.config.block_size, CPU_DEFAULT_BLOCK_SIZE)
    settings = candidate_settings(batch_invariant, row_tile, block)
    path = cache_root() / "dtype_floors.json"
    key = "|".join(
        [f"choice{floors_lib.FLOORS_VERSION}r{FLOOR_ROUNDS}", machine_name(), software_name(),
         *(repr(getattr(target.config, f)) for f in
           ("num_layers", "hidden_size", "intermediate_size", "vocab_size", "quantize")),
         _drafter_shape(drafter), repr(settings)]
    )  # fmt: skip
    table = read_json_table(path)
    if key not in table:
        table[key] = _measure_floors(target, drafter, settings)
        write_json_atomic(path, table)  # a read-only cache: measured again next time
    measured = table[key]
    speeds = {f"AR {d}": 1.0 / measured[f"{d} plain"]["ar"] for d in ("float32", "bfloat16")}
    for dtype, tile in settings:
        f = measured[candidate_name(dtype, tile)]
        rows = tile or min(CANDIDATE_TILES)
        speeds[candidate_name(dtype, tile)] = predicted_speed(f["ar"], f["step"], rows, tile)
    best = max((candidate_name(*s) for s in settings), key=speeds.get)
    fastest_ar = max((k for k in speeds if k.startswith("AR ")), key=speeds.get)
    if speeds[best] > speeds[fastest_ar]:
        dtype, tile = next(s for s in settings if candidate_name(*s) == best)
        choice = DecodeChoice(dtype, tile, True, speeds)
    else:
        choice = DecodeChoice(fastest_ar.split()[1], 0, False, speeds)
    if remember and table.get(_remembered_key(remember)) != choice.dtype:
        table[_remembered_key(remember)] = choice.dtype
        write_json_atomic(path, table)
    return choice


def _drafter_shape(drafter) -> str:
    """What of a drafter its floors depend on, for the floor caches' keys: its layers, and its
    head's width when it drafts over a vocabulary of its own (a head ~6x narrower)."""
    words = drafter.config.draft_vocab_size
    return repr(drafter.config.num_layers) + (f"/draft_vocab{words}" if words else "")


def _measure_floors(target, drafter, settings) -> dict:
    """{setting name: {"ar": one row's GEMM floor, "step": a step's}} for each DFlash setting
    (`candidate_settings`) and the plain one of each dtype (the target alone's), each the
    fastest of `FLOOR_ROUNDS` rounds over all of them."""
    from dflash_jax.decoding import floors as floors_lib
    from dflash_jax.ops.quant import QWeight

    def cast(tree, dtype):  # quantized kernels as stored: the dot dequantizes them to dtype
        keep = lambda w: isinstance(w, QWeight) or not jnp.issubdtype(w.dtype, jnp.floating)
        return jax.tree.map(
            lambda w: w if keep(w) else w.astype(dtype), tree,
            is_leaf=lambda w: isinstance(w, QWeight),
        )  # fmt: skip

    weights = {
        dtype: (cast(target.params, dtype), cast(drafter.params, dtype))
        for dtype in ("float32", "bfloat16")
    }
    wanted = list(dict.fromkeys([*settings, ("float32", 0), ("bfloat16", 0)]))
    out = {}
    for _ in range(FLOOR_ROUNDS):
        for dtype, tile in wanted:
            tcfg = floors_lib.run_config(target.config, dtype, bool(tile), tile)
            tp, dp = weights[dtype]
            f = floors_lib.gemm_floors(tp, tcfg, dp, tile or min(CANDIDATE_TILES), repeats=5)
            name = candidate_name(dtype, tile)
            best = out.get(name, {"ar": float("inf"), "step": float("inf")})
            out[name] = {
                "ar": min(best["ar"], f["gemm_floor_ar_s"]),
                "step": min(best["step"], f["gemm_floor_step_s"]),
            }
    return out


def fastest_dtype(
    target,
    drafter,
    block_size: int,
    batch_invariant: bool | None = None,
    remember: str = "",
    slots: int = 0,
    row_tile: int = 0,
) -> tuple[str, dict[str, float]]:
    """The precision a server (`slots` > 1 busy rows a step, `infer.serve`) decodes in when the
    user does not say: the one whose plain step over its slots, attention included
    (`floors.served_step_floor`), is fastest in the setting it will run (`floors.run_config`:
    the dot policy, the row rule where `batch_invariant`, None: each dtype's default, makes it
    invariant, at `row_tile`): there the rows' attention weighs as much as the matrices. A
    stream is judged by `choose_decode` instead. Measured once per machine (its CPU features
    included), shapes and setting, kept in <cache_root>/dtype_floors.json; `remember` as in
    `choose_decode`. The target alone (drafter None): float32.
    -> (dtype, {setting, e.g. "bfloat16 batch-invariant": its served step in seconds})."""
    if drafter is None:
        return "float32", {}
    from dflash_jax.decoding import floors as floors_lib
    from dflash_jax.ops.invariance import machine_name, software_name
    from dflash_jax.ops.quant import QWeight

    settings = {
        dtype: floors_lib.run_config(target.config, dtype, batch_invariant, row_tile)
        for dtype in ("float32", "bfloat16")
    }
    path = cache_root() / "dtype_floors.json"
    key = "|".join(
        [f"floors{floors_lib.FLOORS_VERSION}", machine_name(), software_name(),
         repr(target.config.num_layers), repr(target.config.hidden_size),
         repr(target.config.intermediate_size), repr(target.config.vocab_size),
         _drafter_shape(drafter), f"served{slots}v{floors_lib.SERVED_VERSION}",
         *(f"{d}:{c.invariant_rows}" for d, c in settings.items()),
         *([f"quantize:{target.config.quantize}"] if target.config.quantize else [])]
    )  # fmt: skip
    table = read_json_table(path)
    if key not in table:
        floors = {}
        for dtype, tcfg in settings.items():
            cast = lambda tree, dt=dtype: jax.tree.map(
                lambda w: w if isinstance(w, QWeight) else w.astype(dt),
                tree,
                is_leaf=lambda w: isinstance(w, QWeight),
            )  # quantized kernels as stored: the dot dequantizes them to dt
            floors[floors_lib.setting_name(tcfg)] = floors_lib.served_step_floor(
                cast(target.params), tcfg, slots
            )
        table[key] = floors
        write_json_atomic(path, table)  # a read-only cache: measured again next time
    floors = table[key]
    choice = min(floors, key=floors.get).split()[0]
    if remember and table.get(_remembered_key(remember)) != choice:
        table[_remembered_key(remember)] = choice
        write_json_atomic(path, table)
    return choice, floors


def remembered_dtype(remember: str) -> str | None:
    """The dtype `fastest_dtype(..., remember=remember)` last chose on this machine and
    software, or None: a hint for which dtype to load first (`infer.common.load_models`), so
    that a second run with --dtype=auto loads its target once."""
    choice = read_json_table(cache_root() / "dtype_floors.json").get(_remembered_key(remember))
    return choice if choice in ("float32", "bfloat16") else None


def _remembered_key(remember: str) -> str:
    from dflash_jax.ops.invariance import machine_name, software_name

    return "|".join(["choice", machine_name(), software_name(), remember])


# The widest prompt buffer whose decodes `compile_decodes` warms up: each warm-up runs the
# prefill again, which for a long prompt costs far more than the ~0.25 s per step kind that the
# first timed decode then carries (a 5k-token prompt with --compare_ar: 305 s with its five
# warm-ups, 175 s without, a 2-core AMD EPYC, 2026-12-06; results/long_prompt_2026-12-06.json).
WARM_UP_MAX_PROMPT = 512


def compile_decodes(
    target, drafter, prompt, lengths, cfg: DecodeConfig, *, with_target_alone: bool = False
) -> float:
    """Compiles what `timed_decode` will run for `prompt` under `cfg` (the speculative decode,
    or the target alone when drafter is None; with_target_alone: that too), then runs each
    decode's prefill and one loop step of each of its step kinds (the kind forced: the same
    executable). XLA:CPU sets each YNNPACK fusion up at its first execution, ~0.25 s per
    target-pass kind of the bf16 adaptive loop of SmolLM2 (2026-12-04, an AMD EPYC with
    avx512_bf16), a one-time cost that the first timed decode would otherwise carry and later
    ones do not (a prompt buffer wider than `WARM_UP_MAX_PROMPT`: compiled only). Every half
    is lowered in turn and compiled in threads as soon as it is lowered
    (XLA compiles, and loads from the persistent cache, outside the GIL: `runner.precompile`);
    each warm-up runs, two at a time, as soon as its decode is compiled. -> seconds."""
    jobs = [drafter] + ([None] if with_target_alone and drafter is not None else [])
    t0 = time.perf_counter()
    with (
        concurrent.futures.ThreadPoolExecutor(2 * len(jobs)) as compiling,
        concurrent.futures.ThreadPoolExecutor(2) as warming,
    ):
        pending = precompile([(target, d, prompt, lengths, cfg) for d in jobs], compiling)
        warm_ups = []
        for d, futures in sorted(
            zip(jobs, pending, strict=True), key=lambda job: job[0] is not None
        ):
            adaptive = d is not None and cfg.adaptive
            kinds = [None, *range(len(cfg.all_kinds))] if adaptive else [-1]
            if np.shape(prompt)[1] > WARM_UP_MAX_PROMPT:  # compiled, not run: see its comment
                for future in futures:
                    future.result()
                continue
            for kind in kinds:
                args = (futures, target, d, prompt, lengths, cfg, kind)
                warm_ups.append(warming.submit(_warm, *args))
        for future in warm_ups:
            future.result()
    return time.perf_counter() - t0


def _warm(compiled, target, drafter, prompt, lengths, cfg: DecodeConfig, kind) -> None:
    """Once the futures `compiled` are done: the decode's prefill (kind None) or its prefill
    and one loop step (of the step kind `kind` forced, or -1: its own)."""
    for future in compiled:
        future.result()
    steps = dict(step_limit=0) if kind is None else dict(step_limit=1, forced_kind=kind)
    timed_decode(target, drafter, prompt, lengths, 0, cfg, **steps)


def check_text_prompts(prompts) -> list[str]:
    """`generate`'s prompts as a list: one string, or a non-empty list (or tuple) of non-empty
    strings; anything else is refused here, naming the bad item, before a tokenizer sees it."""
    if isinstance(prompts, str):
        prompts = [prompts]
    usage = "prompts must be a string or a non-empty list of non-empty strings"
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"{usage}, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError(f"{usage}, got an empty list")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(
                f"{usage}, got {type(p).__name__} {p!r:.40} at prompts[{i}] (token ids: "
                "pad_prompts, then timed_decode)"
            )
        if not p:
            raise ValueError(f"{usage}, got an empty string at prompts[{i}]")
    return list(prompts)


def decode_config(
    *,
    block_size: int,
    adaptive: bool,
    stop_token_ids: tuple[int, ...] = (),
    lookup_kinds: tuple[int, ...] | None = None,
    **settings,
) -> DecodeConfig:
    """The DecodeConfig of a decode whose block size and mode are settled (`decode_mode`):
    `settings` are any other DecodeConfig keywords (flat names or groups); None lookup kinds
    are `DEFAULT_LOOKUP_KINDS` (those <= the block size), or a `controller` group's when one
    is given (its kinds kept as given); step and lookup kinds only when adaptive;
    batch_invariant None: by dtype (`programs.run_target_config`). `generate_config` and the
    CLIs' flags (`infer.common`) both build theirs here."""
    if lookup_kinds is None and settings.get("controller") is None:
        lookup_kinds = default_lookup_kinds(block_size)
    kinds = dict(lookup_kinds=lookup_kinds, step_kinds=settings.pop("step_kinds", None))
    kinds = {k: tuple(v) for k, v in kinds.items() if v is not None}
    controller = group_of("controller", {**settings, **kinds, "adaptive": adaptive})
    if not adaptive:
        controller = dataclasses.replace(controller, step_kinds=(), lookup_kinds=())
    rest = {k: v for k, v in settings.items() if "controller" not in (k, GROUP_OF.get(k))}
    return DecodeConfig(
        block_size=block_size,
        stop_token_ids=tuple(stop_token_ids),
        controller=controller,
        **rest,
    )


def generate_config(
    target,
    drafter,
    *,
    block_size: int | None = None,
    adaptive: bool | None = None,
    step_kinds: tuple[int, ...] = (),
    platform: str | None = None,
    **settings,
) -> DecodeConfig:
    """The DecodeConfig `generate` decodes with (its arguments, `generate`'s docstring): None
    block size / adaptive are the measured defaults on `platform` (`decode_mode`; None: this
    process's backend; a `controller` group's `adaptive` does not override them), no step
    kinds `default_step_kinds` (a plain step where `plain_steps_pay`), None lookup kinds
    `DEFAULT_LOOKUP_KINDS` (`decode_config`); the target's stop tokens (`stop_token_ids`);
    `settings`: every other DecodeConfig keyword (max_new_tokens, temperature, row_tile, ...,
    or a group: `sampling=Sampling(...)`), passed on as given. The one builder of decode
    configs: `infer.generate`, `infer.benchmark`, `infer.serve`, `infer.lower` and
    `infer.memory_plan` call it too. `target` and `drafter` need only `.config` (and the
    target a `.tokenizer`, if any)."""
    block_size, adaptive = decode_mode(target, drafter, block_size, adaptive, platform)
    # Step kinds come as the keyword or inside a `controller` group; the other controller
    # settings (the CLIs' lookup_kinds=None included) are `decode_config`'s to resolve.
    group_kinds = getattr(settings.get("controller"), "step_kinds", ())
    if adaptive and not (step_kinds or group_kinds):
        numerics = group_of("numerics", settings)
        plain = plain_steps_pay(target, numerics.batch_invariant, platform, numerics.row_tile)
        step_kinds = default_step_kinds(block_size, plain)
    return decode_config(
        block_size=block_size, adaptive=adaptive, stop_token_ids=stop_token_ids(target),
        **({"step_kinds": step_kinds} if step_kinds else {}), **settings,
    )  # fmt: skip


def grammar_table(target, spec: grammar_io.GrammarSpec, cfg: DecodeConfig) -> grammar.Grammar:
    """The device table of `spec` over the target's tokenizer (`io.grammar`, compiled once per
    process), ending at the decode's stop tokens."""
    if target.tokenizer is None:
        raise grammar_io.GrammarError("structured output needs the target's tokenizer")
    key = id(target.tokenizer)
    if key not in _PIECES:
        _PIECES[key] = grammar_io.token_bytes(target.tokenizer)
    tables = grammar_io.compile_grammar(
        spec, _PIECES[key], target.config.vocab_size, cfg.stop_token_ids
    )
    return grammar.device_table(*tables)


_PIECES: dict = {}  # id(tokenizer) -> its tokens' bytes


def generate(
    target,
    drafter,
    prompts: list[str],
    *,
    max_new_tokens: int = 128,
    seed: int = 0,
    chat: bool = True,
    json_schema=None,
    regex: str | None = None,
    choices: list[str] | None = None,
    json_object: bool = False,
    **settings,
) -> list[str]:
    """Decodes a batch of text prompts with DFlash (or the target alone when drafter is None)
    and returns the generated texts (stop token removed). `settings`: `generate_config`'s
    keywords, so any DecodeConfig setting by name (or as a group, `sampling=Sampling(...)`):
    block_size / adaptive None: the measured defaults (`decode_mode`); adaptive step costs
    are calibrated on the first call for these shapes and cached on disk. temperature, top_k,
    top_p: how tokens are drawn (0: greedy). lookup_kinds: the prompt-lookup step kinds of an
    adaptive decode (None: `DEFAULT_LOOKUP_KINDS`). tree_nodes: a step that verifies a token
    tree of this many tokens (`decoding.tree`): one more step kind of an adaptive decode,
    else every step; 0: no tree. confidence_cut: a DSpark drafter's drafts are offered while
    the product of their predicted acceptance stays at or above it
    (`DecodeConfig.confidence_cut`); 0: all of them. row_tile: the rows every GEMM of a
    batch-invariant decode runs at (`DecodeConfig.row_tile`; 0: 32); a large batch runs
    faster at `ops.invariance.row_tile_for(len(prompts) * 16)`, in other bits.
    max_new_tokens is an input of the compiled decode, its buffers a power of two
    (`budget_bucket`): a new budget within a bucket runs the programs already compiled.
    Structured output (at most one): json_schema (a dict or JSON text), regex, choices (a
    list of strings) or json_object (any JSON object): every answer is text the grammar
    accepts, drawn from the target's distribution masked to it (`decoding.grammar`);
    `io.grammar.GrammarError` for a grammar the compiler cannot take."""
    prompts = check_text_prompts(prompts)
    spec = grammar_io.spec_of(json_schema, regex, choices, json_object)
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be at least 1")
    tokens = [render_prompt(target.tokenizer, p, chat) for p in prompts]
    room = target.config.max_position_embeddings - max(len(t) for t in tokens)
    budget = budget_bucket(max_new_tokens, room)
    cfg = generate_config(target, drafter, max_new_tokens=budget, **settings)
    prompt, lengths = pad_prompts(tokens)
    # Checked and resolved once (`decoding.plan`): the calibration and the decode read it.
    kw = {"plan": plan_run(target, drafter, cfg)}
    if cfg.adaptive:
        kw["step_costs"] = calibration.calibrate_step_costs(
            target, drafter, prompt, lengths, cfg, traced_budget=True, plan=kw["plan"]
        )
    if spec is not None:
        kw["constraint"] = grammar.constraint(grammar_table(target, spec, cfg), len(prompts))
    run = timed_decode(target, drafter, prompt, lengths, seed, cfg, max_new=max_new_tokens, **kw)
    out = run.output
    return [
        target.tokenizer.decode(toks[:n], skip_special_tokens=True)
        for toks, n in zip(np.asarray(out.tokens), np.asarray(out.lengths), strict=True)
    ]
