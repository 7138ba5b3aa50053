"""Flags shared by infer.generate and infer.benchmark, validated at parse time, and the
conversion of bad-input errors into absl usage errors (a message, not a traceback). The mesh
and multi-process flags (--mesh, --coordinator_address, ...) come from `infer.distributed`:
call `distributed.initialize()` first in main, then load with `mesh=distributed.mesh()`."""

from __future__ import annotations

import contextlib
import dataclasses
import sys

from absl import app, flags, logging

from dflash_jax import api
from dflash_jax.api import DEFAULT_LOOKUP_KINDS
from dflash_jax.config import ATTENTION_IMPLS, ConfigError
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.ops.invariance import served_row_tile
from infer import distributed as distributed
from infer.logs import quiet_library_logs as quiet_library_logs

flags.DEFINE_string(
    "target", "smollm2-135m-instruct",
    "Target model: 'smollm2-135m-instruct' (embedded, offline), an HF directory, a .gguf file "
    "or a hub id such as Qwen/Qwen3-8B (needs a network).",
)  # fmt: skip
flags.DEFINE_string(
    "drafter", "default",
    "Drafter: 'default' (the one shipped for SmolLM2), our Orbax directory, a z-lab HF "
    "directory, a hub id such as z-lab/Qwen3-8B-DFlash-b16, or 'none' for the target alone.",
)  # fmt: skip
flags.DEFINE_enum(
    "dtype", "auto", ["auto", "float32", "bfloat16"],
    "Compute/parameter dtype. 'auto': the decode predicted fastest on this machine "
    "(api.choose_decode): DFlash in float32, or in bfloat16 under the row rule at a row tile "
    "of 4, 8 or 16 (unless --row_tile), or the target alone in its fastest dtype when no DFlash "
    "setting is predicted faster than it; each predicted from GEMM floors computed as the "
    "model computes them in that setting, measured once and cached, the choice and every "
    "candidate's predicted tok/s printed on one line. infer.serve: the dtype whose plain step "
    "over its --slots busy rows, attention included, is fastest (api.fastest_dtype).",
)  # fmt: skip
flags.DEFINE_enum(
    "quantize", None, ["int8", "int4", "fp8", "mxfp4"],
    "Quantized target weights (docs/quantization.md): the decoder layers' projections stored in "
    "int8 or fp8 (one scale per output channel) or int4 (one per block of 32), dequantized to "
    "--dtype in each product; embedding, head, norms and the drafter stay in --dtype. The "
    "quantized model is the target: DFlash output equals its own AR output. A GGUF's Q4_0/Q4_1 "
    "(int4) or Q8_0 (int8) blocks load as stored. Dense Llama/Qwen3 targets only, but mxfp4: "
    "gpt-oss's experts as its checkpoints store them (unset: dequantized at load). Unset: float.",
)  # fmt: skip
flags.DEFINE_bool(
    "target_cache", True,
    "Reuse the converted target (params, config, tokenizer) kept in $DFLASH_JAX_CACHE "
    "(default ~/.cache/dflash_jax); --notarget_cache converts the source every time and "
    "writes nothing (as DFLASH_JAX_NO_CACHE=1 does).",
)  # fmt: skip
flags.DEFINE_integer(
    "max_new_tokens", 256, "Most new tokens per answer (stop token included).", lower_bound=1
)
flags.DEFINE_float(
    "temperature",
    0.0,
    "0 = greedy; > 0 samples (lossless speculative rejection sampling).",
    lower_bound=0.0,
)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 disables it.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 disables it.", lower_bound=0)
flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
# Upper bounds of the sizes that set what a decode compiles: past them a compile takes minutes
# on a CPU (1000 tree nodes: 118 s for 8 tokens) and no drafter gains from them.
MAX_BLOCK_SIZE = 64
MAX_TREE_NODES = 256
flags.DEFINE_integer(
    "block_size", 0,
    "Tokens per draft block (anchor + drafts), at most the drafter's trained size; "
    f"0 = the trained size. At most {MAX_BLOCK_SIZE}.",
    lower_bound=0, upper_bound=MAX_BLOCK_SIZE,
)  # fmt: skip
flags.DEFINE_float(
    "confidence_cut", 0.0,
    "DSpark drafters with a confidence head: offer a step's drafts to the target only while "
    "the product of their predicted acceptance probabilities stays at or above this "
    "(DecodeConfig.confidence_cut; lossless either way). 0 = offer every draft.",
    lower_bound=0.0, upper_bound=0.999,
)  # fmt: skip
flags.DEFINE_integer(
    "draft_window", 0,
    "Bounded drafting at long context (DecodeConfig.draft_window): each full-attention draft "
    "layer sees the first 4 context rows and this many before the block's anchor, so a "
    "draft's cost stops growing with the context (a drafter's own sliding layers keep their "
    "trained window). Lossless (the target verifies every draft); acceptance may drop. "
    "0 = the whole context.",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "tree_nodes", 0,
    "Tree verification: a step that verifies a tree of this many tokens (the anchor and the "
    "drafter's most probable continuations, grown best-first; decoding/tree.py) in one target "
    "pass and commits its longest accepted path. With --adaptive the tree is one more step "
    "kind (recorded as treeN), calibrated and chosen like the others beside the chains of "
    f"--step_kinds and the lookup kinds; without, every step is a tree. 0 = no tree. At most "
    f"{MAX_TREE_NODES} (a larger tree takes minutes to compile).",
    lower_bound=0, upper_bound=MAX_TREE_NODES,
)  # fmt: skip
flags.DEFINE_enum(
    "attention_impl", "auto", list(ATTENTION_IMPLS),
    "Attention: 'xla' (the reference), 'pallas' (Pallas kernels: Triton on GPU for drafting, "
    "training and the target; on TPU Mosaic decode kernels for drafting, verify, AR steps and "
    "prefills under 128 tokens, splash for training; interpret mode on CPU, slow), 'auto' "
    "(pallas on GPU/TPU, xla on CPU). Under --mesh every kernel runs in shard_map (batch over "
    "data/fsdp, KV heads over tensor). A case the kernels lack (a head dim, a dtype, query heads "
    "split over tensor while their KV heads are not) is refused under 'pallas' and done by xla "
    "with one log line under 'auto'; `python -m infer.lower` shows which, for any platform.",
)  # fmt: skip
flags.DEFINE_bool(
    "adaptive", None,
    "Adaptive draft length: every step picks a block size among --step_kinds (1 = a plain "
    "target step), the --lookup_kinds and a --tree_nodes tree, by expected tokens per unit of "
    "cost, measured for this machine by a short "
    "calibration on the first prompt (cached under ~/.cache/dflash_jax). Unset: on on CPU "
    "(measured fastest there, see the README), off elsewhere; infer.generate and "
    "infer.benchmark take the same default.",
)  # fmt: skip
flags.DEFINE_list(
    "step_kinds", [],
    "With --adaptive: the block sizes to choose from, e.g. 1,4,8,16 (the largest is the block "
    "size); empty = 1, 4, 8 and the block size.",
)  # fmt: skip
flags.DEFINE_list(
    "lookup_kinds", None,
    "With --adaptive: block sizes of prompt-lookup steps, whose drafts are copied from the "
    "prompt and the text so far (decoding/lookup.py) and verified like the drafter's; the "
    "controller tracks how often a copy would be accepted after every step. Unset: "
    f"{list(DEFAULT_LOOKUP_KINDS)} (those <= the block size); empty (--lookup_kinds=) for none.",
)  # fmt: skip
flags.DEFINE_bool(
    "batch_invariant", None,
    "Batch-invariant target passes (dflash_jax/ops/invariance.py): a position's logits are the "
    "same bits in an AR step, a verify or a prefill, so greedy DFlash output equals greedy AR "
    "output in any dtype. Its cost: every matmul an isolated GEMM at one fixed row tile "
    "(--row_tile; an AR step's row padded to it), norms and attention at fixed shapes. "
    "--nobatch_invariant runs the passes as XLA picks them: faster, but bf16 output may then "
    "differ from AR. Its measured cost, with and without, is in docs/results.md (\"bf16 at "
    "full speed\", \"One fixed row tile\"). Unset: on for bfloat16 on a CPU (off on GPU and "
    "TPU, where no test has checked the row rule yet; one log line says so), off for float32 "
    "(whose rounding differences have not flipped a token on any benchmark prompt).",
)  # fmt: skip
flags.DEFINE_integer(
    "row_tile", 0,
    "With batch invariance: the rows every matmul of a target pass runs at, by construction "
    "(an AR step's one row padded to it, a wider pass cut into tiles of it). Runs at one tile "
    "give a position the same bits whatever their batch. 0: with --dtype=auto the tile it "
    "chose (4, 8 or 16), else 32 (holds a verify of 16 or a tree of 32), except infer.serve: "
    "its --slots from 8 up (its plain step as one tile), and infer.acceptance: its batch's "
    "widest verify, up to 128.", lower_bound=0, upper_bound=1024,
)  # fmt: skip
flags.DEFINE_string(
    "compilation_cache", "~/.cache/dflash_jax/xla",
    "infer.generate: directory of JAX's persistent compilation cache (a subdirectory per "
    "jax/jaxlib build and machine), so that the decode loops compile once per shape and "
    "machine and later runs load them (empty: off).",
)  # fmt: skip
flags.register_validator("top_p", lambda p: 0.0 < p <= 1.0, "--top_p must be in (0, 1]")
flags.register_validator(
    "lookup_kinds",
    lambda kinds: (
        kinds is None or all(k.strip().isdigit() and 2 <= int(k) <= MAX_BLOCK_SIZE for k in kinds)
    ),
    f"--lookup_kinds must be integers in [2, {MAX_BLOCK_SIZE}], e.g. 8,16",
)
flags.register_validator(
    "step_kinds",
    lambda kinds: all(k.strip().isdigit() and 1 <= int(k) <= MAX_BLOCK_SIZE for k in kinds),
    f"--step_kinds must be integers in [1, {MAX_BLOCK_SIZE}], e.g. 1,4,8,16",
)

