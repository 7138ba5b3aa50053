"""Training data generation: the target regenerates the responses (dflash-spec §7.1).

Each prompt is rendered with the target's chat template exactly as at inference
(`add_generation_prompt=True`, encoded with `add_special_tokens=False`), answered by batched
`autoregressive_decode`, and stored as prompt+response token ids with loss_mask 1 on the response
only (stop token included). Prompts are sorted by length and batched into padded widths rounded
to `bucket` tokens, so padding stays small and few shapes are compiled.

Output directory (local or a URL such as `gs://bucket/data`): `data-NNNNN.{array_record,jsonl}`
shards, each with a `data-NNNNN.json` manifest (hashes of the prompts it covers, kept or
dropped, and counts) written before the shard. A rerun skips every prompt covered by a shard
that exists, so a killed run resumes where it stopped.

Several processes (`jax.distributed`): process p of P answers prompts p, p+P, p+2P, ... of the
list (every prompt once, none left out) on its own devices, and names its shards
`data-NNNNN-pPofP`; each skips the prompts that any visible manifest covers, so with a shared
output directory a rerun resumes whatever the number of processes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
import tqdm
from absl import logging
from etils import epath

from dflash_jax.decoding import autoregressive_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.decoding.slots import prompt_buckets
from dflash_jax.io import paths
from dflash_jax.io.tokenizer import resolved_thinking, thinking_kwargs
from dflash_jax.training.continuous import CHUNK_STEPS, ContinuousDecoder
from dflash_jax.training.data import FORMATS, SHARD_PREFIX, read_shard, write_shard
from dflash_jax.training.prompts import Prompt, answer_points, dedupe

SENTINEL = "\u2063SENTINEL\u2063"


class ChatFormat:
    """The target's chat template applied as at inference time, in thinking mode `thinking`
    (off, on, or template: the template's own default; `io.tokenizer.thinking_kwargs`)."""

    def __init__(self, tokenizer, chat_template: str | None, thinking: str = "template"):
        if chat_template is None:
            raise ValueError("the target has no chat template; training data needs one")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.thinking = thinking
        self._kwargs = thinking_kwargs(chat_template, thinking)

    def thinking_mode(self) -> str:
        """What the template does: on, off, or none (no enable_thinking switch)."""
        return resolved_thinking(self.tokenizer, self.chat_template, self.thinking)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.encode(self.render([{"role": "user", "content": prompt}], True))

    def conversation_ids(
        self, messages: list[dict], stop_ids: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """The token ids of `messages` rendered with the generation prompt, and a mask that is 1
        on the tokens of every assistant turn's text as the template renders it (and on the
        token right after it when that is one of `stop_ids`: the end of the turn)."""
        text = self.render(messages, True)
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not answers:
            ids = self.encode(text)
            return ids, [0] * len(ids)
        spans = self._answer_spans(messages, answers, text)
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as e:
            raise ValueError(
                "multi-turn conversations need a fast tokenizer (token offsets) to find the "
                "answers' tokens"
            ) from e
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        mask = [0] * len(ids)
        for lo, hi in spans:
            last = -1
            for t, (a, b) in enumerate(offsets):
                if a < hi and b > lo:
                    mask[t], last = 1, t
            if last >= 0 and last + 1 < len(ids) and ids[last + 1] in stop_ids:
                mask[last + 1] = 1
        return ids, mask

    def _answer_spans(self, messages, answers, text) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in `text` (the rendered conversation): the
        template rendered with a sentinel for each answer gives the text around them."""
        marked = [
            {**m, "content": f"{SENTINEL}{i}{SENTINEL}"} if i in answers else m
            for i, m in enumerate(messages)
        ]
        pieces = re.split(f"{SENTINEL}\\d+{SENTINEL}", self.render(marked, True))
        if len(pieces) != len(answers) + 1 or not text.startswith(pieces[0]):
            raise ValueError("the chat template does not render assistant turns as their text")
        spans, pos = [], len(pieces[0])
        for j, piece in enumerate(pieces[1:], 1):
            end = len(text) - len(piece) if j == len(answers) else text.find(piece, pos)
            if end < pos or (j == len(answers) and not text.endswith(piece)):
                raise ValueError("the chat template does not render assistant turns as their text")
            spans.append((pos, end))
            pos = end + len(piece)
        return spans

    def user_turn_prefix(self) -> tuple[list[int], int]:
        """Token ids of the template up to where the user's text starts (system turn included,
        e.g. `...<|im_start|>user\\n` for ChatML), and the id that ends the user turn."""
        text = self.render([{"role": "user", "content": SENTINEL}], False)
        prefix, suffix = text.split(SENTINEL)
        end_ids = self.encode(suffix)
        if not end_ids:
            raise ValueError("the chat template puts nothing after the user turn")
        return self.encode(prefix), end_ids[0]


def _prompt_key(prompt: Prompt) -> str:
    text = prompt.text if not prompt.messages else json.dumps(prompt.messages)
    return hashlib.sha1(f"{prompt.source}\n{text}".encode()).hexdigest()


def bucketed_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices sorted by length (stable), cut into batches: neighbours have similar lengths."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _decode_batch(
    target,
    ids: list[list[int]],
    batch_size: int,
    bucket: int,
    decode_config: DecodeConfig,
    rng,
    mesh=None,
    step_limit: int | None = None,
) -> list[list[int]]:
    """Pads `ids` to batch_size rows (repeating the last) and a width rounded up to `bucket`;
    -> the generated tokens of each real row (stop token included). On `mesh` when given."""
    width = -(-max(len(x) for x in ids) // bucket) * bucket
    rows = ids + [ids[-1]] * (batch_size - len(ids))
    prompt_bp = np.zeros((batch_size, width), np.int32)
    for i, x in enumerate(rows):
        prompt_bp[i, : len(x)] = x
    lengths_b = np.asarray([len(x) for x in rows], np.int32)
    out = autoregressive_decode(
        target.params,
        prompt_bp,
        lengths_b,
        rng,
        target_config=target.config,
        decode_config=decode_config,
        mesh=mesh,
        step_limit=step_limit,
    )
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokens[i, : n[i]].tolist() for i in range(len(ids))]


def cached_self_prompts(
    path: epath.Path,
    num_prompts: int,
    sample: Callable[[int], list[Prompt]],
    *,
    is_primary: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> list[Prompt]:
    """Self prompts (`self_prompts`, through `sample(num_prompts)`) sampled once and kept at
    `path` (jsonl), with the request that produced them in a sidecar (`<path>.request.json`).
    Sampling is seeded, so a rerun asking for no more than was asked before reads the file back,
    even when sampling stopped short of the count (the target repeats itself: SmolLM2 gave ~1,240
    distinct turns from 50 batches of 32), instead of sampling again (~100 CPU-minutes there).
    On several processes the primary samples and writes, the others wait at `barrier`."""
    path = epath.Path(path)
    request = path.parent / (path.name + ".request.json")

    def read() -> list[Prompt]:
        if not path.exists():
            return []
        return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line]

    cached = read()
    asked_before = json.loads(request.read_text())["requested"] if request.exists() else 0
    if len(cached) >= num_prompts or (cached and asked_before >= num_prompts):
        if len(cached) < num_prompts:
            logging.info(
                "%d self prompts (sampling found no more when asked for %d before)",
                len(cached), asked_before,
            )  # fmt: skip
        return cached[:num_prompts]
    if is_primary:
        prompts = sample(num_prompts)
        path.write_text(
            "".join(json.dumps({"text": p.text, "source": p.source}) + "\n" for p in prompts)
        )
        request.write_text(json.dumps({"requested": num_prompts, "kept": len(prompts)}))
    barrier()
    return read()[:num_prompts]


def self_prompts(
    target,
    chat: ChatFormat,
    num_prompts: int,
    *,
    batch_size: int,
    temperature: float,
    max_tokens: int,
    min_chars: int = 16,
    seed: int = 0,
    max_rounds: int = 50,
    mesh=None,
) -> list[Prompt]:
    """User turns sampled from the target itself: the template up to the user's text is the
    prompt, sampling stops at the end-of-turn token; unfinished, too short and duplicate turns
    are dropped. Stops after `num_prompts` are kept or `max_rounds` batches."""
    prefix, end_of_turn = chat.user_turn_prefix()
    stops = tuple(sorted({end_of_turn, *target.config.eos_token_ids}))
    decode_config = DecodeConfig(
        max_new_tokens=max_tokens, temperature=temperature, stop_token_ids=stops
    )
    kept: list[Prompt] = []
    key = jax.random.key(seed)
    with tqdm.tqdm(total=num_prompts, desc="self prompts", unit="prompt") as bar:
        for round_index in range(max_rounds):
            outs = _decode_batch(
                target,
                [prefix] * batch_size,
                batch_size,
                1,
                decode_config,
                jax.random.fold_in(key, round_index),
                mesh,
            )
            texts = [
                chat.tokenizer.decode(o[:-1], skip_special_tokens=True).strip()
                for o in outs
                if o and o[-1] in stops
            ]
            before = len(kept)
            kept = dedupe(kept + [Prompt(t, "self") for t in texts if len(t) >= min_chars])
            bar.update(min(len(kept), num_prompts) - min(before, num_prompts))
            if len(kept) >= num_prompts:
                break
    return kept[:num_prompts]


def _read_manifests(out_dir: epath.Path) -> tuple[set[str], int, set[str]]:
    """-> (keys of prompts covered by complete shards, next shard index, the thinking modes
    their manifests record)."""
    done: set[str] = set()
    modes: set[str] = set()
    next_index = 0
    for manifest in sorted(out_dir.glob(f"{SHARD_PREFIX}*.json")):
        index = int(manifest.stem.split("-")[1])
        if any((out_dir / f"{manifest.stem}{s}").exists() for s in FORMATS.values()):
            content = json.loads(manifest.read_text())
            done.update(content["prompt_keys"])
            if "thinking" in content:
                modes.add(content["thinking"])
            next_index = max(next_index, index + 1)
    return done, next_index, modes


class Answerer:
    """Answers lists of prompt token ids with the target: `engine="slots"` by continuous
    batching (`continuous.ContinuousDecoder`: rows leave when they stop, new prompts enter),
    `"fixed"` in padded batches sorted by length, each run until its longest answer stops.
    Answer i is sampled with its own seed (slots) or its batch's key (fixed)."""

    def __init__(self, target, decode_config: DecodeConfig, *, engine: str, batch_size: int,
                 bucket: int, max_prompt_tokens: int, mesh=None,
                 chunk_steps: int = CHUNK_STEPS):  # fmt: skip
        if engine not in ("slots", "fixed"):
            raise ValueError(f"engine {engine!r}: slots or fixed")
        if engine == "slots" and mesh is not None and mesh.size > 1:
            raise ValueError(
                "the slot engine runs on one device; on a mesh of several use engine=fixed"
            )
        self.target, self.cfg, self.engine = target, decode_config, engine
        self.batch_size, self.bucket, self.mesh = batch_size, bucket, mesh
        self.max_prompt_tokens, self.chunk_steps = max_prompt_tokens, chunk_steps
        self._slots: dict[int, ContinuousDecoder] = {}

    def _decoder(self, prompts: list[list[int]]) -> ContinuousDecoder:
        """The slot decoder whose prompt buffer fits these prompts' longest, rounded up to a
        power of two from 32 (`slots.prompt_buckets`, as the server's inserts: a decoder
        compiles an advance per row count, so few widths; a fixed batch of the widest prompts
        pads to a multiple of `bucket`)."""
        longest = max(len(x) for x in prompts)
        width = prompt_buckets(longest)[-1]
        room = self.target.config.max_position_embeddings - self.cfg.max_new_tokens
        width = max(min(width, room), longest)  # within the context where the prompts are
        if width not in self._slots:
            self._slots[width] = ContinuousDecoder(
                self.target, self.cfg, self.batch_size, width, self.chunk_steps
            )
        return self._slots[width]

    def slot_steps(self) -> dict[int, int]:
        """The loop steps the slot engine ran so far, per row count (`continuous`)."""
        total: dict[int, int] = {}
        for decoder in self._slots.values():
            for rows, n in decoder.steps.items():
                total[rows] = total.get(rows, 0) + n
        return total

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Compiles (and runs a step of) every program answering `prompts` would run, so that
        a timed call runs compiled programs only (`infer.bench.data_engines`)."""
        if self.engine == "slots":
            self._decoder(prompts).warm_up(prompts)
            return
        for rows in bucketed_batches([len(x) for x in prompts], self.batch_size):
            _decode_batch(
                self.target, [prompts[i] for i in rows], self.batch_size, self.bucket, self.cfg,
                jax.random.key(0), self.mesh, step_limit=1,
            )  # fmt: skip

    def __call__(self, prompts: list[list[int]], key, on_tokens=lambda n: None) -> list[list[int]]:
        if not prompts:
            return []
        if self.engine == "slots":
            seeds = jax.random.randint(key, (len(prompts),), 0, 2**31 - 1)
            return self._decoder(prompts).generate(prompts, np.asarray(seeds).tolist(), on_tokens)
        out: list[list[int] | None] = [None] * len(prompts)
        batches = bucketed_batches([len(x) for x in prompts], self.batch_size)
        for b, rows in enumerate(batches):
            answers = _decode_batch(
                self.target, [prompts[i] for i in rows], self.batch_size, self.bucket, self.cfg,
                jax.random.fold_in(key, b), self.mesh,
            )  # fmt: skip
            for i, answer in zip(rows, answers, strict=True):
                out[i] = answer
            on_tokens(sum(len(a) for a in answers))
        return out  # type: ignore[return-value]


def _answer_text(chat: ChatFormat, answer: list[int], stops: Sequence[int]) -> str:
    """An answer as the content of its assistant turn: without its stop token."""
    if answer and answer[-1] in stops:
        answer = answer[:-1]
    return chat.tokenizer.decode(answer, skip_special_tokens=True).strip()


def answer_conversations(
    chat: ChatFormat,
    prompts: Sequence[Prompt],
    answer: Callable[[list[list[int]], int], list[list[int]]],
    *,
    stops: Sequence[int],
    max_prompt_tokens: int,
) -> list[dict | str]:
    """Every assistant turn of every conversation regenerated, in order, each given the
    conversation so far with the earlier turns regenerated (`prompts.answer_points`):
    `answer(prompt ids, round)` answers one round, the r-th turn of every conversation still
    going. A conversation stops early when a turn's prompt passes `max_prompt_tokens`.
    -> per prompt: its record (tokens = the last turn's prompt + its answer; loss_mask 1 on
    every regenerated turn, stop tokens included, and on no user or system token), or
    "too_long_prompt" when its first turn's prompt is too long."""
    inputs = [p.chat() for p in prompts]
    points = [answer_points(m) for m in inputs]
    history: list[list[dict]] = [[] for _ in prompts]
    last: list[tuple[list[int], list[int], list[int]] | None] = [None] * len(prompts)
    going = [i for i in range(len(prompts)) if points[i]]
    for round_index in itertools.count():
        asks, rows = [], []
        for i in going:
            start = points[i][round_index - 1] + 1 if round_index else 0
            context = history[i] + [
                m for m in inputs[i][start : points[i][round_index]] if m["role"] != "assistant"
            ]
            ids, mask = chat.conversation_ids(context, stops)
            if len(ids) > max_prompt_tokens:
                continue
            history[i] = context
            asks.append(ids)
            rows.append((i, ids, mask))
        if not asks:
            break
        answers = answer(asks, round_index)
        going = []
        for (i, ids, mask), response in zip(rows, answers, strict=True):
            last[i] = (ids, mask, response)
            history[i] = history[i] + [
                {"role": "assistant", "content": _answer_text(chat, response, stops)}
            ]
            if round_index + 1 < len(points[i]):
                going.append(i)
    out: list[dict | str] = []
    for prompt, final, turns in zip(prompts, last, history, strict=True):
        if final is None:
            out.append("too_long_prompt")
            continue
        ids, mask, response = final
        record = {
            "tokens": ids + response,
            "loss_mask": mask + [1] * len(response),
            "source": prompt.source,
            "prompt": prompt.text,
        }
        if prompt.messages:
            record["turns"] = sum(m["role"] == "assistant" for m in turns)
        out.append(record)
    return out


def generate_records(
    target,
    chat: ChatFormat,
    prompts: Sequence[Prompt],
    out_dir: str | os.PathLike,
    *,
    fmt: str = "arrayrecord",
    batch_size: int = 8,
    max_new_tokens: int = 384,
    max_prompt_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_loss_tokens: int = 32,
    prompts_per_shard: int = 512,
    bucket: int = 32,
    seed: int = 0,
    mesh=None,
    process_index: int = 0,
    process_count: int = 1,
    engine: str = "fixed",
) -> dict:
    """Answers every prompt (or conversation: `answer_conversations`) not yet covered in
    `out_dir` and writes shards; -> counts.

    Drops prompts longer than `max_prompt_tokens` and records with fewer than `min_loss_tokens`
    answer tokens (2 x block_size in the recipe). `engine` and `batch_size` (the rows decoding
    together) as `Answerer` takes them; decodes on `mesh` (this process's devices) when given.
    With process_count > 1 this process takes its share of `prompts` (the module docstring says
    which). Each shard's manifest records the thinking mode (`ChatFormat.thinking_mode`); a
    rerun in another mode into the same directory is refused.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not supported (supported: {sorted(FORMATS)})")
    out_dir = paths.path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done, shard_index, modes = _read_manifests(out_dir)
    thinking = chat.thinking_mode()
    if modes - {thinking}:
        raise ValueError(
            f"{out_dir} holds data generated with thinking {sorted(modes)}, this run's is "
            f"{thinking}: one directory holds one mode; pick another --output"
        )
    # By position in the whole list, so a rerun gives every process the same share.
    prompts = prompts[process_index::process_count]
    todo = [p for p in prompts if _prompt_key(p) not in done]
    logging.info(
        "%d prompts, %d already done, %d to generate",
        len(prompts),
        len(prompts) - len(todo),
        len(todo),
    )
    stops = tuple(sorted(set(target.config.eos_token_ids)))
    decode_config = DecodeConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_token_ids=stops,
    )  # fmt: skip
    answerer = Answerer(
        target, decode_config, engine=engine, batch_size=batch_size, bucket=bucket,
        max_prompt_tokens=max_prompt_tokens, mesh=mesh,
    )  # fmt: skip
    counts = {"written": 0, "too_long_prompt": 0, "short_response": 0, "loss_tokens": 0}
    key = jax.random.fold_in(jax.random.key(seed), shard_index)
    suffix = ""
    if process_count > 1:
        key = jax.random.fold_in(key, process_index)  # samples differ between processes
        suffix = f"-p{process_index}of{process_count}"
    bar = tqdm.tqdm(
        total=len(todo),
        desc="generate" + suffix,
        unit="record",
        dynamic_ncols=True,
        position=process_index,
    )
    started, tokens = time.perf_counter(), 0

    def on_tokens(n: int) -> None:
        nonlocal tokens
        tokens += n
        rate = tokens / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(tokens=tokens, tok_s=f"{rate:.1f}", refresh=True)

    for start in range(0, len(todo), prompts_per_shard):
        chunk = todo[start : start + prompts_per_shard]
        shard_counts = dict.fromkeys(counts, 0)
        shard_key = jax.random.fold_in(key, start)
        results = answer_conversations(
            chat, chunk,
            lambda asks, r, k=shard_key: answerer(asks, jax.random.fold_in(k, r), on_tokens),
            stops=stops, max_prompt_tokens=max_prompt_tokens,
        )  # fmt: skip
        records = []
        for result in results:
            if isinstance(result, str):
                shard_counts[result] += 1
            elif sum(result["loss_mask"]) < min_loss_tokens:
                shard_counts["short_response"] += 1
            else:
                records.append(result)
                shard_counts["loss_tokens"] += sum(result["loss_mask"])
        bar.update(len(chunk))
        shard_counts["written"] = len(records)
        stem = f"{SHARD_PREFIX}{shard_index:05d}{suffix}"
        manifest = {
            "prompt_keys": [_prompt_key(p) for p in chunk],
            "counts": shard_counts,
            "thinking": thinking,
        }
        with paths.written_locally(out_dir / f"{stem}.json") as tmp:
            tmp.write_text(json.dumps(manifest))
        write_shard(out_dir / f"{stem}{FORMATS[fmt]}", records)
        for name, value in shard_counts.items():
            counts[name] += value
        shard_index += 1
    bar.close()
    counts["tokens_per_s"] = round(tokens / max(time.perf_counter() - started, 1e-9), 2)
    return counts


def source_kind(source: str) -> str:
    """`stdlib:json/x.py` -> `stdlib`; `math:template` -> `math`; `self` -> `self`."""
    return source.split(":", 1)[0]


def mixture(out_dir: str | os.PathLike) -> dict:
    """Records and response (loss) tokens per prompt source over every shard in `out_dir`."""
    out_dir = paths.path(out_dir)
    kinds: dict[str, dict[str, int]] = {}
    for suffix in FORMATS.values():
        for shard in sorted(out_dir.glob(f"{SHARD_PREFIX}*{suffix}")):
            for record in read_shard(shard):
                k = kinds.setdefault(source_kind(record["source"]), {"records": 0, "tokens": 0})
                k["records"] += 1
                k["tokens"] += int(sum(record["loss_mask"]))
    total = {
        "records": sum(k["records"] for k in kinds.values()),
        "tokens": sum(k["tokens"] for k in kinds.values()),
    }
    return {"sources": dict(sorted(kinds.items())), "total": total}
