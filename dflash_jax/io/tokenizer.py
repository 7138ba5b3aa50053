"""Tokenizers for targets (an HF directory's tokenizer files, or the one embedded in a GGUF),
and a prompt rendered into token ids with one (`render_prompt`)."""

from __future__ import annotations

import logging
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class _NoTorchNoticeFilter(logging.Filter):
    """Drops the warning `import transformers` logs when torch is absent ("PyTorch was not
    found. Models won't be available and only tokenizers, configuration and file/data utilities
    can be used."): dflash-jax uses transformers for tokenizers only, which need no torch, and
    the notice reads like an error. Every other transformers record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.name == "transformers"
            and record.getMessage().startswith("PyTorch was not found.")
        )


def _drop_no_torch_notice() -> None:
    # On the "transformers" logger itself (where transformers/__init__.py logs it), before
    # transformers is imported: this module imports it lazily, as does target_cache.
    logger = logging.getLogger("transformers")
    if not any(type(f).__name__ == _NoTorchNoticeFilter.__name__ for f in logger.filters):
        logger.addFilter(_NoTorchNoticeFilter())


_drop_no_torch_notice()


def load_hf_tokenizer(directory: str | Path):
    """The directory's tokenizer (a fast tokenizer), or None when it ships no tokenizer files."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


# Tokenizers converted from GGUF files that ship inside this package, by the GGUF's file stem:
# transformers' GGUF reader imports torch, which the runtime does not install. Each was written
# by `load_gguf_tokenizer` itself (transformers' conversion, then save_pretrained); a test checks
# that it still encodes and renders chats exactly as that conversion does.
SHIPPED_TOKENIZERS = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer embedded in a GGUF file (transformers converts it, offline), chat template
    included; the shipped conversion for a GGUF this package ships one for."""
    path = Path(path)
    shipped = SHIPPED_TOKENIZERS / path.stem
    if shipped.is_dir():
        return load_hf_tokenizer(shipped)
    return convert_gguf_tokenizer(path)


def convert_gguf_tokenizer(path: str | Path):
    """transformers' conversion of a GGUF file's tokenizer metadata (needs torch: transformers'
    GGUF reader imports it)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except ModuleNotFoundError as e:
        raise OSError(
            f"{path}: reading a GGUF file's tokenizer needs torch (transformers' GGUF reader "
            f"imports it); install torch, or load the model from an HF directory ({e})"
        ) from e


def render_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """Token ids of one prompt: the chat template with the generation prompt (encoded without
    extra special tokens, as the reference does), or the raw text. `prompt` may be a string
    (one user turn) or a list of chat messages."""
    if tokenizer is None:
        raise ValueError("this target has no tokenizer: pass token ids instead of text")
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target's tokenizer has no chat template; use chat=False")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        if not isinstance(prompt, str):
            raise ValueError("a list of chat messages needs chat=True")
        text = prompt
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    return ids


THINKING_MODES = ("off", "on", "template")
TRAINING_DATA_FILE = "training_data.json"  # in an exported drafter: the data's thinking mode


def takes_thinking(chat_template: str | None) -> bool:
    """Whether a chat template reads `enable_thinking` (Qwen3 style)."""
    return bool(chat_template) and "enable_thinking" in chat_template


def thinking_kwargs(chat_template: str | None, mode: str) -> dict:
    """The extra `apply_chat_template` arguments of thinking `mode` (off, on or template: the
    template's own default); ValueError when on/off is asked of a template without the switch."""
    if mode not in THINKING_MODES:
        raise ValueError(f"thinking mode {mode!r}: one of {THINKING_MODES}")
    if mode == "template":
        return {}
    if not takes_thinking(chat_template):
        raise ValueError(
            f"thinking={mode} asks the chat template for enable_thinking, but this target's "
            "template has no such switch; use thinking=template"
        )
    return {"enable_thinking": mode == "on"}


def resolved_thinking(tokenizer, chat_template: str | None, mode: str = "template") -> str:
    """`mode` as the template applies it: on or off (template: its default, found by rendering
    one turn both ways), or "none" for a template without the switch."""
    if not takes_thinking(chat_template):
        return "none"
    if mode != "template":
        return mode

    def render(**kw) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=chat_template, tokenize=False,
            add_generation_prompt=True, **kw,
        )  # fmt: skip

    default = render()
    if default == render(enable_thinking=True):
        return "on"
    return "off" if default == render(enable_thinking=False) else "none"
