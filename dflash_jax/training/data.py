"""Training records on disk and the grain pipeline that turns them into batches.

A record is one conversation: `tokens` (prompt rendered with the chat template + the target's
own response), `loss_mask` (1 on response tokens only), `source` (where the prompt came from)
and `prompt` (its text, used to resume generation and to audit overlap). Shards are ArrayRecord
files of JSON-encoded records, or `.jsonl` with the same JSON on each line.

Pipeline (deterministic, checkpointable with the iterator state):
  records -> hold out `num_eval` -> shuffle(seed, reshuffled each epoch) -> repeat(epochs)
  -> pad/truncate to seq_len + sample anchors (rng from seed and the global element index, so
  anchors differ every epoch) -> batch(drop_remainder=True) -> crop to the batch's bucket.
Rows are padded, not packed: packing would let a block see another conversation's context.

Bucketing (`bucket_tokens` > 0): each global batch is cropped to its longest row rounded up to a
multiple of `bucket_tokens` (at most seq_len), and its anchor slots to the most valid anchors
any of its rows has, rounded up to a power of two (at most num_anchors), as SpecForge sizes a
batch by its longest row and its rows' anchor counts. Only padding is cut: a row's tokens past
its length and its invalid anchor slots (`anchors.sample_anchors` puts them last) never reach
the loss, and the target is causal, so a cropped batch's loss is the padded batch's. The crop
is a function of the global batch's records alone: deterministic, the same on any process
count, and nothing to save with the iterator. Each (tokens, anchors) shape compiles the step
once: at most (seq_len / bucket_tokens) x log2(num_anchors) programs, far fewer in practice.
One long row sets a batch's length, so the crop cuts little from batches of rows drawn at
random; length grouping (`group_batches` G > 0) batches records of similar length: each window
of G batches' records (in the shuffled stream) is sorted by length, cut into batches, and those
batches are taken in a random order. Still deterministic (a function of the seed and the
records), the same on any process count, and every record is read once per epoch as before.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from dflash_jax.io import jsonl, paths
from dflash_jax.training.anchors import anchor_candidates, sample_anchors

ARRAY_RECORD_SUFFIX = ".array_record"
JSONL_SUFFIX = ".jsonl"
FORMATS = {"arrayrecord": ARRAY_RECORD_SUFFIX, "jsonl": JSONL_SUFFIX}
SHARD_PREFIX = "data-"  # a directory's shards; other jsonl files there (prompt lists) are not


def encode_record(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()


def decode_record(data: bytes | str) -> dict:
    return json.loads(data)


def _suffix(path: str | os.PathLike) -> str:
    return os.path.splitext(os.fspath(path))[1]


def _check_format(path) -> None:
    if _suffix(path) not in FORMATS.values():
        raise ValueError(
            f"{path}: unknown shard format; expected a {sorted(FORMATS.values())} file"
        )


def write_shard(path: str | os.PathLike, records: Sequence[dict]) -> None:
    """Writes a whole shard in one step (`paths.written_locally`: a temporary file, then a rename
    or one upload): a killed run leaves either a complete shard or none. The format follows the
    suffix; `path` may be a URL."""
    path = paths.path(path)
    _check_format(path)
    with paths.written_locally(path) as tmp:
        if path.suffix == ARRAY_RECORD_SUFFIX:
            writer = ArrayRecordWriter(str(tmp), "group_size:1")
            for record in records:
                writer.write(encode_record(record))
            writer.close()
        else:
            with open(tmp, "wb") as f:
                for record in records:
                    f.write(encode_record(record) + b"\n")


def read_shard_bytes(path: str | os.PathLike) -> list[bytes]:
    path = paths.path(path)
    _check_format(path)
    if path.suffix == ARRAY_RECORD_SUFFIX:
        reader = ArrayRecordReader(str(path))  # reads gs:// itself
        out = reader.read_all()
        reader.close()
        return list(out)
    return [line for line in path.read_bytes().splitlines() if line.strip()]


def read_shard(path: str | os.PathLike) -> list[dict]:
    return [decode_record(b) for b in read_shard_bytes(path)]


def _glob(pattern: str) -> list[str]:
    """Files matching `pattern` (`*`, `?`, `[...]` in any part after the first), local or URL."""
    magic = re.search(r"[*?[]", pattern)
    if magic is None:
        return [pattern] if paths.path(pattern).exists() else []
    base = pattern[: magic.start()].rsplit("/", 1)[0]
    return [str(p) for p in paths.path(base or "/").glob(pattern[len(base) + 1 :])]


def expand_paths(patterns: str | Iterable[str]) -> list[str]:
    """Comma-separated or listed globs/directories, local or URLs -> sorted shard files (a
    directory gives its `data-*` shards)."""
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p]
    files: set[str] = set()
    for pattern in patterns:
        where = paths.path(pattern)
        if where.is_dir():
            for suffix in FORMATS.values():
                files.update(_glob(str(where / f"{SHARD_PREFIX}*{suffix}")))
        else:
            files.update(_glob(str(where)))
    shards = sorted(f for f in files if _suffix(f) in FORMATS.values())
    if not shards:
        raise FileNotFoundError(
            f"no {sorted(FORMATS.values())} shards match {list(patterns)}: give "
            "train.generate_data's output directory or shard files (globs, comma-separated)"
        )
    return shards


def data_thinking(shards: Sequence[str]) -> str | None:
    """The thinking mode the manifests beside `shards` record (on, off or none), None when none
    records one; ValueError when they disagree (data made in two modes)."""
    modes = set()
    for shard in shards:
        path = paths.path(shard)
        stem = path.name.split(".")[0]
        manifest = path.parent / f"{stem}.json"
        if manifest.exists():
            mode = json.loads(manifest.read_text()).get("thinking")
            if mode is not None:
                modes.add(mode)
    if len(modes) > 1:
        raise ValueError(
            f"the training shards were generated in different thinking modes {sorted(modes)}; "
            "train on data of one mode (the mode the drafter will serve)"
        )
    return modes.pop() if modes else None


def _checked_jsonl(path) -> list[bytes]:
    """A jsonl shard's records, each checked once to be a record object (`file:line` named)."""
    expected = 'a record {"tokens": [...], "loss_mask": [...]} per line (train.generate_data)'
    lines = jsonl.numbered_lines(paths.path(path).read_bytes().splitlines())
    for i, line in lines:
        record = jsonl.parse_line(line, f"{path}:{i}", expected)
        if not ("tokens" in record and "loss_mask" in record):
            raise ValueError(f"{path}:{i}: no 'tokens' and 'loss_mask'; expected {expected}")
    return [line for _, line in lines]


