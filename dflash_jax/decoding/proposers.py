"""The proposers: where a step's drafts come from, one registry entry each.

An adaptive decode chooses, before each step, one kind among those its proposers offer
(`DecodeConfig.all_kinds`, in registry order): a plain target step ("plain", kind 1), a
drafted block ("drafted", its block size b), a copied block ("copy", -b: `decoding.lookup`,
from the text so far or the drafter's corpus table) or a tree ("tree", `tree_kind(N)`). An
`Entry` holds everything the loop needs of one proposer:

  kinds(cfg)        the kinds it offers the controller (their order is the costs' order)
  init(cfg, b)      its share of the loop state (`LoopState.control[i]`: a pytree whose
                    per-row arrays lead with the batch [B, ...], scalars shared by the rows;
                    None: no state)
  look(s, ctx)      what it knows before the choice (a copy: the proposal and where it came
                    from), computed every step; None: nothing
  expect(...)       expected committed tokens per row of each of its kinds [B, n_kinds]
  learn(...)        its state after a step, whatever kind ran (`adaptive` holds the rules)
  drafts(...)       its drafts for a chained verify of b tokens (b - 1 drafts, their log-probs,
                    the kept count), or `step`: a whole step of its own (the tree)
  record(kind, v)   what each row records for a step of its kind [B] (default: the kind)

The loop (`speculative`) builds its `lax.switch` from the entries: one branch per verify
width, shared by every entry that drafts a chain of that width (a drafted and a copied block
of 8 run one compiled verify), and one per entry with a step of its own. A grammar's forced
run (`decoding.grammar`) rides the copy entry's look: where the row's grammar state forces
tokens, that run is the copy proposal.

Every report names steps by proposer (`NAMES`, from each row's recorded kind: `name_of`):
a plain step, a drafted block, a text copy (prompt lookup), a corpus copy and a tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding import adaptive, grammar, lookup
from dflash_jax.decoding.settings import CORPUS_KIND_BASE, TREE_KIND_BASE, DecodeConfig
from dflash_jax.models.drafter import drafter_logits

# What every report counts steps and tokens by, in this order.
NAMES = ("text_copy", "corpus_copy", "drafted", "tree", "plain")


def name_of(kind: int) -> str:
    """A recorded step kind's proposer (`NAMES`); "" for 0 (no step)."""
    kind = int(kind)
    if kind == 0:
        return ""
    if kind >= TREE_KIND_BASE:
        return "tree"
    if kind <= -CORPUS_KIND_BASE:
        return "corpus_copy"
    if kind < 0:
        return "text_copy"
    return "plain" if kind == 1 else "drafted"


def chosen_kind(kind: int) -> int:
    """The kind the controller chose for a recorded one (a corpus copy's is its copy kind,
    -b: `DecodeConfig.all_kinds` and the step costs name it so)."""
    kind = int(kind)
    return kind + CORPUS_KIND_BASE if kind <= -CORPUS_KIND_BASE else kind


def chain_drafts(kinds) -> np.ndarray:
    """The drafts a chained step offered its verify, per recorded kind (any shape): b - 1 for
    a drafted or copied block of b, 0 for a plain step, a tree or no step."""
    kinds = np.asarray(kinds, np.int64)
    b = np.where(kinds <= -CORPUS_KIND_BASE, -kinds - CORPUS_KIND_BASE, np.abs(kinds))
    return np.where((b > 1) & (kinds < TREE_KIND_BASE), b - 1, 0)


def by_proposer(kinds, taus) -> tuple[dict, dict]:
    """Steps and committed tokens by proposer over recorded kinds and their taus (any shapes,
    alike; kind 0: no step). -> ({name: steps}, {name: tokens}), every name of `NAMES`."""
    kinds = np.asarray(kinds, np.int64).ravel()
    taus = np.asarray(taus, np.int64).ravel()
    names = np.asarray([name_of(k) for k in kinds]) if kinds.size else np.zeros(0, str)
    steps = {n: int(np.sum(names == n)) for n in NAMES}
    tokens = {n: int(np.sum(taus[names == n])) for n in NAMES}
    return steps, tokens


def drafted_tau(kinds, taus) -> float | None:
    """Mean tokens committed by the drafted blocks alone (the drafter's own tau), or None."""
    kinds, taus = np.asarray(kinds).ravel(), np.asarray(taus).ravel()
    own = [t for k, t in zip(kinds, taus, strict=True) if name_of(k) == "drafted"]
    return float(np.mean(own)) if own else None


