"""Structured output on the device: a token-level automaton (a JSON schema's, a regular
expression's or a list of choices', compiled on the host by `io.grammar`) as arrays the decode
loops carry, so that every target distribution the loop draws from is masked to the tokens the
automaton allows where that token would stand.

The table is token classes: `class_of` [V] maps each token to its class (tokens whose moves
agree in every state share one; class 0 is never allowed), `trans` [S, C] the next state of
each (state, class), -1 where the class is not allowed. A state's allowed tokens are
`trans[state][class_of] >= 0` (one gather of V), the move on a token one read. S and C are
padded to powers of two (`bucket`), so a new grammar of similar size reuses the compiled loop.

Row states: >= 0 a state of the table; NONE (-1) a row without a grammar (nothing masked);
DEAD (-2) past a token the automaton refuses (only ever in a verify position after a draft
the masked target rejects: nothing there is committed), masked as NONE. A live state allows
at least one token; a row reaching a state that allows none (past a stop token at the end of
an accepting state, the only move left there) is done.

Letters: B batch, T verified block, G drafts, V vocab, S states, C classes.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.sampling import RowSettings, process_logits, row_keys, sample
from dflash_jax.ops.reductions import argmax_last

NONE = -1  # a row without a grammar
DEAD = -2  # past a refused token (never committed)
MIN_BUCKET = 64


@flax.struct.dataclass
class Grammar:
    """A compiled grammar on the device: class_of [V] int32, trans [S, C] int32 (-1: not
    allowed), live [S] bool (the state allows some token), forced [S] int32 (the one token a
    state allows, -1 where it allows none or several). State 0 is the start."""

    class_of: jax.Array
    trans: jax.Array
    live: jax.Array
    forced: jax.Array

    @property
    def per_row(self) -> bool:
        """One table per row (class_of [B, V], trans [B, S, C], ...: a server's slots, each
        with its own request's grammar), rather than one for every row."""
        return self.class_of.ndim == 2

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self))


