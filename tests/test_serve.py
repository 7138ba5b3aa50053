"""infer.serve on loopback with a tiny target (a character-level ChatML tokenizer) and drafter:
the shapes the `openai` client reads, streaming, 400s naming the field, 429 with Retry-After, a
client that disconnects freeing its slot, SIGTERM draining, and greedy answers under
concurrency equal to the same requests alone and to the target's own greedy decode.

The drafter proposes token 0 and the target's head favours it (as in test_decoding), so steps
accept anywhere from nothing to the whole block. One server (fixed block 8, 4 slots, fp32,
batch-invariant under a given row rule) serves the default tests; its
programs are compiled once per process and reused by the servers built after it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import signal
import threading
import time
import types
import typing

import httpx2 as httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pydantic
import pytest
from _chat_tokenizer import CHATML, char_tokenizer

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import autoregressive_decode, grammar, sampling
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import grammar as grammar_io
from dflash_jax.io.drafter_io import LoadedDrafter
from dflash_jax.io.target_loader import LoadedTarget
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.models.target import init_params
from infer.serving import server as serve
from infer.serving.app import Limits, make_app
from infer.serving.engine import Engine

MODEL = "tiny"
RULE = (2, 16)  # a row rule given: a range, as a test may give (a decode's is one fixed tile)
MAX_NEW = 40
PROMPTS = ["abc", "Hello there", "x" * 20, "The quick brown fox", "12+34=", "?"]


@dataclasses.dataclass
class Served:
    url: str
    server: object
    engine: object
    thread: threading.Thread

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", **kw)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def metrics(self) -> dict:
        return httpx.get(f"{self.url}/stats").json()


def tiny_pair(dtype: str):
    tok = char_tokenizer(CHATML)
    vocab = len(tok)
    tcfg = TargetConfig(
        arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
        eos_token_ids=(2,), dtype=dtype, invariant_rows=RULE, attention_impl="xla",
    )  # fmt: skip
    dcfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, vocab_size=vocab, mask_token_id=vocab - 1, target_layer_ids=(0, 1),
        num_target_layers=2, block_size=8, dtype=dtype, attention_impl="xla",
    )  # fmt: skip
    tp = init_params(tcfg, jax.random.key(0))
    tp = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, tp)
    tp["lm_head"]["kernel"] = tp["lm_head"]["kernel"].at[:, 0].mul(4.0)
    dp = init_drafter_params(dcfg, jax.random.key(1))
    dp["norm"]["scale"] = jnp.zeros_like(dp["norm"]["scale"])
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    target = LoadedTarget(tcfg, cast(tp), tok, CHATML, MODEL)
    return target, LoadedDrafter(dcfg, cast(dp), MODEL)


def decode_config(adaptive: bool = False) -> DecodeConfig:
    return DecodeConfig(
        max_new_tokens=MAX_NEW, block_size=8, stop_token_ids=(2,), adaptive=adaptive,
        lookup_kinds=(8,) if adaptive else (), batch_invariant=True, row_settings=True,
        logprobs=20,
    )  # fmt: skip


@contextlib.contextmanager
def running(target, drafter, cfg, *, slots=4, max_queue=16, chunk_steps=4):
    """A server on a free loopback port, ready; stopped (drained) on exit."""
    server, engine = serve.make_server(
        target, drafter, cfg, host="127.0.0.1", port=0, slots=slots, max_prompt=64,
        chunk_steps=chunk_steps, max_queue=max_queue, model_name=MODEL, calibrate=False,
        precompile=False,
    )  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 300
    while not (server.started and engine.ready.is_set()):
        assert engine.error is None, engine.error
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    served = Served(f"http://127.0.0.1:{port}", server, engine, thread)
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(scope="module")
def fp32_pair():
    return tiny_pair("float32")


@pytest.fixture(scope="module")
def served(fp32_pair):
    with running(*fp32_pair, decode_config()) as s:
        yield s


@contextlib.contextmanager
def slowed(engine, seconds: float = 0.0, gate: threading.Event | None = None):
    """Each advance call of the engine's decoder waits for `gate` and `seconds` first."""
    dec = engine.decoder
    advance = dec.advance

    def slow(*args, **kw):
        if gate is not None:
            gate.wait(30)
        time.sleep(seconds)
        return advance(*args, **kw)

    dec.advance = slow
    try:
        yield
    finally:
        dec.advance = advance


