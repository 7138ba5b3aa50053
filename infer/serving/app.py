"""The OpenAI-compatible HTTP side of `infer.serve` (FastAPI): request validation, the
response and server-sent-event shapes of /v1/completions and /v1/chat/completions, /v1/models,
/health and /metrics. Every request is checked before it is queued; a bad one is answered 400
with an OpenAI-style error naming the field (`param`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from infer.serving.engine import Engine, NotServing, QueueFull
from infer.serving.engine import Request as Job

MAX_STOPS = 4  # as OpenAI's API
MAX_SEED = 2**32


class BadRequest(Exception):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, param: str | None = None, kind="invalid_request_error"):
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def _number(body: dict, name: str, default, lo, hi, *, integer=False, lo_open=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise BadRequest(name, f"{name} must be {'an integer' if integer else 'a number'}")
    low_ok = value > lo if lo_open else value >= lo
    if not low_ok or (hi is not None and value > hi):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(name, f"{name}={value} is out of range {bounds}")
    return value


class Limits:
    """What a request may ask for: its prompt tokens, new tokens, and their sum."""

    def __init__(self, max_prompt: int, max_tokens: int, context: int):
        self.max_prompt, self.max_tokens, self.context = max_prompt, max_tokens, context


def parse(body, *, chat: bool, model: str, tokenizer, limits: Limits) -> tuple[Job, bool]:
    """A request body -> (the engine's job, whether to stream); BadRequest names the field."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    if body.get("model") != model:
        raise BadRequest("model", f"model {body.get('model')!r} is not served here; use {model!r}")
    if chat:
        field, ids = "messages", _chat_ids(body.get("messages"), tokenizer)
    else:
        field, ids = "prompt", _prompt_ids(body.get("prompt"), tokenizer)
    if len(ids) > limits.max_prompt:
        raise BadRequest(
            field,
            f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt}",
        )
    if body.get("n", 1) != 1:
        raise BadRequest("n", "n must be 1 (one choice per request)")
    for unsupported in ("logprobs", "echo", "best_of", "suffix", "tools", "logit_bias"):
        if body.get(unsupported) not in (None, False, 1 if unsupported == "best_of" else None):
            raise BadRequest(unsupported, f"{unsupported} is not supported by this server")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default = limits.max_tokens if chat else min(16, limits.max_tokens)  # OpenAI's defaults
    max_tokens = _number(body, name, default, 1, limits.max_tokens, integer=True)
    if len(ids) + max_tokens > limits.context:
        raise BadRequest(
            name, f"{len(ids)} prompt tokens + {name}={max_tokens} exceed the target's "
            f"context of {limits.context} tokens",
        )  # fmt: skip
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOPS:
        raise BadRequest("stop", f"stop must be a string or a list of at most {MAX_STOPS}")
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop", "every stop sequence must be a non-empty string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "stream must be true or false")
    job = Job(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),  # OpenAI's default: 1
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        top_k=_number(body, "top_k", 0, 0, None, integer=True),
        seed=_number(body, "seed", 0, 0, MAX_SEED - 1, integer=True),
        stop=tuple(stop),
    )
    return job, stream


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt", "prompt must be one non-empty string")
    if not prompt:
        raise BadRequest("prompt", "prompt is empty")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise BadRequest("prompt", "prompt is empty after tokenisation")
    return ids


def _chat_ids(messages, tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        ok = isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
        if not ok or not isinstance(m.get("content"), str):
            raise BadRequest(
                f"messages[{i}]", "each message needs a role (system, user, assistant) and "
                "string content",
            )  # fmt: skip
    if not any(m["content"] for m in messages):
        raise BadRequest("messages", "every message is empty")
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _usage(job: Job) -> dict:
    done = len(job.tokens)
    n = len(job.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done}


def make_app(engine: Engine, *, model: str, tokenizer, limits: Limits) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model`."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()  # builds the decoder on its thread; /health says when it is ready
        yield
        await asyncio.to_thread(engine.drain)  # uvicorn has waited for the open requests

    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())

    @app.get("/health")
    def health():
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.error)}, 500)
        if engine.draining:
            return JSONResponse({"status": "draining"}, 503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "warming up"}, 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        card = {"id": model, "object": "model", "created": created, "owned_by": "dflash-jax"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    def metrics():
        return engine.metrics()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        try:
            job, stream = parse(body, chat=chat, model=model, tokenizer=tokenizer, limits=limits)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            engine.submit(job)
        except QueueFull as e:
            response = _error(429, str(e), kind="rate_limit_error")
            response.headers["Retry-After"] = str(e.retry_after)
            return response
        except NotServing as e:
            return _error(503, f"the server is {e}", kind="server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            events = _events(job, rid, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        while True:  # a client that goes away frees its slot
            try:
                await asyncio.wait_for(_until_done(job), timeout=0.5)
                break
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return JSONResponse({}, 499)
        return _response(job, rid, chat)

    def _head(rid, chat):
        kind = "chat.completion" if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model}

    def _response(job: Job, rid: str, chat: bool) -> dict:
        if chat:
            message = {"role": "assistant", "content": job.text}
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": job.text, "logprobs": None}
        choice["finish_reason"] = job.finish_reason
        extra = {"dflash": {"tau": job.tau, "steps": job.steps}}
        return {**_head(rid, chat), "choices": [choice], "usage": _usage(job), **extra}

    async def _events(job: Job, rid: str, chat: bool):
        head = _head(rid, chat)
        if chat:
            head["object"] = "chat.completion.chunk"
        delta = lambda text, reason=None: {
            **head,
            "choices": [
                {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            ],
        }
        try:
            if chat:
                first = delta("")
                first["choices"][0]["delta"]["role"] = "assistant"
                yield f"data: {json.dumps(first)}\n\n"
            while True:
                kind, text = await job.events.get()
                if kind == "done":
                    break
                yield f"data: {json.dumps(delta(text))}\n\n"
            last = delta("", job.finish_reason)
            if chat:
                last["choices"][0]["delta"] = {}
            last["usage"] = _usage(job)
            yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed), or the answer is complete
            if job.finish_reason is None:
                job.cancel()

    return app


async def _until_done(job: Job) -> None:
    while True:
        kind, _ = await job.events.get()
        if kind == "done":
            return
