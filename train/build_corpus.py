"""Counts a corpus table for corpus lookup (`decoding.corpus`) from the target's answers and
writes it into a drafter directory, where `load_drafter` finds it: the decodes' copy steps then
copy from the target's own past phrasing where the text so far has nothing to copy.

    python -m train.build_corpus --data=data/smollm2 --drafter=runs/smollm2/drafter

The data: `train.generate_data` shards (the drafter's own training data is the natural choice:
the target's answers; only answer tokens are counted as continuations). The table holds, for
every 1..--max_ngram-token n-gram followed by an answer token, the --continuation tokens that
most often followed it. The shipped drafter's table (`--drafter=default`) was counted from
`data/smollm2` with the defaults (docs/decoding.md).
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from dflash_jax.io import corpus_table, paths
from dflash_jax.io.drafter_io import drafter_directory, read_drafter
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
    "Drafter directory to write the table into (corpus_ngrams.npz), or 'default' (the shipped "
    "one); the drafter gives the vocabulary size.",
    required=True,
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    directory = drafter_directory(FLAGS.drafter)
    vocab = read_drafter(directory).config.vocab_size  # any format the decodes read
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
        source=f"{len(shards)} shards of {','.join(FLAGS.data)}",
    )  # fmt: skip
    out = directory / CORPUS_FILE
    corpus_table.save_table(table, out)
    print(
        f"wrote {out}: {table.keys.size:,} n-grams (1-{table.max_ngram} tokens, "
        f"{table.continuation} after each) from {len(shards)} shards in "
        f"{time.perf_counter() - t0:.1f} s, {paths.path(out).stat().length / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    cli.run(main)
