r"""Load test of `infer.serve` on loopback, against the same requests run one by one.

  python -m infer.bench.serve_load --max_new_tokens=128 --output=results/serve_load.json

Starts `python -m infer.serve` on the flags' target and drafter (the embedded default unless
said) and waits for /health (and, --wait_compiles, for the insert programs it compiles in the
background); then --workers threads send --requests chat completions through
the `openai` client (the dev set's prompts in turn: a quarter each greedy / sampled, streamed /
not; max_tokens --max_new_tokens) and time each one (latency; time to the first text when
streamed). It reads the server's /stats (tau, steps by kind), stops it with SIGTERM, then
runs the same requests one by one through `dflash_jax.api.generate` in this process (each
distinct setting run once untimed first, so neither side counts compilation), and checks that
every greedy answer is the same text. Prints one JSON object (and writes it to --output):
aggregate tokens/s of both, the ratio, p50/p95 latency, time to first text and gap between a
streamed answer's pieces of text (a running request's stall while others arrive), tau. Of
infer.common's flags, --target, --drafter, --dtype and --max_new_tokens apply (the sampling
flags do not: each request brings its own). Bounded: --deadline_s for the whole run.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
from absl import app, flags

from dflash_jax import api
from dflash_jax.io.assets import load_dev_prompts
from infer import cli, common, report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)
flags.DEFINE_integer("requests", 32, "Requests to send.", lower_bound=1)
flags.DEFINE_integer("workers", 8, "Concurrent client threads.", lower_bound=1)
flags.DEFINE_integer("slots", 8, "The server's --slots.", lower_bound=1)
flags.DEFINE_float(
    "sampled_temperature", 0.7, "Temperature of the sampled requests.", lower_bound=0.0
)
flags.DEFINE_integer("port", 8011, "Loopback port for the server.")
flags.DEFINE_list(
    "server_flags", [], "More flags for the server, e.g. --server_flags=--chunk_steps=16."
)
flags.DEFINE_integer(
    "max_prompt_tokens", 256,
    "The server's --max_prompt_tokens (an insert program per power-of-two prompt width).",
)  # fmt: skip
flags.DEFINE_bool(
    "wait_compiles", True,
    "Before sending requests, wait until the server has compiled the insert programs it "
    "compiles in the background (its /stats insert_programs.compiling is 0; a server "
    "without that field is not waited for), so that they do not share the timed run.",
)  # fmt: skip
flags.DEFINE_bool(
    "warm_round", False,
    "Send every request once untimed first (then --wait_compiles again): a server that has "
    "met this load, every program it compiles on first use compiled. /stats' counters (tau, "
    "steps) then include that round.",
)  # fmt: skip
flags.DEFINE_bool(
    "one_by_one", True,
    "Also run the requests one by one through api.generate (the throughput ratio and the "
    "greedy check); off: only the served run's figures.",
)  # fmt: skip
flags.DEFINE_integer("deadline_s", 3600, "Give up (and stop the server) after this long.")
flags.DEFINE_string("output", None, "Also write the JSON object here.")


def requests_to_send() -> list[dict]:
    """The chat requests: prompt i of the dev set (cycled); i % 4: 0 greedy, 1 greedy streamed,
    2 sampled, 3 sampled streamed (top_p 0.95, seed i)."""
    prompts = [p["prompt"] for p in load_dev_prompts()]
    out = []
    for i in range(FLAGS.requests):
        sampled = i % 4 >= 2
        out.append({
            "prompt": prompts[i % len(prompts)],
            "stream": i % 2 == 1,
            "temperature": FLAGS.sampled_temperature if sampled else 0.0,
            "top_p": 0.95 if sampled else 1.0,
            "seed": i,
        })  # fmt: skip
    return out


def get_json(path: str) -> tuple[int, dict]:
    """(status, body) of a GET on the server; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{FLAGS.port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def start_server(dtype: str, log_path: str) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable, "-m", "infer.serve", f"--port={FLAGS.port}", f"--slots={FLAGS.slots}",
        f"--max_new_tokens={FLAGS.max_new_tokens}", f"--target={FLAGS.target}",
        f"--drafter={FLAGS.drafter}", f"--dtype={dtype}",
        f"--max_prompt_tokens={FLAGS.max_prompt_tokens}", *FLAGS.server_flags,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    while time.perf_counter() - t0 < FLAGS.deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log_path}")
        status, body = get_json("/health")
        if status == 200:
            return proc, time.perf_counter() - t0
        if status == 500:
            proc.kill()
            raise RuntimeError(f"the server failed to start: {body}; see {log_path}")
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"the server was not ready within --deadline_s={FLAGS.deadline_s}")


def wait_compiles() -> float:
    """With --wait_compiles, waits until the server compiles no insert program in the
    background -> seconds waited."""
    t0 = time.perf_counter()
    while FLAGS.wait_compiles and time.perf_counter() - t0 < FLAGS.deadline_s:
        if get_json("/stats")[1].get("insert_programs", {}).get("compiling", 0) == 0:
            break
        time.sleep(1)
    return time.perf_counter() - t0


