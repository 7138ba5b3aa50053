"""Counts a corpus table for corpus lookup (`decoding.corpus`) from the target's answers and
writes it beside a drafter's params, where `load_drafter` finds it: the decodes' copy steps
then copy from the target's own past phrasing where the text so far has nothing to copy.

    python -m train.build_corpus --data=data/smollm2 --drafter=runs/smollm2/drafter

The data: `train.generate_data` shards (the drafter's own training data is the natural choice:
the target's answers; only answer tokens are counted as continuations). The table holds, for
every 1..--max_ngram-token n-gram followed by an answer token, the --continuation tokens that
most often followed it, and the hash of the --tokenizer's vocabulary (a decode with another
tokenizer refuses the table). Counting streams: records are counted in chunks whose counts go
to hash shards on local disk, folded shard by shard, so memory stays bounded however large the
data (`io.corpus_table.build_table`). The --drafter directory may be local or a URL; a hub id's
(a snapshot in the hub's cache, replaced by its next revision) is refused: copy it first
(`infer.convert --format=orbax`). The shipped drafter's table (`--drafter=default`) was
counted from `data/smollm2` with the defaults (docs/decoding.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from absl import app, flags

from dflash_jax.io import assets, corpus_table, paths
from dflash_jax.io.drafter_io import drafter_directory, read_drafter
from dflash_jax.io.tokenizer import load_hf_tokenizer
from dflash_jax.ops.ngrams import CORPUS_FILE
from dflash_jax.training import data
from infer import cli

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "data", None,
    "train.generate_data output: directories, shard files or globs (comma-separated).",
    required=True,
)  # fmt: skip
flags.DEFINE_string(
    "drafter", None,
    "Drafter directory (local or a URL) to write the table into (corpus_ngrams.npz, beside its "
    "params), or 'default' (the shipped one); the drafter gives the vocabulary size. A hub id "
    "is refused: copy it with python -m infer.convert --format=orbax and pass the copy.",
    required=True,
)  # fmt: skip
flags.DEFINE_string(
    "tokenizer", assets.SMOLLM2_NAME,
    "The target's tokenizer, whose ids the data holds (its vocabulary's hash goes into the "
    "table): 'smollm2-135m-instruct' (embedded), a directory of HF tokenizer files, or a target "
    "as infer's --target takes it (loaded for its tokenizer).",
)  # fmt: skip
flags.DEFINE_integer("max_ngram", corpus_table.MAX_NGRAM, "Longest n-gram counted.", lower_bound=1)
flags.DEFINE_integer(
    "continuation", corpus_table.CONTINUATION,
    "Tokens kept after each n-gram (a copy step of block b proposes b - 1; longer copies "
    "continue from their own tail).",
    lower_bound=1,
)  # fmt: skip
flags.DEFINE_integer(
    "min_count", 1, "Keep an n-gram's continuation when seen at least this often.", lower_bound=1
)
flags.DEFINE_integer(
    "chunk_rows", corpus_table.CHUNK_ROWS,
    "Rows (n-gram, continuation) counted in memory at a time before their counts go to disk: "
    "the bound on the count's memory (about 100 bytes a row at the peak).",
    lower_bound=1,
)  # fmt: skip

_SHIPPED_TOKENIZER = (
    Path(assets.__file__).resolve().parents[1] / "assets/tokenizers/SmolLM2-135M-Instruct.Q4_1"
)


def load_tokenizer(source: str):
    """--tokenizer: the embedded SmolLM2 one, a directory of HF files, else a target's."""
    if source == assets.SMOLLM2_NAME:
        return load_hf_tokenizer(_SHIPPED_TOKENIZER)
    if Path(source).is_dir() and any(Path(source).glob("tokenizer*")):
        return load_hf_tokenizer(source)
    from dflash_jax.io import load_target

    return load_target(source).tokenizer


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    source = FLAGS.drafter
    if source != "default" and not paths.path(source).exists() and source.count("/") == 1:
        raise app.UsageError(
            f"--drafter={source}: a hub id's directory is a snapshot in the hub's cache, which "
            "its next revision replaces; copy it first (python -m infer.convert "
            f"--source={source} --output=DIR --format=orbax) and pass --drafter=DIR"
        )
    directory = drafter_directory(source)
    vocab = read_drafter(directory, corpus=False).config.vocab_size  # any format decodes read
    vocab_hash = corpus_table.vocabulary_hash(load_tokenizer(FLAGS.tokenizer))
    try:
        shards = data.expand_paths(FLAGS.data)
    except FileNotFoundError as e:
        raise app.UsageError(f"--data: {e}") from e
    t0 = time.perf_counter()
    records = (
        (np.asarray(r["tokens"]), np.asarray(r["loss_mask"]))
        for shard in shards
        for r in data.read_shard(shard)
    )
    table = corpus_table.build_table(
        records, vocab, FLAGS.max_ngram, FLAGS.continuation, FLAGS.min_count,
        source=f"{len(shards)} shards of {','.join(FLAGS.data)}", vocab_hash=vocab_hash,
        chunk_rows=FLAGS.chunk_rows,
    )  # fmt: skip
    out = paths.path(directory) / CORPUS_FILE
    corpus_table.save_table(table, out)
    print(
        f"wrote {out}: {table.keys.size:,} n-grams (1-{table.max_ngram} tokens, "
        f"{table.continuation} after each) from {len(shards)} shards in "
        f"{time.perf_counter() - t0:.1f} s, {out.stat().length / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    cli.run(main)