def test_openai_client_shapes_and_streaming(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    done = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    choice = done.choices[0]
    assert done.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert done.usage.prompt_tokens == 3 and 1 <= done.usage.completion_tokens <= 12
    kw = dict(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    parts = list(client.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].text for p in parts) == choice.text
    assert parts[-1].choices[0].finish_reason == choice.finish_reason
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    # The prompt is the target's chat template with the generation prompt.
    tok = char_tokenizer(CHATML)
    hi = [{"role": "user", "content": "Hi"}]
    hi = tok.apply_chat_template(hi, tokenize=False, add_generation_prompt=True)
    assert hi.endswith("<|im_start|>assistant\n")
    assert chat.usage.prompt_tokens == len(tok.encode(hi, add_special_tokens=False))
    pieces = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0,
        stream=True,
    )  # fmt: skip
    pieces = list(pieces)
    assert pieces[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in pieces)
    assert text == chat.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    # A stop string cuts the answer before it, and ends it with finish_reason "stop".
    full = client.completions.create(model=MODEL, prompt="?", max_tokens=MAX_NEW, temperature=0)
    visible = full.choices[0].text
    assert len(visible) >= 4, visible
    cut = client.completions.create(
        model=MODEL, prompt="?", max_tokens=MAX_NEW, temperature=0, stop=[visible[2:4]]
    )
    assert cut.choices[0].text == visible[: visible.index(visible[2:4])]
    assert cut.choices[0].finish_reason == "stop"
    m = served.metrics()
    assert m["requests"]["completed"] >= 6 and m["tau"] >= 1 and m["steps_by_kind"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 70}, "prompt"),  # past --max_prompt_tokens (64)
        ({"prompt": "a", "model": "other"}, "model"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_k": -2}, "top_k"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": MAX_NEW + 1}, "max_tokens"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "a", "seed": -1}, "seed"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_are_400_naming_the_field(served, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = served.post(path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"]


def test_openai_client_sees_a_bad_request(served):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client().completions.create(model=MODEL, prompt="a", temperature=3.0)


def test_full_queue_is_429_with_retry_after(served):
    gate = threading.Event()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0}
    n = 4 + served.engine.max_queue + 2  # slots + queue + 2: at least two find it full
    with slowed(served.engine, gate=gate), concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(served.post, "/v1/completions", body) for _ in range(n)]
        deadline = time.time() + 30
        while sum(f.done() for f in futures) < 2 and time.time() < deadline:
            time.sleep(0.05)
        gate.set()
        codes = [f.result().status_code for f in futures]
    full = [f.result() for f in futures if f.result().status_code == 429]
    assert len(full) >= 2 and set(codes) == {200, 429}, codes
    assert int(full[0].headers["Retry-After"]) >= 1
    assert full[0].json()["error"]["type"] == "rate_limit_error"


def test_a_client_that_disconnects_frees_its_slot(served):
    before = served.metrics()["requests"]["cancelled"]
    body = {"model": MODEL, "prompt": "abc", "max_tokens": MAX_NEW, "temperature": 0.8}
    body["stream"] = True
    with slowed(served.engine, seconds=0.2):
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # the first event: the request holds a slot
        deadline = time.time() + 30
        while time.time() < deadline:
            m = served.metrics()
            if m["requests"]["cancelled"] > before and m["active_slots"] == 0:
                break
            time.sleep(0.1)
    assert m["requests"]["cancelled"] == before + 1 and m["active_slots"] == 0, m
    ok = served.client().completions.create(model=MODEL, prompt="a", max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_free_slots_take_requests_without_429(served):
    """Requests that a free slot takes at the next chunk boundary are not queued against
    --max_queue: with max_queue 0 (no waiting queue) and 4 free slots, 4 requests that arrive
    while the decoder is busy are all answered; a fifth, with no slot left, is 429 (the old
    count refused all of them)."""
    gate = threading.Event()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0}
    engine, before = served.engine, served.engine.max_queue
    engine.max_queue = 0
    try:
        with slowed(engine, gate=gate), concurrent.futures.ThreadPoolExecutor(4) as pool:
            start = engine.stats["requests"]
            futures = [pool.submit(served.post, "/v1/completions", body) for _ in range(4)]
            deadline = time.time() + 30
            while engine.stats["requests"] < start + 4 and time.time() < deadline:
                time.sleep(0.02)
            fifth = served.post("/v1/completions", body)
            gate.set()
            codes = [f.result().status_code for f in futures]
    finally:
        engine.max_queue = before
    assert codes == [200] * 4 and fifth.status_code == 429, (codes, fifth.text)