def record_source(shards: Sequence[str]) -> Sequence[bytes]:
    """A random-access source of encoded records over all shards (ArrayRecord read lazily,
    jsonl held in memory)."""
    suffixes = {_suffix(p) for p in shards}
    if suffixes == {ARRAY_RECORD_SUFFIX}:
        return grain.sources.ArrayRecordDataSource([str(p) for p in shards])
    if suffixes == {JSONL_SUFFIX}:
        return [line for p in shards for line in _checked_jsonl(p)]
    raise ValueError(
        f"shards must all be ArrayRecord or all jsonl, got suffixes {sorted(suffixes)}"
    )


def record_element(record: dict, index: int) -> dict:
    """A decoded record as the pipeline's element: {"tokens": int32 [L], "loss_mask": int32 [L],
    "index": int32 []} (the index finds the record's cached taps)."""
    return {
        "tokens": np.asarray(record["tokens"], np.int32),
        "loss_mask": np.asarray(record["loss_mask"], np.int32),
        "index": np.int32(index),
    }


class ParseRecord(grain.transforms.Map):
    """Source index -> {"tokens": int32 [L], "loss_mask": int32 [L], "index": int32 []}; the
    index finds the record's cached taps."""

    def __init__(self, source: Sequence[bytes]):
        self.source = source

    def map(self, element) -> dict:
        index = int(element)
        return record_element(decode_record(self.source[index]), index)


class PadAndSampleAnchors(grain.transforms.RandomMap):
    """Truncates/pads a record to `seq_len` and samples its anchors.

    -> tokens, loss_mask int32 [S]; length int32 []; anchors int32 [N]; anchor_valid bool [N].
    """

    def __init__(self, seq_len: int, num_anchors: int):
        self.seq_len = seq_len
        self.num_anchors = num_anchors

    def random_map(self, element: dict, rng: np.random.Generator) -> dict:
        length = min(len(element["tokens"]), self.seq_len)
        tokens = np.zeros((self.seq_len,), np.int32)
        loss_mask = np.zeros((self.seq_len,), np.int32)
        tokens[:length] = element["tokens"][:length]
        loss_mask[:length] = element["loss_mask"][:length]
        anchors, valid = sample_anchors(loss_mask, length, self.num_anchors, rng)
        return {
            "index": element["index"],
            "tokens": tokens,
            "loss_mask": loss_mask,
            "length": np.int32(length),
            "anchors": anchors,
            "anchor_valid": valid,
        }


