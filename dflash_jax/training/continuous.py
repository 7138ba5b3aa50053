"""Continuous batching of the target alone, for training data: rows decode one token a step in
one jitted loop; a row whose answer stops leaves at once and the next waiting prompt is
prefilled into it, so no row idles until the longest answer of a batch ends (what fixed
batches do: `generate._decode_batch`).

The server's slots (`decoding.slots.SlotDecoder`) do the same for the speculative loop and need
a drafter; training data is made before there is one, so this is the autoregressive loop of
`decoding.autoregressive`, step for step: the same pass, the same greedy head
(`next_token` with the decode's own config, no per-row settings to branch on) and a cache
sized to its `max_prompt` (rounded up to BUCKET) plus the answer, as a fixed batch's. Sampled
rows draw their n-th token with their own key folded with n, so an answer does not depend on
the rows beside it; a greedy row's tokens are the target's greedy tokens.

How it saves steps (docs/training.md measures it against fixed batches): the step holds a fixed
batch's ops, compiled as the decode loops are (`programs.LOOP_COMPILER_OPTIONS`: without them
XLA:CPU copied every layer's K and V cache twice a step), a chunk of steps ends as soon as a row
stops while prompts wait (so a freed row idles for no step), and once no prompt waits the rows still
decoding are gathered into a state of half the rows (down to `slots // 8`), whose steps cost less:
the tail of long answers runs at the rows it needs.

How it prefills: the prompts of a call enter longest first, a stage of them (up to as many as the
rows, of one width) prefilled in one batched pass, whose rows are then copied into rows as they
free (a one-row prefill per prompt cost about twice a token on a CPU). The tokens every prompt
begins with (a chat template's system prompt: 24 of the mixed set's 36-51 tokens for SmolLM2)
are prefilled once per call and copied into each stage's caches, and the stage runs over the
rest of each prompt only (`phases.prefill(prefix=...)`). Programs: one advance and one gather
per row count, the prefix's prefill, one stage per (rows, width: `stage_widths`) and one
insert per stage shape, each compiled at its first use (`warm_up` compiles what a call runs).

Letters: N rows (slots), P prompt buffer width, W generated-token buffer.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.autoregressive import autoregressive_config
from dflash_jax.decoding.phases import next_token, prefill
from dflash_jax.decoding.programs import LOOP_COMPILER_OPTIONS, run_target_config
from dflash_jax.decoding.sampling import RowSettings
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.state import LoopState, commit, keep_going, step_key
from dflash_jax.models.target import KVCache, Transformer, decoding_head

CHUNK_STEPS = 64  # the most loop steps between host visits (a progress update)
BUCKET = 32  # the prompt buffer is the widest prompt rounded up to a multiple of this
STAGE_WIDTH = 16  # the narrowest prompt width a stage compiles for (`stage_widths`)
SHRINK_FLOOR = 8  # rows are gathered into halves down to slots // SHRINK_FLOOR (at least 1)


def _start(params, prompt_np, lengths_n, rows: RowSettings, *, tcfg, cfg) -> LoopState:
    """The prefill of every row at once (its shapes give the slots' empty state)."""
    cache_len = prompt_np.shape[1] + cfg.max_new_tokens + 2
    head = decoding_head(params, tcfg)
    state, _ = prefill(params, head, tcfg, cfg, prompt_np, lengths_n, None, cache_len, (), rows)
    return state


def _prefix(params, head, prefix_1c, rows_1: RowSettings, *, tcfg, cfg) -> KVCache:
    """The cache of the C tokens every prompt of a call begins with (one row, C positions;
    the chat template's system prompt, say): prefilled once, copied into every stage."""
    c = prefix_1c.shape[1]
    lengths_1 = jnp.full((1,), c, jnp.int32)
    state, _ = prefill(params, head, tcfg, cfg, prefix_1c, lengths_1, None, c, (), rows_1)
    cut = lambda bufs: tuple(x[:, :, :c] for x in bufs)  # a row rule rounds the length up
    return state.cache.replace(k=cut(state.cache.k), v=cut(state.cache.v))


def _stage(params, head, prefix, suffix_gs, lengths_g, rows_g: RowSettings, *, tcfg, cfg):
    """G prompts prefilled in one pass (a batched prefill costs less a token than one-row ones:
    SmolLM2 fp32 on a CPU, 1.4 against 2.5 ms at 32 tokens): [G,S] each prompt's tokens after
    the shared `prefix` (None: all of them), `lengths_g` whole prompts' lengths. -> their
    state, G rows whose caches hold C + S positions, for `_insert` to copy into free rows."""
    c = 0 if prefix is None else prefix.k[0].shape[2]
    cache_len = c + suffix_gs.shape[1]
    staged, _ = prefill(
        params, head, tcfg, cfg, suffix_gs, lengths_g, None, cache_len, (), rows_g, prefix=prefix
    )
    return staged


def _insert(staged: LoopState, j, slot, state: LoopState) -> LoopState:
    """Row `j` of a stage written into row `slot` of `state` (its cache from position 0; later
    positions of a previous request sit past the new length, masked out)."""

    def put(big, small):
        if big.ndim == 0:
            return big
        row = jax.lax.dynamic_slice_in_dim(small, j, 1, axis=0).astype(big.dtype)
        return jax.lax.dynamic_update_slice(big, row, (slot,) + (0,) * (big.ndim - 1))

    return jax.tree.map(put, state, staged)


def _advance(params, head, lengths_n, steps, min_done, state: LoopState, *, tcfg, cfg) -> LoopState:
    """Up to `steps` target steps over every row still decoding (the step count restarts),
    stopping early once `min_done` rows are done. The step is the AR loop's
    (`autoregressive._advance_autoregressive`); each row draws with its own key. `head`: the
    decoder's `decoding_head`, made once (inside, a CPU program would transpose a tied
    embedding at every call: ~0.1 s of SmolLM2's, a step's worth)."""
    model = Transformer(tcfg)

    def body(s: LoopState) -> LoopState:
        last_n1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        start_n = lengths_n + s.n_gen - 1
        hidden_n1d, _, cache = model.apply(
            {"params": params}, last_n1, start_n[:, None], s.cache, start_n, method="hidden"
        )
        # Greedy (a static choice) needs no key; sampled, the row's own key and token index.
        keys = None if cfg.greedy else step_key(s.rows.keys(), s.n_gen)
        next_n = next_token(head, hidden_n1d[:, 0], keys, cfg)
        s, _ = commit(s.replace(cache=cache), next_n[:, None], jnp.ones_like(start_n), cfg)
        return s

    going = keep_going(cfg, steps)
    return jax.lax.while_loop(
        lambda s: going(s) & (jnp.sum(s.done) < min_done), body, state.replace(step=jnp.int32(0))
    )


def _gather(state: LoopState, rows_m) -> LoopState:
    """The state of rows `rows_m` [M] of `state` (every array's leading axis is the rows)."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else x[rows_m], state)


# Module-level, so every decoder of the same shapes and configs reuses the compiled programs.
_prefix_jit = jax.jit(_prefix, static_argnames=("tcfg", "cfg"))
_stage_jit = jax.jit(
    _stage, static_argnames=("tcfg", "cfg"), compiler_options=LOOP_COMPILER_OPTIONS
)  # fmt: skip
_insert_jit = jax.jit(_insert, donate_argnames="state")
_advance_jit = jax.jit(
    _advance, static_argnames=("tcfg", "cfg"), donate_argnames="state",
    compiler_options=LOOP_COMPILER_OPTIONS,
)  # fmt: skip
_gather_jit = jax.jit(_gather)


@jax.jit
def _peek(state: LoopState):
    return state.gen, state.n_gen, state.done, state.step


def stage_widths(longest: int) -> tuple[int, ...]:
    """The prompt widths a stage compiles for: powers of two from STAGE_WIDTH and the midpoints
    between them (16, 24, 32, 48, 64, 96, ...), up to the first that holds `longest` tokens, so
    that a stage pads its prompts by at most a third (a prefill costs about its width on a CPU;
    powers of two alone padded the mixed set's 36-51-token prompts to 64)."""
    widths = [STAGE_WIDTH]
    while widths[-1] < longest:
        w = widths[-1]
        widths.append(w * 3 // 2 if w & (w - 1) == 0 else w * 4 // 3)
    return tuple(widths)


def shared_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The tokens every one of several prompts begins with, leaving each at least one of its own
    (its last position gives its first answer token); [] for fewer than two prompts."""
    if len(prompts) < 2:
        return []
    common = os.path.commonprefix([list(x) for x in prompts])  # (any sequences, not just paths)
    return common[: min(len(x) for x in prompts) - 1]


def row_counts(slots: int) -> tuple[int, ...]:
    """The row counts a decoder of `slots` rows runs at: halves down to slots // SHRINK_FLOOR."""
    counts, floor = [slots], max(1, slots // SHRINK_FLOOR)
    while counts[-1] // 2 >= floor and counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return tuple(counts)


class ContinuousDecoder:
    """`slots` rows of the target decoding alone, prompts of up to `max_prompt` tokens entering
    free rows as answers end. `cfg` gives the sampling settings, stop tokens and the longest
    answer (`max_new_tokens`); one device (no mesh)."""

    def __init__(
        self, target, cfg: DecodeConfig, slots: int, max_prompt: int, chunk_steps: int = CHUNK_STEPS
    ):
        context = target.config.max_position_embeddings
        if max_prompt + cfg.max_new_tokens > context:
            raise ValueError(
                f"prompts of up to {max_prompt} tokens + answers of up to {cfg.max_new_tokens} "
                f"exceed the target's context of {context} tokens; lower --max_prompt_tokens "
                "or --max_new_tokens"
            )
        self.cfg = autoregressive_config(cfg)
        self.tcfg = run_target_config(target.config, self.cfg)
        self.params = target.params
        self.head = decoding_head(self.params, self.tcfg)  # once: a tied head's transpose
        self.slots, self.chunk_steps = slots, chunk_steps
        self.counts = row_counts(slots)
        # As a fixed batch: the prompt buffer is the widest prompt rounded up to BUCKET, so a
        # step reads a cache no longer than the fixed batch of those prompts would.
        self.room = -(-max_prompt // BUCKET) * BUCKET
        # A shared prefix is reused where the cache is plain K/V rows (no ring, no state).
        self.reuse_prefix = not (self.tcfg.sliding or self.tcfg.layered)
        self.max_prompt = max_prompt
        self.steps: dict[int, int] = {}  # loop steps run by `generate`, per row count
        self._statics = dict(tcfg=self.tcfg, cfg=self.cfg)
        self._shapes = {
            n: jax.eval_shape(
                lambda p, x, l, r: _start(p, x, l, r, **self._statics),
                self.params,
                np.zeros((n, self.room), np.int32),
                np.ones((n,), np.int32),
                self._rows(np.zeros((n,), np.int64)),
            )
            for n in self.counts
        }
        self._reset()

    def _reset(self) -> None:
        """Every row free (done), at the full row count."""
        state = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), self._shapes[self.slots])
        self.state = state.replace(done=jnp.ones((self.slots,), bool))
        self.lengths = np.ones((self.slots,), np.int32)

    def _rows(self, seeds) -> RowSettings:
        n = len(seeds)
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
        return RowSettings(
            temperature=np.full((n,), self.cfg.temperature, np.float32),
            top_k=np.full((n,), self.cfg.top_k, np.int32),
            top_p=np.full((n,), self.cfg.top_p, np.float32),
            key_data=jax.random.key_data(keys),
            max_new=np.full((n,), self.cfg.max_new_tokens, np.int32),
        )

    def _advance_state(self, steps: int, min_done: int) -> None:
        self.state = _advance_jit(
            self.params, self.head, self.lengths, np.int32(steps), np.int32(min_done), self.state,
            **self._statics,
        )  # fmt: skip

    def advance_hlo(self) -> str:
        """The HLO text of the compiled advance at the full row count (what a check that its
        loop updates the cache in place reads: `infer.hlo_scan.cache_copies_in_loop`)."""
        return _advance_jit.lower(
            self.params, self.head, self.lengths, np.int32(1), np.int32(1), self.state,
            **self._statics,
        ).compile().as_text()  # fmt: skip

    def _shrink(self, busy: dict[int, int]) -> dict[int, int]:
        """Gathers the busy rows (slot -> prompt) into a state of the next smaller row count
        (the rest of it done rows); -> the new slot of each prompt."""
        n = self.counts[self.counts.index(len(self.lengths)) + 1]
        old = list(busy)
        done_row = next(s for s in range(len(self.lengths)) if s not in busy)
        rows = np.asarray(old + [done_row] * (n - len(old)), np.int32)
        self.state = _gather_jit(self.state, rows)
        self.lengths = self.lengths[rows]
        return {new: busy[s] for new, s in enumerate(old)}

    def _next_count(self, busy: int) -> int | None:
        """The row count the busy rows can be gathered into once no prompt waits (or None)."""
        at = self.counts.index(len(self.lengths))
        if at + 1 < len(self.counts) and busy <= self.counts[at + 1]:
            return self.counts[at + 1]
        return None

    def _plan(self, prompts: Sequence[Sequence[int]]):
        """How `generate` prefills these prompts: (the shared prefix's tokens, the stages: each
        (prompt indices in the order they enter, longest first, its width), a stage holding up
        to `slots` prompts of one width (`_width`), so that it pads none to a far longer one's)."""
        prefix = shared_prefix(prompts) if self.reuse_prefix else []
        stages: list[tuple[list[int], int]] = []
        for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
            width = self._width(len(prompts[i]) - len(prefix), len(prefix))
            if stages and stages[-1][1] == width and len(stages[-1][0]) < self.slots:
                stages[-1][0].append(i)
            else:
                stages.append(([i], width))
        return prefix, stages

    def _width(self, n: int, c: int) -> int:
        """The width of a stage whose longest prompt has `n` tokens after a `c`-token prefix."""
        return min(next(w for w in stage_widths(n) if w >= n), self.room - c)

    def _stage_rows(self, members: int) -> int:
        """The rows of a stage of `members` prompts: the fewest of slots, slots // 2, ..., 1
        that hold them (a stage's spare rows are prefilled for nothing)."""
        counts = [self.slots]
        while counts[-1] > 1:
            counts.append(counts[-1] // 2)
        return min(n for n in counts if n >= members)

    def _prefill_prefix(self, prefix: list[int]) -> KVCache | None:
        if not prefix:
            return None
        return _prefix_jit(
            self.params, self.head, np.asarray([prefix], np.int32), self._rows([0]),
            **self._statics,
        )  # fmt: skip

    def _stage(self, members, width: int, prompts, seeds, prefix: KVCache | None):
        """Prefills prompts `members` (indices into `prompts`) at `width` (`_plan`'s) in one pass
        of `_stage_rows` rows (the spare rows repeat the first prompt, then are dropped). -> the
        staged state."""
        c = 0 if prefix is None else prefix.k[0].shape[2]
        rows = self._stage_rows(len(members))
        picks = list(members) + [members[0]] * (rows - len(members))
        suffix = np.zeros((rows, width), np.int32)
        for r, i in enumerate(picks):
            suffix[r, : len(prompts[i]) - c] = prompts[i][c:]
        lengths = np.asarray([len(prompts[i]) for i in picks], np.int32)
        settings = self._rows([seeds[i] for i in picks])
        return _stage_jit(
            self.params, self.head, prefix, suffix, lengths, settings, **self._statics
        )  # fmt: skip

    def _insert(self, staged, j: int, slot: int, length: int) -> None:
        self.lengths[slot] = length
        self.state = _insert_jit(staged, np.int32(j), np.int32(slot), self.state)

    def warm_up(self, prompts: Sequence[Sequence[int]]) -> None:
        """Compiles (and runs once) what `generate(prompts)` will run: the prefix's prefill,
        every stage shape and its insert, the advance and gather of every row count; then frees
        every row: what `generate` then runs is compiled."""
        self._reset()
        prefix_ids, stages = self._plan(prompts)
        prefix = self._prefill_prefix(prefix_ids)
        shapes = set()
        for members, width in stages:  # one stage of each shape (not every prompt's prefill)
            shape = (self._stage_rows(len(members)), width)
            if shape not in shapes:
                shapes.add(shape)
                staged = self._stage(members, width, prompts, [0] * len(prompts), prefix)
                self._insert(staged, 0, 0, len(prompts[members[0]]))
        for n in self.counts:
            if n != self.slots:
                self._shrink({0: 0})
            self._advance_state(1, n)
        self._reset()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        on_chunk: Callable[[int], None] | None = None,
    ) -> list[list[int]]:
        """Every prompt's answer (stop token included when it stopped), prompt i sampled with
        `seeds[i]`; `on_chunk(new tokens)` after each chunk of steps. Prompts enter longest
        first, prefilled a stage at a time (`_plan`): the tokens all of them begin with once,
        the rest of each in batched passes, whose rows are copied into rows as they free."""
        for i, ids in enumerate(prompts):
            if not 1 <= len(ids) <= self.max_prompt:
                raise ValueError(
                    f"prompt {i} of {len(ids)} tokens: between 1 and {self.max_prompt} fit"
                )
        self._reset()
        prefix_ids, stages = self._plan(prompts)
        prefix = self._prefill_prefix(prefix_ids)
        stages = collections.deque(stages)
        staged: collections.deque = collections.deque()  # (prompt index, stage, its row)
        answers: list[list[int] | None] = [None] * len(prompts)
        busy: dict[int, int] = {}  # slot -> prompt index
        counted = np.zeros((self.slots,), np.int64)
        while stages or staged or busy:
            for slot in range(len(self.lengths)):
                if slot in busy or not (stages or staged):
                    continue
                if not staged:
                    members, width = stages.popleft()
                    stage = self._stage(members, width, prompts, seeds, prefix)
                    staged.extend((i, stage, j) for j, i in enumerate(members))
                i, stage, j = staged.popleft()
                self._insert(stage, j, slot, len(prompts[i]))
                busy[slot] = i
                counted[slot] = 0
            waiting = bool(stages or staged)
            if not waiting and self._next_count(len(busy)) is not None:
                moved = self._shrink(busy)
                counted[: len(moved)] = [counted[s] for s in busy]
                busy = moved
                continue
            rows = len(self.lengths)
            if waiting:  # stop as soon as a row is free for the next prompt
                min_done = rows - len(busy) + 1
            else:  # or, none waiting, once the busy rows fit the next smaller row count
                smaller = self.counts[self.counts.index(rows) + 1 :]
                min_done = rows - smaller[0] if smaller else rows
            self._advance_state(self.chunk_steps, min_done)
            gen, n_gen, done, ran = jax.device_get(_peek(self.state))
            self.steps[rows] = self.steps.get(rows, 0) + int(ran)
            fresh = 0
            for slot, i in list(busy.items()):
                fresh += int(n_gen[slot]) - int(counted[slot])
                counted[slot] = n_gen[slot]
                if done[slot]:
                    answers[i] = gen[slot, : n_gen[slot]].tolist()
                    del busy[slot]
            if on_chunk is not None:
                on_chunk(fresh)
        return answers  # type: ignore[return-value]