FLAGS = flags.FLAGS


def _flag_settings() -> dict:
    """The decode settings the flags give, as `api.decode_config` / `api.generate_config`
    take them (block size and mode apart)."""
    lookup = None if FLAGS.lookup_kinds is None else tuple(int(k) for k in FLAGS.lookup_kinds)
    return dict(
        max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
        top_p=FLAGS.top_p, step_kinds=tuple(int(k) for k in FLAGS.step_kinds),
        lookup_kinds=lookup, tree_nodes=FLAGS.tree_nodes, batch_invariant=FLAGS.batch_invariant,
        confidence_cut=FLAGS.confidence_cut, row_tile=FLAGS.row_tile,
        draft_window=FLAGS.draft_window,
    )  # fmt: skip


def run_config(target, drafter, block_size: int | None = None) -> DecodeConfig:
    """The DecodeConfig a run decodes with: the flags through `api.generate_config` (the one
    builder, which infer.lower and infer.memory_plan use too), --block_size (or `block_size`)
    and --adaptive defaulting as it says, the target's stop tokens."""
    return api.generate_config(
        target, drafter, block_size=block_size or FLAGS.block_size or None,
        adaptive=FLAGS.adaptive, **_flag_settings(),
    )  # fmt: skip


def decode_config(
    block_size: int, stop_token_ids: tuple[int, ...], adaptive: bool | None = None
) -> DecodeConfig:
    """The DecodeConfig the flags describe at a given block size (`adaptive` overrides
    --adaptive), for the scripts that time one mode (`api.decode_config`)."""
    adaptive = bool(FLAGS.adaptive) if adaptive is None else adaptive
    return api.decode_config(
        block_size=block_size, adaptive=adaptive, stop_token_ids=stop_token_ids,
        **_flag_settings(),
    )  # fmt: skip


