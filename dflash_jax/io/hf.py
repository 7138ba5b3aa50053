"""HF checkpoints: safetensors reading and the one table that turns HF-named tensors into the
`Transformer` param tree. The GGUF reader maps its tensors onto the same HF names, so both formats
share this conversion (and its checks).

HF Linear weights are [out, in]; our kernels are [in, out] with heads split out:
q_proj [D,N,H], k/v_proj [D,K,H], o_proj [N,H,D], gate/up [D,F], down [F,D], lm_head [D,V].
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.io import hf_layered


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the tensor, the file and the expectation."""


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor in a checkpoint file, read lazily. `shape` is the HF-layout shape."""

    name: str  # as spelled in the file
    file: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    # index (one slice per dim, steps of 1) -> that region, reading no more of the file than
    # it needs (GGUF: dequantising only its rows); None: read()[index] (a memory map's view).
    read_part: Callable[[tuple[slice, ...]], np.ndarray] | None = None
    # A GGUF tensor stored in a block scheme (Q4_0, Q4_1, Q8_0): its type's name and
    # `blocks()` -> (qvalue int8 [out, in], scale [out, in/32], offset or None), HF layout.
    ggml_type: str = ""
    blocks: Callable[[], tuple] | None = None

    def part(self, index: tuple[slice, ...]) -> np.ndarray:
        """The region `index` (one slice per dim) of the tensor, in HF layout."""
        return self.read()[index] if self.read_part is None else self.read_part(index)


# safetensors dtype codes; numpy has no bfloat16, hence ml_dtypes and our own header reader
# (safe_open(framework="numpy") refuses BF16, the dtype most targets ship in).
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _memmap(file: str, offset: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
    return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape)


def read_safetensors_header(file: str | Path) -> dict[str, StoredTensor]:
    """Tensor name -> StoredTensor (memory-mapped on read) for one .safetensors file."""
    file = str(file)
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        shape = tuple(int(d) for d in info["shape"])
        offset = 8 + header_len + int(info["data_offsets"][0])
        out[name] = StoredTensor(
            name, file, shape, lambda f=file, o=offset, d=dtype, s=shape: _memmap(f, o, d, s)
        )
    return out


def write_safetensors(
    file: str | Path,
    arrays: Mapping[str, Any],
    fill: Callable[[str, np.ndarray], None] | None = None,
) -> None:
    """Writes name -> numpy array (any dtype `read_safetensors_header` reads, bfloat16 included)
    as one .safetensors file, in the given order. Streams the arrays: safetensors' own
    `save_file` first copies them all into one bytes object, doubling peak memory.

    fill(name, out): the arrays may then be anything with a shape and a dtype (a sharded
    jax.Array); the file is sized first and `fill` writes each array into `out`, its region
    of the file memory-mapped, so no array need ever be whole in host memory."""
    codes = {np.dtype(d): code for code, d in _SAFETENSORS_DTYPES.items()}
    header, offset = {}, 0
    for name, w in arrays.items():
        dtype = np.dtype(w.dtype)
        if dtype not in codes:
            raise ValueError(f"{file}: array {name!r} has dtype {w.dtype}, not a safetensors dtype")
        nbytes = math.prod(w.shape) * dtype.itemsize
        header[name] = {
            "dtype": codes[dtype],
            "shape": list(w.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so the data starts 8-aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        if fill is None:
            for w in arrays.values():
                f.write(np.ascontiguousarray(w).reshape(-1).view(np.uint8))
            return
        f.truncate(8 + len(raw) + offset)
    for name, w in arrays.items():
        if math.prod(w.shape):  # a memory map cannot be empty
            start = 8 + len(raw) + header[name]["data_offsets"][0]
            out = np.memmap(file, np.dtype(w.dtype), "r+", start, tuple(w.shape))
            fill(name, out)
            out.flush()
            del out


def read_safetensors_dir(directory: str | Path) -> dict[str, StoredTensor]:
    """All tensors of an HF directory: `model.safetensors.index.json` (sharded) or
    `model.safetensors`."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        weight_map, files = {}, ["model.safetensors"]
    else:
        found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(found)}; convert them to safetensors)" if found else ""
        raise FileNotFoundError(
            f"{directory}: no model.safetensors or model.safetensors.index.json{hint}"
        )
    tensors: dict[str, StoredTensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"{index}: shard {name} is missing from {directory}")
        tensors.update(read_safetensors_header(path))
    for name, file in weight_map.items():
        if name not in tensors or Path(tensors[name].file).name != file:
            raise CheckpointError(f"{index}: tensor {name!r} is not in its listed shard {file}")
    return tensors


def canonical_name(name: str) -> str:
    """HF names with or without the `model.` prefix map to one spelling (without it)."""
    return name.removeprefix("model.")


