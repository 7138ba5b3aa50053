"""Training-data generation: record layout and loss mask, resume, evaluation-overlap filter,
shard round trips and the offline prompt sources. A character-level ChatML tokenizer and a tiny
random target keep it fast."""

import json

import jax
import numpy as np
import pytest
from _chat_tokenizer import CHATML, QWEN3_STYLE, char_tokenizer

from dflash_jax.decoding import autoregressive_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io.assets import load_dev_prompts, load_humaneval_prompts, load_mtbench_questions
from dflash_jax.io.drafter_io import warn_thinking_mismatch
from dflash_jax.io.loaded_target import LoadedTarget
from dflash_jax.io.tokenizer import TRAINING_DATA_FILE
from dflash_jax.training import data
from dflash_jax.training.continuous import ContinuousDecoder, shared_prefix
from dflash_jax.training.generate import ChatFormat, generate_records, mixture
from dflash_jax.training.prompt_templates import chat_prompts, math_prompts
from dflash_jax.training.prompts import (
    OverlapFilter,
    Prompt,
    answer_points,
    dedupe,
    read_prompt_file,
    stdlib_code_prompts,
)
from infer.hlo_scan import cache_copies_in_loop


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


@pytest.mark.slow  # moved out of the default suite for its budget (2026-12-06); CI's slow step runs it
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
        engine="slots",  # the programs of test_every_assistant_turn_is_regenerated_and_masked
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
        target, chat, prompts, tmp_path, fmt="jsonl", batch_size=2, max_new_tokens=8,
        min_loss_tokens=1, engine="slots",
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


SHAREGPT = [
    {"conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "old answer one"},
        {"from": "human", "value": "more"}, {"from": "gpt", "value": "old answer two"},
    ]},
    {"conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "why?"},
        {"from": "gpt", "value": "old"},
    ]},
]  # fmt: skip
MESSAGES = [
    {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "old b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "old d"},
    ]},
    {"messages": [{"role": "user", "content": "single"}]},
]  # fmt: skip


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_conversation_files_are_detected_per_line_and_bad_lines_named(tmp_path):
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", SHAREGPT[1:] + MESSAGES + [{"prompt": "p"}])
    system, two_turns, single, plain = read_prompt_file(mixed)
    assert system.messages == (("system", "be brief"), ("user", "why?"), ("assistant", "old"))
    assert two_turns.text == "a\n\nc" and len(two_turns.messages) == 4
    assert single == plain.__class__("single", "file:mixed.jsonl") and not plain.messages
    for row, problem in [
        ({"text": "no known field"}, "no string 'prompt', no 'messages'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\] needs 'role'"),
        ({"conversations": [{"from": "gpt", "value": "x"}]}, "assistant turn before any user"),
        ({"messages": [{"role": "system", "content": "x"}]}, "has no user turn"),
    ]:
        bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
        with pytest.raises(ValueError, match=rf"{bad}:2: .*{problem}"):
            read_prompt_file(bad)
    table = tmp_path / "t.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # not a requirement: the error says what to install
        table.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs the `pyarrow` package; install it"):
            read_prompt_file(table)
    else:
        pq.write_table(pa.Table.from_pylist(SHAREGPT), str(table))
        assert [p.text for p in read_prompt_file(table)] == ["hi\n\nmore", "why?"]


def _spans(mask):
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


def test_every_assistant_turn_is_regenerated_and_masked(tmp_path, target, chat):
    """The issue's done-when at tiny size, through the slot engine: 2 ShareGPT + 2 messages
    conversations -> 4 records; each 2-turn one has two answer spans, each the target's own
    (regenerated) answer followed by its end of turn, and no user or system token is in the
    loss; the second turn was asked with the first regenerated answer in its context."""
    prompts = read_prompt_file(_write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT))
    prompts += read_prompt_file(_write_jsonl(tmp_path / "messages.jsonl", MESSAGES))
    counts = generate_records(
        target, chat, prompts, tmp_path / "out", fmt="jsonl", batch_size=2, max_new_tokens=8,
        min_loss_tokens=1, engine="slots",
    )  # fmt: skip
    records = [r for p in data.expand_paths(str(tmp_path / "out")) for r in data.read_shard(p)]
    assert counts["written"] == len(records) == 4
    decode = chat.tokenizer.decode
    for record in records:
        tokens, mask = record["tokens"], record["loss_mask"]
        turns = record.get("turns", 1)
        assert len(_spans(mask)) == turns
        assert sum(mask[len(tokens) - 8 :]) == 8  # the last answer (8 tokens, cut there) ends it
        masked = decode([t for t, m in zip(tokens, mask, strict=True) if m])
        for old in ("old", "be brief", "why?", "hi", "more", "single"):
            assert old not in masked  # no input answer, no user or system text
        if turns == 2:
            first_end = mask.index(0, _spans(mask)[0])
            assert tokens[first_end - 1] == 2  # the first answer's end of turn is in the loss
            text = decode(tokens)
            assert text.count("<|im_start|>assistant\n") == 2 and "old" not in text
    assert sorted(r.get("turns", 1) for r in records) == [1, 1, 2, 2]


