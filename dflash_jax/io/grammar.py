"""Structured output on the host: a JSON schema, a regular expression or a list of choices
compiled once to a token-level automaton over a tokenizer's vocabulary (outlines-core builds
the regex of a schema and the index of a regex), then reduced to the class table
`decoding.grammar.device_table` places on the device. Compiled tables are kept per process
and on disk, keyed by the grammar's and the vocabulary's hashes.

class_of [V]: each token id's class (tokens whose moves agree in every state share one; class
0 is the tokens no state allows: the specials, ids past the tokenizer). trans [S, C]: the next
state per (state, class), -1 not allowed; state 0 the start; in an accepting state each stop
token moves to a last state that allows nothing, where the row ends.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from dflash_jax.files import cache_root

KINDS = ("json_schema", "regex", "choices", "json_object")
# json_object: any JSON object, nested up to this depth (outlines-core's recursion bound).
JSON_OBJECT_DEPTH = 2
_TABLES: dict = {}


class GrammarError(ValueError):
    """A grammar the compiler cannot take; the message says which and what to do."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What the user asked for: kind (one of KINDS) and its text (a JSON schema as JSON, a
    regular expression, the choices as a JSON list; json_object: empty)."""

    kind: str
    text: str = ""

    def regex(self) -> str:
        return regex_of(self)


def spec_of(json_schema=None, regex=None, choices=None, json_object=False) -> GrammarSpec | None:
    """The one grammar of a request's options (a schema as a dict or JSON text, a regex, a
    list of choices, or any JSON object), None without; GrammarError for two at once."""
    given = [
        (k, v)
        for k, v in (("json_schema", json_schema), ("regex", regex), ("choices", choices))
        if v is not None
    ] + ([("json_object", "")] if json_object else [])
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(
            f"structured output: give one of json_schema, regex, choices (got "
            f"{', '.join(k for k, _ in given)})"
        )
    kind, value = given[0]
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choices":
        if isinstance(value, str) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("choices: a non-empty list of strings, e.g. ['yes', 'no']")
        value = json.dumps(list(value))
    return GrammarSpec(kind, value)


def regex_of(spec: GrammarSpec) -> str:
    """The regular expression of a spec (outlines-core's for a schema)."""
    from outlines_core.json_schema import build_regex_from_schema

    if spec.kind not in KINDS:
        raise GrammarError(f"grammar kind {spec.kind!r}: one of {KINDS}")
    if spec.kind == "regex":
        return spec.text
    if spec.kind == "choices":
        return "|".join(_escape(c) for c in json.loads(spec.text))
    schema = spec.text if spec.kind == "json_schema" else json.dumps({"type": "object"})
    depth = JSON_OBJECT_DEPTH if spec.kind == "json_object" else 3
    try:
        json.loads(schema)
    except ValueError as e:
        raise GrammarError(f"json_schema is not valid JSON ({e}); pass a JSON object") from e
    schema, ranges = bounded_numbers(schema)
    try:
        regex = build_regex_from_schema(schema, None, depth)
    except Exception as e:  # outlines-core raises its own types
        raise GrammarError(
            f"json_schema: outlines-core cannot turn this schema into a grammar ({e}); "
            "simplify the schema (bounded nesting, supported keywords) or pass a regex"
        ) from e
    for mark, pattern in ranges.items():
        regex = regex.replace(str(mark), pattern)
    return regex


# A number no schema holds: the stand-in for a bounded number's own regex (`bounded_numbers`).
_MARK = 918273645500000
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def bounded_numbers(schema: str) -> tuple[str, dict[int, str]]:
    """outlines-core ignores an integer's or a number's minimum and maximum; so each bounded
    one is replaced by a stand-in enum and its regex (`number_regex`) put in its place after:
    -> (the schema, {stand-in: regex})."""
    ranges: dict[int, str] = {}

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind in ("integer", "number") and any(k in node for k in _BOUNDS):
            mark = _MARK + len(ranges)
            ranges[mark] = number_regex(node, integer=kind == "integer")
            return {k: v for k, v in node.items() if k not in (*_BOUNDS, "type")} | {"enum": [mark]}
        return {k: walk(v) for k, v in node.items()}

    out = walk(json.loads(schema))
    return (json.dumps(out) if ranges else schema), ranges


def number_regex(node: dict, integer: bool) -> str:
    """The regex of the integers (or numbers: an integer part, an optional fraction, no
    exponent) within a schema node's minimum/maximum (exclusive ones too). A bound that is
    not an integer is rounded inwards, so every number the regex takes is within bounds."""
    import math

    lo = node.get("minimum")
    hi = node.get("maximum")
    if "exclusiveMinimum" in node:
        x = node["exclusiveMinimum"]
        lo = max(lo, math.floor(x) + 1) if lo is not None else math.floor(x) + 1
    if "exclusiveMaximum" in node:
        x = node["exclusiveMaximum"]
        hi = min(hi, math.ceil(x) - 1) if hi is not None else math.ceil(x) - 1
    lo = None if lo is None else math.ceil(lo)
    hi = None if hi is None else math.floor(hi)
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(f"json_schema: no {'integer' if integer else 'number'} lies in {node}")
    frac = "" if integer else r"(\.[0-9]+)?"
    zeros = "" if integer else r"(\.0+)?"
    parts = []
    if hi is None or hi >= 0:  # the non-negative ones: [max(lo, 0), hi]
        a = max(lo, 0) if lo is not None else 0
        if integer:
            parts.append(_digits(a, hi))
        else:  # below hi with any fraction; hi itself with zeros only
            if hi is None or a <= hi - 1:
                parts.append(_digits(a, None if hi is None else hi - 1) + frac)
            if hi is not None:
                parts.append(f"{hi}{zeros}")
    if lo is None or lo < 0:  # the negative ones: -k, k in [n, m]
        n = -hi if hi is not None and hi < 0 else 1 if integer else 0
        m = None if lo is None else -lo
        if integer:
            parts.append("-" + _digits(n, m))
        else:
            if m is None or n <= m - 1:
                parts.append("-" + _digits(n, None if m is None else m - 1) + frac)
            if m is not None:
                parts.append(f"-{m}{zeros}")
    return "(" + "|".join(parts) + ")"


def _digits(a: int, b: int | None) -> str:
    """A regex of the integers a..b (b None: no end), a >= 0, without leading zeros."""
    if b is None:
        width = len(str(a))
        return f"({_digits(a, 10**width - 1)[1:-1]}|[1-9][0-9]{{{width},}})"
    parts = []
    for width in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (width - 1) if width > 1 else 0), min(b, 10**width - 1)
        if lo <= hi:
            parts += _same_width(str(lo), str(hi))
    return "(" + "|".join(parts) + ")"


