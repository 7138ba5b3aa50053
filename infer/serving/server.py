"""The server as a library: the warmed-up SlotDecoder, the engine, and the uvicorn server that
drains on exit. `infer.serve` is its command line (flags); tests and benchmarks build it here
without importing any flags."""

from __future__ import annotations

import uvicorn

from dflash_jax import api
from dflash_jax.decoding.slots import SlotDecoder
from infer.serving.app import Limits, make_app
from infer.serving.engine import Engine
from infer.serving.metrics import Metrics
from infer.serving.structured import Grammars

WARM_PROMPT = "Write a Python function that checks whether a number is prime."
# Each slot's structured-output table (states, token classes): SmolLM2's tables for the tested
# JSON schemas and any JSON object fit (results/structured/tables.json); 2 MiB a slot.
GRAMMAR_SHAPE = (2048, 256)


def build_decoder(
    target, drafter, cfg, *, slots, max_prompt, calibrate, precompile=True, grammar_shape=None
) -> SlotDecoder:
    """The SlotDecoder, compiled, warmed up over every step kind and (adaptive) calibrated:
    what /health waits for. Its inserts of every slot and of one row are compiled at the warm
    prompt's width; with `precompile`, the insert of one row at every other prompt width is
    then compiled in the background while it serves (smallest first; a request that needs one
    first compiles it itself), other row counts on their first use (`admission.Inserts`)."""
    decoder = SlotDecoder(target, drafter, cfg, slots, max_prompt, grammar_shape)
    warm = api.render_prompt(target.tokenizer, WARM_PROMPT)[:max_prompt]
    decoder.warm_up(warm)
    if calibrate:
        decoder.calibrate(warm)
    if precompile:
        decoder.inserts.prefetch((1, width) for width in decoder.buckets)
    return decoder


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit signal (SIGTERM, Ctrl-C) first stops the engine taking
    requests; uvicorn then waits for the accepted ones, and the app's shutdown drains it."""

    def __init__(self, config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.stop_admitting()
        super().handle_exit(sig, frame)


def make_server(
    target, drafter, cfg, *, host, port, slots, max_prompt, chunk_steps, max_queue, model_name,
    calibrate=True, api_key=None, precompile=True, admit_together=True,
    grammar_shape=GRAMMAR_SHAPE,
) -> tuple[DrainingServer, Engine]:  # fmt: skip
    """(server, engine): the engine builds its decoder on its own thread once the server runs
    (`server.run()`); /health says ready when it is built. With `api_key`, /v1/ needs it.
    grammar_shape: (states, token classes) of each slot's structured-output table (None:
    structured output refused)."""
    build = lambda: build_decoder(
        target, drafter, cfg, slots=slots, max_prompt=max_prompt, calibrate=calibrate,
        precompile=precompile, grammar_shape=grammar_shape,
    )  # fmt: skip
    engine = Engine(
        build,
        target.tokenizer,
        cfg.stop_token_ids,
        max_queue=max_queue,
        chunk_steps=chunk_steps,
        on_error=lambda e: setattr(server, "should_exit", True),  # main() reports it
        metrics=Metrics(model_name),
        admit_together=admit_together,
    )
    limits = Limits(
        max_prompt, cfg.max_new_tokens, target.config.max_position_embeddings,
        logprobs=cfg.logprobs,
    )  # fmt: skip
    grammars = Grammars(
        target.tokenizer, target.config.vocab_size, cfg.stop_token_ids, grammar_shape
    )
    web = make_app(
        engine, model=model_name, tokenizer=target.tokenizer, limits=limits, api_key=api_key,
        grammars=grammars,
    )  # fmt: skip
    config = uvicorn.Config(web, host=host, port=port, log_level="warning", lifespan="on")
    server = DrainingServer(config, engine)
    return server, engine