def row_tile(slots: int = 0) -> int:
    """The row tile a run decodes at: --row_tile, else a server's of `slots` rows
    (`invariance.served_row_tile`: ROW_TILE below 8 slots, so a stream's too)."""
    return FLAGS.row_tile or served_row_tile(slots)


def load_models(slots: int = 0, ar_fallback: bool = False, choose_tile: bool = True):
    """(target, drafter, dtype, why) as the flags ask, on the mesh of --mesh (`distributed`),
    with --attention_impl. --dtype=auto: a stream's decode is chosen by `api.choose_decode`
    (the dtype, and under the row rule the row tile, whose predicted tokens/s is highest; the
    tile goes into the target's config, where the decode and its defaults read it); with
    `ar_fallback`, a choice of the target alone (no DFlash setting predicted faster than the
    fastest AR) returns no drafter; without `choose_tile` (a batched run that sets its own
    tile: infer.acceptance) only the dtype is taken. A server (`slots` > 1) is judged by its
    plain step over that many busy slots (`api.fastest_dtype`). `why` says what was chosen and
    why on one line, which is also printed (None when --dtype was given)."""
    mesh = distributed.mesh()
    dtype = "float32" if FLAGS.dtype == "auto" else FLAGS.dtype
    # --dtype=auto: the request as named here; the dtype it chose last time is loaded first
    request = "|".join(
        str(v) for v in (FLAGS.target, FLAGS.drafter, slots, FLAGS.batch_invariant,
                         FLAGS.quantize, FLAGS.mesh, FLAGS.row_tile)
    )  # fmt: skip
    if FLAGS.dtype == "auto":
        dtype = api.remembered_dtype(request) or dtype
    load = lambda dt: with_attention_impl(
        *api.load_pair(
            FLAGS.target, FLAGS.drafter, dt, FLAGS.target_cache, mesh=mesh, quantize=FLAGS.quantize
        )
    )
    target, drafter = load(dtype)
    why, tile = None, 0
    if FLAGS.dtype == "auto" and drafter is None:
        why = "float32: the target alone runs one row per step, fastest in float32"
        dtype = "float32"
    elif FLAGS.dtype == "auto" and slots > 1:
        block = api.default_block_size(target, drafter)
        dtype, floors = api.fastest_dtype(
            target, drafter, block, FLAGS.batch_invariant, remember=request, slots=slots,
            row_tile=row_tile(slots),
        )  # fmt: skip
        short = lambda name: name.replace(" plain", "").replace("batch-invariant", "invariant")
        costs = ", ".join(f"{short(d)} {1e3 * s:.1f} ms" for d, s in floors.items())
        why = f"{dtype}: {slots}-slot served step {costs}"
    elif FLAGS.dtype == "auto":
        choice = api.choose_decode(
            target, drafter, FLAGS.batch_invariant, remember=request, row_tile=FLAGS.row_tile
        )
        dtype, tile, why = choice.dtype, choice.row_tile * choose_tile, choice.why()
        if not choice.drafter and ar_fallback:
            drafter = None
    if why is not None and distributed.is_primary():
        print(f"--dtype=auto chose {why}", file=sys.stderr, flush=True)
    loaded = target.config.dtype
    if dtype != loaded and (FLAGS.quantize or loaded != "float32"):
        target, reloaded = load(dtype)
        drafter = drafter and reloaded
    elif dtype != loaded:  # the float32 target as loaded, cast: its source read once
        target, recast = with_attention_impl(
            *api.recast_pair(target, FLAGS.drafter, dtype, FLAGS.target_cache, mesh=mesh)
        )
        drafter = drafter and recast
    if tile:  # the chosen tile, in the config every decode of this run reads its rule from
        config = dataclasses.replace(target.config, invariant_rows=(tile, tile))
        target = dataclasses.replace(target, config=config)
    return target, drafter, dtype, why