def bucket_shape(
    max_length: int, max_anchors: int, seq_len: int, num_anchors: int, bucket_tokens: int
) -> tuple[int, int]:
    """(tokens, anchor slots) a batch is cropped to (module docstring): its longest row rounded
    up to a multiple of `bucket_tokens` (at most seq_len), its most valid anchors rounded up to
    a power of two (at most num_anchors); (seq_len, num_anchors) when `bucket_tokens` is 0."""
    if not bucket_tokens:
        return seq_len, num_anchors
    tokens = min(seq_len, bucket_tokens * max(1, -(-int(max_length) // bucket_tokens)))
    anchors = min(num_anchors, 1 << max(0, int(max_anchors) - 1).bit_length())
    return tokens, anchors


class RowExtent(grain.transforms.Map):
    """A parsed record -> int64 [2]: its (length, valid anchors) once padded to `seq_len`, what
    its row needs of a batch's shape (anchors are sampled from min(num_anchors, candidates))."""

    def __init__(self, seq_len: int, num_anchors: int):
        self.seq_len, self.num_anchors = seq_len, num_anchors

    def map(self, element: dict) -> np.ndarray:
        length = min(len(element["tokens"]), self.seq_len)
        candidates = anchor_candidates(np.asarray(element["loss_mask"][:length]), length)
        return np.array([length, min(self.num_anchors, candidates.size)])


def crop_batch(batch: dict, tokens: int, anchors: int) -> dict:
    """`batch` with its token axis cut to `tokens` (tokens, loss_mask, taps) and its anchor axis
    to `anchors` (anchors, anchor_valid)."""
    out = dict(batch)
    for key in ("tokens", "loss_mask", "taps"):
        if key in out:
            out[key] = out[key][:, :tokens]
    for key in ("anchors", "anchor_valid"):
        out[key] = out[key][:, :anchors]
    return out


class CropToBucket(grain.transforms.Map):
    """A batch (all of the global batch's rows: one process) cropped to its `bucket_shape`."""

    def __init__(self, seq_len: int, num_anchors: int, bucket_tokens: int):
        self.sizes = (seq_len, num_anchors, bucket_tokens)

    def map(self, batch: dict) -> dict:
        valid = int(np.max(np.sum(batch["anchor_valid"], axis=1)))
        shape = bucket_shape(int(np.max(batch["length"])), valid, *self.sizes)
        return crop_batch(batch, *shape)


class CropShard(grain.transforms.Map):
    """Step k -> this process's part of global batch k (`local[k]`), cropped to the global
    batch's `bucket_shape`, which the global batch's row extents (`extents[k]`, [rows, 2])
    give: every process crops its rows alike without seeing the others' arrays."""

    def __init__(self, local, extents, seq_len: int, num_anchors: int, bucket_tokens: int):
        self.local, self.extents = local, extents
        self.sizes = (seq_len, num_anchors, bucket_tokens)

    def map(self, step) -> dict:
        step = int(step)
        longest, valid = np.max(np.asarray(self.extents[step]), axis=0)
        return crop_batch(self.local[step], *bucket_shape(longest, valid, *self.sizes))


class GroupedRecord(grain.transforms.Map):
    """Index i of the record stream -> the record that length grouping puts there: the stream
    in windows of `group_batches` batches, each window's records sorted by length and cut into
    batches, the batches in a random order (from `seed` and the window); a last partial window
    keeps its order. A window's order is computed from its records' lengths once and cached."""

    def __init__(self, records, batch_size: int, group_batches: int, seq_len: int, seed: int):
        self.records, self.seq_len, self.seed = records, seq_len, seed
        self.batch_size, self.group_batches = batch_size, group_batches
        self.window = batch_size * group_batches
        self.orders: dict[int, np.ndarray] = {}

    def order(self, w: int) -> np.ndarray:
        """Window w's rows in their grouped order: int [group_batches * batch_size]."""
        order = self.orders.get(w)
        if order is None:
            start = w * self.window
            lengths = [len(self.records[start + j]["tokens"]) for j in range(self.window)]
            by_length = np.argsort(np.minimum(lengths, self.seq_len), kind="stable")
            batches = by_length.reshape(self.group_batches, self.batch_size)
            order = batches[np.random.default_rng((self.seed, w)).permutation(len(batches))]
            order = order.reshape(-1)
            # grain's reader threads work on a few windows at once; a lost race only means a
            # window's order (a function of w) is computed again.
            try:
                while len(self.orders) >= 8:
                    self.orders.pop(next(iter(self.orders)), None)
            except (RuntimeError, StopIteration):
                pass
            self.orders[w] = order
        return order

    def map(self, index) -> dict:
        w, row = divmod(int(index), self.window)
        if (w + 1) * self.window > len(self.records):
            return self.records[int(index)]
        return self.records[w * self.window + int(self.order(w)[row])]


class AttachTaps(grain.transforms.Map):
    """Adds the cached taps [seq_len, F] of the element's record (by its source `index`) from a
    `tap_cache.TapCache`."""

    def __init__(self, cache):
        self.cache = cache

    def map(self, element: dict) -> dict:
        return {**element, "taps": self.cache.row(int(element["index"]))}


def split_holdout(
    source: Sequence[bytes], num_eval: int, seed: int
) -> tuple[grain.MapDataset, list[dict]]:
    """A fixed random subset of `num_eval` records is held out (for evaluation prompts); the rest
    is the training set. -> (train MapDataset of parsed records, held-out decoded records)."""
    if len(source) <= num_eval:
        raise ValueError(f"{len(source)} records cannot spare {num_eval} for evaluation")
    ds = grain.MapDataset.range(len(source)).shuffle(seed=seed)
    held_out = [decode_record(source[ds[i]]) for i in range(num_eval)]
    return ds[num_eval:].map(ParseRecord(source)), held_out


def batched_dataset(
    train: grain.MapDataset,
    *,
    seq_len: int,
    num_anchors: int,
    batch_size: int,
    num_epochs: int,
    seed: int,
    tap_cache=None,
    shard_index: int = 0,
    shard_count: int = 1,
    bucket_tokens: int = 0,
    group_batches: int = 0,
) -> grain.MapDataset:
    """Shuffled, repeated, padded, anchor-sampled (with cached taps attached when `tap_cache` is
    a TapCache), batched and, with `bucket_tokens` > 0, each batch cropped to its bucket
    (module docstring); len() is the number of steps. `group_batches` G > 0: records of
    similar length are batched together (`GroupedRecord`: within each window of G batches),
    so that the crop cuts more.

    Several processes: with shard_count > 1 each element holds only rows
    [shard_index*n, (shard_index+1)*n) of the global batch (n = batch_size / shard_count), and
    only those records are read. The global batches (the shards in order) are those of one
    process, element for element: a run's losses do not depend on how many processes feed it.
    """
    if len(train) < batch_size:
        raise ValueError(f"{len(train)} training records do not fill one batch of {batch_size}")
    if batch_size % shard_count or not 0 <= shard_index < shard_count:
        raise ValueError(
            f"a batch of {batch_size} rows cannot be split into {shard_count} equal process "
            f"shards (shard {shard_index})"
        )
    records = train.shuffle(seed=seed).repeat(num_epochs)
    if group_batches:
        grouped = GroupedRecord(records, batch_size, group_batches, seq_len, seed)
        records = grain.MapDataset.range(len(records)).map(grouped)
    ds = records.random_map(PadAndSampleAnchors(seq_len, num_anchors), seed=seed)
    if tap_cache is not None:
        ds = ds.map(AttachTaps(tap_cache))
    ds = ds.batch(batch_size // shard_count, drop_remainder=True)
    if shard_count == 1:
        return ds.map(CropToBucket(seq_len, num_anchors, bucket_tokens)) if bucket_tokens else ds
    # Local batch k*count + index is this process's part of global batch k.
    steps = len(ds) // shard_count
    ds = ds[: steps * shard_count][shard_index::shard_count]
    if not bucket_tokens:
        return ds
    # The crop needs the whole global batch's extents: this process parses the other rows'
    # records too (their lengths and loss masks only; no anchors, taps or device arrays).
    extents = records.map(RowExtent(seq_len, num_anchors)).batch(batch_size, drop_remainder=True)
    crop = CropShard(ds, extents, seq_len, num_anchors, bucket_tokens)
    return grain.MapDataset.range(steps).map(crop)


def seek(data_iter: grain.DatasetIterator, step: int) -> None:
    """Moves an iterator of `batched_dataset(...).to_iter_dataset()` to where a run resumed at
    `step` reads next, without reading what comes before: element k of the dataset is (this
    process's part of) global batch k + 1 on any process count, and the iterator's state is
    the next element's index."""
    data_iter.set_state({"next_index": int(step)})


def prompt_tokens(record: dict) -> list[int]:
    """The prompt part of a record: every token before the first loss-masked one."""
    mask = record["loss_mask"]
    first = mask.index(1) if 1 in mask else len(mask)
    return record["tokens"][:first]
