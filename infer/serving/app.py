"""The OpenAI-compatible HTTP side of `infer.serve` (FastAPI): request validation, the
response and server-sent-event shapes of /v1/completions and /v1/chat/completions, /v1/models,
/health, /metrics (Prometheus) and /stats (JSON). Every request is checked before it is queued:
the body's size before it is parsed, a prompt's characters before it is tokenized (off the
event loop), then its fields; a bad one is answered 400 with an OpenAI-style error naming the
field (`param`). Every error, the framework's 404 and 405 included, has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from infer.serving import structured
from infer.serving.engine import Engine, NotServing, QueueFull
from infer.serving.engine import Request as Job
from infer.serving.metrics import CONTENT_TYPE
from infer.serving.structured import Grammars

log = logging.getLogger(__name__)

MAX_STOPS = 4  # as OpenAI's API
MAX_SEED = 2**32
ROLES = ("system", "user", "assistant", "developer", "tool")
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


class BadRequest(Exception):
    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _error(status: int, message: str, param: str | None = None, kind: str | None = None):
    if kind is None:
        kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
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


@dataclasses.dataclass
class Limits:
    """What a request may ask for: its prompt tokens, new tokens, their sum (the context), the
    characters of its prompt text (checked before tokenizing) and the bytes of its body
    (checked before parsing)."""

    max_prompt: int
    max_tokens: int
    context: int
    max_chars: int = 0  # 0: 32 per prompt token
    max_body: int = 0  # 0: 4 bytes per character, plus 64 KiB
    logprobs: int = 0  # the most alternatives per token a request may ask for (0: no logprobs)

    def __post_init__(self):
        self.max_chars = self.max_chars or 32 * self.max_prompt
        self.max_body = self.max_body or 4 * self.max_chars + 65536


@dataclasses.dataclass
class Options:
    """How to answer a request (beside what the engine needs)."""

    stream: bool = False
    include_usage: bool = False


def parse(
    body, *, chat: bool, model: str, tokenizer, limits: Limits, grammars: Grammars | None = None
) -> tuple[Job, Options]:
    """A request body -> (the engine's job, how to answer); BadRequest names the field. Runs
    off the event loop: it tokenizes, and compiles a structured output's grammar (`grammars`;
    None: such a request is refused)."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    if body.get("model") != model:
        raise BadRequest("model", f"model {body.get('model')!r} is not served here; use {model!r}")
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "stream must be true or false")
    opts = Options(stream=stream, include_usage=_include_usage(body, stream))
    if chat:
        field, ids = "messages", _chat_ids(body.get("messages"), tokenizer, limits)
    else:
        field, ids = "prompt", _prompt_ids(body.get("prompt"), tokenizer, limits)
    if len(ids) > limits.max_prompt:
        raise BadRequest(
            field,
            f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt}",
        )
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default = limits.max_tokens if chat else min(16, limits.max_tokens)  # OpenAI's defaults
    default = min(default, limits.context - len(ids))
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
    seed = _number(body, "seed", None, 0, MAX_SEED - 1, integer=True)
    logprobs = _logprobs(body, chat, limits)
    table = _grammar(body, grammars)
    job = Job(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),  # OpenAI's default: 1
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        top_k=_number(body, "top_k", 0, 0, None, integer=True),
        # Unseeded: a fresh seed, so that asking again gives another answer.
        seed=secrets.randbelow(MAX_SEED) if seed is None else seed,
        stop=tuple(stop),
        logprobs=logprobs,
        grammar=table,
    )
    return job, opts


def _grammar(body: dict, grammars: Grammars | None):
    """The table of a request's structured output (`structured`), None without one."""
    try:
        asked = structured.requested(body)
        if asked is None:
            return None
        if grammars is None:
            raise structured.GrammarRequestError(asked[0], "structured output is off here")
        return grammars.table(*asked)
    except structured.GrammarRequestError as e:
        raise BadRequest(e.param, str(e)) from e


def _logprobs(body: dict, chat: bool, limits: Limits) -> int | None:
    """The alternatives a request wants per token (None: no logprobs). Chat: logprobs (bool)
    and top_logprobs; completions: logprobs, the number of alternatives."""
    if chat:
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            raise BadRequest("logprobs", "logprobs must be true or false")
        top = body.get("top_logprobs")
        if top is not None and not wanted:
            raise BadRequest("top_logprobs", "top_logprobs needs logprobs: true")
        name, top = "top_logprobs", (top or 0) if wanted else None
    else:
        name, top = "logprobs", body.get("logprobs")
    if top is None:
        return None
    if not limits.logprobs:
        raise BadRequest(name, "this server keeps no logprobs")
    return _number({name: top}, name, 0, 0, limits.logprobs, integer=True)


