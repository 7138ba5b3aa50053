r"""An OpenAI-compatible server: continuous batching over the jitted DFlash loop.

  python -m infer.serve --slots=8 --port=8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}],
         "max_tokens": 64, "temperature": 0}'

POST /v1/completions and /v1/chat/completions (`stream: true` as server-sent events; per
request max_tokens, temperature, top_p, top_k, stop, seed; an unseeded request draws a fresh
seed; structured output: response_format json_object / json_schema, vLLM's guided_json,
guided_regex, guided_choice, each row constrained inside the loop), GET /v1/models, /health
(200 once every program is compiled and warmed up, 503 before, while draining and after a
failure, with the reason), /metrics (Prometheus: requests, queue, tokens, latency histograms,
speculative decoding) and /stats (the same summary as JSON). The
--slots rows of one running decode are the slots: between chunks of --chunk_steps loop steps,
finished rows are freed and queued requests are prefilled into free rows
(`dflash_jax.decoding.slots`). Target passes are batch-invariant unless --nobatch_invariant, so
a greedy request's answer is the same alone or beside others. Past --max_queue requests
waiting beyond the free slots: 429 with Retry-After; a bad request: 400 naming the field; a
failure one request causes: that request alone ends (500, or 400 for input the decoder
refuses); a failure of the decoder's shared loop: 500 to every request it held, then the
process exits with code 1 (for a supervisor to restart it). --api_key (or DFLASH_API_KEY)
guards /v1/. SIGTERM (or Ctrl-C) stops admitting, lets every accepted request finish, then
exits. Loopback by default (--host). The sampling flags of infer.generate do not apply: each
request brings its own (OpenAI's defaults: temperature 1, top_p 1). docs/serving.md has the
details.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags

from dflash_jax import api
from infer import cli, common
from infer.serving.server import GRAMMAR_SHAPE, make_server

FLAGS = flags.FLAGS
API_KEY_ENV = "DFLASH_API_KEY"  # as vLLM's VLLM_API_KEY
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit)
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback by default).")
flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
flags.DEFINE_integer(
    "slots", 8, "Requests decoded at once: the rows of the running decode.", lower_bound=1
)
flags.DEFINE_integer(
    "max_prompt_tokens", None,
    "Longest prompt (in tokens, after the chat template) a request may have (an insert "
    "program per power-of-two width from 32 up to it, each compiled on its first use or by "
    "--precompile_inserts). Default: the target's context less --max_new_tokens.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_string(
    "api_key", None,
    f"With a key, every /v1/ request needs the header 'Authorization: Bearer <key>' (401 "
    f"otherwise); /health and /metrics stay open. Default: the environment's {API_KEY_ENV}.",
)  # fmt: skip
flags.DEFINE_integer(
    "chunk_steps", 8,
    "Loop steps per advance call: between chunks, text is handed out, finished rows freed and "
    "waiting requests admitted.",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "max_queue", 64, "Requests that may wait for a slot; past it, 429 with Retry-After.",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_string(
    "model_name", None, "The model id requests name (and /v1/models lists); default: --target."
)
flags.DEFINE_bool(
    "precompile_inserts", True,
    "Once serving, compile the insert of one request at every prompt width in the background "
    "(smallest first), so that a longer prompt rarely waits for its compile; off: each width "
    "on its first use. Start-up compiles only the warm-up prompt's width either way.",
)  # fmt: skip
flags.DEFINE_bool(
    "admit_together", True,
    "Prefill the prompts admitted at one chunk boundary together (one insert program); off: "
    "one after another, each alone (what the server did before; for comparisons).",
)  # fmt: skip
flags.DEFINE_string(
    "grammar_table",
    "x".join(map(str, GRAMMAR_SHAPE)),
    "Structured output (response_format, guided_json / guided_regex / guided_choice): each "
    "slot's grammar table, STATESxCLASSES (a request whose grammar needs more is refused with "
    "a 400 naming this flag); 0: structured output off.",
)
flags.DEFINE_bool(
    "calibrate", True,
    "Measure the adaptive step kinds' costs on the served program at start-up (a few "
    "seconds); off: the default costs.",
)  # fmt: skip


def server_config(target, drafter) -> api.DecodeConfig:
    """The served decode: the flags' kinds (the measured defaults when unset), every row with
    its own settings, --max_new_tokens the most a request may ask for, batch-invariant unless
    --nobatch_invariant, at --row_tile's tile (by default `invariance.served_row_tile`: the
    slots, from 8 of them, so the plain step over every slot runs as one tile), keeping up to
    MAX_LOGPROBS alternatives per token for the requests that ask for logprobs."""
    cfg = common.run_config(target, drafter)
    invariant = True if FLAGS.batch_invariant is None else FLAGS.batch_invariant
    # A plain step stays among the default kinds: with several busy slots a drafted step costs
    # a few plain ones (block 4 at 8 slots ~1.7x greedy, `decoding.slots`), unlike a stream's.
    kinds = cfg.step_kinds
    if cfg.adaptive and not FLAGS.step_kinds:
        kinds = api.default_step_kinds(cfg.block_size)
    return dataclasses.replace(
        cfg, temperature=0.0, top_k=0, top_p=1.0, batch_invariant=invariant, row_settings=True,
        step_kinds=kinds, row_tile=common.row_tile(FLAGS.slots), logprobs=MAX_LOGPROBS,
    )  # fmt: skip


def parse_grammar_table(text: str) -> tuple[int, int] | None:
    """--grammar_table: "STATESxCLASSES" -> (states, classes); "0": None (off)."""
    if text.strip() in ("0", "off", ""):
        return None
    try:
        states, classes = (int(x) for x in text.lower().split("x"))
    except ValueError:
        states = classes = 0
    if states < 1 or classes < 1:
        raise ValueError(f"--grammar_table={text!r}: give STATESxCLASSES, e.g. 2048x256, or 0")
    return states, classes


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    common.enable_compilation_cache()
    if FLAGS.batch_invariant is None:
        FLAGS.batch_invariant = True  # also what --dtype=auto compares dtypes under
    with common.usage_errors():
        grammar_shape = parse_grammar_table(FLAGS.grammar_table)  # a typo fails before the load
        target, drafter, _, _ = common.load_models(slots=FLAGS.slots)
        if drafter is None:
            raise ValueError("--drafter=none: the server decodes with a drafter")
        if target.tokenizer is None:
            raise ValueError(f"the target {FLAGS.target} has no tokenizer to read requests with")
        cfg = server_config(target, drafter)
        api.check_inputs(target, drafter, [[1]], [1], cfg)
        context = target.config.max_position_embeddings
        max_prompt = FLAGS.max_prompt_tokens or context - cfg.max_new_tokens
        if max_prompt < 1 or max_prompt + cfg.max_new_tokens > context:
            raise ValueError(
                f"--max_prompt_tokens {max_prompt} + --max_new_tokens "
                f"{cfg.max_new_tokens} exceed the target's context of {context} tokens"
            )
    server, engine = make_server(
        target, drafter, cfg, host=FLAGS.host, port=FLAGS.port, slots=FLAGS.slots,
        max_prompt=max_prompt, chunk_steps=FLAGS.chunk_steps,
        max_queue=FLAGS.max_queue, model_name=FLAGS.model_name or FLAGS.target,
        calibrate=FLAGS.calibrate, api_key=FLAGS.api_key or os.environ.get(API_KEY_ENV),
        precompile=FLAGS.precompile_inserts, admit_together=FLAGS.admit_together,
        grammar_shape=grammar_shape,
    )  # fmt: skip
    print(
        f"serving {FLAGS.model_name or FLAGS.target} on http://{FLAGS.host}:{FLAGS.port} "
        f"({FLAGS.slots} slots, prompts up to {max_prompt} tokens; /health is 200 once "
        "compiled)",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if engine.error is not None:  # exit code 1, for a supervisor to restart the server
        when = "while serving" if engine.ready.is_set() else "to start"
        raise ValueError(f"the decoder failed {when}: {engine.reason}")


if __name__ == "__main__":
    cli.run(main)
