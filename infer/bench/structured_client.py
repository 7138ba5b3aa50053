r"""Structured output through the `openai` client against a running `infer.serve`: for each of
four pydantic models (nested objects, enums, arrays, bounded numbers) `chat.completions.parse`
over --prompts_per_schema prompts, then `response_format={"type": "json_object"}`,
`guided_regex` and `guided_choice` (vLLM's extras, as `extra_body`). Prints and writes how many
answers parsed and matched.

  python -m infer.serve --slots=4 &
  python -m infer.bench.structured_client --output=results/structured/serve_openai_client.json

The server compiles each new schema once (outlines-core; seconds to a minute here on a CPU)
and keeps it on disk, so a first run waits for the compiles.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
import time
import typing

from absl import app, flags

flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server's address.")
flags.DEFINE_integer("prompts_per_schema", 8, "Prompts asked of each model (at most 8).")
flags.DEFINE_integer("max_tokens", 160, "max_tokens of each request.")
flags.DEFINE_integer("concurrency", 4, "Requests in flight at once.")
flags.DEFINE_string("output", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS

PROMPTS = {
    "Person": [
        "Describe a fictional person as JSON with name, age, city and languages.",
        "Give me a JSON record for a French chef who lives in Lyon.",
        "Create a JSON profile of a retired teacher from Berlin.",
        "A young software engineer in Madrid, as JSON.",
        "Invent a polyglot traveller and describe them as JSON.",
        "JSON for a nurse from Toronto who speaks English and French.",
        "Describe a student in Vienna as a JSON object.",
        "A farmer from Texas, as a JSON record.",
    ],
    "Order": [
        "Make up an online order as JSON: id, customer name and email, status.",
        "A shipped order for Alice (alice@example.com), as JSON.",
        "JSON for a pending order placed by Bob.",
        "Describe a delivered order of a book as JSON.",
        "An order record for a customer called Chen, as JSON.",
        "Give a JSON order that has just been shipped.",
        "Create a JSON order for Maria, still pending.",
        "A delivered order for a coffee machine, as JSON.",
    ],
    "Review": [
        "Write a short product review of a pair of headphones as JSON.",
        "Review a restaurant in JSON: title, rating, pros, recommended.",
        "A JSON review of a budget laptop.",
        "Give a JSON review of a hiking boot you liked.",
        "Review a novel you did not enjoy, as JSON.",
        "A JSON review of a coffee shop.",
        "Write a JSON review of a smartphone camera.",
        "Review a city bike as JSON.",
    ],
    "Weather": [
        "Report the weather in Paris as JSON.",
        "What is the weather like in Oslo? Answer in JSON.",
        "A JSON weather report for Cairo at noon.",
        "Give the current weather in Tokyo as JSON.",
        "JSON weather for London on a rainy day.",
        "Weather in Sydney in summer, as JSON.",
        "Describe a snowy day in Montreal as a JSON weather report.",
        "A JSON weather report for Lima.",
    ],
}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]


def models():
    """The four pydantic models (the tested schemas' shapes, results/structured/*.json)."""
    import pydantic

    field = pydantic.Field

    class Person(pydantic.BaseModel):
        name: str = field(max_length=24)
        age: int = field(ge=0, le=120)
        city: str = field(max_length=24)
        languages: list[typing.Literal["English", "French", "Spanish", "German"]] = field(
            max_length=3
        )

    class Customer(pydantic.BaseModel):
        name: str = field(max_length=24)
        email: str = field(max_length=32)

    class Order(pydantic.BaseModel):
        order_id: int = field(ge=1, le=999999)
        customer: Customer
        status: typing.Literal["pending", "shipped", "delivered"]

    class Review(pydantic.BaseModel):
        title: str = field(max_length=32)
        rating: int = field(ge=1, le=5)
        pros: list[str] = field(max_length=3)
        recommended: bool

    class Weather(pydantic.BaseModel):
        city: str = field(max_length=24)
        temperature_c: float = field(ge=-60, le=60)
        humidity: int = field(ge=0, le=100)
        conditions: typing.Literal["sunny", "cloudy", "rain", "snow"]

    return {"Person": Person, "Order": Order, "Review": Review, "Weather": Weather}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import openai

    client = openai.OpenAI(base_url=f"{FLAGS.url}/v1", api_key="none", timeout=900)
    try:
        model = client.models.list().data[0].id
    except openai.APIConnectionError:
        sys.exit(f"no server answers at {FLAGS.url}: start one with python -m infer.serve")
    n = max(1, min(FLAGS.prompts_per_schema, 8))
    kw = dict(model=model, max_tokens=FLAGS.max_tokens, temperature=0)
    ask = lambda content: [{"role": "user", "content": content}]
    jobs = [(name, p) for name in PROMPTS for p in PROMPTS[name][:n]]
    kinds = models()

    def parse(job):
        name, prompt = job
        t0 = time.perf_counter()
        try:
            r = client.chat.completions.parse(
                messages=ask(prompt), response_format=kinds[name], **kw
            )
            msg, usage = r.choices[0].message, r.usage.completion_tokens
            ok, text = msg.parsed is not None, msg.content
        except Exception as e:  # noqa: BLE001 - a failed parse is a figure, not a crash
            ok, text, usage = False, f"{type(e).__name__}: {e}", None
        return {
            "schema": name, "prompt": prompt, "parsed": ok, "text": text,
            "tokens": usage, "seconds": round(time.perf_counter() - t0, 2),
        }  # fmt: skip

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(FLAGS.concurrency) as pool:
        rows = list(pool.map(parse, jobs))
    by_schema = {
        name: f"{sum(r['parsed'] for r in rows if r['schema'] == name)}/{n}" for name in PROMPTS
    }
    obj = client.chat.completions.create(
        messages=ask("Describe your favourite book as a JSON object."),
        response_format={"type": "json_object"}, **kw,
    ).choices[0].message.content  # fmt: skip
    try:
        json_object_ok = isinstance(json.loads(obj), dict)
    except ValueError:
        json_object_ok = False
    phone = (
        client.chat.completions.create(
            messages=ask("Give me a US phone number."), extra_body={"guided_regex": REGEX}, **kw
        )
        .choices[0]
        .message.content
    )
    mood = client.chat.completions.create(
        messages=ask("Classify the sentiment: 'I love this phone, the battery lasts days.'"),
        extra_body={"guided_choice": CHOICES}, **kw,
    ).choices[0].message.content  # fmt: skip
    result = {
        "model": model,
        "parsed": f"{sum(r['parsed'] for r in rows)}/{len(rows)}",
        "parsed_by_schema": by_schema,
        "json_object": {"text": obj, "valid": json_object_ok},
        "guided_regex": {"regex": REGEX, "text": phone, "match": bool(re.fullmatch(REGEX, phone))},
        "guided_choice": {"choices": CHOICES, "text": mood, "match": mood in CHOICES},
        "seconds": round(time.perf_counter() - t0, 1),
        "answers": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "answers"}, indent=1))
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
