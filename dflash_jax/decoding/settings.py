"""The decode settings (`DecodeConfig`: frozen and hashable, a static argument of the jitted
loops) and the step-kind encoding every decode records (`tree_kind`, `kind_label`).

A DecodeConfig holds the run's lengths (max_new_tokens, block_size, stop_token_ids) and three
groups, each a small frozen dataclass that checks its own fields: `Sampling` (how tokens are
drawn and reported), `Controller` (which steps the loop takes: adaptive kinds, lookup, trees,
the confidence cut) and `Numerics` (how the passes are computed: the row rule, prefill chunks,
the draft window). Every group field reads and sets as a flat name too:
`DecodeConfig(temperature=0.7, adaptive=True)`, `cfg.temperature`,
`dataclasses.replace(cfg, row_tile=8)`; `DecodeConfig(sampling=Sampling(temperature=0.7))` is
the same config (equal, same hash: one compiled program). A new setting is a field of its
group, read where it is used: nothing between has to pass it on.
"""

from __future__ import annotations

import dataclasses
import inspect

from dflash_jax.config import ConfigError

# A tree step of N nodes is recorded (`DecodeOutput.block_sizes`, `DecodeConfig.all_kinds`) as
# TREE_KIND_BASE + N: above every block size (a drafting kind is its block size, a copy its
# negative), so one int still names any step kind. `kind_label` names it "treeN".
TREE_KIND_BASE = 1000
# A copied block of b tokens is recorded per row as -b when the text so far proposed it (prompt
# lookup), -(CORPUS_KIND_BASE + b) when the drafter's corpus table did (`decoding.proposers`);
# the controller chooses (and costs) both as the copy kind -b.
CORPUS_KIND_BASE = 1000


def tree_kind(num_nodes: int) -> int:
    """The recorded kind of a tree step of `num_nodes` tokens."""
    return TREE_KIND_BASE + num_nodes


