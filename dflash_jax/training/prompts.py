"""Prompt sources for drafter training data, and the guard that keeps evaluation prompts out.

Sources: user files (jsonl lines with a `prompt`, OpenAI `messages` or ShareGPT `conversations`;
parquet files and Hugging Face `datasets` directories with those columns; any other text file as
one prompt a line: `read_prompt_file`), prompts built from
Python standard-library functions with docstrings (offline, HumanEval-like), templated math and
chat prompts (`prompt_templates.py`), and prompts the target writes itself from its own chat
template (`self_prompts` in generate.py).
HumanEval, MT-Bench and our dev set are evaluation sets: `OverlapFilter` drops any prompt that
equals one of them after normalisation or shares a long word n-gram with one.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from dflash_jax.io import jsonl, paths
from dflash_jax.io.assets import load_dev_prompts, load_humaneval_prompts, load_mtbench_questions

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
EXPECTED = (
    'a {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}, ...]} (OpenAI) or '
    '{"conversations": [{"from": ..., "value": ...}, ...]} (ShareGPT) object'
)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: a single user turn (`text`), or a conversation (`messages`: (role, content)
    pairs, roles system/user/assistant) whose user turns joined are its `text` (what the
    deduplication and the evaluation-overlap filter read)."""

    text: str
    source: str
    messages: tuple[tuple[str, str], ...] = ()

    def chat(self) -> list[dict]:
        """The input conversation as chat-template messages."""
        if not self.messages:
            return [{"role": "user", "content": self.text}]
        return [{"role": r, "content": c} for r, c in self.messages]


def answer_points(messages: list[dict]) -> list[int]:
    """Where the target answers in a conversation: the index of every assistant turn (its
    context is the messages before it, earlier answers regenerated), and len(messages) when the
    conversation ends with a user turn."""
    points = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] == "user":
        points.append(len(messages))
    return points


def conversation(turns, where: str, source: str, style: str) -> Prompt:
    """A Prompt from OpenAI `messages` (style "messages": role/content) or ShareGPT
    `conversations` (style "conversations": from/value); ValueError naming `where` otherwise."""
    role_key, text_key = ("role", "content") if style == "messages" else ("from", "value")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: '{style}' must be a non-empty list; expected {EXPECTED}")
    pairs = []
    for j, turn in enumerate(turns):
        role = turn.get(role_key) if isinstance(turn, dict) else None
        content = turn.get(text_key) if isinstance(turn, dict) else None
        if str(role).lower() not in ROLES or not isinstance(content, str):
            raise ValueError(
                f"{where}: {style}[{j}] needs '{role_key}' (one of {sorted(ROLES)}) and a string "
                f"'{text_key}'; expected {EXPECTED}"
            )
        pairs.append((ROLES[str(role).lower()], content.strip()))
    seen_user = False
    for j, (role, _) in enumerate(pairs):
        if role == "assistant" and not seen_user:
            raise ValueError(
                f"{where}: {style}[{j}] is an assistant turn before any user turn; a conversation "
                "needs a user turn for the target to answer"
            )
        seen_user |= role == "user"
    if not seen_user:
        raise ValueError(f"{where}: '{style}' has no user turn; expected {EXPECTED}")
    text = "\n\n".join(c for r, c in pairs if r == "user")
    if len(pairs) == 1:
        return Prompt(text, source)  # one user turn: the same prompt as {"prompt": ...}
    return Prompt(text, source, tuple(pairs))


def parse_prompt_record(record: dict, where: str, source: str) -> Prompt:
    """One jsonl line or table row: `prompt`, `messages` or `conversations`, detected per
    record (a table's empty cell, None, counts as absent); ValueError naming `where` for
    anything else."""
    if record.get("messages") is not None:
        return conversation(record["messages"], where, source, "messages")
    if record.get("conversations") is not None:
        return conversation(record["conversations"], where, source, "conversations")
    if isinstance(record.get("prompt"), str):
        return Prompt(record["prompt"].strip(), source)
    raise ValueError(
        f"{where}: no string 'prompt', no 'messages' and no 'conversations' field; "
        f"expected {EXPECTED}"
    )


def _table_rows(path) -> list[dict]:
    """Rows of a parquet file or a `datasets` directory (`save_to_disk`), as dicts."""
    if path.is_dir():
        try:
            import datasets
        except ImportError as e:
            raise ValueError(
                f"{path}: a Hugging Face datasets directory needs the `datasets` package; "
                "install it (pip install datasets) or export the data to jsonl"
            ) from e
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if len(loaded) != 1:
                raise ValueError(
                    f"{path}: a DatasetDict with splits {sorted(loaded)}; give one split's "
                    f"directory (e.g. {path}/train)"
                )
            loaded = next(iter(loaded.values()))
        return list(loaded)
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(
            f"{path}: reading parquet needs the `pyarrow` package; install it (pip install "
            "pyarrow) or export the data to jsonl"
        ) from e
    return pq.read_table(str(path)).to_pylist()


