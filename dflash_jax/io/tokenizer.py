"""Tokenizers for targets: an HF directory's tokenizer files, or the one embedded in a GGUF."""

from __future__ import annotations

from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_tokenizer(directory: str | Path):
    """The directory's tokenizer (a fast tokenizer), or None when it ships no tokenizer files."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer embedded in a GGUF file (transformers converts it, offline), chat template
    included; None when the file has no tokenizer metadata."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
