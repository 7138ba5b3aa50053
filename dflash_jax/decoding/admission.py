"""The slots' insert programs (`decoding.slots`): every request admitted at one chunk boundary
is prefilled in one program of K rows (K a power of two up to the slots, padded with rows
written nowhere), at the widest admitted prompt's power-of-two width, and its rows replace
those of the loop state.

A program per (K, width) is compiled on its first use, not at start-up (a server's prompt
limit spans ~9 widths, times the row counts). `Inserts.plan` picks, for n prompts at width w:
the (K, w) program if compiled; else, while that one compiles in the background, a compiled
program of at least n rows at a width >= w (the fewest rows x width: padding costs only the
prefill's compute), else of fewer rows, run in turns; only when no program of a width >= w is
compiled does the admission wait for the compile (a prompt width never seen before). Under
batch invariance a row's prefill gives the same bits in any of them (each row's passes are
computed alike at any row count and width), so greedy answers do not depend on the choice.

Letters: K rows of one insert, P prompt width, N slots.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time

import jax
import jax.numpy as jnp

from dflash_jax.decoding import grammar, proposers
from dflash_jax.decoding.phases import init_speculative
from dflash_jax.decoding.state import LoopState
from dflash_jax.models.target import decoding_head

log = logging.getLogger(__name__)


def row_counts(slots: int) -> tuple[int, ...]:
    """The row counts K an insert compiles for: powers of two below `slots`, then `slots`."""
    counts = [1]
    while counts[-1] * 2 < slots:
        counts.append(counts[-1] * 2)
    return tuple(sorted(set(counts) | {slots}))


def insert_rows(
    target_params,
    drafter_params,
    prompt_kp,
    length_k,
    rows_k,
    slot_k,
    state: LoopState,
    constraint_k=None,
    *,
    target_config,
    drafter_config,
    decode_config,
) -> LoopState:
    """Prefills K requests (prompts [K,P], lengths [K], `sampling.RowSettings` [K]) together
    and writes row k into row slot_k[k] of `state` (a slot index past the state's rows: a
    padding row, written nowhere): its target cache and drafter context rows from slot 0, its
    generated tokens, counts and controller estimates. The loop-wide scalars (step, probe wait)
    stay. constraint_k: structured output, (one grammar table per row [K], start states [K])
    (`SlotDecoder._constraint`), written into the rows with their automaton states."""
    head = decoding_head(target_params, target_config)
    new = init_speculative(
        target_params, drafter_params, head, target_config, drafter_config, decode_config,
        prompt_kp, length_k, None, rows=rows_k, cache_len=prompt_kp.shape[1],
        control=proposers.init_control(decode_config, prompt_kp.shape[0]),
        constraint=constraint_k,
    )  # fmt: skip

    def put(big, small):  # rows slot_k of big [N, ...] from small [K, ...] (no wider)
        if big.ndim == 0:
            return big
        index = (slot_k, *(slice(0, d) for d in small.shape[1:]))
        return big.at[index].set(small.astype(big.dtype), mode="drop")

    return jax.tree.map(put, state, new)


def release_rows(state: LoopState, release_n) -> LoopState:
    """Between chunks: rows in `release_n` [N] bool stop (done, greedy, so no free row keeps
    the sampling arithmetic running) and shrink to one generated token and one context entry
    (with the host's prompt length of 1, `slots.SlotDecoder.release`: a free row's attention reads
    one key tile, not its last request's length), and the step counter restarts, so the
    per-step records (acc, kinds) of the next chunk start at column 0."""
    rows = state.rows.replace(temperature=jnp.where(release_n, 0.0, state.rows.temperature))
    if state.gstate is not None:  # a free row has no grammar
        state = state.replace(gstate=jnp.where(release_n, grammar.NONE, state.gstate))
    return state.replace(
        done=state.done | release_n, step=jnp.int32(0), rows=rows,
        n_gen=jnp.where(release_n, 1, state.n_gen),
        drf_len=jnp.where(release_n, 1, state.drf_len),
    )  # fmt: skip


class Inserts:
    """The compiled insert programs of one SlotDecoder, by (K, width), each compiled once on
    its first use: `compile(k, width)` builds the program of K rows at `width` from
    `lower(k, width)` (a jax `Lowered`) and is called on this object's one background thread
    or, when an admission has to wait, on the caller's. `seconds` sums the compile times."""

    def __init__(self, lower, options, counts: tuple[int, ...], widths: tuple[int, ...]):
        self._lower, self._options = lower, options
        self.counts, self.widths = counts, widths
        self._futures: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._claimed: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        # A daemon thread, not an executor's: a process that exits drops the compiles queued.
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._work, name="dflash-insert", daemon=True).start()
        self.seconds = 0.0

    def _work(self) -> None:
        while (item := self._todo.get()) is not None and not self._closed:
            self._claim(*item)

    def _compile(self, k: int, width: int):
        t0 = time.perf_counter()
        program = self._lower(k, width).compile(compiler_options=self._options)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.seconds += seconds
        log.info("compiled the insert of %d rows at prompt width %d (%.1f s)", k, width, seconds)
        return program

    def _future(self, key: tuple[int, int], background: bool) -> concurrent.futures.Future:
        """The program's future; compiled on the background thread or (not `background`) now,
        unless a compile of it has started (then the future waits for that one)."""
        with self._lock:
            future = self._futures.get(key)
            new = future is None
            if new:
                future = self._futures[key] = concurrent.futures.Future()
        if not background:
            self._claim(key, future)
        elif new:
            self._todo.put((key, future))
        return future

    def _claim(self, key: tuple[int, int], future: concurrent.futures.Future) -> None:
        with self._lock:
            if key in self._claimed:
                return
            self._claimed.add(key)
        _settle(future, lambda: self._compile(*key))

    def prefetch(self, keys) -> None:
        """Compiles the programs of `keys` ((K, width) pairs) on the background thread, in
        turn; one an admission needs first it compiles itself."""
        for key in keys:
            self._future(key, background=True)

    def pending(self) -> int:
        """Programs asked for and not yet compiled."""
        with self._lock:
            return sum(not f.done() for f in self._futures.values())

    def ready(self) -> dict[tuple[int, int], object]:
        """The programs compiled so far, by (K, width)."""
        with self._lock:
            done = [(k, f) for k, f in self._futures.items() if f.done()]
        return {k: f.result() for k, f in done if f.exception() is None}

    def get(self, k: int, width: int):
        """The program of K rows at `width`, compiled now unless its compile has started (then
        it waits for that one)."""
        return self._future((k, width), background=False).result()

    def plan(self, n: int, width: int) -> list[tuple[int, int, int]]:
        """How to prefill n prompts of a width <= `width`: [(rows taken, K, program width)]
        in turns, as the module docstring says; the exact program is set compiling."""
        k = next(c for c in self.counts if c >= n)
        ready = self.ready()
        if (k, width) in ready:
            return [(n, k, width)]
        self._future((k, width), background=True)
        wide = [key for key in ready if key[1] >= width]
        if not wide:
            self.get(k, width)
            return [(n, k, width)]
        enough = [key for key in wide if key[0] >= n]
        if enough:
            kk, w = min(enough, key=lambda key: (key[0] * key[1], key[1]))
            return [(n, kk, w)]
        kk, w = max(wide, key=lambda key: (key[0], -key[1]))
        turns = []
        while n > 0:
            turns.append((min(n, kk), kk, w))
            n -= kk
        return turns

    def close(self) -> None:
        """Stops the background thread after the compile it runs (those queued are dropped;
        `get` still compiles any program itself)."""
        self._closed = True
        self._todo.put(None)


def _settle(future: concurrent.futures.Future, make) -> None:
    try:
        future.set_result(make())
    except BaseException as e:  # noqa: BLE001 - whoever waits for the program hears of it
        future.set_exception(e)
