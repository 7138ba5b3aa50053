"""The server's incremental detokenization (`infer.serving.detokenize`): fed tokens a few at a
time, its text is the decode of all of them at once, multi-byte characters split across
tokens and special tokens included, and its character ends find a cut's tokens."""

import random

import pytest

from dflash_jax.io import assets
from dflash_jax.io.tokenizer import load_gguf_tokenizer
from infer.serving.detokenize import Detokenizer

TEXT = "Héllo wörld! 你好，世界 🚀🎉 def f(x):\n    return x ** 2  # ça va? 日本語 .<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(assets.smollm2_gguf_path())


def fed(tokenizer, ids, rng) -> Detokenizer:
    detok, i = Detokenizer(tokenizer), 0
    while i < len(ids):
        k = rng.randint(1, 4)
        detok.add(ids[i : i + k], final=i + k >= len(ids))
        i += k
    return detok


def test_incremental_text_is_the_whole_decode(tokenizer):
    """A real text (emoji and CJK split into byte tokens) and random token soups (bytes that
    never complete a character included: the last add flushes them as the decode does)."""
    rng = random.Random(0)
    soups = [[rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(20)]
    for ids in [tokenizer.encode(TEXT, add_special_tokens=False), *soups]:
        detok = fed(tokenizer, ids, rng)
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_ends_give_the_tokens_of_a_cut(tokenizer):
    """tokens_for(chars): the fewest leading tokens whose decode starts with the answer's
    first `chars` characters (half a character, decoded as U+FFFD, does not hold it)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = fed(tokenizer, ids, random.Random(1))
    for chars in range(len(detok.text) + 1):
        want = next(
            n for n in range(len(ids) + 1)
            if tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(detok.text[:chars])
        )  # fmt: skip
        assert detok.tokens_for(chars) == want, chars
