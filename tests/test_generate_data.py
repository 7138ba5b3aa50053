"""Training-data generation: record layout and loss mask, resume, evaluation-overlap filter,
shard round trips and the offline prompt sources. A character-level ChatML tokenizer and a tiny
random target keep it fast."""

import jax
import numpy as np
import pytest

from dflash_jax.decoding import autoregressive_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io.assets import load_dev_prompts, load_humaneval_prompts, load_mtbench_questions
from dflash_jax.training import data
from dflash_jax.training.generate import generate_records, mixture
from dflash_jax.training.prompt_templates import chat_prompts, math_prompts
from dflash_jax.training.prompts import (
    OverlapFilter,
    Prompt,
    dedupe,
    read_prompt_file,
    stdlib_code_prompts,
)


def test_chat_format_renders_as_at_inference(chat):
    ids = chat.prompt_ids("hi")
    text = chat.tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nhi"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    prefix, end_of_turn = chat.user_turn_prefix()
    assert chat.tokenizer.decode(prefix).endswith("<|im_end|>\n<|im_start|>user\n")
    assert end_of_turn == 2


@pytest.mark.slow
def test_records_mask_only_the_response_and_resume(tmp_path, target, chat):
    prompts = [Prompt(t, "test") for t in ("hello", "write a poem", "abc def ghi jkl", "x")]
    counts = generate_records(
        target,
        chat,
        prompts,
        tmp_path,
        fmt="jsonl",
        batch_size=2,
        max_new_tokens=12,
        min_loss_tokens=1,
        prompts_per_shard=3,
        bucket=8,
    )
    records = [r for path in data.expand_paths(str(tmp_path)) for r in data.read_shard(path)]
    assert counts["written"] == len(records) == 4 - counts["short_response"]
    assert len(data.expand_paths(str(tmp_path))) == 2  # 3 prompts per shard
    decode_config = DecodeConfig(max_new_tokens=12, stop_token_ids=(2,))
    for record in records:
        prompt_ids = chat.prompt_ids(record["prompt"])
        p = len(prompt_ids)
        assert record["tokens"][:p] == prompt_ids
        assert record["loss_mask"] == [0] * p + [1] * (len(record["tokens"]) - p)
        alone = autoregressive_decode(
            target.params,
            np.asarray([prompt_ids], np.int32),
            np.asarray([p], np.int32),
            jax.random.key(0),
            target_config=target.config,
            decode_config=decode_config,
        )
        n = int(alone.lengths[0])
        assert record["tokens"][p:] == np.asarray(alone.tokens[0, :n]).tolist()
        assert data.prompt_tokens(record) == prompt_ids

    again = generate_records(
        target,
        chat,
        prompts + [Prompt("new one", "test")],
        tmp_path,
        fmt="jsonl",
        batch_size=2,
        max_new_tokens=12,
        min_loss_tokens=1,
        prompts_per_shard=3,
        bucket=8,
    )
    assert again["written"] + again["short_response"] == 1  # only the new prompt


def test_short_responses_are_dropped(tmp_path, target, chat):
    counts = generate_records(
        target,
        chat,
        [Prompt("hello", "test")],
        tmp_path,
        fmt="jsonl",
        batch_size=2,
        max_new_tokens=8,
        min_loss_tokens=9,
    )
    assert counts["written"] == 0 and counts["short_response"] == 1


def test_overlap_filter_drops_evaluation_prompts():
    overlap = OverlapFilter.for_benchmarks()
    humaneval = load_humaneval_prompts()[0]
    assert overlap.overlaps("  " + humaneval.upper().replace("\n", " \n\n "))  # normalised match
    turn = load_mtbench_questions()[0]["turns"][0]
    assert overlap.overlaps(f"Please help me with this. {turn} Thanks a lot!")  # long n-gram
    assert not overlap.overlaps("Write a Python function that reverses a linked list in place.")
    small = OverlapFilter(["the quick brown fox jumps over the lazy dog"], ngram=4)
    assert small.overlaps("a lazy fox: quick brown fox jumps!")
    assert not small.overlaps("brown fox, quick jumps")