def kind_label(kind: int) -> str:
    """A step kind as text: its block size ("8"; "1" a plain step), "-8" for a block copied
    from the text, "corpus8" for one copied from the corpus table, "tree16" for a tree of 16
    tokens."""
    kind = int(kind)
    if kind >= TREE_KIND_BASE:
        return f"tree{kind - TREE_KIND_BASE}"
    if kind <= -CORPUS_KIND_BASE:
        return f"corpus{-kind - CORPUS_KIND_BASE}"
    return str(kind)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: `temperature == 0` is greedy; otherwise sampling with top-k
    (0 = off) and top-p (1 = off), applied identically to target and draft."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Each row carries its own request's settings in the loop state (`sampling.RowSettings`:
    # temperature, top-k, top-p, PRNG key, token limit up to max_new_tokens), so the rows of one
    # running decode can be different requests (a server's slots, `decoding.slots`). The start
    # gives every row this config's settings; greedy rows keep the argmax of the greedy path.
    row_settings: bool = False
    # With row_settings: log-probabilities kept for every committed token (a server's
    # `logprobs`): the token's and those of the `logprobs` likeliest tokens, from the
    # distribution the row draws from (its temperature, top-k and top-p; a greedy row's raw
    # distribution), computed in a step only while some row asks (`RowSettings.logprobs`).
    # 0: none kept (the loop state has no room for them).
    logprobs: int = 0

    def __post_init__(self):
        if self.logprobs and not (0 < self.logprobs <= 20 and self.row_settings):
            raise ConfigError(
                f"logprobs={self.logprobs}: 1 to 20 alternatives, with row_settings (0: none)"
            )
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Controller:
    """Which step the loop takes: one fixed block, or (adaptive) a kind chosen per step among
    drafted blocks, prompt-lookup copies and a tree; and how many drafts a step offers. The
    kinds are checked against the block size by `DecodeConfig`, which holds both."""

    # Adaptive draft length (decoding/adaptive.py): each loop step picks one of `step_kinds`
    # block sizes (1 = a plain target step, no drafting) by expected tokens per unit of cost.
    adaptive: bool = False
    step_kinds: tuple[int, ...] = ()  # () with adaptive: 1, 4, 8 and block_size (those <= it)
    adaptive_rate: float = 0.2  # weight of the newest step in the acceptance estimates
    adaptive_prior: float = 0.3  # initial per-position acceptance estimate (see adaptive.py)
    probe_every: int = 16  # after this many plain steps in a row, draft once to re-measure
    probe_backoff: int = 4  # a failed probe doubles the wait, up to probe_every * this
    # Prompt-lookup step kinds (adaptive only; decoding/lookup.py): block sizes whose drafts are
    # copied from the prompt and the text so far (the longest suffix match of up to
    # `lookup_ngram` tokens, then what followed it) instead of drafted; verified the same way.
    lookup_kinds: tuple[int, ...] = ()
    lookup_ngram: int = 3
    # Tree verification (decoding/tree.py): a step that verifies a tree of this many tokens (the
    # anchor and tree_nodes - 1 drafted nodes, grown best-first from the drafter's per-position
    # distributions) in one target pass and commits its longest accepted path. Fixed mode: every
    # step is one. Adaptive: one more step kind (`tree_kind(tree_nodes)`, last in `all_kinds`)
    # the controller chooses beside the chains and copies. 0: no tree.
    tree_nodes: int = 0
    # DSpark's confidence cut (a drafter with a confidence head, `models/dspark.py`): a step
    # keeps its drafts only while the product of their predicted acceptance probabilities
    # stays >= this; the drafts after the cut are not offered to the verify (the step commits
    # the kept drafts the target accepts, then one target token: at the cut a sample of the
    # target itself). A fixed-block decode verifies at the narrowest compiled width holding
    # every active row's kept drafts (`decoding/cut.py`: what a cut saves); adaptive kinds
    # apply the cut to their own drafts. 0: no cut (the measured default, docs/results.md).
    confidence_cut: float = 0.0

    def __post_init__(self):
        # Tuples of ints, so that a list and a tuple give one (hashable) config.
        object.__setattr__(self, "step_kinds", tuple(int(b) for b in self.step_kinds))
        object.__setattr__(self, "lookup_kinds", tuple(int(b) for b in self.lookup_kinds))
        if not 0.0 < self.adaptive_rate <= 1.0 or not 0.0 <= self.adaptive_prior <= 1.0:
            raise ConfigError(
                f"adaptive_rate={self.adaptive_rate} must be in (0, 1] and "
                f"adaptive_prior={self.adaptive_prior} in [0, 1]"
            )
        if self.probe_every < 1:
            raise ConfigError(f"probe_every={self.probe_every} must be at least 1")
        if not 0.0 <= self.confidence_cut < 1.0:
            raise ConfigError(f"confidence_cut={self.confidence_cut} must be in [0, 1) (0: no cut)")
        if self.lookup_ngram < 1:
            raise ConfigError(f"lookup_ngram={self.lookup_ngram} must be at least 1")
        if self.probe_backoff < 1:
            raise ConfigError(f"probe_backoff={self.probe_backoff} must be at least 1")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the passes are computed: whether every target pass keeps to a row rule (and at
    which tile), how a long prompt is prefilled, how much context a draft layer sees. None of
    it changes what a lossless decode outputs, only its bits' rounding and its cost."""

    # Every target pass batch-invariant (`ops.invariance`): a position's logits are bitwise the
    # same in an AR step, a verify, a prefill or a batch, so greedy speculative output equals
    # greedy AR output in any dtype. False: the passes as XLA picks them (fastest; a verify and
    # an AR step may then round a near-tie apart: ~1e-6 apart in fp32, where no benchmark
    # prompt has flipped, but often in bf16). None: on for every dtype but float32
    # (`decoding.programs.run_target_config`).
    batch_invariant: bool | None = None
    # The row tile of a batch-invariant decode: every GEMM of every target pass runs at exactly
    # this many rows (`ops.invariance.RowRule.fixed`; 0: `ops.invariance.ROW_TILE`, 32). Runs
    # at one tile give a position the same bits, whatever their batch; a run whose passes are
    # all wide (a server's slots x 16, `ops.invariance.row_tile_for`) sets a wider one, which
    # runs them as one tile instead of several.
    row_tile: int = 0
    # Prompts longer than this are prefilled in chunks of this many tokens (`phases.prompt_pass`),
    # each a pass over the cache written so far: a layer's prefill holds scores for
    # prefill_chunk x prompt slots, not prompt x prompt (32k tokens of Qwen3-8B: 267 GiB of
    # fp32 scores whole). 0: the whole prompt in one pass.
    prefill_chunk: int = 256
    # Bounded drafting for drafters trained without a window (`models.drafter`): every
    # full-attention draft layer sees the first `draft_sinks` context rows and the last
    # `draft_window` before the block's anchor, so a draft's cost stops growing with the
    # context. Lossless (the target verifies); acceptance may change. 0: the whole context.
    draft_window: int = 0
    draft_sinks: int = 4

    def __post_init__(self):
        if self.prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk={self.prefill_chunk} must be >= 0 (0: whole)")
        if self.draft_window < 0 or self.draft_sinks < 0:
            raise ConfigError(
                f"draft_window={self.draft_window} and draft_sinks={self.draft_sinks} must be "
                ">= 0 (draft_window 0: the drafter sees the whole context)"
            )
        if not 0 <= self.row_tile <= 1024:
            raise ConfigError(f"row_tile={self.row_tile}: give 1 to 1024 rows (0: the default, 32)")


