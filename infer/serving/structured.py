"""Structured output in the server: what a request asks for (OpenAI's `response_format`:
`json_object`, `json_schema` with its `schema`; vLLM's `guided_json`, `guided_regex`,
`guided_choice`) read into a `io.grammar.GrammarSpec`, and the spec compiled to the table its
slot carries (`decoding.slots.Admit.grammar`), padded to the decoder's grammar shape.

Compiling a schema takes outlines-core seconds to a minute on a CPU, so it runs where the
request is parsed (off the event loop and off the engine thread) and the tables are kept by
spec (`io.grammar.compile_grammar`'s cache). A grammar the compiler cannot take, or whose
table is larger than the server's, is a 400 naming the field, never an unconstrained answer.
"""

from __future__ import annotations

import threading

from dflash_jax.decoding import grammar
from dflash_jax.io import grammar as grammar_io

GUIDED = ("guided_json", "guided_regex", "guided_choice")


class GrammarRequestError(ValueError):
    """A request's structured output the server cannot take; `param` names its field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def requested(body: dict) -> tuple[str, grammar_io.GrammarSpec] | None:
    """(the field that asked, its spec) of a request body, None without structured output."""
    asked = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and isinstance(fmt, dict) and fmt.get("type") == "text":
        asked.remove("response_format")
    if body.get("guided_grammar") is not None:
        raise GrammarRequestError(
            "guided_grammar", "guided_grammar (a context-free grammar) is not supported: pass "
            "guided_json, guided_regex or guided_choice",
        )  # fmt: skip
    if not asked:
        return None
    if len(asked) > 1:
        raise GrammarRequestError(asked[1], f"give one of {', '.join(asked)}, not several")
    name = asked[0]
    try:
        if name == "response_format":
            return name, _response_format(fmt)
        value = body[name]
        if name == "guided_json":
            if not isinstance(value, dict | str):
                raise GrammarRequestError(name, "guided_json must be a JSON schema (an object)")
            return name, grammar_io.spec_of(json_schema=value)
        if name == "guided_regex":
            if not isinstance(value, str) or not value:
                raise GrammarRequestError(name, "guided_regex must be a non-empty string")
            return name, grammar_io.spec_of(regex=value)
        return name, grammar_io.spec_of(choices=value)
    except grammar_io.GrammarError as e:
        raise GrammarRequestError(name, str(e)) from e


def _response_format(fmt) -> grammar_io.GrammarSpec:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return grammar_io.spec_of(json_object=True)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise GrammarRequestError(
                "response_format", 'json_schema needs {"name": ..., "schema": {a JSON schema}}'
            )
        return grammar_io.spec_of(json_schema=schema)
    raise GrammarRequestError(
        "response_format",
        'response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name": ..., "schema": {...}}}',
    )


class Grammars:
    """Compiles request grammars over the target's tokenizer to tables of `shape` (states,
    token classes): `table(param, spec)` -> a host `grammar.Grammar`, or GrammarRequestError.
    None shape: the server carries no grammars (every structured request refused)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, shape: tuple[int, int] | None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids, self.shape = tuple(stop_ids), shape
        self._pieces = None
        self._lock = threading.Lock()

    def pieces(self):
        with self._lock:
            if self._pieces is None:
                self._pieces = grammar_io.token_bytes(self.tokenizer)
            return self._pieces

    def table(self, param: str, spec: grammar_io.GrammarSpec) -> grammar.Grammar:
        if self.shape is None:
            raise GrammarRequestError(
                param, "structured output is off on this server (infer.serve --grammar_table=0)"
            )
        try:
            tables = grammar_io.compile_grammar(spec, self.pieces(), self.vocab_size, self.stop_ids)
            return grammar.host_table(*tables, shape=self.shape)
        except grammar_io.GrammarError as e:
            raise GrammarRequestError(param, str(e)) from e
        except ValueError as e:  # larger than the server's table
            raise GrammarRequestError(
                param, f"{e} (infer.serve --grammar_table=STATESxCLASSES)"
            ) from e