def test_shard_round_trip(tmp_path):
    records = [
        {"tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "source": "s", "prompt": "é ü"},
        {"tokens": [5, 6], "loss_mask": [0, 1], "source": "t", "prompt": "p\nq"},
    ]
    for name in ("a.jsonl", "a.array_record"):
        data.write_shard(tmp_path / name, records)
        assert data.read_shard(tmp_path / name) == records
        source = data.record_source([str(tmp_path / name)])
        parsed = data.ParseRecord(source).map(1)
        assert parsed["index"] == 1
        np.testing.assert_array_equal(parsed["tokens"], [5, 6])
        np.testing.assert_array_equal(parsed["loss_mask"], [0, 1])
    with pytest.raises(ValueError, match="all be ArrayRecord or all jsonl"):
        data.record_source([str(tmp_path / "a.jsonl"), str(tmp_path / "a.array_record")])


def test_prompt_sources(tmp_path):
    code = stdlib_code_prompts(5)
    assert len(code) == 5 and code == stdlib_code_prompts(5)
    assert all(p.text.startswith("Write a Python function `") for p in code)
    assert all(p.source.startswith("stdlib:") for p in code)
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    (tmp_path / "p.txt").write_text("alpha\n  \nbeta\n")
    assert [p.text for p in read_prompt_file(tmp_path / "p.jsonl")] == ["one", "two"]
    assert [p.text for p in read_prompt_file(tmp_path / "p.txt")] == ["alpha", "beta"]
    kept = dedupe([Prompt("Hello!", "a"), Prompt("hello", "b"), Prompt(" ", "c"), Prompt("x", "d")])
    assert [p.source for p in kept] == ["a", "d"]


def test_templated_math_and_chat_prompts_and_the_mixture(tmp_path, target, chat):
    math = math_prompts(300, seed=1)
    assert len(math) == 300 and len({p.text for p in math}) == 300
    assert math == math_prompts(300, seed=1) and math != math_prompts(300, seed=2)
    assert all(p.source == "math:template" and "?" in p.text for p in math)
    talk = chat_prompts(200, seed=0)
    assert len({p.text for p in talk}) == 200 and all(p.source == "chat:template" for p in talk)
    fenced = stdlib_code_prompts(3, fenced=True)
    assert all(
        p.text.startswith("Write a solution") and "```python\ndef " in p.text for p in fenced
    )
    # The dev set is an evaluation set: its prompts never reach training data.
    dev = load_dev_prompts()
    assert len(dev) == 24 and {r["category"] for r in dev} == {"code", "math", "chat"}
    overlap = OverlapFilter.for_benchmarks()
    assert all(overlap.overlaps(r["prompt"]) for r in dev)
    assert not any(overlap.overlaps(p.text) for p in math[:50] + talk[:50])

    prompts = math[:3] + talk[:2] + [Prompt("def f(): pass", "stdlib:x.py")]
    generate_records(
        target, chat, prompts, tmp_path, fmt="jsonl", batch_size=2, max_new_tokens=6,
        min_loss_tokens=1,
    )  # fmt: skip
    mix = mixture(tmp_path)
    records = [r for path in data.expand_paths(str(tmp_path)) for r in data.read_shard(path)]
    assert set(mix["sources"]) == {"math", "chat", "stdlib"}
    assert (
        mix["total"]["records"]
        == len(records)
        == sum(k["records"] for k in mix["sources"].values())
    )
    assert mix["total"]["tokens"] == sum(sum(r["loss_mask"]) for r in records)


def test_self_prompts_are_sampled_once_even_when_fewer_than_asked(tmp_path):
    """A rerun asking for no more self prompts than before reads them back, though sampling
    found fewer than asked (generate_data used to sample ~100 minutes again on every resume);
    asking for more samples again."""
    from dflash_jax.training.generate import cached_self_prompts
    from dflash_jax.training.prompts import Prompt

    calls = []

    def sample(num_prompts):
        calls.append(num_prompts)
        return [Prompt(f"user turn number {i}", "self") for i in range(3)]  # fewer than asked

    path = tmp_path / "self_prompts.jsonl"
    first = cached_self_prompts(path, 10, sample)
    again = cached_self_prompts(path, 10, sample)
    assert calls == [10] and first == again and len(first) == 3
    assert cached_self_prompts(path, 2, sample) == first[:2] and calls == [10]
    cached_self_prompts(path, 20, sample)
    assert calls == [10, 20]
