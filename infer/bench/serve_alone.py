r"""One request alone through `infer.serve` against `infer.generate` on the same prompt, run
right after it on the same machine.

  python -m infer.bench.serve_alone --slots=4 --output=results/serve_alone.json

Starts `python -m infer.serve --slots=N` (the embedded default unless --target/--drafter say
otherwise), waits for /health and for the insert programs it compiles in the background,
sends a warm-up chat completion, then --repeats timed ones of
--prompt (greedy, --max_new_tokens), one at a time to the idle server: each one's tokens per
second is its completion tokens over its wall time (prefill, HTTP and all). Reads /stats,
stops the server, then runs `python -m infer.generate --prompt=... --json` (its defaults) and
reads its tokens per second. Prints one JSON object: the server's best and median rate, the
CLI's, their ratio, and both sides' steps by kind.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from absl import app, flags

from dflash_jax.ops.invariance import machine_name
from infer.serving.server import WARM_PROMPT

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", WARM_PROMPT, "The one prompt (a chat message).")
flags.DEFINE_integer(
    "max_new_tokens", 128, "max_tokens of the request, --max_new_tokens of the CLI."
)
flags.DEFINE_integer("slots", 4, "The server's --slots.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Timed requests (after one warm-up).", lower_bound=1)
flags.DEFINE_integer("port", 8013, "Loopback port for the server.")
flags.DEFINE_list(
    "server_flags", [], "More flags for the server, e.g. --server_flags=--dtype=float32."
)
flags.DEFINE_list("cli_flags", [], "More flags for infer.generate.")
flags.DEFINE_integer("deadline_s", 1800, "Give up on the server's start after this long.")
flags.DEFINE_string("output", None, "Also write the JSON object here.")


def _get(path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{FLAGS.port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def _chat() -> tuple[int, float]:
    """One greedy chat completion of --prompt -> (completion tokens, seconds)."""
    body = {
        "model": _get("/v1/models")[1]["data"][0]["id"],
        "messages": [{"role": "user", "content": FLAGS.prompt}],
        "max_tokens": FLAGS.max_new_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{FLAGS.port}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    return answer["usage"]["completion_tokens"], time.perf_counter() - t0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    log = os.path.join(tempfile.gettempdir(), f"serve_alone_{os.getpid()}.log")
    cmd = [sys.executable, "-m", "infer.serve", f"--port={FLAGS.port}", f"--slots={FLAGS.slots}",
           *FLAGS.server_flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        t0 = time.perf_counter()
        while _get("/health")[0] != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > FLAGS.deadline_s:
                sys.exit(f"the server did not start; see {log}")
            time.sleep(1)
        while _get("/stats")[1].get("insert_programs", {}).get("compiling", 0):
            time.sleep(1)  # the inserts it compiles in the background, done first
        _chat()  # warm-up
        runs = [_chat() for _ in range(FLAGS.repeats)]
        stats = _get("/stats")[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    rates = [n / s for n, s in runs]
    cli_cmd = [sys.executable, "-m", "infer.generate", f"--prompt={FLAGS.prompt}",
               f"--max_new_tokens={FLAGS.max_new_tokens}", "--json", *FLAGS.cli_flags]  # fmt: skip
    out = subprocess.run(cli_cmd, capture_output=True, text=True, check=True).stdout
    cli = json.loads(out[out.index("{") :])
    result = {
        "server": {
            "command": " ".join(cmd[1:]),
            "tokens_per_s": [round(r, 2) for r in rates],
            "best": round(max(rates), 2),
            "median": round(statistics.median(rates), 2),
            "tokens": [n for n, _ in runs],
            "steps_by_kind": stats.get("steps_by_kind"),
            "tokens_by_proposer": stats.get("tokens_by_proposer"),
            "step_costs": stats.get("step_costs"),
            "tau": stats.get("tau"),
        },
        "cli": {
            "command": " ".join(cli_cmd[1:]),
            "tokens_per_s": round(cli["tokens_per_s"], 2),
            "new_tokens": cli["new_tokens"],
            "steps": cli["steps"],
            "step_kind_mix": cli.get("step_kind_mix"),
            "dtype": cli.get("dtype"),
        },
        "machine": machine_name(),
    }
    result["median_over_cli"] = round(result["server"]["median"] / cli["tokens_per_s"], 3)
    result["best_over_cli"] = round(result["server"]["best"] / cli["tokens_per_s"], 3)
    print(json.dumps(result, indent=1))
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
