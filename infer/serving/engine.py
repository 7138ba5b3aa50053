"""The server's engine: a bounded queue of requests and one thread that drives a
`decoding.slots.SlotDecoder` (continuous batching over the jitted speculative loop).

The thread repeats: admit queued requests into free slots (one jitted prefill of them all), run
one chunk of loop steps for all slots, hand every request the text its row committed, and free
the rows that are done (a stop token, the request's max_tokens, one of its stop strings, or a
client that went away). Requests talk to it through `Request.events`, an asyncio queue the HTTP
handler reads on its own event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time

import numpy as np

from dflash_jax.decoding import proposers
from dflash_jax.decoding.settings import kind_label
from dflash_jax.decoding.slots import Admit
from infer.serving.detokenize import Detokenizer
from infer.serving.metrics import Metrics

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds its maximum; `retry_after` is a guess in seconds for the client."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class NotServing(Exception):
    """The engine is still warming up, draining before it exits, or has failed."""


@dataclasses.dataclass
class Request:
    """One completion: its prompt token ids and settings, and what the engine writes back.
    events receives ("text", (str, n)) deltas, n: the tokens the text so far covers (whose
    logprobs may go out with it), then ("done", None); `cancel()` frees its slot."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none wanted; else the alternatives wanted per token
    grammar: object | None = None  # structured output: its table (`slots.Admit.grammar`)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    id: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    # With logprobs: per token (its log-probability, its step's likeliest ids, theirs).
    token_logprobs: list = dataclasses.field(default_factory=list)
    text: str = ""  # the answer so far (cut at a stop string)
    sent: int = 0  # characters of `text` handed out
    searched: int = 0  # characters of the answer searched for stop strings
    detok: Detokenizer | None = None  # the answer's text, decoded as tokens arrive
    finish_reason: str | None = None
    error: str | None = None  # this request failed, or the engine while it was in flight
    error_status: int = 500  # the HTTP status of `error`: 400 when its input caused it
    counted: int = 0  # completion tokens returned: not past a stop string
    steps: int = 0  # loop steps the row ran
    drafted: int = 0  # tokens drafted for its row's verify steps
    accepted: int = 0  # of those, accepted by the target
    arrived: float = 0.0
    admitted: float | None = None
    first_text: float | None = None
    last_tokens: float | None = None  # when it last received new tokens
    finished: float | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def tau(self) -> float | None:
        """Tokens committed per loop step (the prefill's token is not a step's)."""
        return (len(self.tokens) - 1) / self.steps if self.steps else None

    @property
    def acceptance(self) -> float | None:
        """Drafted tokens the target accepted, as a fraction of those drafted."""
        return self.accepted / self.drafted if self.drafted else None

    def _post(self, event) -> None:
        if self.loop is not None and self.events is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """Builds its decoder on its own thread (`build()` -> a SlotDecoder ready to run: compiled,
    warmed up, calibrated; a failure is kept in `error` and passed to `on_error`), then
    serves. submit() raises QueueFull once more than `max_queue` requests would wait for a slot
    (requests that a free slot takes at the next chunk boundary do not count), and NotServing
    before it is ready, once it drains or after it failed. A failure one request causes (its
    admission: a prompt the decoder refuses, an insert program that fails to compile; its text:
    a tokenizer that cannot decode its tokens) ends that request alone (`Request.error`, 400
    when its input was refused, else 500) while the others go on. A failure of the shared loop
    (an advance, or an admission that lost the loop state: a device out of memory, say) is kept
    in `error`: every accepted request is finished with it (the HTTP side answers 500), the
    thread ends, as after a drain, and `on_error` is called (the server then exits, non-zero,
    for a supervisor to restart it). drain() lets the running and queued requests finish and
    stops the thread."""

    def __init__(
        self, build, tokenizer, stop_token_ids, *, max_queue: int, chunk_steps: int,
        on_error=None, metrics: Metrics | None = None, admit_together: bool = True,
    ):  # fmt: skip
        self._build, self._on_error = build, on_error
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self.max_queue, self.chunk_steps = max_queue, chunk_steps
        self.admit_together = admit_together  # False: each admitted prompt prefilled alone
        self.decoder = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.prom = metrics if metrics is not None else Metrics()
        self._queue: collections.deque[Request] = collections.deque()
        self._active: dict[int, Request] = {}
        self._cond = threading.Condition()
        self._draining = False
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self.started = time.time()
        self.stats = collections.Counter()
        self.kinds = collections.Counter()
        # row-steps and committed tokens by proposer (`decoding.proposers.NAMES`)
        self.by_proposer = {"steps": collections.Counter(), "tokens": collections.Counter()}
        self.busy_s = 0.0

    # -- the HTTP side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        with self._cond:
            if self.error is not None:
                raise NotServing(f"failed ({self.reason})")
            if not self.ready.is_set() or self._draining:
                raise NotServing("warming up" if not self._draining else "draining")
            free = self.decoder.slots - len(self._active)  # rows the next admission fills
            if len(self._queue) + 1 - free > self.max_queue:
                self.stats["rejected_queue_full"] += 1
                self.prom.of(self.prom.rejected).inc()
                raise QueueFull(self._retry_after())
            req.id, req.arrived = next(self._ids), time.perf_counter()
            self._queue.append(req)
            self.stats["requests"] += 1
            self.prom.of(self.prom.waiting).set(len(self._queue))
            self._cond.notify()

    @property
    def reason(self) -> str | None:
        """Why the engine stopped serving, as text (None while it is fine)."""
        e = self.error
        return None if e is None else f"{type(e).__name__}: {e}"

    def stop_admitting(self) -> None:
        """From now on submit() refuses; the accepted requests still run to their end."""
        with self._cond:
            self._draining = True
            self._cond.notify()

    def drain(self, timeout: float | None = None) -> None:
        """Stops admitting new requests; returns when every accepted one has finished."""
        self.stop_admitting()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def draining(self) -> bool:
        return self._draining

    def metrics(self) -> dict:
        """A JSON summary (`GET /stats`); `prom` holds the Prometheus metrics (`/metrics`)."""
        with self._cond:
            queued, active = len(self._queue), len(self._active)
        tokens, row_steps = self.stats["tokens"], self.stats["row_steps"]
        slots = self.decoder.slots if self.decoder is not None else 0
        return {
            "ready": self.ready.is_set(),
            "draining": self._draining,
            "error": self.reason,
            "slots": slots,
            "active_slots": active,
            "queue_length": queued,
            "max_queue": self.max_queue,
            "requests": {
                k: self.stats[k]
                for k in ("requests", "completed", "cancelled", "failed", "rejected_queue_full")
            },
            "generated_tokens": tokens,
            "decode_busy_s": round(self.busy_s, 3),
            "tokens_per_s_busy": tokens / self.busy_s if self.busy_s else 0.0,
            "tokens_per_s_uptime": tokens / max(time.time() - self.started, 1e-9),
            "tau": self.stats["step_tokens"] / row_steps if row_steps else None,
            "acceptance": (
                self.stats["accepted"] / self.stats["drafted"] if self.stats["drafted"] else None
            ),
            "loop_steps": self.stats["steps"],
            "steps_by_kind": dict(self.kinds),
            "steps_by_proposer": {n: self.by_proposer["steps"][n] for n in proposers.NAMES},
            "tokens_by_proposer": {n: self.by_proposer["tokens"][n] for n in proposers.NAMES},
            "insert_programs": self._insert_programs(),
            "step_costs": self._step_costs("step_costs"),
            "sampled_step_costs": self._step_costs("sampled_step_costs"),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def _insert_programs(self) -> dict:
        """The decoder's insert programs: compiled ("rows x width"), still compiling, and the
        seconds spent compiling them (`admission.Inserts`)."""
        inserts = getattr(self.decoder, "inserts", None)
        if inserts is None:
            return {}
        return {
            "compiled": [f"{k}x{w}" for k, w in sorted(inserts.ready())],
            "compiling": inserts.pending(),
            "compile_s": round(inserts.seconds, 1),
        }

    def _step_costs(self, table: str) -> dict:
        """The adaptive controller's cost of each step kind (in plain steps), as calibrated:
        `table` "step_costs" while every row is greedy, "sampled_step_costs" while one
        samples."""
        dec = self.decoder
        if dec is None or not dec.cfg.adaptive:
            return {}
        costs = np.asarray(getattr(dec, table)).tolist()
        return {kind_label(k): c for k, c in zip(dec.cfg.all_kinds, costs, strict=True)}

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the mean request time so far."""
        done = max(self.stats["completed"], 1)
        return max(1, int(np.ceil(self.stats["request_s"] / done)))

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.decoder = self._build()
        except BaseException as e:  # reported by /health and the CLI
            self.error = e
            log.exception("the decoder failed to build")
            if self._on_error is not None:
                self._on_error(e)
            return
        self.started = time.time()
        self.ready.set()
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - every request must hear of it
            self._fail(e)
            if self._on_error is not None:
                self._on_error(e)
        inserts = getattr(self.decoder, "inserts", None)
        if inserts is not None:  # no more admissions: stop compiling their programs
            inserts.close()

    def _fail(self, e: BaseException) -> None:
        """The decoder failed: every accepted request ends with the error, nothing more is
        admitted, and /health reports it."""
        log.exception("the decoder failed while serving; every accepted request gets a 500")
        with self._cond:
            self.error = e
            self._draining = True
            failed = list(self._active.values()) + list(self._queue)
            self._active.clear()
            self._queue.clear()
        for req in failed:
            if req.finish_reason is None:
                req.error = f"the decoder failed: {self.reason}"
                req.finish_reason = "error"
                self._finish(req)
        self.prom.of(self.prom.running).set(0)
        self.prom.of(self.prom.waiting).set(0)

    def _serve(self) -> None:
        dec = self.decoder
        while True:
            with self._cond:
                while not self._queue and not self._active and not self._draining:
                    self._cond.wait()
                if self._draining and not self._queue and not self._active:
                    return
                gone = [r for r in self._queue if r.cancelled]  # left while they waited
                for req in gone:
                    self._queue.remove(req)
                free = [s for s in range(dec.slots) if s not in self._active]
                admit = [(s, self._queue.popleft()) for s in free[: len(self._queue)]]
                for slot, req in admit:
                    self._active[slot] = req
                self.prom.of(self.prom.waiting).set(len(self._queue))
                self.prom.of(self.prom.running).set(len(self._active))
            for req in gone:
                req.finish_reason = "cancelled"
                self._finish(req)
            now = time.perf_counter()
            for _, req in admit:
                req.admitted = now
                self.prom.of(self.prom.queue_time).observe(now - req.arrived)
                self.prom.of(self.prom.prompt_tokens).inc(len(req.prompt_ids))
            # Every admitted prompt prefilled together: one insert program (or, not
            # admit_together, one after another, as before batched admission).
            for group in [admit] if self.admit_together else [[a] for a in admit]:
                if group:
                    self._admit(group)
            if admit:  # the prefill's token: the first text, without waiting for a chunk
                self._deliver(dec.advance(0))
            self._deliver(dec.advance(self.chunk_steps))

    def _admit(self, group) -> None:
        """Prefills the requests of `group` ((slot, request) pairs) together. If that fails
        with the loop state intact (a request's own failure: a prompt the decoder refuses, an
        insert program that does not compile), each is tried alone and those that fail alone
        end with their error; a failure that lost the loop state is the engine's (raised)."""
        admits = [
            Admit(
                slot, req.prompt_ids, req.max_tokens, temperature=req.temperature,
                top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                logprobs=req.logprobs is not None, grammar=req.grammar,
            )
            for slot, req in group
        ]  # fmt: skip
        for _, req in group:
            req.detok = Detokenizer(self.tokenizer)
        try:
            self.decoder.insert_many(admits)
            return
        except Exception as e:  # noqa: BLE001 - the request's, unless the state is lost
            if not self._intact():
                raise
            if len(group) == 1:
                self._drop(group, e)
                return
        for pair, one in zip(group, admits, strict=True):
            try:
                self.decoder.insert_many([one])
            except Exception as e:  # noqa: BLE001 - as above
                if not self._intact():
                    raise
                self._drop([pair], e)

    def _intact(self) -> bool:
        """Whether the decoder's loop state survived a failed call (an insert donates it)."""
        intact = getattr(self.decoder, "intact", None)
        return intact() if intact is not None else True

    def _drop(self, pairs, e: BaseException) -> None:
        """Ends the requests of `pairs` ((slot, request)) with `e`, their own failure, and
        frees their rows; the engine goes on."""
        log.warning("a request failed alone: %s: %s", type(e).__name__, e)
        for _, req in pairs:
            self._fail_request(req, e)
        with self._cond:
            for slot, _ in pairs:
                self._active.pop(slot, None)
            self.prom.of(self.prom.running).set(len(self._active))
        self.decoder.release([slot for slot, _ in pairs])

    def _fail_request(self, req: Request, e: BaseException) -> None:
        bad_input = isinstance(e, ValueError)
        req.error_status = 400 if bad_input else 500
        req.error = f"{'' if bad_input else 'this request failed: '}{type(e).__name__}: {e}"
        req.finish_reason = "error"
        self._finish(req)

    def _deliver(self, chunk) -> None:
        """Hands each active row's new tokens to its request; frees the finished rows."""
        self.busy_s += chunk.seconds
        steps = chunk.kinds.shape[1]
        self.stats["steps"] += steps
        for j in range(steps):
            col = chunk.kinds[:, j]
            if col.any():
                self.kinds[kind_label(proposers.chosen_kind(col[col != 0][0]))] += 1
        self.prom.record_steps(chunk.acc, chunk.kinds)
        self.stats["step_tokens"] += int(chunk.acc.sum())
        self.stats["row_steps"] += int((chunk.kinds != 0).sum())
        steps_by, tokens_by = proposers.by_proposer(chunk.kinds, chunk.acc)
        self.by_proposer["steps"].update(steps_by)
        self.by_proposer["tokens"].update(tokens_by)
        drafted = proposers.chain_drafts(chunk.kinds)
        accepted = np.where(drafted > 0, chunk.acc - 1, 0)
        self.stats["drafted"] += int(drafted.sum())
        self.stats["accepted"] += int(accepted.sum())
        now = time.perf_counter()
        freed = []
        for slot, req in list(self._active.items()):
            try:
                self._deliver_row(req, slot, chunk, drafted, accepted, now)
            except Exception as e:  # noqa: BLE001 - this request's own failure (its text)
                log.warning("a request failed alone: %s: %s", type(e).__name__, e)
                if req.finish_reason is None:
                    self._fail_request(req, e)
            if req.finish_reason is not None:
                freed.append(slot)
        with self._cond:
            for slot in freed:
                del self._active[slot]
            self.prom.of(self.prom.running).set(len(self._active))
        self.decoder.release(freed)

    def _deliver_row(self, req: Request, slot: int, chunk, drafted, accepted, now) -> None:
        """Row `slot`'s new tokens (and logprobs, counts) to `req`, its text handed out; ends
        `req` if its row is done."""
        new = chunk.gen[slot, len(req.tokens) : int(chunk.n_gen[slot])].tolist()
        if req.logprobs is not None and chunk.logprobs is not None:
            lp, top_lp, top_ids = (x[slot, len(req.tokens) : len(req.tokens) + len(new)]
                                   for x in chunk.logprobs)  # fmt: skip
            k = req.logprobs
            req.token_logprobs.extend(
                (float(a), b[:k].tolist(), c[:k].tolist())
                for a, b, c in zip(lp, top_ids, top_lp, strict=True)
            )
        req.tokens.extend(new)
        req.steps = int(chunk.num_steps[slot])
        req.drafted += int(drafted[slot].sum())
        req.accepted += int(accepted[slot].sum())
        self.stats["tokens"] += len(new)
        self.prom.of(self.prom.generation_tokens).inc(len(new))
        if new:
            if req.last_tokens is None:
                self.prom.of(self.prom.ttft).observe(now - req.arrived)
            else:
                self.prom.of(self.prom.itl).observe(now - req.last_tokens)
            req.last_tokens = now
        if req.cancelled:
            req.finish_reason = "cancelled"
        elif new or chunk.done[slot]:
            self._update_text(req, new, bool(chunk.done[slot]))
        if req.finish_reason is not None:
            self._finish(req)

    def _update_text(self, req: Request, new: list[int], row_done: bool) -> None:
        """Decodes only `new` (`Detokenizer`); searches for stop strings only where one could
        newly start; hands out the text no stop string can still claim."""
        detok = req.detok
        detok.add(new, final=row_done)
        text = detok.text
        if row_done:
            last = req.tokens[-1] if req.tokens else None
            req.finish_reason = "stop" if last in self.stop_token_ids else "length"
        req.counted = len(req.tokens)
        longest = max((len(s) for s in req.stop), default=0)
        start = max(req.searched - longest + 1, 0)
        cuts = [i for i in (text.find(s, start) for s in req.stop) if i >= 0]
        req.searched = len(text)
        if cuts:
            text, req.finish_reason = text[: min(cuts)], "stop"
            req.counted = detok.tokens_for(len(text))
        if req.finish_reason is None:
            # Hold back what could be the start of a stop string.
            upto = max(len(text) - max(longest - 1, 0), req.sent)
        else:
            upto = len(text)
        req.text = text
        if upto > req.sent:
            if req.first_text is None:
                req.first_text = time.perf_counter()
            covered = req.counted
            if req.logprobs is not None and req.finish_reason is None:
                covered = detok.tokens_for(upto)
            req._post(("text", (text[req.sent : upto], covered)))
            req.sent = upto

    def _finish(self, req: Request) -> None:
        req.finished = time.perf_counter()
        kind = "failed" if req.error else "cancelled" if req.cancelled else "completed"
        self.stats[kind] += 1
        self.stats["request_s"] += req.finished - req.arrived
        prom = self.prom
        if kind == "completed":
            prom.of(prom.success, finished_reason=req.finish_reason).inc()
        else:
            prom.of(prom.failure, reason="error" if req.error else "cancelled").inc()
        prom.of(prom.e2e).observe(req.finished - req.arrived)
        req._post(("done", None))