def report(kinds, taus) -> dict:
    """What every report says of its steps (recorded kinds and their taus, any shapes alike):
    `steps_by_proposer`, `tokens_by_proposer` (`by_proposer`) and `drafted_tau_mean`, the
    tau of the drafted blocks alone (None where none ran)."""
    steps, tokens = by_proposer(kinds, taus)
    return {
        "steps_by_proposer": steps,
        "tokens_by_proposer": tokens,
        "drafted_tau_mean": drafted_tau(kinds, taus),
    }


@dataclasses.dataclass(frozen=True)
class Entry:
    """One proposer of the adaptive loop (the module docstring says what each field does)."""

    name: str
    kinds: Callable
    expect: Callable
    init: Callable | None = None
    look: Callable | None = None
    learn: Callable | None = None
    drafts: Callable | None = None
    step: Callable | None = None
    record: Callable | None = None
    kind_at: Callable = lambda bs: bs  # the kind of its chained step of `bs` tokens


def _mine(control, name: str):
    """An entry's share of the control state, by its name."""
    return control[[e.name for e in REGISTRY].index(name)]


def _prior(cfg: DecodeConfig, b: int):
    return jnp.full((b, max(cfg.block_size - 1, 1)), cfg.adaptive_prior, jnp.float32)


# -- plain: the target alone (kind 1); no drafts, its value is 1 --------------------------------
def _plain_kinds(cfg):
    return (1,) if 1 in cfg.step_kinds else ()


def _plain_expect(control, view, cfg, b):
    return jnp.ones((b, 1), jnp.float32)


# -- drafted: the drafter's chain (kinds b > 1); the probe clock is its own --------------------
def _drafted_kinds(cfg):
    return tuple(b for b in cfg.step_kinds if b > 1)


def _drafted_init(cfg, b):
    return {
        "alpha": _prior(cfg, b),
        "plain_run": jnp.int32(0),
        "probe_wait": jnp.int32(cfg.probe_every),
    }


def _drafted_expect(control, view, cfg, b):
    return adaptive.expected_tokens(_mine(control, "drafted")["alpha"], _drafted_kinds(cfg))


def _drafted_learn(mine, step, produced_b, active_b, view, cfg):
    """The chain's estimates after a chain step; the plain-step run and the probe wait after
    any step (a copy counts as plain, a tree as drafting)."""
    block = jnp.maximum(step.kind, 1)  # the probe clock counts a copied step as plain
    tried_b = jnp.where(active_b, step.accepted + 1, 0)
    chain = jnp.where(step.kind >= TREE_KIND_BASE, 0, step.kind)  # 0: the estimates stay
    alpha = adaptive.update_estimates(
        mine["alpha"], step.accepted, tried_b, chain, cfg.adaptive_rate
    )
    return {
        "alpha": alpha,
        "plain_run": jnp.where(block == 1, mine["plain_run"] + 1, 0),
        "probe_wait": adaptive.next_probe_wait(
            mine["probe_wait"], block, step.accepted, active_b, cfg
        ),
    }


def _drafted_drafts(s, view, bs, ctx, draw, k_draft, anchor_b1, start_b, cut: bool):
    from dflash_jax.decoding.phases import draft_hidden, draft_tokens

    # Draft [anchor, MASK x (bs-1)] non-causally over the context (which ends at start).
    hidden_bgd = draft_hidden(
        ctx.drafter_params, ctx.target_params, ctx.tcfg, ctx.dcfg, anchor_b1, s.ctx_k, s.ctx_v,
        s.drf_len, start_b, bs,
    )  # fmt: skip
    if s.grammar is not None and not cut and grammar.drafts_constrained(ctx.dcfg):
        logits_bgv = drafter_logits(ctx.head, ctx.tcfg, ctx.dcfg, ctx.drafter_params, hidden_bgd)
        return grammar.constrained_drafts(logits_bgv, s.grammar, s.gstate, draw, k_draft)
    return draft_tokens(
        ctx.head, ctx.tcfg, ctx.dcfg, draw, hidden_bgd, k_draft, ctx.drafter_params, anchor_b1,
        kept=cut,
    )  # fmt: skip


# -- copy: prompt lookup and corpus lookup (kinds -b) -------------------------------------------
def _copy_kinds(cfg):
    return tuple(-b for b in cfg.lookup_kinds)


def _copy_init(cfg, b):
    return {"alpha": _prior(cfg, b)}