def test_unseeded_samples_differ_seeded_repeat(served):
    client = served.client()
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=MAX_NEW, temperature=1.0)
    unseeded = {client.completions.create(**kw).choices[0].text for _ in range(4)}
    seeded = {client.completions.create(**kw, seed=7).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1 and len(seeded) == 1, (unseeded, seeded)


def test_request_shapes_apps_send(served):
    """Content parts and the developer role (the system role of a template without one); a
    tool message where the template has no tool role: 400; n null; the usage chunk of
    stream_options.include_usage (choices empty); acceptance in usage; a completions prompt
    as token ids answered as its text is (ids outside the vocabulary: 400); fields not
    implemented refused naming them; an unknown route and a wrong method in OpenAI's error
    shape."""
    client = served.client()
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    answer = client.chat.completions.create(messages=messages, n=None, **kw)
    same = client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        **kw,
    )  # fmt: skip
    assert answer.choices[0].message.content == same.choices[0].message.content
    assert answer.usage.prompt_tokens == same.usage.prompt_tokens
    assert 0 <= answer.usage.model_extra["dflash"]["accepted_tokens"]
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    ids = char_tokenizer(CHATML).encode("12+34=")
    by_text, by_ids = (
        client.completions.create(prompt=p, **kw).choices[0].text for p in ("12+34=", [ids])
    )  # fmt: skip
    assert by_text == by_ids
    tool = [{"role": "tool", "content": "42", "tool_call_id": "a"}]
    for body, param in (
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"messages": tool}, "messages[0]"),
        ({"messages": messages, "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": messages, "guided_regex": "(?=a)b"}, "guided_regex"),  # never ignored
        ({"messages": messages, "guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"messages": messages, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"messages": messages, "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = served.post(path, {"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for r, status in (
        (httpx.get(f"{served.url}/v1/nothing"), 404),
        (httpx.get(f"{served.url}/v1/completions"), 405),
    ):
        assert r.status_code == status and r.json()["error"]["message"], r.text


def test_structured_output_rows_carry_their_own_grammars(served, fp32_pair):
    """Guards the server's structured output: each slot carries its own request's grammar
    (per-row tables in the loop state). A guided_regex, a guided_choice and a json_schema
    response_format request and one without, admitted together: each constrained answer is
    text its grammar accepts and equals the constrained target alone (greedy), the free one
    equals the target alone; the openai client's `parse` with a pydantic model reads the
    answer back."""
    target = fp32_pair[0]
    client = served.client()
    regex = r"[a-c]{2,6}-[0-9]{1,3}"
    choices = ["yes", "no", "maybe"]
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"type": "string", "enum": ["ab", "c"]},
        },
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    json_format = {"type": "json_schema", "json_schema": {"name": "T", "schema": schema}}
    jobs = [
        ("abc", {"guided_regex": regex}, grammar_io.spec_of(regex=regex)),
        ("12+34=", {"guided_choice": choices}, grammar_io.spec_of(choices=choices)),
        ("The quick brown fox", {"response_format": json_format},
         grammar_io.spec_of(json_schema=schema)),
        ("Hello there", {}, None),
    ]  # fmt: skip
    kw = dict(model=MODEL, max_tokens=MAX_NEW, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(
            pool.map(
                lambda job: client.completions.create(prompt=job[0], extra_body=job[1], **kw),
                jobs,
            )
        )
    texts = [a.choices[0].text for a in answers]
    assert re.fullmatch(regex, texts[0]) and texts[1] in choices, texts
    assert json.loads(texts[2])["tag"] in ("ab", "c"), texts[2]
    assert all(a.choices[0].finish_reason == "stop" for a in answers[:3]), answers
    assert texts == [_greedy_reference(target, p, MAX_NEW, spec) for p, _, spec in jobs]

    class T(pydantic.BaseModel):
        n: int = pydantic.Field(ge=0, le=99)
        tag: typing.Literal["ab", "c"]

    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], response_format=T,
        max_tokens=MAX_NEW, temperature=0,
    ).choices[0].message.parsed  # fmt: skip
    assert isinstance(parsed, T), parsed


def test_prometheus_metrics(served):
    from prometheus_client.parser import text_string_to_metric_families

    served.client().completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
    r = httpx.get(f"{served.url}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    value = lambda name, suffix="_total": sum(
        s.value for s in families[name].samples if s.name == name + suffix
    )
    assert value("dflash:spec_decode_num_drafts") >= 1
    drafted = value("dflash:spec_decode_num_draft_tokens")
    assert drafted >= value("dflash:spec_decode_num_accepted_tokens") >= 0
    assert value("dflash:time_to_first_token_seconds", "_count") >= 1
    assert value("dflash:request_success") >= 1 and value("dflash:generation_tokens") >= 8
    assert {s.labels["kind"] for s in families["dflash:spec_decode_steps"].samples} >= {"8"}