def test_thinking_mode_reaches_the_template_manifest_and_export(tmp_path, target):
    """--thinking: passed as enable_thinking (refused for a template without it), recorded in
    each shard's manifest (a rerun in the other mode is refused), read back for the export, and
    a drafter exported from data of one mode warns when loaded for a template serving the
    other."""
    tok = char_tokenizer(QWEN3_STYLE)
    off, on = ChatFormat(tok, QWEN3_STYLE, "off"), ChatFormat(tok, QWEN3_STYLE, "on")
    default = ChatFormat(tok, QWEN3_STYLE)
    assert tok.decode(off.prompt_ids("q")).endswith("assistant\n<think>\n\n</think>\n\n")
    assert on.prompt_ids("q") == default.prompt_ids("q") != off.prompt_ids("q")
    assert (off.thinking_mode(), on.thinking_mode(), default.thinking_mode()) == ("off", "on", "on")
    with pytest.raises(ValueError, match="no such switch; use thinking=template"):
        ChatFormat(tok, CHATML, "on")
    assert ChatFormat(tok, CHATML).thinking_mode() == "none"

    out = tmp_path / "data"
    kw = dict(fmt="jsonl", max_prompt_tokens=1)  # every prompt too long: no decode to compile
    counts = generate_records(target, off, [Prompt("q", "t")], out, **kw)
    assert counts["too_long_prompt"] == 1
    assert json.loads((out / "data-00000.json").read_text())["thinking"] == "off"
    assert data.data_thinking(data.expand_paths(str(out))) == "off"
    with pytest.raises(ValueError, match=r"thinking \['off'\], this run's is on"):
        generate_records(target, on, [Prompt("r", "t")], out, **kw)

    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    (drafter_dir / TRAINING_DATA_FILE).write_text(json.dumps({"thinking": "off"}))
    serving_on = LoadedTarget(target.config, None, tok, QWEN3_STYLE, "qwen3-like")
    assert "trained on data generated with thinking off" in warn_thinking_mismatch(
        drafter_dir, serving_on
    )
    (drafter_dir / TRAINING_DATA_FILE).write_text(json.dumps({"thinking": "on"}))
    assert warn_thinking_mismatch(drafter_dir, serving_on) is None
    assert warn_thinking_mismatch(tmp_path / "nothing", serving_on) is None


@pytest.mark.slow
def test_slot_engine_answers_as_the_target_alone(tmp_path, target, chat):
    """Guards the slot engine's answers (only this test): greedy, every conversation's records
    equal the fixed batches' (whose rows are the target's own greedy decode, checked by
    test_records_mask_only_the_response_and_resume), chunks ending at each stop and the tail's
    rows gathered into fewer (2 slots to 1) included, the prompts prefilled in stages after
    the tokens all of them begin with (the template's system prompt, prefilled once); sampled,
    a request's answer depends on its seed alone, not on the rows beside it (1 slot or 3,
    gathered to 1, stages of 1 or 3 rows); and its loop updates the cache in place (no
    cache-sized copy a step: a 1.35x step without the loop options)."""
    prompts = read_prompt_file(_write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT))
    prompts += read_prompt_file(_write_jsonl(tmp_path / "messages.jsonl", MESSAGES))
    kw = dict(fmt="jsonl", max_new_tokens=8, min_loss_tokens=1)
    # The first round's prompts (as `answer_conversations` builds them) share a prefix to reuse:
    first = [m.chat()[: answer_points(m.chat())[0]] for m in prompts]
    first = [chat.conversation_ids([m for m in c if m["role"] != "assistant"])[0] for c in first]
    assert chat.tokenizer.decode(shared_prefix(first)).startswith("<|im_start|>system\n")
    assert shared_prefix([[1, 2, 3], [1, 2]]) == [1] and shared_prefix([[1, 2]]) == []

    def records(name, **more):
        generate_records(target, chat, prompts, tmp_path / name, **kw, **more)
        return [r for p in data.expand_paths(str(tmp_path / name)) for r in data.read_shard(p)]

    assert records("slots", engine="slots", batch_size=2) == records("fixed", batch_size=2)
    sampled = dict(engine="slots", temperature=1.0, top_p=0.9, seed=3)
    one = records("one", batch_size=1, **sampled)
    assert one == records("three", batch_size=3, **sampled)
    assert one != records("slots", engine="slots", batch_size=2)  # it did sample
    decoder = ContinuousDecoder(target, DecodeConfig(max_new_tokens=8), 2, 16)
    cache = jax.tree.leaves(decoder.state.cache.k)[0]
    assert cache_copies_in_loop(decoder.advance_hlo(), cache.size) == 0