def bucket(n: int) -> int:
    """The padded size of a dimension of n: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(int(n) - 1, 0).bit_length())


def host_table(class_of, trans, shape: tuple[int, int] | None = None) -> Grammar:
    """The host table (class_of [V], trans [S, C] numpy, from `io.grammar`) padded to `shape`
    (S, C) (None: its buckets), as numpy arrays; ValueError if it does not fit `shape`."""
    class_of = np.asarray(class_of, np.int32)
    trans = np.asarray(trans, np.int32)
    s, c = trans.shape
    rows, cols = shape or (bucket(s), bucket(c))
    if s > rows or c > cols:
        raise ValueError(
            f"the grammar's table has {s} states x {c} token classes; this decoder's grammar "
            f"table holds at most {rows} x {cols}: simplify the grammar, or give the decoder "
            "a larger grammar table"
        )
    padded = np.full((rows, cols), -1, np.int32)
    padded[:s, :c] = trans
    live = (padded >= 0).any(axis=1)
    sizes = np.bincount(class_of, minlength=padded.shape[1])  # tokens per class
    allowed_sc = padded >= 0
    count = allowed_sc @ sizes
    single = np.where(allowed_sc & (sizes == 1)[None, :], 1, 0)
    token_of_class = np.full(padded.shape[1], -1, np.int64)
    token_of_class[class_of] = np.arange(class_of.size)  # a class of one token: that token
    forced = np.where(
        count == 1, token_of_class[np.argmax(single, axis=1)], -1
    )  # a state with one allowed token: its class has that one token
    return Grammar(class_of=class_of, trans=padded, live=live, forced=forced.astype(np.int32))


def device_table(class_of, trans) -> Grammar:
    """The host table padded to its buckets (`host_table`) and placed on the device."""
    return jax.tree.map(jnp.asarray, host_table(class_of, trans))


@functools.lru_cache(maxsize=4)
def no_grammar(vocab: int, shape: tuple[int, int]) -> Grammar:
    """The table of a row without a grammar, in a per-row table of `shape` (S, C): nothing
    allowed (its row's state is NONE, so nothing is masked). Kept: every admission of a
    decoder with grammars reads it (`row_constraint` stacks copies)."""
    s, c = shape
    return Grammar(
        class_of=np.zeros(vocab, np.int32), trans=np.full((s, c), -1, np.int32),
        live=np.zeros(s, bool), forced=np.full(s, -1, np.int32),
    )  # fmt: skip


def per_row(tables) -> Grammar:
    """One table per row (`Grammar.per_row`) from host tables of one shape, in row order."""
    return jax.tree.map(lambda *xs: np.stack(xs), *tables)


def constraint(g: Grammar, batch: int, rows=None):
    """The decodes' `constraint` input: (g, each row's start state [B]): 0 (the start) for
    every row, or for the rows where `rows` [B] (bool) is true, NONE elsewhere."""
    start = np.zeros(batch, np.int32)
    if rows is not None:
        start = np.where(np.asarray(rows, bool), 0, NONE).astype(np.int32)
    return g, jnp.asarray(start)


def row_constraint(tables, vocab: int, shape: tuple[int, int]):
    """The constraint of rows each with its own grammar (a host table of `shape`, or None):
    (one table per row, `per_row`; each row's start state: 0, NONE for a row without)."""
    free = no_grammar(vocab, shape)
    start = np.asarray([NONE if t is None else 0 for t in tables], np.int32)
    return per_row([free if t is None else t for t in tables]), start


def rowwise(fn):
    """`fn(g, state, *args)` for one table, run per row (vmapped over the leading axis of the
    table and of every argument) when `g` holds one table per row (`Grammar.per_row`)."""

    def run(g, *args):
        return jax.vmap(fn)(g, *args) if g.per_row else fn(g, *args)

    run.__doc__, run.__name__ = fn.__doc__, fn.__name__
    return run


@rowwise
def allowed(g: Grammar, state) -> jax.Array:
    """Tokens allowed in `state` [...] -> bool [..., V]; all of them for NONE/DEAD rows."""
    at = jnp.maximum(state, 0)
    ok = jnp.take(g.trans[at], g.class_of, axis=-1) >= 0  # [..., C] -> [..., V]
    free = (state < 0) | ~g.live[at]  # nothing masked (a done row's pad: never committed)
    return ok | free[..., None]


@rowwise
def advance(g: Grammar, state, token) -> jax.Array:
    """The state after `token` [...] from `state` [...]: NONE stays NONE, a refused token DEAD."""
    nxt = g.trans[jnp.maximum(state, 0), g.class_of[token]]
    nxt = jnp.where(nxt >= 0, nxt, DEAD)
    return jnp.where(state < 0, state, nxt)


@rowwise
def is_live(g: Grammar, state) -> jax.Array:
    """Whether `state` [...] (a state of the table, >= 0) allows some token."""
    return g.live[jnp.maximum(state, 0)]


@rowwise
def forced_token(g: Grammar, state) -> jax.Array:
    """The one token `state` [...] allows (-1 where it allows none or several)."""
    return g.forced[jnp.maximum(state, 0)]


def walk(g: Grammar, state_b, tokens_bt) -> jax.Array:
    """States before each token and after the last: [B] + tokens [B,T] -> [B,T+1]."""
    states = [state_b]
    for t in range(tokens_bt.shape[1]):
        states.append(advance(g, states[-1], tokens_bt[:, t]))
    return jnp.stack(states, axis=1)


def commit_walk(g: Grammar, state_b, new_bt, produced_b):
    """The rows' states after committing new[:, :produced] -> (state [B], ended [B]: the row
    has a grammar and reached a state that allows no token, or a refused one)."""
    states_bt = walk(g, state_b, new_bt)
    state_b = jnp.take_along_axis(states_bt, produced_b[:, None], 1)[:, 0]
    ended_b = (state_b == DEAD) | ((state_b >= 0) & ~is_live(g, state_b))
    return state_b, ended_b


def started(constraint, first_b):
    """What the prefill carries of a constraint once its first tokens [B] are drawn:
    ({grammar, gstate} for the loop state, or {}; the rows it ended [B] or False)."""
    if constraint is None:
        return {}, False
    g, start_b = constraint
    state_b, ended_b = commit_walk(g, start_b, first_b[:, None], jnp.ones_like(first_b))
    return {"grammar": g, "gstate": state_b}, ended_b


def masked_head(head, g: Grammar | None, state):
    """`head` whose logits are masked to the tokens allowed in `state` [...] (the positions its
    hidden states [..., D] stand at); `head` itself without a grammar."""
    if g is None:
        return head
    return head.replace(allowed=allowed(g, state))


def constrained_drafts(logits_bgv, g: Grammar, state_b, draw, key):
    """Drafts one after the other from the drafter's logits [B,G,V], each masked to the tokens
    allowed after the drafts before it (a state with one allowed token drafts it: forced tokens
    cost nothing): greedy the masked argmax, sampled a draw from the masked, processed
    distribution, which is then the proposal's q. -> (drafts [B,G], log q [B,G,V] or None)."""
    b, gn, _ = logits_bgv.shape
    keys_b = None if draw.greedy and not isinstance(draw, RowSettings) else row_keys(key, b)
    tokens, logps = [], []
    state = state_b
    for j in range(gn):
        x_bv = jnp.where(allowed(g, state), logits_bgv[:, j], -jnp.inf)
        tok_b = argmax_last(x_bv)
        if keys_b is not None:
            logq_bv = process_logits(x_bv, draw)
            keys_j = jax.vmap(lambda k, j=j: jax.random.fold_in(k, j))(keys_b)
            drawn_b = sample(keys_j, logq_bv, draw)
            if isinstance(draw, RowSettings):
                drawn_b = jnp.where(draw.temperature > 0, drawn_b, tok_b)
            tok_b = drawn_b
            logps.append(logq_bv)
        tokens.append(tok_b)
        state = advance(g, state, tok_b)
    drafts_bg = jnp.stack(tokens, axis=1)
    return drafts_bg, (jnp.stack(logps, axis=1) if logps else None)


def forced_run(g: Grammar, state_b, width: int):
    """The run of tokens the grammar forces from each row's state (each the one token its
    state allows), up to `width`: -> (tokens [B,width] (0 past the run), run length [B])."""
    state, going = state_b, state_b >= 0
    tokens, n = [], jnp.zeros_like(state_b)
    for _ in range(width):
        tok_b = jnp.where(going, forced_token(g, state), -1)
        going = going & (tok_b >= 0)
        tokens.append(jnp.where(going, tok_b, 0))
        n = n + going.astype(jnp.int32)
        state = jnp.where(going, advance(g, state, jnp.maximum(tok_b, 0)), state)
    return jnp.stack(tokens, axis=1), n


TREE_REFUSED = (
    "structured output (a JSON schema, regex or choices) is not applied to tree steps: "
    "decode without tree_nodes"
)


def drafts_constrained(dcfg) -> bool:
    """Whether the drafter's proposals are drawn masked (`constrained_drafts`): a DFlash
    drafter over the target's vocabulary; the others' drafts are proposed as they come, and
    the masked verify rejects a refused one (lossless either way)."""
    return not (dcfg.is_dspark or dcfg.is_dflash2 or dcfg.draft_vocab_size)


def with_forced(g: Grammar, state_b, copy_bg, found_b):
    """A prompt-lookup proposal [B,W] with, for the rows whose state forces a run, that run
    instead (verified like a copy: each forced token is accepted, the masked target having
    no other choice), the rows with a run counted as found. -> (proposal, found)."""
    run_bw, n_b = forced_run(g, state_b, copy_bg.shape[1])
    has_b = n_b > 0
    return jnp.where(has_b[:, None], run_bw, copy_bg), found_b | has_b


def forced_share(g: Grammar, tokens_bn, lengths_b) -> tuple[int, int]:
    """(tokens the grammar forced, tokens) over each row's first lengths[b] tokens, on the
    host: a token counts as forced where its state allows no other."""
    trans, class_of = np.asarray(g.trans), np.asarray(g.class_of)
    forced = np.asarray(g.forced)
    hits = total = 0
    for row, n in zip(np.asarray(tokens_bn), np.asarray(lengths_b), strict=True):
        state = 0
        for tok in row[:n]:
            total += 1
            hits += int(forced[state] >= 0)
            state = int(trans[state, class_of[tok]])
            if state < 0:
                break
    return hits, total