# DecodeConfig's groups: field name -> class. Each group's fields read and set as flat names.
GROUPS = {"sampling": Sampling, "controller": Controller, "numerics": Numerics}
GROUP_OF = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}


def group_of(name: str, settings: dict):
    """The group `name` ("sampling", ...) that DecodeConfig keywords `settings` give: the group
    passed (default: its defaults) with the flat names of its fields in `settings` set on it."""
    cls = GROUPS[name]
    group = settings.get(name)
    if group is None:
        group = cls()
    elif not isinstance(group, cls):
        raise ConfigError(
            f"{name}={group!r:.80}: give a {cls.__name__}(...) (dflash_jax.decoding.settings) "
            "or its fields as keywords"
        )
    flat = {k: v for k, v in settings.items() if GROUP_OF.get(k) == name}
    return dataclasses.replace(group, **flat) if flat else group


@dataclasses.dataclass(frozen=True, init=False)
class DecodeConfig:
    """Static decoding settings: the lengths, and the `Sampling`, `Controller` and `Numerics`
    groups (see the module docstring), given as groups, as flat names, or both (a flat name
    overrides its group's field): `DecodeConfig(block_size=8, temperature=0.7)`."""

    max_new_tokens: int = 128
    block_size: int = 16
    stop_token_ids: tuple[int, ...] = ()
    sampling: Sampling = Sampling()
    controller: Controller = Controller()
    numerics: Numerics = Numerics()

    def __init__(self, **settings):
        for name in GROUPS:
            object.__setattr__(self, name, group_of(name, settings))
        settings = {k: v for k, v in settings.items() if k not in GROUPS and k not in GROUP_OF}
        for f in _OWN_FIELDS:
            object.__setattr__(self, f.name, settings.pop(f.name, f.default))
        if settings:
            raise TypeError(
                f"DecodeConfig() got unexpected keyword arguments {sorted(settings)}: it takes "
                "its own fields and those of Sampling, Controller and Numerics"
            )
        self.__post_init__()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        c = self.controller
        if c.tree_nodes and (c.tree_nodes < 2 or self.block_size < 2):
            raise ConfigError(
                f"tree_nodes={c.tree_nodes} needs at least 2 nodes (the anchor and one "
                f"draft) and block_size >= 2 (got {self.block_size}); 0 = a chain"
            )
        if c.tree_nodes and self.sampling.row_settings:
            raise ConfigError(
                f"tree_nodes={c.tree_nodes} with row_settings: per-row sampling settings are "
                "not implemented for tree steps; use tree_nodes=0"
            )
        if c.tree_nodes and self.block_size >= TREE_KIND_BASE:
            raise ConfigError(
                f"block_size={self.block_size} with a tree: block sizes below {TREE_KIND_BASE} "
                "(a tree step's recorded kind lies above them)"
            )
        kinds = c.step_kinds
        if c.adaptive and not kinds:
            kinds = tuple(sorted({1, *(b for b in (4, 8) if b < self.block_size), self.block_size}))
        if kinds and (min(kinds) < 1 or max(kinds) != self.block_size or len(set(kinds)) < 2):
            raise ConfigError(
                f"step_kinds={kinds} must be distinct block sizes >= 1 (at least two), the "
                f"largest equal to block_size={self.block_size}"
            )
        lookup = tuple(sorted({int(b) for b in c.lookup_kinds}))
        if lookup and (not c.adaptive or min(lookup) < 2 or max(lookup) > self.block_size):
            raise ConfigError(
                f"lookup_kinds={c.lookup_kinds} need adaptive=True and block sizes in "
                f"[2, block_size={self.block_size}]"
            )
        kinds = tuple(sorted(kinds)) if c.adaptive else ()
        if (kinds, lookup) != (c.step_kinds, c.lookup_kinds):
            c = dataclasses.replace(c, step_kinds=kinds, lookup_kinds=lookup)
            object.__setattr__(self, "controller", c)
        if self.block_size < 1:
            raise ConfigError(f"block_size={self.block_size} must be at least 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def __getattr__(self, name: str):
        """A group's field by its flat name: `cfg.temperature` is `cfg.sampling.temperature`."""
        group = GROUP_OF.get(name)
        if group is None:
            raise AttributeError(f"'DecodeConfig' object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    @property
    def all_kinds(self) -> tuple[int, ...]:
        """Every adaptive step kind, in the order of the controller's costs and of a forced
        kind index: the drafter's `step_kinds`, then the lookup kinds as negative block sizes,
        then the tree kind `tree_kind(tree_nodes)` when there is a tree (how
        `DecodeOutput.block_sizes` records them): the kinds `decoding.proposers`' entries
        offer, in registry order (plain, drafted, copy, tree; `proposers.all_kinds`, which
        the loop checks against this)."""
        c = self.controller
        tree = (tree_kind(c.tree_nodes),) if c.adaptive and c.tree_nodes else ()
        return c.step_kinds + tuple(-b for b in c.lookup_kinds) + tree

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy


_OWN_FIELDS = [f for f in dataclasses.fields(DecodeConfig) if f.name not in GROUPS]
# Every keyword DecodeConfig takes: its own fields, each group's fields, the groups.
_SETTING_NAMES = [f.name for f in _OWN_FIELDS] + list(GROUP_OF) + list(GROUPS)


def _signature() -> inspect.Signature:
    defaults = {f.name: f.default for f in _OWN_FIELDS}
    for cls in GROUPS.values():
        defaults.update((f.name, f.default) for f in dataclasses.fields(cls))
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(n))
        for n in _SETTING_NAMES
    ]
    return inspect.Signature(params)


DecodeConfig.__init__.__signature__ = _signature()


# What only a drafting decode reads: the AR loop resets them (block_size to 1), so one compiled
# AR loop serves every block size and mode; every other field (sampling, stops, lengths) is kept.
_DRAFTING_FIELDS = (
    "block_size",
    "adaptive",
    "step_kinds",
    "adaptive_rate",
    "adaptive_prior",
    "probe_every",
    "probe_backoff",
    "lookup_kinds",
    "lookup_ngram",
    "tree_nodes",
    "row_settings",  # the baseline of a row-settings decode runs its uniform settings
)


def autoregressive_config(cfg: DecodeConfig) -> DecodeConfig:
    """`cfg` for the target alone: the drafting fields at their defaults, block size 1."""
    defaults = DecodeConfig()
    reset = {name: getattr(defaults, name) for name in _DRAFTING_FIELDS}
    return dataclasses.replace(cfg, **{**reset, "block_size": 1})
