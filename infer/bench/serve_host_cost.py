r"""The server's host time per streamed token as an answer grows: the engine thread's CPU time
between two advance calls (handing each row its tokens, decoding their text, searching stop
strings, logprobs), divided by the tokens the chunk gave, at answer lengths around --short
and --long tokens. Flat (linear streaming) means the ratio long/short is near 1.

  python -m infer.bench.serve_host_cost --short=256 --long=4096

No model runs: a stand-in decoder commits --tokens_per_chunk tokens of a real text (the
embedded SmolLM2's tokenizer: multi-byte characters, merged tokens) per advance call, for
--rows requests at once, each streamed, with --logprobs alternatives and a stop string that
never matches (the work a request with both asks for). Prints one JSON object: the median host
CPU seconds per token near each length (over --window chunks) and their ratio.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
from absl import app, flags

from dflash_jax.decoding.slots import Chunk
from dflash_jax.io import assets
from dflash_jax.io.tokenizer import load_gguf_tokenizer
from infer import cli
from infer.serving.engine import Engine, Request

FLAGS = flags.FLAGS
flags.DEFINE_integer("short", 256, "The shorter answer length measured at.", lower_bound=16)
flags.DEFINE_integer("long", 4096, "The longer answer length measured at.", lower_bound=16)
flags.DEFINE_integer("rows", 4, "Requests streamed at once (the slots).", lower_bound=1)
flags.DEFINE_integer("tokens_per_chunk", 16, "Tokens each row commits per advance.", lower_bound=1)
flags.DEFINE_integer("logprobs", 5, "Alternatives per token each request asks for.", lower_bound=0)
flags.DEFINE_integer("window", 8, "Chunks measured around each length.", lower_bound=1)
TEXT = (
    "Here is a function that checks whether a number is prime: def is_prime(n): return n > 1 "
    "and all(n % d for d in range(2, int(n ** 0.5) + 1)). Ça marche très bien 👍; 素数の判定。\n"
)


class StandIn:
    """Commits `per` tokens of `ids` (cycled) per advance to every busy row, with logprobs;
    records the engine thread's CPU time when each advance call starts and ends, and how long
    the answers are then (CPU time, not wall time: other jobs on the machine do not count)."""

    def __init__(self, slots: int, width: int, ids: list[int], per: int, k: int):
        self.slots, self.per, self.ids, self.k = slots, per, ids, max(k, 1)
        self.gen = np.zeros((slots, width), np.int32)
        self.lp = (
            np.zeros((slots, width), np.float32),
            np.zeros((slots, width, self.k), np.float32),
            np.zeros((slots, width, self.k), np.int32),
        )
        self.n, self.max_new = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
        self.calls: list[tuple[float, float, int]] = []  # (start, end, answer length)

    def insert_many(self, admits):
        for a in admits:
            self.n[a.slot], self.max_new[a.slot] = 0, a.max_new

    def advance(self, steps, forced_kind=-1):
        t0 = time.thread_time()
        busy = self.n < self.max_new
        for row in np.flatnonzero(busy):
            take = min(self.per if steps else 1, int(self.max_new[row] - self.n[row]))
            at = int(self.n[row])
            self.gen[row, at : at + take] = [
                self.ids[(at + j) % len(self.ids)] for j in range(take)
            ]
            self.lp[2][row, at : at + take] = self.gen[row, at : at + take, None]
            self.n[row] += take
        acc = busy[:, None].astype(np.int32)
        done = self.n >= self.max_new
        chunk = Chunk(self.gen, self.n.copy(), done, self.n.copy(), acc, acc * 8, 0.0, self.lp)
        self.calls.append((t0, time.thread_time(), int(self.n.max())))
        return chunk

    def release(self, rows):
        pass


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.long <= FLAGS.short:
        raise app.UsageError("--long must exceed --short")
    tok = load_gguf_tokenizer(assets.smollm2_gguf_path())
    ids = tok.encode(TEXT, add_special_tokens=False)
    width = FLAGS.long + FLAGS.tokens_per_chunk * (FLAGS.window + 2)
    dec = StandIn(FLAGS.rows, width, ids, FLAGS.tokens_per_chunk, FLAGS.logprobs)
    engine = Engine(lambda: dec, tok, (), max_queue=FLAGS.rows, chunk_steps=8)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine.start()
    engine.ready.wait()
    jobs = []
    for _ in range(FLAGS.rows):
        job = Request(
            prompt_ids=[1, 2, 3], max_tokens=width, stop=("<never appears>",),
            logprobs=FLAGS.logprobs or None, loop=loop, events=asyncio.Queue(),
        )  # fmt: skip
        engine.submit(job)
        jobs.append(job)

    async def consume(job):
        while (await job.events.get())[0] != "done":
            pass

    for job in jobs:
        asyncio.run_coroutine_threadsafe(consume(job), loop).result(timeout=3600)
    engine.drain(timeout=60)
    # Host time of a chunk: from the end of one advance to the start of the next.
    gaps = [(b[0] - a[1], a[2]) for a, b in zip(dec.calls, dec.calls[1:], strict=False)]
    per_token = lambda at: float(
        np.median([g for g, n in gaps if at <= n < at + FLAGS.window * FLAGS.tokens_per_chunk])
        / (FLAGS.tokens_per_chunk * FLAGS.rows)
    )
    short, long = per_token(FLAGS.short), per_token(FLAGS.long)
    print(json.dumps({
        "host_s_per_token_short": short, "host_s_per_token_long": long, "ratio": long / short,
        "short": FLAGS.short, "long": FLAGS.long, "rows": FLAGS.rows,
        "tokens_per_chunk": FLAGS.tokens_per_chunk, "logprobs": FLAGS.logprobs,
    }))  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