def _copy_look(s, ctx):
    """What a copy would propose now (cheap: token compares and table reads)."""
    copy_bg, found_b, corpus_b = lookup.device_proposal(
        ctx.prompt, ctx.prompt_lengths, s.gen, s.n_gen, ctx.cfg.block_size - 1,
        ctx.cfg.lookup_ngram, ctx.corpus,
    )  # fmt: skip
    if s.grammar is not None:  # a run the grammar forces is proposed instead, as a copy
        forced_b = grammar.forced_run(s.grammar, s.gstate, 1)[1] > 0
        copy_bg, found_b = grammar.with_forced(s.grammar, s.gstate, copy_bg, found_b)
        corpus_b = corpus_b & ~forced_b
    return {"copy": copy_bg, "found": found_b, "corpus": corpus_b}


def _copy_expect(control, view, cfg, b):
    gain_bk = adaptive.expected_tokens(_mine(control, "copy")["alpha"], cfg.lookup_kinds) - 1.0
    return 1.0 + gain_bk * view["found"][:, None]


def _copy_learn(mine, step, produced_b, active_b, view, cfg):
    return {
        "alpha": adaptive.update_lookup_estimates(
            mine["alpha"], view["copy"], step.new, produced_b, view["found"], cfg.adaptive_rate
        )
    }


def _copy_drafts(s, view, bs, ctx, draw, k_draft, anchor_b1, start_b, cut: bool):
    drafts_bg = view["copy"][:, : bs - 1]
    logp = None if draw.greedy else lookup.one_hot_logp(drafts_bg, ctx.tcfg.vocab_size)
    return (drafts_bg, logp) + ((jnp.full_like(start_b, bs - 1),) if cut else ())


def _copy_record(kind, view):
    """A text copy records -b, a corpus copy -(CORPUS_KIND_BASE + b)."""
    return jnp.where(view["corpus"], kind - CORPUS_KIND_BASE, kind)


# -- tree: a best-first token tree, one verify under the tree mask ------------------------------
def _tree_kinds(cfg):
    from dflash_jax.decoding.settings import tree_kind

    return (tree_kind(cfg.tree_nodes),) if cfg.tree_nodes else ()


def _tree_init(cfg, b):
    return {"alpha": _prior(cfg, b)} if cfg.adaptive and cfg.tree_nodes else None


def _tree_expect(control, view, cfg, b):
    tree_bg, chain_bg = _mine(control, "tree")["alpha"], _mine(control, "drafted")["alpha"]
    return adaptive.tree_expected_tokens(tree_bg, chain_bg, cfg)[:, None]


def _tree_learn(mine, step, produced_b, active_b, view, cfg):
    if mine is None:
        return None
    tried_b = jnp.where(active_b, step.accepted + 1, 0)
    # depths 1..tree_reach tried, each as far as the path got
    reach = jnp.where(step.kind >= TREE_KIND_BASE, adaptive.tree_reach(cfg) + 1, 0)
    return {
        "alpha": adaptive.update_estimates(
            mine["alpha"], step.accepted, tried_b, reach, cfg.adaptive_rate
        )
    }


def _tree_step(s, view, width, ctx):
    from dflash_jax.decoding import tree

    return tree.propose(s, ctx, width)


# The registry, in the order of `DecodeConfig.all_kinds` and of `LoopState.control`.
REGISTRY = (
    Entry("plain", _plain_kinds, _plain_expect),
    Entry("drafted", _drafted_kinds, _drafted_expect, _drafted_init, None, _drafted_learn,
          _drafted_drafts),
    Entry("copy", _copy_kinds, _copy_expect, _copy_init, _copy_look, _copy_learn, _copy_drafts,
          record=_copy_record, kind_at=lambda bs: -bs),
    Entry("tree", _tree_kinds, _tree_expect, _tree_init, None, _tree_learn, step=_tree_step),
)  # fmt: skip


def all_kinds(cfg: DecodeConfig) -> tuple[int, ...]:
    """Every kind the entries offer, in registry order (`DecodeConfig.all_kinds`)."""
    return tuple(k for e in REGISTRY for k in e.kinds(cfg)) if cfg.adaptive else ()


def entry_of_kinds(cfg: DecodeConfig) -> tuple[int, ...]:
    """The entry index (into REGISTRY) of each of `all_kinds(cfg)`."""
    return tuple(i for i, e in enumerate(REGISTRY) for _ in e.kinds(cfg)) if cfg.adaptive else ()