def with_attention_impl(target, drafter=None):
    """(target, drafter) as loaded (`api.load_pair`), with --attention_impl in their configs;
    a None drafter stays None."""
    impl = FLAGS.attention_impl
    target = dataclasses.replace(
        target, config=dataclasses.replace(target.config, attention_impl=impl)
    )
    if drafter is not None:
        drafter = dataclasses.replace(
            drafter, config=dataclasses.replace(drafter.config, attention_impl=impl)
        )
    return target, drafter


def enable_compilation_cache() -> None:
    """Points JAX's persistent compilation cache at --compilation_cache
    (`programs.enable_persistent_cache`: a directory per jax/jaxlib build and machine), so that
    a second run of a script loads the loops instead of compiling them. For scripts whose
    executables take their weights as arguments (infer.generate): one that closes over them
    (the benchmark's --breakdown phases) would write ~300 MB entries, for minutes.

    On a CPU a float32 decode without a row rule is compiled without YNNPACK fusions
    (`programs.executable_options`): with them, loading the default adaptive loop took ~33 s
    (against ~34 s to compile it), without them ~5 s, at the same decode speed."""
    if not FLAGS.compilation_cache:
        return
    from dflash_jax.decoding import programs

    path = programs.enable_persistent_cache(FLAGS.compilation_cache)
    logging.info("persistent compilation cache: %s", path)


@contextlib.contextmanager
def usage_errors():
    """Bad input (a misfit drafter, a missing file, a prompt too long for the cache, ...) ends
    the program with its message as a usage error."""
    try:
        yield
    except (ConfigError, ValueError, OSError) as e:
        raise app.UsageError(f"{type(e).__name__}: {e}") from e


def load_for_prompt(prompt_text: str | None):
    """What the one-prompt timing scripts (infer.bench.step_cost, infer.bench.stream_cost) start
    with: the prompt is required, the flags' target and drafter are loaded, and the prompt is
    rendered in the target's chat template and padded. Bad input is a usage error.
    -> (target, drafter or None, prompt [1,P], lengths [1])."""
    if not prompt_text:
        raise app.UsageError("--prompt is required")
    with usage_errors():
        target, drafter, _, _ = load_models()
        prompt, lengths = api.pad_prompts([api.render_prompt(target.tokenizer, prompt_text)])
    return target, drafter, prompt, lengths


def grammar_constraint(target, cfg, json_schema_file=None, regex=None, choices=None):
    """(the decodes' constraint input, the grammar's device table) of a CLI's --json_schema
    (a file) / --regex / --choices, (None, None) without any; a UsageError naming the problem
    for a file it cannot read or a grammar the compiler cannot take."""
    from dflash_jax.decoding import grammar
    from dflash_jax.io import grammar as grammar_io

    schema = None
    if json_schema_file:
        try:
            with open(json_schema_file) as f:
                schema = f.read()
        except OSError as e:
            message = f"--json_schema={json_schema_file}: cannot read it ({e})"
            raise app.UsageError(message) from None
    try:
        spec = grammar_io.spec_of(schema, regex, choices)
        if spec is None:
            return None, None
        table = api.grammar_table(target, spec, cfg)
    except grammar_io.GrammarError as e:
        raise app.UsageError(str(e)) from None
    return grammar.constraint(table, 1), table