def send(client, model: str, req: dict) -> dict:
    """One request through the openai client -> text, latency, time to first text and
    (streamed) the gaps between its successive pieces of text."""
    kw = dict(
        model=model, messages=[{"role": "user", "content": req["prompt"]}],
        max_tokens=FLAGS.max_new_tokens, temperature=req["temperature"], top_p=req["top_p"],
        seed=req["seed"],
    )  # fmt: skip
    t0 = time.perf_counter()
    first, arrivals = None, []
    if req["stream"]:
        parts = []
        for chunk in client.chat.completions.create(**kw, stream=True):
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                arrivals.append(time.perf_counter())
                if first is None:
                    first = arrivals[-1] - t0
            parts.append(text or "")
        text = "".join(parts)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    gaps = np.diff(arrivals).tolist()  # a running request's waits between pieces of text
    return {"text": text, "latency_s": time.perf_counter() - t0, "ttft_s": first, "gaps_s": gaps}


def percentiles(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


def one_by_one(target, drafter, reqs: list[dict]) -> tuple[list[str], list[int], float]:
    """Each request alone through api.generate; every distinct setting once untimed first."""
    settings = {(r["temperature"], r["top_p"]) for r in reqs}
    gen = lambda r: api.generate(
        target, drafter, [r["prompt"]], max_new_tokens=FLAGS.max_new_tokens,
        temperature=r["temperature"], top_p=r["top_p"], seed=r["seed"],
    )[0]  # fmt: skip
    for t, p in settings:
        gen(next(r for r in reqs if (r["temperature"], r["top_p"]) == (t, p)))
    texts, tokens, total = [], [], 0.0
    for r in reqs:
        t0 = time.perf_counter()
        text = gen(r)
        total += time.perf_counter() - t0
        texts.append(text)
        tokens.append(count_tokens(target, text))
    return texts, tokens, total


def count_tokens(target, text: str) -> int:
    """An answer's tokens, counted alike on both sides: its text encoded again (generate gives
    text; the stop token is not counted)."""
    return len(target.tokenizer.encode(text, add_special_tokens=False))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import openai

    common.quiet_library_logs()
    started = time.perf_counter()
    if FLAGS.batch_invariant is None:
        FLAGS.batch_invariant = True  # as infer.serve: --dtype=auto judges its setting
    with common.usage_errors():
        # --dtype=auto as the server resolves it (its --slots busy rows), passed to it
        target, drafter, dtype, _ = common.load_models(slots=FLAGS.slots)
        if drafter is None:
            raise ValueError("--drafter=none: the server decodes with a drafter")
    reqs = requests_to_send()
    log_path = os.path.join(tempfile.gettempdir(), f"serve_load_{os.getpid()}.log")
    proc, startup_s = start_server(dtype, log_path)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{FLAGS.port}/v1", api_key="none", max_retries=0,
            timeout=FLAGS.deadline_s,
        )  # fmt: skip
        model = client.models.list().data[0].id
        compiled_s = startup_s + wait_compiles()
        if FLAGS.warm_round:  # untimed: the programs this load needs, compiled
            with concurrent.futures.ThreadPoolExecutor(FLAGS.workers) as pool:
                list(pool.map(lambda r: send(client, model, r), reqs))
            wait_compiles()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(FLAGS.workers) as pool:
            served = list(pool.map(lambda r: send(client, model, r), reqs))
        wall_s = time.perf_counter() - t0
        metrics = get_json("/stats")[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = None
    for s in served:
        s["tokens"] = count_tokens(target, s["text"])
    served_tokens = sum(s["tokens"] for s in served)
    served_tps = served_tokens / wall_s
    result = {
        "requests": len(reqs),
        "answered": sum(s["text"] is not None for s in served),
        "workers": FLAGS.workers,
        "slots": FLAGS.slots,
        "max_tokens": FLAGS.max_new_tokens,
        "dtype": dtype,
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        "server_startup_s": startup_s,
        "server_compiled_s": compiled_s,
        "server_exit_code_after_sigterm": exit_code,
        "served": {
            "wall_s": wall_s,
            "completion_tokens": served_tokens,
            "tokens_per_s": served_tps,
            "latency_s": percentiles(s["latency_s"] for s in served),
            "ttft_s_streamed": percentiles(s["ttft_s"] for s in served),
            # Between a streamed request's pieces of text, over every streamed request: what a
            # running request waits while others are admitted (their prefills) and decoded.
            "inter_token_gap_s_streamed": percentiles(g for s in served for g in s["gaps_s"]),
            "tau": metrics["tau"],
            "steps_by_kind": metrics["steps_by_kind"],
            "insert_programs": metrics.get("insert_programs"),
            "server_tokens_per_s_busy": metrics["tokens_per_s_busy"],
        },
        "server_flags": FLAGS.server_flags,
        "warm_round": FLAGS.warm_round,
        "per_request": [
            {
                **r,
                "prompt": r["prompt"][:60],
                **{k: s[k] for k in ("tokens", "latency_s", "ttft_s")},
            }
            for r, s in zip(reqs, served, strict=True)
        ],
    }
    if FLAGS.one_by_one:
        texts, alone_tokens, alone_s = one_by_one(target, drafter, reqs)
        greedy = [i for i, r in enumerate(reqs) if r["temperature"] == 0]
        differ = [i for i in greedy if served[i]["text"] != texts[i]]
        alone_tps = sum(alone_tokens) / alone_s
        result["one_by_one"] = {
            "run_s": alone_s,
            "completion_tokens": sum(alone_tokens),
            "tokens_per_s": alone_tps,
        }
        result["throughput_ratio"] = served_tps / alone_tps
        result["greedy_identical"] = f"{len(greedy) - len(differ)}/{len(greedy)}"
        result["greedy_differ"] = differ
    result["total_s"] = time.perf_counter() - started
    report.emit_json(result, FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