def init_control(cfg: DecodeConfig, b: int) -> tuple:
    """The controller's loop state of `b` rows: each entry's share (`LoopState.control`; kept,
    unread, by a fixed-block decode too, whose carry then matches an adaptive one's)."""
    return tuple(e.init(cfg, b) if e.init else None for e in REGISTRY)


def look(s, ctx) -> dict:
    """Every entry's view of the step before the choice, merged (entries name their keys)."""
    view = {}
    if ctx.cfg.adaptive:
        for e in REGISTRY:
            if e.look and e.kinds(ctx.cfg):
                view.update(e.look(s, ctx))
    return view


def choose_kind(control, active_b, costs_k, forced_kind, cfg: DecodeConfig, view):
    """Index into cfg.all_kinds of the kind to run now: each entry's expected tokens per cost,
    averaged over the active rows; a probe of the smallest drafting kind once the plain-step
    run reaches the probe wait (`adaptive` module docstring); `forced_kind` >= 0 overrides the
    choice (calibration)."""
    value_bk = jnp.concatenate(
        [e.expect(control, view, cfg, active_b.shape[0]) for e in REGISTRY if e.kinds(cfg)],
        axis=-1,
    )
    value_bk = value_bk / costs_k[None, :]
    weight_b = active_b.astype(jnp.float32)
    value_k = jnp.sum(value_bk * weight_b[:, None], 0) / jnp.maximum(jnp.sum(weight_b), 1.0)
    k = jnp.argmax(value_k).astype(jnp.int32)
    kinds = cfg.step_kinds
    plain = kinds.index(1) if 1 in kinds else -1
    smallest_draft = min(i for i, b in enumerate(kinds) if b > 1)
    clock = _mine(control, "drafted")
    k = jnp.where((k == plain) & (clock["plain_run"] >= clock["probe_wait"]), smallest_draft, k)
    return jnp.where(forced_kind >= 0, forced_kind, k)


def learn(control, step, produced_b, active_b, view, cfg: DecodeConfig) -> tuple:
    """Every entry's state after a step (`step`: its `Proposal`; produced_b [B] the tokens it
    committed; active_b [B] the rows still decoding when it ran); an entry whose kinds this
    decode does not offer keeps its state."""
    return tuple(
        e.learn(mine, step, produced_b, active_b, view, cfg) if e.learn and e.kinds(cfg) else mine
        for e, mine in zip(REGISTRY, control, strict=True)
    )


def record(kind, view, cfg: DecodeConfig, b: int):
    """What each row records for a step of the chosen `kind` [] -> [B]."""
    out = jnp.broadcast_to(kind, (b,))
    for e in REGISTRY:
        own = e.kinds(cfg)
        if e.record and own:
            mine = jnp.any(kind == jnp.asarray(own, jnp.int32))
            out = jnp.where(mine, e.record(kind, view), out)
    return out


def branches(cfg: DecodeConfig) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The compiled step variants of an adaptive decode: (verify width, the entries that draft
    a chain of it) per width, then (0, (i,)) per entry with a step of its own. -> the list,
    and each kind's branch index [num_kinds]."""
    if all_kinds(cfg) != cfg.all_kinds:  # DecodeConfig lists them without the registry
        raise AssertionError(f"registry kinds {all_kinds(cfg)} != {cfg.all_kinds}")
    of_kind = entry_of_kinds(cfg)
    widths = sorted({abs(k) for k, i in zip(all_kinds(cfg), of_kind, strict=True)
                     if REGISTRY[i].step is None})  # fmt: skip
    chains = tuple(
        (w, tuple(sorted({i for k, i in zip(all_kinds(cfg), of_kind, strict=True)
                          if REGISTRY[i].step is None and abs(k) == w})))
        for w in widths
    )  # fmt: skip
    own = tuple((0, (i,)) for i, e in enumerate(REGISTRY) if e.step is not None and e.kinds(cfg))
    return chains + own


def branch_of_kinds(cfg: DecodeConfig) -> tuple[tuple[int, int], ...]:
    """(branch index, entry's place among its branch's entries) of each of cfg.all_kinds."""
    variants = branches(cfg)
    out = []
    for k, i in zip(all_kinds(cfg), entry_of_kinds(cfg), strict=True):
        for j, (w, entries) in enumerate(variants):
            if i in entries and (REGISTRY[i].step is not None or abs(k) == w):
                out.append((j, entries.index(i)))
                break
    return tuple(out)


def state_axes(control) -> object:
    """Logical axes of the control state's leaves: per-row arrays split with the batch."""
    return jax.tree.map(lambda x: ("batch",) if np.ndim(x) else (), control)
