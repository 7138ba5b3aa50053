"""Continuous batching of the target alone, for training data: `slots` rows decode one token a
step in one jitted loop; between chunks of steps the host takes the answers of the rows that
stopped and prefills waiting prompts into the freed rows, so no row idles until the longest
answer of a batch ends (what fixed batches do: `generate._decode_batch`).

The server's slots (`decoding.slots.SlotDecoder`) do the same for the speculative loop and need
a drafter; training data is made before there is one, so this is the autoregressive loop of
`decoding.autoregressive` with per-row settings (`sampling.RowSettings`): each request draws
its n-th token with its own key folded with n, so its answer does not depend on which rows run
beside it, and a greedy row's tokens are the target's greedy tokens. Programs: one advance for
the slots' shape, one insert per prompt bucket (`slots.prompt_buckets`), each compiled at its
first use.

Letters: N slots, P prompt buffer width, W generated-token buffer.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.autoregressive import autoregressive_config
from dflash_jax.decoding.phases import next_token, prefill
from dflash_jax.decoding.programs import run_target_config
from dflash_jax.decoding.sampling import RowSettings
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.slots import prompt_buckets
from dflash_jax.decoding.state import LoopState, commit, keep_going, step_key
from dflash_jax.models.target import Transformer, decoding_head

CHUNK_STEPS = 32  # loop steps between host visits: a stopped row idles at most this many


def _start(params, prompt_np, lengths_n, rows: RowSettings, *, tcfg, cfg) -> LoopState:
    """The prefill of every row at once (its shapes give the slots' empty state)."""
    cache_len = prompt_np.shape[1] + cfg.max_new_tokens + 2
    head = decoding_head(params, tcfg)
    state, _ = prefill(params, head, tcfg, cfg, prompt_np, lengths_n, None, cache_len, (), rows)
    return state


def _insert(params, prompt_1p, length_1, rows_1: RowSettings, slot, state: LoopState, *, tcfg, cfg):
    """Prefills one prompt [1,P'] and writes it into row `slot` of `state` (its cache rows from
    position 0; later rows of a previous request sit past the new length, masked out)."""
    head = decoding_head(params, tcfg)
    one, _ = prefill(
        params, head, tcfg, cfg, prompt_1p, length_1, None, prompt_1p.shape[1], (), rows_1
    )

    def put(big, small):
        if big.ndim == 0:
            return big
        start = (slot,) + (0,) * (big.ndim - 1)
        return jax.lax.dynamic_update_slice(big, small.astype(big.dtype), start)

    return jax.tree.map(put, state, one)


def _advance(params, lengths_n, steps, state: LoopState, *, tcfg, cfg) -> LoopState:
    """Up to `steps` target steps over every row still decoding (the step count restarts)."""
    head = decoding_head(params, tcfg)
    model = Transformer(tcfg)

    def body(s: LoopState) -> LoopState:
        last_n1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
        start_n = lengths_n + s.n_gen - 1
        hidden_n1d, _, cache = model.apply(
            {"params": params}, last_n1, start_n[:, None], s.cache, start_n, method="hidden"
        )
        keys = step_key(s.rows.keys(), s.n_gen)  # the row's own token index
        next_n = next_token(head, hidden_n1d[:, 0], keys, s.rows)
        s, _ = commit(s.replace(cache=cache), next_n[:, None], jnp.ones_like(start_n), cfg)
        return s

    return jax.lax.while_loop(keep_going(cfg, steps), body, state.replace(step=jnp.int32(0)))


# Module-level, so every decoder of the same shapes and configs reuses the compiled programs.
_insert_jit = jax.jit(_insert, static_argnames=("tcfg", "cfg"), donate_argnames="state")
_advance_jit = jax.jit(_advance, static_argnames=("tcfg", "cfg"), donate_argnames="state")


@jax.jit
def _peek(state: LoopState):
    return state.gen, state.n_gen, state.done


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
        self.slots, self.chunk_steps = slots, chunk_steps
        self.buckets = prompt_buckets(max_prompt)
        self.max_prompt = max_prompt
        statics = dict(tcfg=self.tcfg, cfg=self.cfg)
        self._insert, self._advance = _insert_jit, _advance_jit
        self._statics = statics
        self.lengths = np.ones((slots,), np.int32)
        shapes = jax.eval_shape(
            lambda p, x, n, r: _start(p, x, n, r, **statics),
            self.params,
            np.zeros((slots, self.buckets[-1]), np.int32),
            self.lengths,
            self._rows(np.zeros((slots,), np.int64)),
        )
        state = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        self.state = state.replace(done=jnp.ones((slots,), bool))

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
        self.state = self._insert(
            self.params, prompt, np.asarray([n], np.int32), self._rows([seed]), np.int32(slot),
            self.state, **self._statics,
        )  # fmt: skip

    def warm_up(self, prompt_lengths: Sequence[int]) -> None:
        """Compiles (and runs once) the insert of every bucket these prompt lengths fall in
        and the advance, then frees every row: what `generate` then runs is compiled."""
        widths = sorted({next(w for w in self.buckets if w >= n) for n in prompt_lengths})
        for width in widths:
            self.insert(0, [1] * width, seed=0)
        self.state = self._advance(
            self.params, self.lengths, np.int32(1), self.state, **self._statics
        )
        self.state = jax.block_until_ready(self.state.replace(done=jnp.ones((self.slots,), bool)))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        on_chunk: Callable[[int], None] | None = None,
    ) -> list[list[int]]:
        """Every prompt's answer (stop token included when it stopped), prompt i sampled with
        `seeds[i]`; `on_chunk(new tokens)` after each chunk of steps."""
        # Longest prompts first: the widest inserts run while every row is free anyway.
        waiting = collections.deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
        answers: list[list[int] | None] = [None] * len(prompts)
        busy: dict[int, int] = {}  # slot -> prompt index
        counted = np.zeros((self.slots,), np.int64)
        while waiting or busy:
            for slot in range(self.slots):
                if slot not in busy and waiting:
                    i = waiting.popleft()
                    self.insert(slot, prompts[i], seeds[i])
                    busy[slot] = i
                    counted[slot] = 0
            self.state = self._advance(
                self.params, self.lengths, np.int32(self.chunk_steps), self.state, **self._statics
            )
            gen, n_gen, done = jax.device_get(_peek(self.state))
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
