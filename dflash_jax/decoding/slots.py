"""Continuous batching over the speculative loop: the B rows of one running decode are slots
that requests enter and leave between advance calls (a server's engine, `infer.serve`).

The decode is the loop of `decoding.speculative` with `DecodeConfig.row_settings`: each row
carries its request's sampling settings, PRNG key and token limit (`sampling.RowSettings`), so
one compiled loop serves every mix of requests. Between calls of its `advance` half (a chunk of
steps) the host reads what each row committed, frees the rows that are done, and admits waiting
requests into free rows with `insert_many`: one jitted prefill of every admitted prompt
together (K rows, K a power of two, padded) whose target cache rows, drafter context rows and
bookkeeping replace those rows of the loop state while the other rows keep theirs (the state is
donated: nothing else is copied). The advance for the slots' shape is compiled at
construction; an insert program per (K, prompt width) on its first use (`Inserts`): a missing
row count is compiled in the background while a compiled program of more rows (padded) or
fewer (in turns) stands in, so only a prompt width never seen before waits for a compile.

Structured output (`grammar_shape`): each row carries its own grammar table and automaton
state; the constrained advance (compiled on first use) runs while a busy row has one, else the
plain one (grammar fields set aside). A row busy alone runs in a one-row program (`solo`).

With batch invariance (`DecodeConfig.batch_invariant`) a greedy row's tokens are the target's
greedy tokens whatever the other rows hold: every target pass computes a row the same way at
any row count, and stale cache rows of a slot's previous request sit past its length, where
attention gives them weight zero. A sampled row draws from its own key folded with its own step
count; its tokens are still exact samples of the target, but in adaptive mode the rows share
each step's kind, so which tokens a seed gives depends on the other rows.

Letters: N slots (the batch), P prompt buffer width, W generated-token buffer.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ConfigError
from dflash_jax.decoding import grammar, proposers, speculative
from dflash_jax.decoding.admission import Inserts, insert_rows, release_rows, row_counts
from dflash_jax.decoding.plan import make_plan
from dflash_jax.decoding.runner import compile_half, decode_params
from dflash_jax.decoding.sampling import RowSettings
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.solo import Solo
from dflash_jax.decoding.solo import peek as _peek
from dflash_jax.decoding.state import LoopState, max_steps

MIN_BUCKET = 32  # the narrowest prompt buffer an insert compiles for (as `api.bucket_length`)


def prompt_buckets(max_prompt: int) -> tuple[int, ...]:
    """The prompt widths an insert compiles for: powers of two from MIN_BUCKET up to the first
    that holds `max_prompt` tokens."""
    widths = [MIN_BUCKET]
    while widths[-1] < max_prompt:
        widths.append(widths[-1] * 2)
    return tuple(widths)


@dataclasses.dataclass(frozen=True)
class Admit:
    """One request for a free row (`SlotDecoder.insert_many`): its prompt token ids, its own
    token limit and sampling settings; `logprobs`: keep its tokens' log-probabilities (with
    `DecodeConfig.logprobs`); grammar: its structured output, a host table padded to the
    decoder's `grammar_shape` (`grammar.host_table`), None without."""

    slot: int
    token_ids: tuple[int, ...] | list[int]
    max_new: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False
    grammar: grammar.Grammar | None = None


@dataclasses.dataclass
class Chunk:
    """What one advance call did. gen [N,W], n_gen [N], done [N], num_steps [N] as the state
    holds them after the chunk; acc [N,steps], kinds [N,steps]: each step's committed tokens
    and kind per row (0 where the row ran no step); seconds: the call's wall time; logprobs:
    with `DecodeConfig.logprobs`, (logp [N,W], top_logp [N,W,K], top_ids [N,W,K]) beside gen
    (filled for the rows inserted with logprobs), else None."""

    gen: np.ndarray
    n_gen: np.ndarray
    done: np.ndarray
    num_steps: np.ndarray
    acc: np.ndarray
    kinds: np.ndarray
    seconds: float
    logprobs: tuple | None = None