def test_logprobs_are_the_targets(served, fp32_pair):
    """logprobs on both endpoints: one entry per completion token with the alternatives asked
    for, streamed as answered; a greedy token is its step's likeliest; each token's
    log-probability is the target's own (a forward over prompt + answer, fp32) under the
    distribution the row samples (temperature 0.8, top-k 5)."""
    from dflash_jax.models.target import Transformer

    target, client = fp32_pair[0], served.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12)
    chat = client.chat.completions.create(**kw, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for c in content:
        assert len(c.top_logprobs) == 2 and c.token == c.top_logprobs[0].token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6)
    chunks = client.chat.completions.create(
        **kw, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]  # fmt: skip
    assert [c.token for c in streamed] == [c.token for c in content]
    prompt, tok = "Hello there", target.tokenizer
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, seed=1, logprobs=3,
        extra_body={"top_k": 5},
    )  # fmt: skip
    lp = done.choices[0].logprobs
    ids = tok.encode(prompt)
    answer = [tok.convert_tokens_to_ids(t) for t in lp.tokens]
    seq = jnp.asarray([ids + answer])
    logits = Transformer(target.config).apply(
        {"params": target.params}, seq, jnp.arange(seq.shape[1])[None]
    )
    x = np.asarray(logits[0] if isinstance(logits, tuple) else logits)[0] / 0.8
    x = x[len(ids) - 1 : len(ids) - 1 + len(answer)]
    x = np.where(x < np.sort(x, -1)[:, -5:-4], -np.inf, x)
    want = np.asarray(jax.nn.log_softmax(x, -1))[np.arange(len(answer)), answer]
    assert len(answer) == done.usage.completion_tokens and len(lp.top_logprobs[0]) == 3
    np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)


class StandIn:
    """A stand-in for the SlotDecoder (no program compiled): every busy row commits token 3
    ("0") per advance until its max_new; `fail` makes advance raise, as a device error would;
    an admission of a request whose max_new is `refuse` raises, as an insert program that
    fails to compile would (with the loop state intact); `gate` holds each advance until
    set."""

    def __init__(self, slots=2, width=64, refuse=None):
        self.slots, self.cfg, self.refuse = slots, decode_config(), refuse
        self.gen = np.zeros((slots, width), np.int32)
        self.n, self.max_new = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
        self.gate, self.fail = threading.Event(), False
        self.gate.set()

    def insert_many(self, admits):
        if any(a.max_new == self.refuse for a in admits):
            raise RuntimeError("the insert program failed to compile (stand-in)")
        for a in admits:
            self.n[a.slot], self.max_new[a.slot] = 0, a.max_new

    def intact(self):
        return True

    def advance(self, steps, forced_kind=-1):
        from dflash_jax.decoding.slots import Chunk

        self.gate.wait(30)
        if self.fail:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (stand-in)")
        busy = self.n < self.max_new
        self.gen[busy, self.n[busy]] = 3
        self.n = self.n + busy
        acc = busy[:, None].astype(np.int32)
        done = self.n >= self.max_new
        return Chunk(self.gen.copy(), self.n.copy(), done, self.n.copy(), acc, acc, 0.001)

    def release(self, rows):
        pass


@contextlib.contextmanager
def stand_in_server(decoder, tokenizer=None, **app_kw):
    """The HTTP app and engine of `infer.serve` on `decoder` (a StandIn), on loopback; as
    `make_server`'s, the server exits once the engine fails."""
    import uvicorn

    tok = tokenizer or char_tokenizer(CHATML)
    exit_on_error = lambda e: setattr(server, "should_exit", True)
    engine = Engine(lambda: decoder, tok, (2,), max_queue=4, chunk_steps=1, on_error=exit_on_error)
    web = make_app(engine, model=MODEL, tokenizer=tok, limits=Limits(64, MAX_NEW, 256), **app_kw)
    config = uvicorn.Config(web, host="127.0.0.1", port=0, log_level="error", lifespan="on")
    server = serve.DrainingServer(config, engine)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not (server.started and engine.ready.is_set()):
        assert thread.is_alive()
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(f"http://127.0.0.1:{port}", server, engine, thread)
    finally:
        decoder.gate.set()
        server.should_exit = True
        thread.join(30)


