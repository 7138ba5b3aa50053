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
the tail of long answers runs at the rows it needs. Programs: one advance and one gather per row
count, one insert per prompt bucket (`insert_buckets`), each compiled at its first use
(`warm_up` compiles them all).

Letters: N rows (slots), P prompt buffer width, W generated-token buffer.
"""

from __future__ import annotations

import collections
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
from dflash_jax.models.target import Transformer, decoding_head

CHUNK_STEPS = 64  # the most loop steps between host visits (a progress update)
BUCKET = 32  # the prompt buffer is the widest prompt rounded up to a multiple of this
SHRINK_FLOOR = 8  # rows are gathered into halves down to slots // SHRINK_FLOOR (at least 1)


def _start(params, prompt_np, lengths_n, rows: RowSettings, *, tcfg, cfg) -> LoopState:
    """The prefill of every row at once (its shapes give the slots' empty state)."""
    cache_len = prompt_np.shape[1] + cfg.max_new_tokens + 2
    head = decoding_head(params, tcfg)
    state, _ = prefill(params, head, tcfg, cfg, prompt_np, lengths_n, None, cache_len, (), rows)
    return state


def _insert(
    params, head, prompt_1p, length_1, rows_1: RowSettings, slot, state: LoopState, *, tcfg, cfg
):
    """Prefills one prompt [1,P'] and writes it into row `slot` of `state` (its cache rows from
    position 0; later rows of a previous request sit past the new length, masked out)."""
    one, _ = prefill(
        params, head, tcfg, cfg, prompt_1p, length_1, None, prompt_1p.shape[1], (), rows_1
    )

    def put(big, small):
        if big.ndim == 0:
            return big
        start = (slot,) + (0,) * (big.ndim - 1)
        return jax.lax.dynamic_update_slice(big, small.astype(big.dtype), start)

    return jax.tree.map(put, state, one)


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
_insert_jit = jax.jit(
    _insert, static_argnames=("tcfg", "cfg"), donate_argnames="state",
    compiler_options=LOOP_COMPILER_OPTIONS,
)  # fmt: skip
_advance_jit = jax.jit(
    _advance, static_argnames=("tcfg", "cfg"), donate_argnames="state",
    compiler_options=LOOP_COMPILER_OPTIONS,
)  # fmt: skip
_gather_jit = jax.jit(_gather)


@jax.jit
def _peek(state: LoopState):
    return state.gen, state.n_gen, state.done, state.step


def insert_buckets(max_prompt: int) -> tuple[int, ...]:
    """The prompt widths an insert compiles for: powers of two from BUCKET and the midpoints
    between them (48, 96, 192, ...), up to the first that holds `max_prompt` tokens, so that a
    prompt's prefill pads it by at most a third (powers of two alone padded the mixed set's
    36-51-token prompts to 64; a one-row prefill costs about its width on a CPU)."""
    widths = [BUCKET]
    while widths[-1] < max_prompt:
        w = widths[-1]
        widths.append(w * 3 // 2 if w & (w - 1) == 0 else w * 4 // 3)
    return tuple(widths)


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
        self.buckets = tuple(sorted({min(w, self.room) for w in insert_buckets(max_prompt)}))
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

    def insert(self, slot: int, token_ids: Sequence[int], seed: int) -> None:
        n = len(token_ids)
        if not 1 <= n <= self.max_prompt:
            raise ValueError(f"prompt of {n} tokens: between 1 and {self.max_prompt} fit")
        width = next(w for w in self.buckets if w >= n)
        prompt = np.zeros((1, width), np.int32)
        prompt[0, :n] = token_ids
        self.lengths[slot] = n
        self.state = _insert_jit(
            self.params, self.head, prompt, np.asarray([n], np.int32), self._rows([seed]),
            np.int32(slot), self.state, **self._statics,
        )  # fmt: skip

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

    def warm_up(self, prompt_lengths: Sequence[int]) -> None:
        """Compiles (and runs once) the insert of every bucket these prompt lengths fall in,
        the advance and gather of every row count, then frees every row: what `generate`
        then runs is compiled."""
        widths = sorted({next(w for w in self.buckets if w >= n) for n in prompt_lengths})
        self._reset()
        for width in widths:
            self.insert(0, [1] * min(width, self.max_prompt), seed=0)
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
        `seeds[i]`; `on_chunk(new tokens)` after each chunk of steps."""
        self._reset()
        # Longest prompts first: the widest inserts run while every row is free anyway.
        waiting = collections.deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
        answers: list[list[int] | None] = [None] * len(prompts)
        busy: dict[int, int] = {}  # slot -> prompt index
        counted = np.zeros((self.slots,), np.int64)
        while waiting or busy:
            for slot in range(len(self.lengths)):
                if slot not in busy and waiting:
                    i = waiting.popleft()
                    self.insert(slot, prompts[i], seeds[i])
                    busy[slot] = i
                    counted[slot] = 0
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