class SlotDecoder:
    """`slots` rows of one speculative decode, with requests inserted into free rows (`insert`)
    and released (`release`) between calls of `advance`, each a chunk of loop steps. Not
    thread-safe: one engine thread drives it. Prompts up to `max_prompt` tokens, each with at
    most `cfg.max_new_tokens` new tokens (its own limit below that); `cfg` must have
    row_settings. The adaptive controller's step costs are the defaults until `calibrate`.
    grammar_shape: (states, token classes) of each row's grammar table, for requests with
    structured output (`Admit.grammar`); None: no grammars. solo: a row busy alone runs in a
    program of one row (`decoding.solo`)."""

    def __init__(
        self, target, drafter, cfg: DecodeConfig, slots: int, max_prompt: int,
        grammar_shape: tuple[int, int] | None = None, solo: bool = True,
    ):  # fmt: skip
        if not cfg.row_settings:
            raise ConfigError("a SlotDecoder needs DecodeConfig(row_settings=True)")
        if drafter is None:
            raise ConfigError("a SlotDecoder decodes with a drafter (speculative rows)")
        self.plan = make_plan(target.config, drafter.config, cfg)  # checked, resolved once
        context = target.config.max_position_embeddings
        if max_prompt + cfg.max_new_tokens > context:
            raise ConfigError(
                f"max_prompt {max_prompt} + max_new_tokens {cfg.max_new_tokens} exceeds the "
                f"target's context of {context} tokens"
            )
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.slots, self.max_prompt = slots, max_prompt
        self.grammar_shape = None if grammar_shape is None else tuple(map(int, grammar_shape))
        self._grammar_rows = np.zeros((slots,), bool)  # which busy rows have a grammar
        self.busy = np.zeros((slots,), bool)  # rows holding a request (done or not)
        self._constrained = None  # the constrained advance, compiled on its first use
        self.buckets = prompt_buckets(max_prompt)
        self.statics = self.plan.statics
        self.params = (target.params, decode_params(drafter))
        width = self.buckets[-1]
        self.prompt = np.zeros((slots, width), np.int32)
        self.lengths = np.ones((slots,), np.int32)
        # The controller's step costs: one table while every busy row is greedy, one while
        # some row samples (then every row runs the sampling arithmetic: a drafted step
        # costs far more, e.g. block 4 at 8 slots 1.7x a plain step greedy, 2.1x sampling).
        self.step_costs = speculative.step_cost_array(cfg)
        self.sampled_step_costs = self.step_costs
        self._sampling = np.zeros((slots,), bool)  # which rows' requests sample
        self._rng = jax.random.key(0)  # the loop's own key: unused, each row has its own
        self.state = self._empty_state()
        self._compile_all()
        self.solo = Solo(self) if solo and slots > 1 else None

    # -- programs -------------------------------------------------------------------------
    def _empty_state(self) -> LoopState:
        """The loop state of `slots` free rows (every row done), without running a prefill."""
        shapes = speculative.start_speculative.eval_shape(
            *self.params, self.prompt, self.lengths, self._rng, **self.statics
        )
        state = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        control = list(state.control)  # the probe clock starts at its wait
        drafted = [e.name for e in proposers.REGISTRY].index("drafted")
        control[drafted] = {**control[drafted], "probe_wait": jnp.int32(self.cfg.probe_every)}
        state = state.replace(done=jnp.ones((self.slots,), bool), control=tuple(control))
        if self.grammar_shape is not None:  # every row without a grammar
            free = jax.tree.map(jnp.asarray, self._constraint([Admit(0, (), 1)] * self.slots))
            state = state.replace(grammar=free[0], gstate=free[1])
        return state

    def _advance_args(self, state, costs, forced_kind, steps) -> tuple:
        args = (self.prompt, self.lengths, self._rng, costs, np.int32(forced_kind))
        return (*self.params, *args, np.int32(steps), state)

    def _compile_advance(self, state):
        program, _, seconds = compile_half(
            speculative.advance_speculative, self._advance_args(state, self.step_costs, -1, 0),
            self.statics, None, self.plan.compiler_options,
        )  # fmt: skip
        return program, seconds

    def _compile_all(self) -> None:
        """The advance and the release now; the inserts on their first use (`Inserts`)."""
        t0 = time.perf_counter()
        self._advance, _ = self._compile_advance(self._plain(self.state))
        options = self.plan.compiler_options
        insert = jax.jit(insert_rows, static_argnames=tuple(self.statics), donate_argnames="state")
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state
        )
        self.inserts = Inserts(
            lambda k, width: insert.lower(
                *self.params, np.zeros((k, width), np.int32), np.ones((k,), np.int32),
                self._row_settings([Admit(0, (), 1)] * k), np.zeros((k,), np.int32), state,
                self._constraint([Admit(0, (), 1)] * k), **self.statics,
            ),
            options, row_counts(self.slots), self.buckets,
        )  # fmt: skip
        release = jax.jit(release_rows, donate_argnums=0)
        self._release = release.lower(self.state, np.zeros((self.slots,), bool)).compile()
        self._compile_s = time.perf_counter() - t0

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling: the advances and release, and every insert so far."""
        return self._compile_s + self.inserts.seconds + (self.solo.compile_s if self.solo else 0)

    def _plain(self, state: LoopState) -> LoopState:  # the grammar fields set aside
        return state.replace(grammar=None, gstate=None)

    def _constraint(self, admits):  # the insert's input: each admitted row's grammar
        if self.grammar_shape is None:
            return None
        vocab = self.target.config.vocab_size
        return grammar.row_constraint([a.grammar for a in admits], vocab, self.grammar_shape)

    # -- rows ----------------------------------------------------------------------------
    def _row_settings(self, admits) -> RowSettings:
        """The settings [K] of `admits` (a list of `Admit`)."""
        field = lambda name, dtype: np.asarray([getattr(a, name) for a in admits], dtype)
        keys = [np.asarray(jax.random.key_data(jax.random.key(a.seed))) for a in admits]
        return RowSettings(
            temperature=field("temperature", np.float32),
            top_k=field("top_k", np.int32),
            top_p=field("top_p", np.float32),
            key_data=np.stack(keys),
            max_new=field("max_new", np.int32),
            logprobs=field("logprobs", bool) if self.cfg.logprobs else None,
        )

    def insert(self, slot: int, token_ids, *, max_new: int, **settings) -> None:
        """Prefills one request into row `slot` (a free one): `insert_many` of one `Admit`
        (`settings`: its temperature, top_k, top_p, seed, logprobs)."""
        self.insert_many([Admit(slot, token_ids, max_new, **settings)])

    def insert_many(self, admits) -> None:
        """Prefills the requests `admits` (`Admit`s, each for a different free row) together,
        each with its own settings: one insert program of K >= len(admits) rows at the widest
        prompt's bucket, or what `Inserts.plan` runs while that one compiles."""
        for a in admits:
            if a.logprobs and not self.cfg.logprobs:
                raise ValueError("logprobs: this decoder keeps none (DecodeConfig.logprobs=0)")
            n = len(a.token_ids)
            if not 1 <= n <= self.max_prompt:
                raise ValueError(f"prompt of {n} tokens: between 1 and {self.max_prompt} fit")
            if not 1 <= a.max_new <= self.cfg.max_new_tokens:
                raise ValueError(f"max_new={a.max_new}: between 1 and {self.cfg.max_new_tokens}")
            if not 0 <= a.slot < self.slots:
                raise ValueError(f"slot {a.slot}: between 0 and {self.slots - 1}")
            if a.grammar is not None:
                if self.grammar_shape is None:
                    raise ValueError("structured output: this decoder carries no grammars")
                if tuple(a.grammar.trans.shape) != self.grammar_shape:
                    raise ValueError(
                        f"a grammar table of shape {tuple(a.grammar.trans.shape)}: this "
                        f"decoder's are {self.grammar_shape} (grammar.host_table(shape=))"
                    )
        if len({a.slot for a in admits}) < len(admits):
            raise ValueError("two requests for one slot")
        if not admits:
            return
        if self.solo is not None:  # a row decoded alone goes back to its slot first
            self.solo.leave()
        width = next(w for w in self.buckets if w >= max(len(a.token_ids) for a in admits))
        admits = list(admits)
        for taken, k, w in self.inserts.plan(len(admits), width):
            self._insert(admits[:taken], k, w)
            admits = admits[taken:]

    def _insert(self, admits, k: int, width: int) -> None:
        """`admits` (at most k) through the insert program of k rows at `width`; the rows
        past them are padding, written nowhere."""
        pad = Admit(self.slots, (0,), 1)
        rows = list(admits) + [pad] * (k - len(admits))
        prompt = np.zeros((k, width), np.int32)
        for i, a in enumerate(rows):
            prompt[i, : len(a.token_ids)] = a.token_ids
        for a in admits:
            n = len(a.token_ids)
            self.prompt[a.slot] = 0
            self.prompt[a.slot, :n] = a.token_ids
            self.lengths[a.slot] = n
            self._sampling[a.slot] = a.temperature > 0
            self._grammar_rows[a.slot] = a.grammar is not None
            self.busy[a.slot] = True
        lengths = np.asarray([len(a.token_ids) for a in rows], np.int32)
        slots = np.asarray([a.slot for a in rows], np.int32)
        self.state = self.inserts.get(k, width)(
            *self.params, prompt, lengths, self._row_settings(rows), slots, self.state,
            self._constraint(rows),
        )  # fmt: skip

    def intact(self) -> bool:
        """Whether the loop state is whole: an insert donates it, so one that failed while
        running (not compiling) may have taken it down (the decoder is then unusable)."""
        solo = None if self.solo is None else self.solo.state
        return not any(x.is_deleted() for x in jax.tree.leaves((self.state, solo)))

    def advance(self, steps: int, forced_kind: int = -1) -> Chunk:
        """Runs up to `steps` loop steps (fewer when every row is done), then releases nothing:
        call `release` next, which also restarts the step count. The controller steers by
        `sampled_step_costs` while some row samples, else by `step_costs`; one busy row alone
        runs in the one-row program (`decoding.solo`). -> the chunk's records."""
        t0 = time.perf_counter()
        if self.solo is not None and self.solo.fits():
            peeked = self.solo.advance(steps, forced_kind)
        else:
            if self.solo is not None:
                self.solo.leave()
            self._advance_all(steps, forced_kind)
            peeked = jax.device_get(_peek(self.state))
        gen, n_gen, done, num_steps, acc, kinds, step, lp = peeked
        seconds = time.perf_counter() - t0
        ran = int(step)
        return Chunk(gen, n_gen, done, num_steps, acc[:, :ran], kinds[:, :ran], seconds, lp)

    def _advance_all(self, steps: int, forced_kind: int) -> None:
        costs = self.sampled_step_costs if self._sampling.any() else self.step_costs
        steps = min(steps, max_steps(self.cfg))
        if self._grammar_rows.any():  # the constrained loop, over the whole state
            if self._constrained is None:
                self._constrained, seconds = self._compile_advance(self.state)
                self._compile_s += seconds
            args = self._advance_args(self.state, costs, forced_kind, steps)
            self.state = self._constrained(*args)
        elif self.grammar_shape is None:
            self.state = self._advance(*self._advance_args(self.state, costs, forced_kind, steps))
        else:  # the plain loop; the (unused) grammar fields kept aside
            kept = {"grammar": self.state.grammar, "gstate": self.state.gstate}
            args = self._advance_args(self._plain(self.state), costs, forced_kind, steps)
            self.state = self._advance(*args).replace(**kept)

    def release(self, rows) -> None:
        """Marks the rows `rows` (indices) free (done, their lengths one token: they cost the
        loop's passes almost nothing), and restarts the step count."""
        mask = np.zeros((self.slots,), bool)
        mask[list(rows)] = True
        self._sampling[mask] = False
        self._grammar_rows[mask] = False
        self.busy[mask] = False
        self.lengths[mask] = 1
        if self.solo is not None:
            self.solo.release(rows)
        self.state = self._release(self.state, mask)

    # -- start-up ------------------------------------------------------------------------
    def warm_up(self, token_ids, steps: int = 1) -> None:
        """Runs every step kind once over all rows, every other one sampling and all keeping
        log-probabilities (with `DecodeConfig.logprobs`), so that those branches run too
        (XLA:CPU sets each fusion up at its first execution; `api._warm`), then frees the
        rows. The inserts of every slot at once and of one row are compiled (at the width of
        `token_ids`) and run here; others on their first use (`admission.Inserts`)."""
        kinds = range(len(self.cfg.all_kinds)) if self.cfg.adaptive else (-1,)
        for kind in kinds:
            self._fill(token_ids, sampled=True, logprobs=bool(self.cfg.logprobs))
            self.advance(steps, forced_kind=kind)
            self.release(range(self.slots))
        for kind in kinds if self.solo is not None else ():  # one busy row: its program
            self.insert(0, token_ids, max_new=self.cfg.max_new_tokens)
            self.advance(steps, forced_kind=kind)
            self.release([0])
        self.insert(0, token_ids, max_new=1)
        self.release([0])

    def _fill(self, token_ids, sampled: bool, logprobs: bool = False) -> None:
        """Every slot busy with `token_ids`; with `sampled`, the odd ones sample (temperature
        0.7, top_p 0.95, a seed each), the others greedy; with `logprobs`, every row keeps
        its tokens' log-probabilities. One insert of every slot."""
        self.insert_many([
            Admit(
                slot, token_ids, self.cfg.max_new_tokens,
                temperature=0.7 if sample else 0.0, top_p=0.95 if sample else 1.0, seed=slot,
                logprobs=logprobs,
            )
            for slot, sample in ((s, sampled and s % 2 == 1) for s in range(self.slots))
        ])  # fmt: skip

    def calibrate(
        self, token_ids, steps: int = 8, repeats: int = 2, sampled_steps: int = 4
    ) -> np.ndarray:
        """The adaptive controller's step costs measured on this decode's own program, every
        row busy: each kind forced for `steps` steps, the fastest of `repeats` rounds, in units
        of a plain step's (only their ratios steer the controller). Then the same with every
        other row sampling (temperature 0.7, top_p 0.95; `sampled_steps` steps, one round) for
        `sampled_step_costs`. Sets both and returns the greedy table."""
        if not self.cfg.adaptive:
            return self.step_costs
        every = range(self.slots)
        fill = lambda sampled: lambda: self._fill(token_ids, sampled)
        self.step_costs = self._measure_costs(fill(False), every, steps, repeats)
        self.sampled_step_costs = self._measure_costs(fill(True), every, sampled_steps, 1)
        if self.solo is not None:
            self.solo.calibrate(token_ids, steps, sampled_steps, repeats)
        return np.asarray(self.step_costs)

    def _measure_costs(self, fill, rows, steps: int, repeats: int) -> jax.Array:
        """Each kind forced for `steps` steps once `fill()` has made `rows` busy (its prefills
        and a row alone's move to its program not timed), the fastest of `repeats` rounds, in
        units of a plain step's."""
        best = np.full(len(self.cfg.all_kinds), np.inf)
        for _ in range(repeats):
            for kind in range(len(self.cfg.all_kinds)):
                fill()
                self.advance(0)  # untimed: waits for the prefills
                chunk = self.advance(steps, forced_kind=kind)
                self.release(rows)
                best[kind] = min(best[kind], chunk.seconds / max(chunk.acc.shape[1], 1))
        unit = best[self.cfg.all_kinds.index(1)] if 1 in self.cfg.all_kinds else best.min()
        return jnp.asarray(np.maximum(best / unit, 1.0), jnp.float32)