def _refuse_unsupported(body: dict) -> None:
    """A 400 naming each field this server does not implement, unless it asks for the
    default (OpenAI's clients send some of them explicitly)."""
    if body.get("n") not in (None, 1):
        raise BadRequest("n", "n must be 1 (one choice per request)")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of", "best_of must be 1 (one choice per request)")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(name, f"{name} is not supported by this server (only 0)")
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise BadRequest("repetition_penalty", "repetition_penalty is not supported (only 1)")
    for name in ("echo", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False, []):
            raise BadRequest(name, f"{name} is not supported by this server")
    if body.get("logit_bias") not in (None, {}):
        raise BadRequest("logit_bias", "logit_bias is not supported by this server")


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("stream_options", 'stream_options must be {"include_usage": bool}')
    return options.get("include_usage", False)


def _check_chars(field: str, n: int, limits: Limits) -> None:
    if n > limits.max_chars:
        raise BadRequest(
            field, f"the prompt has {n} characters; this server takes at most {limits.max_chars}"
        )


def _prompt_ids(prompt, tokenizer, limits: Limits) -> list[int]:
    """A completions prompt: one string (tokenized) or its token ids (a list of integers, or
    a list holding one such list, as OpenAI's API takes them)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise BadRequest("prompt", f"a prompt token id is outside the vocabulary [0, {vocab})")
        return list(prompt)
    if not isinstance(prompt, str):
        raise BadRequest("prompt", "prompt must be one non-empty string or one list of token ids")
    if not prompt:
        raise BadRequest("prompt", "prompt is empty")
    _check_chars("prompt", len(prompt), limits)
    try:  # special tokens (a BOS) as the tokenizer adds them, as the target was trained
        ids = tokenizer.encode(prompt)
    except Exception as e:  # noqa: BLE001 - the tokenizer's message says what it could not read
        raise BadRequest("prompt", f"the tokenizer could not read the prompt: {e}") from e
    if not ids:
        raise BadRequest("prompt", "prompt is empty after tokenisation")
    return ids


def _content(m: dict, i: int) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if m.get("role") == "assistant" and content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"messages[{i}].content[{j}]",
                    f"content part of type {kind!r} is not supported (only text)",
                )
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content[{j}]", "a text part needs a string text")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"messages[{i}]", "content must be a string or a list of text parts")


def _template_has(tokenizer, role: str) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders
        template = template.get("default", "")
    return f"'{role}'" in (template or "") or f'"{role}"' in (template or "")


def _chat_ids(messages, tokenizer, limits: Limits) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}]", f"each message needs a role ({', '.join(ROLES)})")
        role, text = m["role"], _content(m, i)
        if role == "developer" and not _template_has(tokenizer, "developer"):
            role = "system"  # OpenAI's developer role is the system role of other models
        if role == "tool" and not _template_has(tokenizer, "tool"):
            raise BadRequest(
                f"messages[{i}]", "this model's chat template has no tool role; send the "
                "tool's result in a user message",
            )  # fmt: skip
        message = {"role": role, "content": text}
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        plain.append(message)
    if not any(m["content"] for m in plain):
        raise BadRequest("messages", "every message is empty")
    _check_chars("messages", sum(len(m["content"]) for m in plain), limits)
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template has its BOS
    except Exception as e:  # noqa: BLE001 - a template that refuses these messages says why
        raise BadRequest("messages", f"the chat template could not render them: {e}") from e


def _usage(job: Job) -> dict:
    done, n = job.counted, len(job.prompt_ids)
    usage = {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done}
    # Extensions, as some servers add them: how much of what was drafted the target accepted.
    usage["dflash"] = {
        "acceptance": job.acceptance, "drafted_tokens": job.drafted,
        "accepted_tokens": job.accepted, "tau": job.tau, "steps": job.steps,
    }  # fmt: skip
    return usage


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes before it is all read or parsed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(None, f"the request body is over {limit} bytes", status=413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadRequest(None, f"the request body is over {limit} bytes", status=413)
        parts.append(part)
    return b"".join(parts)


class ApiKey:
    """ASGI middleware: with a key, every /v1/ request needs `Authorization: Bearer <key>`
    (401 in OpenAI's error shape otherwise); /health, /metrics and /stats stay open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, b"Bearer " + self.key):
                response = _error(401, "a valid API key is needed: Authorization: Bearer <key>")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_app(
    engine: Engine,
    *,
    model: str,
    tokenizer,
    limits: Limits,
    api_key: str | None = None,
    grammars: Grammars | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model`; `grammars` compiles the
    requests' structured output (None: refused)."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()  # builds the decoder on its thread; /health says when it is ready
        yield
        await asyncio.to_thread(engine.drain)  # uvicorn has waited for the open requests

    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    created = int(time.time())

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return _error(400, str(e))

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):
        log.exception("an unexpected error while answering a request")
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    def health():
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": engine.reason}, 503)
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
        return Response(engine.prom.text(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    def stats():
        return engine.metrics()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        try:
            raw = await _read_body(request, limits.max_body)
            try:
                body = json.loads(raw)
            except ValueError:
                return _error(400, "the request body is not valid JSON")
            job, opts = await asyncio.to_thread(
                parse,
                body,
                chat=chat,
                model=model,
                tokenizer=tokenizer,
                limits=limits,
                grammars=grammars,
            )
        except BadRequest as e:
            return _error(e.status, str(e), e.param)
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            engine.submit(job)
        except QueueFull as e:
            response = _error(429, str(e))
            response.headers["Retry-After"] = str(e.retry_after)
            return response
        except NotServing as e:
            return _error(503, f"the server is {e}")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if opts.stream:
            events = _events(job, rid, chat, opts)
            return StreamingResponse(events, media_type="text/event-stream")
        while True:  # a client that goes away frees its slot
            try:
                await asyncio.wait_for(_until_done(job), timeout=0.5)
                break
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return JSONResponse({}, 499)
        if job.error is not None:
            return _error(job.error_status, job.error)
        return _response(job, rid, chat)

    def _head(rid, chat):
        kind = "chat.completion" if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model}

    def _response(job: Job, rid: str, chat: bool) -> dict:
        lp = _logprobs_of(job, 0, job.counted, chat, tokenizer)
        if chat:
            message = {"role": "assistant", "content": job.text}
            choice = {"index": 0, "message": message, "logprobs": lp}
        else:
            choice = {"index": 0, "text": job.text, "logprobs": lp}
        choice["finish_reason"] = job.finish_reason
        extra = {"dflash": {"tau": job.tau, "steps": job.steps, "acceptance": job.acceptance}}
        return {**_head(rid, chat), "choices": [choice], "usage": _usage(job), **extra}

    async def _events(job: Job, rid: str, chat: bool, opts: Options):
        head = _head(rid, chat)
        if chat:
            head["object"] = "chat.completion.chunk"
        sent = 0  # tokens whose logprobs went out

        def delta(text, reason=None, covered=0):
            nonlocal sent
            lp = _logprobs_of(job, sent, covered, chat, tokenizer)
            sent = max(sent, covered)
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            return {**head, "choices": [{**choice, "logprobs": lp, "finish_reason": reason}]}

        sse = lambda obj: f"data: {json.dumps(obj)}\n\n"
        try:
            if chat:
                first = delta("")
                first["choices"][0]["delta"]["role"] = "assistant"
                yield sse(first)
            while True:
                kind, event = await job.events.get()
                if kind == "done":
                    break
                yield sse(delta(*event))
            if job.error is not None:  # the status line is sent: the error is an event
                kind = "server_error" if job.error_status >= 500 else "invalid_request_error"
                yield sse({"error": {"message": job.error, "type": kind,
                                     "param": None, "code": job.error_status}})  # fmt: skip
                yield "data: [DONE]\n\n"
                return
            last = delta("", job.finish_reason, job.counted)
            if chat:
                last["choices"][0]["delta"] = {}
            yield sse(last)
            if opts.include_usage:  # OpenAI's shape: a last chunk without choices
                yield sse({**head, "choices": [], "usage": _usage(job)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed), or the answer is complete
            if job.finish_reason is None:
                job.cancel()

    return app


def _logprobs_of(job: Job, lo: int, hi: int, chat: bool, tokenizer) -> dict | None:
    """OpenAI's logprobs object for tokens lo:hi of `job` (None: none asked or none new)."""
    if job.logprobs is None or hi <= lo:
        return None
    text = lambda i: tokenizer.decode([i])
    entries = job.token_logprobs[lo:hi]
    tokens = [text(t) for t in job.tokens[lo:hi]]
    if chat:
        item = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode())}
        tops = lambda ids, lps: [item(text(i), v) for i, v in zip(ids, lps, strict=True)]
        return {
            "content": [
                {**item(t, lp), "top_logprobs": tops(ids, lps)}
                for t, (lp, ids, lps) in zip(tokens, entries, strict=True)
            ]
        }
    # Where each token's text starts in the answer (the incremental decode's ends: no
    # decode of the answer before it).
    ends = job.detok.ends if job.detok is not None else []
    offsets = [ends[i - 1] if 0 < i <= len(ends) else 0 for i in range(lo, hi)]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [
            {text(i): v for i, v in zip(ids, lps, strict=True)} for _, ids, lps in entries
        ],
        "text_offset": offsets,
    }


async def _until_done(job: Job) -> None:
    while True:
        kind, _ = await job.events.get()
        if kind == "done":
            return