def canonical_tensors(tensors: Mapping[str, StoredTensor], config: TargetConfig) -> dict:
    """A checkpoint's tensors by canonical name; for the MoE / hybrid families also renamed as
    `hf_layered.rename` does (experts stacked, a multimodal wrapper's language model)."""
    out = {canonical_name(n): t for n, t in tensors.items()}
    return hf_layered.rename(out, config, StoredTensor) if config.layered else out


# Buffers some older checkpoints carry; derived from the config, so never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# The transforms HF layout -> ours. Each converts a whole array (`__call__`, lazily on a memory
# map) and, given a region of ours, reads only the HF region it comes from (`part`): what lets
# a GGUF be dequantised slice by slice. A transform without `part` (any callable) is applied to
# the whole tensor's read() and sliced (see `Converted`).


def _slices(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """An index of slices (None bounds allowed, steps of 1) -> explicit [start, stop) slices."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


class _Keep:
    def __call__(self, w: np.ndarray) -> np.ndarray:
        return w

    def part(self, t: StoredTensor, index: tuple[slice, ...]) -> np.ndarray:
        return t.part(index)


class _Transpose:
    """[out, in] -> [in, out]"""

    def __call__(self, w: np.ndarray) -> np.ndarray:
        return w.T

    def part(self, t: StoredTensor, index: tuple[slice, ...]) -> np.ndarray:
        return t.part(index[::-1]).T


@dataclasses.dataclass(frozen=True)
class _HeadsIn:
    """[n*h, D] -> [D, n, h]"""

    n: int
    h: int

    def __call__(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(self.n, self.h, w.shape[1]).transpose(2, 0, 1)

    def part(self, t: StoredTensor, index: tuple[slice, ...]) -> np.ndarray:
        d, n, h = index
        w = t.part((slice(n.start * self.h, n.stop * self.h), d))  # the heads' rows
        return w.reshape(n.stop - n.start, self.h, -1)[:, h].transpose(2, 0, 1)


@dataclasses.dataclass(frozen=True)
class _HeadsOut:
    """[D, n*h] -> [n, h, D]"""

    n: int
    h: int

    def __call__(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(w.shape[0], self.n, self.h).transpose(1, 2, 0)

    def part(self, t: StoredTensor, index: tuple[slice, ...]) -> np.ndarray:
        n, h, d = index
        w = t.part((d, slice(n.start * self.h, n.stop * self.h)))
        return w.reshape(w.shape[0], n.stop - n.start, self.h)[:, :, h].transpose(1, 2, 0)


def block_transform(fn, block: int):
    """The transform `fn` (HF [out, in] -> our layout) for an array of one value per `block`
    consecutive `in` values ([out, in / block]: a block-quantized kernel's scales), or None
    when a block would straddle two heads of o_proj's split input."""
    if isinstance(fn, _HeadsOut):
        return _HeadsOut(fn.n, fn.h // block) if fn.h % block == 0 else None
    return fn


_t, _keep = _Transpose(), _Keep()
_split_heads_in, _split_heads_out = _HeadsIn, _HeadsOut


class Converted:
    """A tensor in our layout, read lazily by regions: `converted[index]` reads and converts only
    what `index` needs (see the transforms above). `shape` is our layout's."""

    def __init__(self, tensor: StoredTensor, fn: Callable[[np.ndarray], np.ndarray]):
        self.tensor, self.fn = tensor, fn
        if hasattr(fn, "part"):  # reshapes and transposes: a zero-stride stand-in has the shape
            self.whole = None
            self.shape = fn(np.broadcast_to(np.zeros((), np.float32), tensor.shape)).shape
        else:  # any other transform: on the whole tensor (a memory map's view stays lazy)
            self.whole = fn(tensor.read())
            self.shape = self.whole.shape

    def __getitem__(self, index) -> np.ndarray:
        if self.whole is not None:
            return self.whole[index]
        index = _slices(index if isinstance(index, tuple) else (index,), self.shape)
        return self.fn.part(self.tensor, index)


def _equal_by_rows(a: StoredTensor, b: StoredTensor, rows: int = 1024) -> bool:
    """a == b, compared `rows` rows at a time (neither tensor is ever read whole)."""
    if a.shape != b.shape:
        return False
    rest = tuple(slice(0, n) for n in a.shape[1:])
    for r in range(0, a.shape[0], rows):
        index = (slice(r, min(r + rows, a.shape[0])), *rest)
        if not np.array_equal(a.part(index), b.part(index)):
            return False
    return True


def param_layout(config: TargetConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], Any]]:
    """Canonical HF name -> (param path, expected HF shape, HF->ours transform), every tensor
    the `Transformer` needs (lm_head only when untied)."""
    c = config
    d, f, v, h = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    n, k = c.num_heads, c.num_kv_heads
    layout = {
        "embed_tokens.weight": (("embed_tokens", "embedding"), (v, d), _keep),
        "norm.weight": (("norm", "scale"), (d,), _keep),
    }
    if not c.tie_word_embeddings:
        layout["lm_head.weight"] = (("lm_head", "kernel"), (v, d), _t)
    if c.per_layer_input_size:  # Gemma 4
        layout |= hf_layered.per_layer_input_layout(c)
    for i in range(c.num_layers):
        hf, ours = f"layers.{i}.", f"layers_{i}"
        q_in, kv_in, o_out = _split_heads_in(n, h), _split_heads_in(k, h), _split_heads_out(n, h)
        per_layer = {
            "input_layernorm.weight": (("input_layernorm", "scale"), (d,), _keep),
            "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), (d,), _keep),
            "self_attn.q_proj.weight": (("self_attn", "q_proj", "kernel"), (n * h, d), q_in),
            "self_attn.k_proj.weight": (("self_attn", "k_proj", "kernel"), (k * h, d), kv_in),
            "self_attn.v_proj.weight": (("self_attn", "v_proj", "kernel"), (k * h, d), kv_in),
            "self_attn.o_proj.weight": (("self_attn", "o_proj", "kernel"), (d, n * h), o_out),
            "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), (f, d), _t),
            "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), (f, d), _t),
            "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), (d, f), _t),
        }
        if c.use_qk_norm:
            per_layer["self_attn.q_norm.weight"] = (("self_attn", "q_norm", "scale"), (h,), _keep)
            per_layer["self_attn.k_norm.weight"] = (("self_attn", "k_norm", "scale"), (h,), _keep)
        if c.layered:  # MoE / hybrid layers (io/hf_layered.py)
            per_layer = hf_layered.layer_layout(c, i)
        for name, (path, shape, fn) in per_layer.items():
            layout[hf + name] = ((ours, *path), shape, fn)
    return layout


def convert_to_params(
    tensors: Mapping[str, StoredTensor],
    config: TargetConfig,
    source: str,
    cast: Callable[[np.ndarray], Any] = np.asarray,
    place: Callable[[tuple[str, ...], Callable[[], np.ndarray]], Any] | None = None,
    native: Mapping[str, Any] | None = None,
) -> dict:
    """Checks names and shapes against `param_layout` and builds the nested param dict.

    tensors: canonical HF name -> StoredTensor. Refuses missing, unknown and mis-shaped tensors
    (naming tensor, file and expected shape); with tied embeddings an `lm_head.weight` present
    in the file must equal the embedding (compared by slices). `cast` turns each converted
    numpy array into a leaf; or `place(param path, read)` makes the leaf from `read()`, the
    converted array as a lazy `Converted` (files are then read, and a GGUF dequantised, only
    where `place` slices them). `native`: canonical name -> a leaf already made in our layout
    (a GGUF's quantized blocks as a `QWeight`), used as it is.
    """
    layout = param_layout(config)
    tensors = {n: t for n, t in tensors.items() if not n.endswith(_IGNORED_SUFFIXES)}
    extra = sorted(set(tensors) - set(layout) - {"lm_head.weight"})
    if extra:
        t = tensors[extra[0]]
        raise CheckpointError(
            f"{t.file}: unknown tensor {t.name!r} with shape {t.shape} "
            f"({len(extra)} unexpected in all: {', '.join(extra[:5])})"
        )
    missing = [n for n in layout if n not in tensors]
    if missing:
        hint = " (config has tie_word_embeddings=false)" if missing[0] == "lm_head.weight" else ""
        raise CheckpointError(
            f"{source}: missing tensor {missing[0]!r}{hint}, expected shape "
            f"{layout[missing[0]][1]} ({len(missing)} missing in all)"
        )
    for name, (_, shape, _) in layout.items():
        if tensors[name].shape != shape:
            t = tensors[name]
            raise CheckpointError(
                f"{t.file}: tensor {t.name!r} has shape {t.shape}, expected {shape}"
            )
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors["lm_head.weight"], tensors["embed_tokens.weight"]
        if not _equal_by_rows(head, embed):
            raise CheckpointError(
                f"{head.file}: config ties word embeddings but {head.name!r} differs from "
                f"{embed.name!r}; set tie_word_embeddings=false to load an untied head"
            )
    params: dict = {}
    for name, (path, _, fn) in layout.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if native and name in native:
            node[path[-1]] = native[name]
        elif place is None:
            node[path[-1]] = cast(fn(tensors[name].read()))
        else:
            node[path[-1]] = place(path, lambda fn=fn, t=tensors[name]: Converted(t, fn))
    return params


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """Stop ids from `generation_config.json` (eos_token_id may be an int or a list)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
