"""A slot decoder's one busy row decoded alone (`decoding.slots.SlotDecoder`): while exactly one
row is busy (and has no grammar), its state is taken out of the slots' loop state and advanced
by a program of one row, so a request alone costs what it costs the command line's decode
rather than a step over every slot (every free row rides in every GEMM, head and sampling op
of a slot step: at 4 slots, SmolLM2 bf16, a copy-16 step of one busy row cost 116 ms against
49 for one row alone). When another request is admitted the row is written back into its slot
(one row copy each way, once per such change of load, not per step); a released row is
dropped. Under batch invariance a row's tokens are the same in either program (its passes are
computed alike at any row count), so greedy answers do not depend on the load.

Letters: N slots, W generated-token buffer.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dflash_jax.decoding import speculative
from dflash_jax.decoding.runner import compile_half
from dflash_jax.decoding.state import max_steps


def _take(state, slot):
    """Row `slot` of every per-row leaf [N, ...] -> [1, ...]; loop-wide scalars as they are."""
    return jax.tree.map(
        lambda x: x if x.ndim == 0 else jax.lax.dynamic_slice_in_dim(x, slot, 1, 0), state
    )


def _put(state, row, slot):
    """`row` (`_take`'s) written back into row `slot` of `state`; its scalars kept."""
    return jax.tree.map(
        lambda big, small: (
            small
            if big.ndim == 0
            else jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, 0)
        ),
        state,
        row,
    )


class Solo:
    """The one-row programs of a SlotDecoder `dec` and, while it decodes a row alone, that
    row's state (`slot`, `state`). `step_costs`: the controller's step costs for one row
    (`calibrate`; the slots' until then)."""

    def __init__(self, dec):
        self.dec = dec
        self.slot: int | None = None
        self.state = None
        self.chunks = 0  # advance calls run here
        t0 = time.perf_counter()
        full = dec._plain(dec.state)
        self._take = jax.jit(_take).lower(full, np.int32(0)).compile()
        row = jax.eval_shape(_take, full, np.int32(0))
        self._put = jax.jit(_put, donate_argnums=0).lower(full, row, np.int32(0)).compile()
        args = self._args(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), row), 0)
        self._advance, _, _ = compile_half(
            speculative.advance_speculative, args, dec.statics, None, dec.plan.compiler_options
        )
        self.step_costs = dec.step_costs
        self.sampled_step_costs = dec.sampled_step_costs
        self.compile_s = time.perf_counter() - t0

    def _args(self, state, slot, costs=None, forced_kind=-1, steps=0) -> tuple:
        dec = self.dec
        costs = dec.step_costs if costs is None else costs
        inputs = (dec.prompt[slot : slot + 1], dec.lengths[slot : slot + 1], dec._rng, costs)
        return (*dec.params, *inputs, np.int32(forced_kind), np.int32(steps), state)

    def fits(self) -> bool:
        """Whether the decoder has exactly one busy row, without a grammar."""
        busy = np.flatnonzero(self.dec.busy)
        return busy.size == 1 and not self.dec._grammar_rows[busy[0]]

    def leave(self) -> None:
        """Writes the row decoded alone back into its slot (before another is admitted)."""
        if self.slot is None:
            return
        dec = self.dec
        slot, row = self.slot, self.state
        self.slot = self.state = None
        if dec.grammar_shape is None:
            dec.state = self._put(dec.state, row, np.int32(slot))
        else:  # the grammar fields (NONE in this row) kept aside
            kept = {"grammar": dec.state.grammar, "gstate": dec.state.gstate}
            dec.state = self._put(dec._plain(dec.state), row, np.int32(slot)).replace(**kept)

    def release(self, rows) -> None:
        """`SlotDecoder.release` of `rows`: the row decoded alone, if among them, is dropped
        (not written back); else its step count restarts, as the slots' does."""
        if self.slot is not None and self.slot in set(rows):
            self.slot = self.state = None
        elif self.state is not None:
            self.state = self.state.replace(step=jax.numpy.zeros_like(self.state.step))

    def advance(self, steps: int, forced_kind: int):
        """`SlotDecoder.advance` for the one busy row: taken out first if it is not yet.
        -> (gen, n_gen, done, num_steps, acc, kinds, step, logprobs) as N rows."""
        dec = self.dec
        slot = int(np.flatnonzero(dec.busy)[0])
        if self.slot is None:
            self.slot, self.state = slot, self._take(dec._plain(dec.state), np.int32(slot))
        costs = self.sampled_step_costs if dec._sampling[slot] else self.step_costs
        steps = min(steps, max_steps(dec.cfg))
        self.state = self._advance(*self._args(self.state, slot, costs, forced_kind, steps))
        self.chunks += 1
        gen, n_gen, done, num_steps, acc, kinds, step, lp = jax.device_get(peek(self.state))
        n = dec.slots

        def rows(x, fill=0):  # [1, ...] -> [N, ...], the other rows `fill`
            out = np.full((n, *x.shape[1:]), fill, x.dtype)
            out[slot] = x[0]
            return out

        lp = None if lp is None else tuple(rows(x) for x in lp)
        return (rows(gen), rows(n_gen), rows(done, True), rows(num_steps), rows(acc),
                rows(kinds), step, lp)  # fmt: skip

    def calibrate(self, token_ids, steps: int, sampled_steps: int, repeats: int) -> None:
        """The one-row step costs, as `SlotDecoder.calibrate` measures the slots' (greedy, then
        sampling at temperature 0.7 for `sampled_steps` steps, one round)."""
        dec = self.dec
        one = lambda t: (
            lambda: dec.insert(0, token_ids, max_new=dec.cfg.max_new_tokens, temperature=t, seed=1)
        )
        self.step_costs = dec._measure_costs(one(0.0), [0], steps, repeats)
        self.sampled_step_costs = dec._measure_costs(one(0.7), [0], sampled_steps, 1)


@jax.jit
def peek(state):
    logprobs = None if state.logp is None else (state.logp, state.top_logp, state.top_ids)
    return (
        state.gen, state.n_gen, state.done, state.num_steps, state.acc, state.kinds, state.step,
        logprobs,
    )  # fmt: skip
