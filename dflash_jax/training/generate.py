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
import json
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
import tqdm
from absl import logging
from etils import epath

from dflash_jax.decoding import autoregressive_decode
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import paths
from dflash_jax.training.data import FORMATS, SHARD_PREFIX, read_shard, write_shard
from dflash_jax.training.prompts import Prompt, dedupe

SENTINEL = "\u2063SENTINEL\u2063"


class ChatFormat:
    """The target's chat template applied as at inference time."""

    def __init__(self, tokenizer, chat_template: str | None):
        if chat_template is None:
            raise ValueError("the target has no chat template; training data needs one")
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.encode(self.render([{"role": "user", "content": prompt}], True))

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
    return hashlib.sha1(f"{prompt.source}\n{prompt.text}".encode()).hexdigest()


def _bucketed_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
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


def _read_manifests(out_dir: epath.Path) -> tuple[set[str], int]:
    """-> (keys of prompts covered by complete shards, next shard index)."""
    done: set[str] = set()
    next_index = 0
    for manifest in sorted(out_dir.glob(f"{SHARD_PREFIX}*.json")):
        index = int(manifest.stem.split("-")[1])
        if any((out_dir / f"{manifest.stem}{s}").exists() for s in FORMATS.values()):
            done.update(json.loads(manifest.read_text())["prompt_keys"])
            next_index = max(next_index, index + 1)
    return done, next_index


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
    min_loss_tokens: int = 32,
    prompts_per_shard: int = 512,
    bucket: int = 32,
    seed: int = 0,
    mesh=None,
    process_index: int = 0,
    process_count: int = 1,
) -> dict:
    """Answers every prompt not yet covered in `out_dir` and writes shards; -> counts.

    Drops prompts longer than `max_prompt_tokens` and responses with fewer than
    `min_loss_tokens` tokens (2 x block_size in the recipe). Decodes on `mesh` (this process's
    devices) when given. With process_count > 1 this process takes its share of `prompts`
    (the module docstring says which).
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not supported (supported: {sorted(FORMATS)})")
    out_dir = paths.path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done, shard_index = _read_manifests(out_dir)
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
        max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stops
    )
    counts = {"written": 0, "too_long_prompt": 0, "short_response": 0, "loss_tokens": 0}
    key = jax.random.fold_in(jax.random.key(seed), shard_index)
    suffix = ""
    if process_count > 1:
        key = jax.random.fold_in(key, process_index)  # samples differ between processes
        suffix = f"-p{process_index}of{process_count}"
    bar = tqdm.tqdm(
        total=len(todo),
        desc="generate" + suffix,
        unit="prompt",
        dynamic_ncols=True,
        position=process_index,
    )
    for start in range(0, len(todo), prompts_per_shard):
        chunk = todo[start : start + prompts_per_shard]
        ids = [chat.prompt_ids(p.text) for p in chunk]
        fits = [i for i, x in enumerate(ids) if len(x) <= max_prompt_tokens]
        shard_counts = dict.fromkeys(counts, 0)
        shard_counts["too_long_prompt"] = len(chunk) - len(fits)
        bar.update(len(chunk) - len(fits))
        records = []
        for batch_index, batch in enumerate(
            _bucketed_batches([len(ids[i]) for i in fits], batch_size)
        ):
            rows = [fits[j] for j in batch]
            responses = _decode_batch(
                target,
                [ids[i] for i in rows],
                batch_size,
                bucket,
                decode_config,
                jax.random.fold_in(key, start + batch_index),
                mesh,
            )
            for i, response in zip(rows, responses, strict=True):
                if len(response) < min_loss_tokens:
                    shard_counts["short_response"] += 1
                    continue
                records.append(
                    {
                        "tokens": ids[i] + response,
                        "loss_mask": [0] * len(ids[i]) + [1] * len(response),
                        "source": chunk[i].source,
                        "prompt": chunk[i].text,
                    }
                )
                shard_counts["loss_tokens"] += len(response)
            bar.update(len(rows))
        shard_counts["written"] = len(records)
        stem = f"{SHARD_PREFIX}{shard_index:05d}{suffix}"
        manifest = {"prompt_keys": [_prompt_key(p) for p in chunk], "counts": shard_counts}
        with paths.written_locally(out_dir / f"{stem}.json") as tmp:
            tmp.write_text(json.dumps(manifest))
        write_shard(out_dir / f"{stem}{FORMATS[fmt]}", records)
        for name, value in shard_counts.items():
            counts[name] += value
        shard_index += 1
    bar.close()
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
