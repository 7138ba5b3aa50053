"""Prompt sources for drafter training data, and the guard that keeps evaluation prompts out.

Sources: user files (jsonl `{"prompt": ...}` or txt, one prompt per line), prompts built from
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


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    source: str


def read_prompt_file(path: str | os.PathLike) -> list[Prompt]:
    """`.jsonl` lines with a "prompt" field, or any other file as one prompt per line; `path`
    may be a URL."""
    path = paths.path(path)
    text = path.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        texts = []
        expected = 'a {"prompt": "..."} object per line'
        for i, line in jsonl.numbered_lines(text.splitlines()):
            record = jsonl.parse_line(line, f"{path}:{i}", expected)
            if not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{i}: no string 'prompt' field; expected {expected}")
            texts.append(record["prompt"])
    else:
        texts = lines
    return [Prompt(t.strip(), f"file:{path.name}") for t in texts if t.strip()]


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