def read_prompt_file(path: str | os.PathLike) -> list[Prompt]:
    """Prompts and conversations from `path` (local or a URL): `.jsonl` lines (each a
    `prompt`, `messages` or `conversations` object, detected per line), a `.parquet` file or a
    `datasets` directory (`save_to_disk`) whose rows hold one of those columns, or any other
    file as one prompt a line. A bad line or row raises ValueError naming `file:line`."""
    path = paths.path(path)
    source = f"file:{path.name}"
    if path.is_dir() or path.suffix == ".parquet":
        rows = _table_rows(path)
        prompts = [parse_prompt_record(r, f"{path}:row {i}", source) for i, r in enumerate(rows)]
    elif path.suffix == ".jsonl":
        text = path.read_text(encoding="utf-8")
        prompts = [
            parse_prompt_record(
                jsonl.parse_line(line, f"{path}:{i}", EXPECTED), f"{path}:{i}", source
            )
            for i, line in jsonl.numbered_lines(text.splitlines())
        ]
    else:
        text = path.read_text(encoding="utf-8")
        prompts = [Prompt(t.strip(), source) for t in text.splitlines()]
    return [p for p in prompts if p.text]


def _first_paragraph(doc: str) -> str:
    paragraph = doc.strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def _signature(node: ast.FunctionDef) -> str:
    args = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({args}){returns}"


def _stdlib_functions(min_doc_chars: int):
    """(function node, docstring, path relative to the stdlib) for public top-level functions of
    the Python standard library whose docstring's first paragraph has at least `min_doc_chars`
    characters; deterministic (sorted files, source order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = Path(dirpath) / name
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in tree.body:
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if doc and len(_first_paragraph(doc)) >= min_doc_chars:
                    yield node, doc, path.relative_to(root)


FENCED_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{code}\n```"
)


def stdlib_code_prompts(limit: int, min_doc_chars: int = 40, fenced: bool = False) -> list[Prompt]:
    """Code prompts from Python standard-library functions (at most `limit`).

    Default: "Write a Python function `sig` that does the following. <first docstring
    paragraph>". `fenced=True` instead shows the signature and whole docstring in a python fence
    behind the instruction the HumanEval benchmark uses (the stdlib function, not a HumanEval
    task: `OverlapFilter` still applies)."""
    prompts: list[Prompt] = []
    for node, doc, rel in _stdlib_functions(min_doc_chars):
        if fenced:
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            code = f'def {_signature(node)}:\n    """{body.lstrip()}\n    """'
            prompts.append(Prompt(FENCED_TEMPLATE.format(code=code), f"stdlib-fenced:{rel}"))
        else:
            text = (
                f"Write a Python function `{_signature(node)}` that does the following.\n\n"
                f"{_first_paragraph(doc)}"
            )
            prompts.append(Prompt(text, f"stdlib:{rel}"))
        if len(prompts) >= limit:
            break
    return prompts


def normalize(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class OverlapFilter:
    """Flags prompts that match an evaluation text exactly after `normalize`, or share any word
    n-gram of length `ngram` with one (the GPT-3 contamination test uses 13)."""

    def __init__(self, eval_texts: Iterable[str], ngram: int = 13):
        self.ngram = ngram
        normalized = [normalize(t) for t in eval_texts]
        self.exact = set(normalized)
        self.grams = set().union(*(_ngrams(t.split(), ngram) for t in normalized))

    @classmethod
    def for_benchmarks(cls, ngram: int = 13) -> OverlapFilter:
        """HumanEval prompts, every MT-Bench turn and the shipped dev set."""
        texts = list(load_humaneval_prompts())
        texts += [turn for q in load_mtbench_questions() for turn in q["turns"]]
        texts += [r["prompt"] for r in load_dev_prompts()]
        return cls(texts, ngram)

    def overlaps(self, text: str) -> bool:
        norm = normalize(text)
        return norm in self.exact or not self.grams.isdisjoint(_ngrams(norm.split(), self.ngram))


def dedupe(prompts: Iterable[Prompt]) -> list[Prompt]:
    """Drops empty prompts and exact duplicates (after `normalize`), keeping the first."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        key = normalize(p.text)
        if key and key not in seen:
            seen.add(key)
            out.append(p)
    return out
