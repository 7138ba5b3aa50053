"""A character-level ChatML tokenizer (a transformers fast tokenizer with a chat template),
for tiny random targets that must read and write text: every printable character is one token,
after the three special tokens (ids 0-2; 2 is <|im_end|>, the end of a turn)."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3's switch, small: thinking on unless enable_thinking is false, which puts an empty think
# block in the generation prompt.
QWEN3_STYLE = CHATML.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is "
    "false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}",
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer(chat_template: str | None = None):
    """The tokenizer; with `chat_template`, that template on it."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", additional_special_tokens=SPECIALS
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast
