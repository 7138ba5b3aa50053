"""The embedded target's tokenizer ships converted (transformers' GGUF reader needs torch, which
the runtime does not install): it must encode, decode and render chats exactly as transformers'
own conversion of the GGUF does."""

import pytest

from dflash_jax.io import assets
from dflash_jax.io.tokenizer import SHIPPED_TOKENIZERS, convert_gguf_tokenizer, load_gguf_tokenizer

TEXTS = [
    "Write a Python function that checks whether a number is prime.",
    "def f(x):\n    return x ** 2  # squares\n\n\tprint(f(12345))",
    "Ünïcödé, emoji 🚀, CJK 漢字, and  double  spaces.",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def pair():
    gguf = assets.smollm2_gguf_path()
    assert (SHIPPED_TOKENIZERS / gguf.stem).is_dir()
    return load_gguf_tokenizer(gguf), convert_gguf_tokenizer(gguf)


def test_shipped_tokenizer_encodes_and_decodes_as_the_gguf_conversion(pair):
    shipped, converted = pair
    assert len(shipped) == len(converted)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(shipped, attr) == getattr(converted, attr), attr
    for text in TEXTS:
        ids = converted.encode(text, add_special_tokens=False)
        assert shipped.encode(text, add_special_tokens=False) == ids, text
        assert shipped.decode(ids) == converted.decode(ids)


def test_shipped_tokenizer_renders_chats_as_the_gguf_conversion(pair):
    shipped, converted = pair
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": TEXTS[0]},
        {"role": "assistant", "content": TEXTS[1]},
        {"role": "user", "content": TEXTS[2]},
    ]
    for messages in (chat[1:2], chat):
        kw = dict(tokenize=False, add_generation_prompt=True)
        assert shipped.apply_chat_template(messages, **kw) == converted.apply_chat_template(
            messages, **kw
        )