def _same_width(lo: str, hi: str) -> list[str]:
    """Regexes covering the integers lo..hi, written with as many digits each."""
    i = 0
    while i < len(lo) and lo[i] == hi[i]:
        i += 1
    prefix, lo, hi = lo[:i], lo[i:], hi[i:]
    if not lo:
        return [prefix]
    n = len(lo) - 1
    tail = f"[0-9]{{{n}}}" if n else ""
    low_full, high_full = lo[1:] == "0" * n, hi[1:] == "9" * n
    out = []
    first = int(lo[0]) if low_full else int(lo[0]) + 1
    last = int(hi[0]) if high_full else int(hi[0]) - 1
    if not low_full:
        out += _same_width(lo, lo[0] + "9" * n)
    if first <= last:
        out.append(f"[{first}-{last}]{tail}")
    if not high_full:
        out += _same_width(hi[0] + "0" * n, hi)
    return [prefix + x for x in out]


def _escape(text: str) -> str:
    """A literal for outlines-core's regex syntax."""
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\/" else ch for ch in text)


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (each byte as a printable character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes as the text decodes them (None for a special token): byte-level
    BPE (GPT-2, Llama 3, Qwen, SmolLM2) read through its alphabet, SentencePiece's ▁ and
    <0xNN> pieces as a space and that byte."""
    specials = set(getattr(tokenizer, "all_special_ids", ()))
    added = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    inverse = _unicode_to_byte()
    out: list[bytes | None] = []
    for i in range(len(tokenizer)):
        if i in specials or i in added:
            out.append(None)
            continue
        piece = tokenizer.convert_ids_to_tokens(i)
        if piece is None:
            out.append(None)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        elif all(ch in inverse for ch in piece):
            out.append(bytes(inverse[ch] for ch in piece))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out


def vocab_hash(pieces: list[bytes | None]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(b"\xff" if piece is None else len(piece).to_bytes(2, "little") + piece)
    return digest.hexdigest()[:16]


def compile_grammar(
    spec: GrammarSpec, pieces: list[bytes | None], vocab_size: int, stop_ids
) -> tuple[np.ndarray, np.ndarray]:
    """(class_of [vocab_size] int32, trans [S, C] int32) of `spec` over a vocabulary whose
    token ids have the bytes `pieces` (`token_bytes`; ids past it and None never allowed);
    `stop_ids` end the text in an accepting state. Cached per process and on disk
    (`files.cache_root()/grammars`: outlines-core takes seconds to minutes per schema)."""
    stop_ids = tuple(sorted({int(i) for i in stop_ids}))
    if not stop_ids:
        raise GrammarError("structured output needs a stop token (the tokenizer's EOS)")
    key = (spec, vocab_hash(pieces), vocab_size, stop_ids)
    if key not in _TABLES:
        path = cache_root() / "grammars" / f"{hashlib.sha256(repr(key).encode()).hexdigest()}.npz"
        try:
            with np.load(path) as kept:
                _TABLES[key] = (kept["class_of"], kept["trans"])
        except (OSError, ValueError, KeyError):  # not kept yet (or damaged): compiled again
            _TABLES[key] = _compile(spec.regex(), pieces, vocab_size, stop_ids)
            _keep(path, *_TABLES[key])
    return _TABLES[key]


def _keep(path, class_of: np.ndarray, trans: np.ndarray) -> None:
    """A compiled table kept on disk (through a temporary file and a rename); an unwritable
    cache is left as it is."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, class_of=class_of, trans=trans)
        os.replace(tmp, path)
    except OSError:
        pass


def _compile(regex: str, pieces, vocab_size: int, stop_ids) -> tuple[np.ndarray, np.ndarray]:
    from outlines_core import Index, Vocabulary

    by_bytes: dict[bytes, list[int]] = {}
    for i, piece in enumerate(pieces[:vocab_size]):
        if piece and i not in stop_ids:
            by_bytes.setdefault(piece, []).append(i)
    try:
        index = Index(regex, Vocabulary(stop_ids[0], by_bytes))
    except Exception as e:
        raise GrammarError(
            f"outlines-core cannot build a token automaton for this grammar ({e}); check the "
            "regex (no lookaround or backreferences) or simplify the schema"
        ) from e
    moves = index.get_transitions()
    first = index.get_initial_state()
    finals = set(index.get_final_states())
    states = [first, *sorted((set(moves) | finals) - {first})]
    ids = np.asarray(sorted(states), np.int64)  # outlines-core's state ids, sorted
    numbered = np.empty(len(ids), np.int64)  # its number here, by position in ids
    numbered[np.searchsorted(ids, states)] = np.arange(len(states))
    end = len(states)  # allows nothing: a stop token's target
    stop = np.asarray([i for i in stop_ids if i < vocab_size], np.int64)

    def column(state) -> np.ndarray:  # next state per token id, -1 not allowed
        col = np.full(vocab_size, -1, np.int64)
        out = moves.get(state, {})
        toks = np.fromiter(out.keys(), np.int64, len(out))
        nxt = numbered[np.searchsorted(ids, np.fromiter(out.values(), np.int64, len(out)))]
        keep = toks < vocab_size
        col[toks[keep]] = nxt[keep]
        col[stop] = end if state in finals else -1
        return col

    # tokens whose columns agree share a class (a hash of each token's column, checked after)
    hashed = np.zeros(vocab_size, np.uint64)
    for state in states:
        hashed = hashed * np.uint64(1000003) + (column(state) + 2).astype(np.uint64)
    _, first_of, class_of = np.unique(hashed, return_index=True, return_inverse=True)
    cols = [column(state) for state in states]
    trans = np.stack([c[first_of] for c in cols] + [np.full(first_of.size, -1)], axis=0)
    for c, col in zip(trans, cols, strict=False):
        if not np.array_equal(c[class_of], col):
            raise GrammarError("grammar table: a hash collision merged two token classes")
    # class 0 = the tokens no state allows (if any)
    refused = np.flatnonzero((trans < 0).all(axis=0))
    order = np.arange(trans.shape[1])
    if refused.size:
        order = np.concatenate([refused[:1], np.delete(order, refused[:1])])
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank[class_of].astype(np.int32), trans[:, order].astype(np.int32)