def test_a_failing_decoder_answers_500_then_the_server_exits():
    """The engine thread survives its decoder's loop raising: the requests it held or queued
    (one streamed, one not) end with a 500 in OpenAI's error shape, then the server exits
    (`infer.serve` then exits with code 1, for a supervisor to restart it)."""
    dec = StandIn()
    with stand_in_server(dec) as s:
        ok = s.post("/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "000", ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3
        dec.gate.clear()
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 30}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(s.post, "/v1/completions", body)
            with httpx.stream(
                "POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=30
            ) as r:
                while s.engine.stats["requests"] < 3:  # both in flight (held or queued)
                    time.sleep(0.01)
                dec.fail = True
                dec.gate.set()
                events = [line for line in r.iter_lines() if line.startswith("data: {")]
            failed = plain.result(timeout=30)
        assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
        assert "out of memory" in events[-1] and '"error"' in events[-1]
        s.thread.join(30)
        assert not s.thread.is_alive() and "out of memory" in s.engine.reason
        assert not s.engine._thread.is_alive()


class FailingTokenizer:
    """The character tokenizer, whose decode raises on token 4 ("1")."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kw):
        if 4 in list(ids):
            raise KeyError("no text for token 4 (stand-in)")
        return self.tok.decode(ids, **kw)


def test_a_request_that_fails_ends_alone():
    """A failure one request causes (its admission: an insert that does not compile; its
    text: a tokenizer that cannot decode its tokens) ends that request alone with a 500 in
    OpenAI's error shape, streamed or not, while the requests beside it complete and /health
    stays ok (before: any failure failed every request and the server for good)."""
    dec = StandIn(slots=4, refuse=7)
    with stand_in_server(dec, tokenizer=FailingTokenizer(char_tokenizer(CHATML))) as s:
        dec.gate.clear()  # all of them admitted at one chunk boundary, together
        body = lambda n, **kw: {"model": MODEL, "prompt": "ab", "max_tokens": n, **kw}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(s.post, "/v1/completions", body(n)) for n in (3, 7, 5)]
            futures.append(pool.submit(s.post, "/v1/completions", body(7, stream=True)))
            while s.engine.stats["requests"] < 4:
                time.sleep(0.01)
            dec.gate.set()
            ok3, bad, ok5, bad_stream = (f.result(timeout=30) for f in futures)
        assert ok3.status_code == 200 and ok3.json()["choices"][0]["text"] == "000"
        assert ok5.status_code == 200 and ok5.json()["choices"][0]["text"] == "00000"
        error = bad.json()["error"]
        assert bad.status_code == 500 and "failed to compile" in error["message"], bad.text
        assert error["type"] == "server_error"
        assert '"error"' in bad_stream.text and "failed to compile" in bad_stream.text
        dec.refuse = None
        real = dec.advance

        def with_a_one(steps, forced_kind=-1):  # the row of max_tokens 4 commits a "1" too
            chunk = real(steps, forced_kind)
            for row in np.flatnonzero((dec.max_new == 4) & (chunk.n_gen > 0)):
                chunk.gen[row, chunk.n_gen[row] - 1] = 4
            return chunk

        dec.advance = with_a_one
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bad, ok = pool.map(lambda n: s.post("/v1/completions", body(n)), (4, 5))
        assert bad.status_code == 500 and "token 4" in bad.json()["error"]["message"]
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "00000"
        dec.advance = real
        assert s.post("/v1/completions", body(2)).json()["choices"][0]["text"] == "00"
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}
        assert s.engine.error is None
        from prometheus_client.parser import text_string_to_metric_families

        metrics = httpx.get(f"{s.url}/metrics").text
        count = lambda name: {
            x.labels.get("reason", x.labels.get("finished_reason")): x.value
            for f in text_string_to_metric_families(metrics) for x in f.samples
            if x.name == name
        }  # fmt: skip
        assert count("dflash:request_failure_total") == {"error": 3.0}
        assert count("dflash:request_success_total") == {"length": 4.0}


def test_api_key_and_body_cap():
    """With an API key, /v1/ without the bearer token is 401 (OpenAI's error shape), with it
    200; /health stays open. A body past the cap is 413 before it is parsed."""
    with stand_in_server(StandIn(), api_key="sesame") as s:
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
        refused = s.post("/v1/completions", body)
        assert refused.status_code == 401 and refused.json()["error"]["type"]
        with pytest.raises(openai.AuthenticationError):
            s.client().completions.create(**body)
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sesame")
        assert good.completions.create(**body).choices[0].text == "00"
        assert httpx.get(f"{s.url}/health").status_code == 200
        big = httpx.post(
            f"{s.url}/v1/completions", json={**body, "prompt": "a" * 10**6},
            headers={"Authorization": "Bearer sesame"},
        )  # fmt: skip
        assert big.status_code == 413 and big.json()["error"]["message"]


def test_per_row_cuts_equal_the_sorted_cuts():
    """Each row's top-k / top-p support (found among the largest values, or by bisection for
    rows whose cut lies past them) is the one `process_logits` finds by sorting, per setting."""
    rng = np.random.default_rng(0)
    peaky = rng.normal(size=(4, 3, 600)) * 3
    flat = rng.normal(size=(4, 3, 600)) * 0.01  # top-p 0.99 reaches far past the candidates
    logits = jnp.asarray(np.concatenate([peaky, flat]), jnp.float32)
    settings = [(0.7, 0, 0.95), (1.0, 40, 1.0), (0.5, 300, 0.8), (1.3, 1, 0.5)] * 2
    rows = sampling.RowSettings(
        temperature=jnp.asarray([t for t, _, _ in settings], jnp.float32),
        top_k=jnp.asarray([k for _, k, _ in settings], jnp.int32),
        top_p=jnp.asarray([p for _, _, p in settings], jnp.float32),
        key_data=jnp.zeros((8, 2), jnp.uint32),
        max_new=jnp.ones((8,), jnp.int32),
    )
    got = np.isinf(np.asarray(jax.jit(sampling.process_logits)(logits, rows)))
    for r, (t, k, p) in enumerate(settings):
        cfg = DecodeConfig(temperature=t, top_k=k, top_p=p)
        want = np.isinf(np.asarray(sampling.process_logits(logits[r], cfg)))
        assert (got[r] == want).all(), (r, t, k, p)


def test_rows_with_their_own_settings_run_the_head_once(fp32_pair):
    """A pass over rows with their own settings needs the greedy tokens for every row and, if a
    row samples, the logits: under a row rule (the server's, batch-invariant) the argmax reads
    the full logits anyway, so the sampled branch takes those instead of running the head's
    [rows, V] product again (~5 ms of an 8-slot fp32 SmolLM2 step on 2 cores). Counted in the
    lowered programs of a plain step's token and a block's verify: one head product each
    (two before)."""
    from dflash_jax.decoding import phases
    from dflash_jax.models.target import decoding_head

    target, _ = fp32_pair
    vocab = target.config.vocab_size
    rows = sampling.RowSettings(
        temperature=jnp.asarray([0.0, 0.7, 0.0, 0.0], jnp.float32),
        top_k=jnp.zeros((4,), jnp.int32),
        top_p=jnp.ones((4,), jnp.float32),
        key_data=jnp.zeros((4, 2), jnp.uint32),
        max_new=jnp.ones((4,), jnp.int32),
    )
    head_of = lambda p: decoding_head(p, target.config)
    key = jax.random.key(0)
    token = lambda p, h: phases.next_token(head_of(p), h, key, rows)
    drafts, logp = jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3, vocab), jnp.float32)
    verify = lambda p, h: phases.verify_accept(head_of(p), rows, h, drafts, logp, key)
    for fn, hidden in ((token, jnp.ones((4, 32))), (verify, jnp.ones((4, 4, 32)))):
        text = jax.jit(fn).lower(target.params, hidden).as_text()
        heads = [
            line for line in text.splitlines()
            if "dot_general" in line and f"x{vocab}xf32>" in line.split("->")[-1]
        ]  # fmt: skip
        assert len(heads) == 1, heads


def test_the_controller_steers_by_sampled_costs_while_a_row_samples(monkeypatch):
    """An adaptive server's step costs come in two tables (`SlotDecoder.calibrate`): drafted
    steps cost far more once any row samples (every row then runs the sampling arithmetic).
    Each advance hands the loop the table of its busy rows: sampled from the insert of a
    sampling request until its row is released, greedy otherwise. The decoder's programs are
    stood in for: what is checked is which table each advance passes."""
    from dflash_jax.decoding import slots as slots_lib

    dec = object.__new__(slots_lib.SlotDecoder)
    dec.cfg, dec.slots, dec.max_prompt, dec.buckets = decode_config(True), 2, 32, (32,)
    dec.params, dec._rng, dec.state = (None, None), None, None
    dec.prompt, dec.lengths = np.zeros((2, 32), np.int32), np.ones((2,), np.int32)
    dec.step_costs, dec.sampled_step_costs = "greedy", "sampled"
    dec._sampling, dec._grammar_rows = np.zeros((2,), bool), np.zeros((2,), bool)
    dec.grammar_shape, dec.solo, dec.busy = None, None, np.zeros((2,), bool)
    passed = []
    dec.inserts = types.SimpleNamespace(
        plan=lambda n, width: [(n, n, width)], get=lambda k, width: lambda *args: None
    )
    dec._release = lambda state, mask: None
    dec._advance = lambda *args: passed.append(args[5])
    zeros = lambda *shape: np.zeros(shape, np.int32)
    monkeypatch.setattr(
        slots_lib, "_peek", lambda state: (zeros(2, 4), zeros(2), zeros(2), zeros(2),
                                           zeros(2, 1), zeros(2, 1), 0, None)
    )  # fmt: skip
    dec.insert(0, [5, 6], max_new=4)
    dec.advance(1)
    dec.insert(1, [7], max_new=4, temperature=0.7)
    dec.advance(1)
    dec.release([0])
    dec.advance(1)
    dec.release([1])
    dec.advance(1)
    assert passed == ["greedy", "sampled", "sampled", "greedy"]


def test_inverse_cdf_draws_follow_the_distribution():
    """The server's sampler (`sampling.sample_inverse_cdf`): 60k draws follow the probabilities
    (total variation under 0.03, a vocabulary that is not a multiple of its chunk), and an id of
    probability 0 is never drawn (Gumbel-max: TV 0.016 on the same keys; ids shifted by one: 0.87)."""
    logits = np.random.default_rng(1).normal(size=300) * 2
    logits[::7] = -np.inf
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
    n = 60000
    keys = jax.vmap(jax.random.key)(jnp.arange(n))
    draws = jax.jit(sampling.sample_inverse_cdf)(keys, jnp.broadcast_to(logp, (n, 300)))
    freq = np.bincount(np.asarray(draws), minlength=300) / n
    assert freq[::7].sum() == 0
    assert 0.5 * np.abs(freq - np.exp(np.asarray(logp))).sum() < 0.03


def _greedy_reference(target, prompt: str, max_tokens: int, spec=None) -> str:
    """The target's own greedy decode of the raw prompt, alone (batch 1), as text: the first
    max_tokens of one MAX_NEW-token decode (one program for every request). spec: a grammar
    (`io.grammar.GrammarSpec`) its distribution is masked to at every step."""
    tok = target.tokenizer
    constraint = None
    if spec is not None:
        pieces, vocab = grammar_io.token_bytes(tok), target.config.vocab_size
        table = grammar.device_table(*grammar_io.compile_grammar(spec, pieces, vocab, [2]))
        constraint = grammar.constraint(table, 1)
    ids = tok.encode(prompt, add_special_tokens=False)
    buf = np.zeros((1, 64), np.int32)
    buf[0, : len(ids)] = ids
    cfg = DecodeConfig(max_new_tokens=MAX_NEW, stop_token_ids=(2,), batch_invariant=True)
    out = autoregressive_decode(
        target.params, buf, np.array([len(ids)], np.int32), jax.random.key(0),
        target_config=target.config, decode_config=cfg, constraint=constraint,
    )  # fmt: skip
    tokens = np.asarray(out.tokens[0, : min(int(out.lengths[0]), max_tokens)]).tolist()
    return target.tokenizer.decode(tokens, skip_special_tokens=True)


def check_greedy_under_load(served, target, seeded_too: bool) -> None:
    """Each greedy request alone (a row alone runs in the one-row program, `decoding.solo`),
    then all of them at once among sampled ones (more requests than slots, so rows are reused
    mid-decode): the same text, the target's own greedy text.
    seeded_too (a fixed block size): each sampled request's text is its text alone too."""
    client = served.client(max_retries=0)
    greedy = [
        dict(prompt=p, max_tokens=MAX_NEW - 3 * i, temperature=0) for i, p in enumerate(PROMPTS)
    ]
    sampled = [
        dict(prompt=p, max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=i, **extra)
        for i, (p, extra) in enumerate(
            zip(PROMPTS, [{}, {"extra_body": {"top_k": 5}}] * 3, strict=True)
        )
    ]
    ask = lambda kw: client.completions.create(model=MODEL, **kw).choices[0].text
    solo = served.engine.decoder.solo
    before = solo.chunks
    alone = [ask(kw) for kw in greedy + (sampled if seeded_too else [])]
    assert solo.chunks > before  # each request alone ran in the one-row program
    mixed = [kw for pair in zip(greedy, sampled, strict=True) for kw in pair]
    with concurrent.futures.ThreadPoolExecutor(len(mixed)) as pool:
        loaded = list(pool.map(ask, mixed))
    assert loaded[::2] == alone[: len(greedy)]
    if seeded_too:
        assert loaded[1::2] == alone[len(greedy) :]
    reference = [_greedy_reference(target, kw["prompt"], kw["max_tokens"]) for kw in greedy]
    assert alone[: len(greedy)] == reference


def test_prompts_admitted_together_decode_as_alone(fp32_pair):
    """Admission prefills the prompts admitted at one chunk boundary together
    (`SlotDecoder.insert_many`): a short, a long and a one-token prompt into rows 3, 1 and 0 by
    one insert of 4 rows at the long one's width (64), its fourth row padding (written
    nowhere: row 2 stays free). Every row's greedy tokens are the target's own greedy decode
    of its prompt alone."""
    from dflash_jax.decoding.slots import Admit, SlotDecoder

    target, drafter = fp32_pair
    tok = target.tokenizer
    dec = SlotDecoder(target, drafter, decode_config(), 4, 64)
    prompts = {3: "12+34=", 1: "The quick brown fox jumps over the lazy dog, twice a day.", 0: "?"}
    dec.insert_many(
        [Admit(s, tok.encode(p, add_special_tokens=False), MAX_NEW) for s, p in prompts.items()]
    )
    assert sorted(dec.inserts.ready()) == [(4, 64)]
    while not (chunk := dec.advance(8)).done.all():
        dec.release([])
    assert chunk.n_gen[2] == 0  # the free row, untouched
    texts = {
        s: tok.decode(chunk.gen[s, : chunk.n_gen[s]].tolist(), skip_special_tokens=True)
        for s in prompts
    }
    assert texts == {s: _greedy_reference(target, p, MAX_NEW) for s, p in prompts.items()}


def test_inserts_plan_waits_only_for_a_new_width():
    """Which insert programs an admission runs (`admission.Inserts.plan`), with stand-in
    compiles: a width never seen waits for its program; a missing row count is compiled in
    the background while a compiled program stands in (more rows padded, the cheapest, else
    fewer rows in turns); once compiled, the exact program."""
    from dflash_jax.decoding.admission import Inserts, row_counts

    gate = threading.Event()
    compiled = []

    def lower(k, width):
        if (k, width) != (1, 32):
            gate.wait(30)
        compiled.append((k, width))
        return types.SimpleNamespace(compile=lambda **_: f"{k}x{width}")

    assert row_counts(6) == (1, 2, 4, 6) and row_counts(1) == (1,)
    ins = Inserts(lower, None, row_counts(8), (32, 64))
    try:
        assert ins.plan(1, 32) == [(1, 1, 32)] and compiled == [(1, 32)]
        assert ins.plan(3, 32) == [(1, 1, 32)] * 3  # (4, 32) compiles meanwhile
        gate.set()
        assert ins.get(4, 32) == "4x32"
        assert ins.plan(3, 32) == [(3, 4, 32)]
        assert ins.plan(2, 32) == [(2, 4, 32)]  # (2, 32) compiles meanwhile
        assert ins.get(2, 32) == "2x32" and ins.plan(2, 32) == [(2, 2, 32)]
        assert ins.plan(1, 64) == [(1, 1, 64)]  # a new width waits
        assert compiled == [(1, 32), (4, 32), (2, 32), (1, 64)]
    finally:
        ins.close()


def test_answers_under_concurrency_equal_alone_fp32(served, fp32_pair):
    check_greedy_under_load(served, fp32_pair[0], seeded_too=True)


@pytest.mark.slow
def test_greedy_under_concurrency_equals_alone_bf16_adaptive():
    """Guards the bf16 claim (and the adaptive loop with copy kinds under load): greedy answers
    in a full batch of mixed requests equal the same requests alone and bf16 AR."""
    target, drafter = tiny_pair("bfloat16")
    with running(target, drafter, decode_config(adaptive=True)) as s:
        check_greedy_under_load(s, target, seeded_too=False)


def refused(request) -> bool:
    """Whether `request()` is turned away: 503 (draining), or no connection (closed port)."""
    try:
        return request().status_code == 503
    except httpx.TransportError:
        return True


def test_sigterm_drains_then_exits(fp32_pair):
    with running(*fp32_pair, decode_config()) as s:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": MAX_NEW, "temperature": 0.7}
        with slowed(s.engine, seconds=0.1), concurrent.futures.ThreadPoolExecutor(2) as pool:
            running_one = pool.submit(s.post, "/v1/completions", body)
            while s.metrics()["active_slots"] == 0:
                time.sleep(0.02)
            previous = signal.signal(signal.SIGTERM, s.server.handle_exit)  # as uvicorn does
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler runs in the main thread, between bytecodes
                assert refused(lambda: s.post("/v1/completions", body))  # after SIGTERM
            finally:
                signal.signal(signal.SIGTERM, previous)
            answer = running_one.result(timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"]
        s.thread.join(60)
        assert not s.thread.is_alive() and not s.engine._thread.is_alive()
        assert s.engine.metrics()["requests"]["completed"] == 1
