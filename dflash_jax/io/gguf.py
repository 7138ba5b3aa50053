"""GGUF (llama.cpp) targets: metadata -> HF-style config dict, tensors -> HF names and layout.

Tensors are dequantised with the gguf package's numpy reader and renamed onto the HF names that
`hf.convert_to_params` expects, so both formats share one conversion. Loaded onto a mesh, each
tensor is dequantised by the rows a process's slices need (`StoredTensor.read_part`), never
whole. llama.cpp permutes the rows
of q/k for its interleaved RoPE; `_unpermute` undoes it (as transformers' own GGUF loader does).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix

from dflash_jax.io.hf import CheckpointError, StoredTensor, block_transform, param_layout
from dflash_jax.models.quantized import CONTRACTED
from dflash_jax.ops.quant import QWeight

# Block schemes read as stored (`blocks`): bytes per block of 32 values.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GGUF_BLOCK = 32
# Which of them each quantization scheme takes as it is (`native_kernels`).
NATIVE_TYPES = {"int4": ("Q4_0", "Q4_1"), "int8": ("Q8_0",)}

_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_LEVEL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> canonical HF name; unknown names pass through unchanged so the
    conversion refuses them by name."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_TO_HF:
        return f"layers.{m.group(1)}.{_GGUF_TO_HF[m.group(2)]}.weight"
    return gguf_name


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation: [n_head*H, D] rows (pairs interleaved) ->
    HF rotate-half order."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise CheckpointError(f"q/k rows {rows} are not divisible by 2*{n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _dequantized(tensor, n_head: int | None, file: str, shape: tuple[int, ...]) -> np.ndarray:
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if tuple(w.shape) != shape:
        raise CheckpointError(
            f"{file}: tensor {tensor.name!r} dequantised to {tuple(w.shape)}, expected {shape}"
        )
    w = w.astype(np.float32, copy=False)
    return w if n_head is None else _unpermute(w, n_head)


def _dequantized_part(
    tensor, n_head: int | None, file: str, shape: tuple[int, ...], index: tuple[slice, ...]
) -> np.ndarray:
    """The region `index` ([rows, cols] slices, HF layout) of a tensor, dequantising only its
    rows (ggml stores a matrix row by row, each row whole blocks), a few at a time, so no more
    than the region and one chunk of whole rows is ever held. q/k rows are dequantised by whole
    heads: llama.cpp's permutation moves rows only inside a head."""
    if len(shape) != 2:
        return _dequantized(tensor, n_head, file, shape)[index]
    rows, cols = index
    unit = shape[0] // n_head if n_head else 1  # rows that must be read together
    lo, hi = rows.start // unit * unit, -(-rows.stop // unit) * unit
    out = np.empty((rows.stop - rows.start, cols.stop - cols.start), np.float32)
    step = max(unit, out.size // shape[1] // unit * unit)
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        w = gguf.quants.dequantize(tensor.data[a:b], tensor.tensor_type)
        if w.shape != (b - a, shape[1]):
            raise CheckpointError(
                f"{file}: rows {a}:{b} of tensor {tensor.name!r} dequantised to {w.shape}, "
                f"expected {(b - a, shape[1])}"
            )
        w = w.astype(np.float32, copy=False)
        w = w if n_head is None else _unpermute(w, (b - a) // unit)
        keep = slice(max(a, rows.start), min(b, rows.stop))
        out[keep.start - rows.start : keep.stop - rows.start] = w[
            keep.start - a : keep.stop - a, cols
        ]
    return out


def _blocks(tensor, n_head: int | None, file: str, shape: tuple[int, ...]):
    """A Q4_0 / Q4_1 / Q8_0 matrix as stored, in HF layout: (qvalue int8 [out, in], scale f16
    [out, in/32], offset f32 [out, in/32] or None) with w = qvalue * scale + offset. Q4_0:
    w = d * (q - 8); Q4_1: w = d * q + m = d * (q - 8) + (m + 8 d), the offset exact in fp32;
    Q8_0: w = d * q. A 4-bit block holds values 0-15 in its low nibbles, 16-31 in its high."""
    kind = tensor.tensor_type.name
    rows, cols = shape
    if cols % GGUF_BLOCK:
        raise CheckpointError(f"{file}: tensor {tensor.name!r} rows are not whole blocks")
    raw = np.asarray(tensor.data).reshape(rows, cols // GGUF_BLOCK, _BLOCK_BYTES[kind])
    half = lambda a, b: np.ascontiguousarray(raw[..., a:b]).view(np.float16)[..., 0]
    scale, offset = half(0, 2), None
    if kind == "Q8_0":
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8)
    else:
        packed = raw[..., 4:] if kind == "Q4_1" else raw[..., 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], -1).astype(np.int8) - 8
        if kind == "Q4_1":
            offset = half(2, 4).astype(np.float32) + 8 * scale.astype(np.float32)
    q = q.reshape(rows, cols)
    if n_head is not None:
        q, scale = _unpermute(q, n_head), _unpermute(scale, n_head)
        offset = None if offset is None else _unpermute(offset, n_head)
    return q, scale, offset


def has_native_blocks(path: str | Path, scheme: str) -> bool:
    """Whether the GGUF at `path` holds decoder-layer projections in a block type `scheme`
    takes as stored (`native_kernels`). Only projections count: the shipped SmolLM2 GGUF's
    embedding is Q8_0 and its projections Q4_1, and counting the embedding sent --quantize=int8
    down the native path, which took no projection as stored and skipped the converted-target
    cache on every load."""
    types = NATIVE_TYPES.get(scheme, ())
    projections = {k for k, v in _GGUF_TO_HF.items() if v.endswith("_proj")}
    for t in gguf.GGUFReader(str(path)).tensors:
        match = _BLOCK.fullmatch(t.name)
        if match and match.group(2) in projections and t.tensor_type.name in types:
            return True
    return False


def native_kernels(tensors: dict[str, StoredTensor], config, scheme: str) -> dict:
    """Canonical name -> `QWeight` in our layout, for each decoder-layer projection stored in a
    block type that `scheme` takes as it is (`NATIVE_TYPES`): the blocks become the qvalue,
    scales and offsets, never a float matrix. Other tensors are not in the result."""
    types = NATIVE_TYPES.get(scheme, ())
    storage = ml_dtypes.int4 if scheme == "int4" else np.int8
    out = {}
    for name, (_, _, fn) in param_layout(config).items():
        t = tensors[name]
        module = name.rsplit(".", 2)[-2]
        if t.ggml_type not in types or module not in CONTRACTED or t.blocks is None:
            continue
        block_fn = block_transform(fn, GGUF_BLOCK)
        if block_fn is None:  # blocks straddling heads: the kernel is quantized from floats
            continue
        q, scale, offset = t.blocks()
        qarray = qwix.QArray(jnp.asarray(fn(q).astype(storage)), jnp.asarray(block_fn(scale)))
        offset = None if offset is None else jnp.asarray(block_fn(offset))
        out[name] = QWeight(qarray, offset)
    return out


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, StoredTensor], bool]:
    """Returns (HF-style config dict for `io.hf_config.target_from_hf`, canonical HF name ->
    StoredTensor in HF layout, whether the file embeds a tokenizer). Only the llama
    architecture is supported."""
    file = str(path)
    reader = gguf.GGUFReader(file)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{file}: GGUF architecture {arch!r} is not supported (only llama)")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise CheckpointError(f"{file}: GGUF metadata llama.{key} is missing")
        return value

    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{file}: partial RoPE (rope.dimension_count={rope_dims}, head_dim={head_dim}) "
            "is not supported"
        )
    names = [t.name for t in reader.tensors]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(meta("vocab_size"))
    scaling_type = _field(reader, "llama.rope.scaling.type", "none")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None
        if scaling_type == "none"
        else {"rope_type": scaling_type, "factor": _field(reader, "llama.rope.scaling.factor")},
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }
    heads = {"attn_q": n_heads, "attn_k": n_kv}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
        m = _BLOCK.fullmatch(t.name)
        n_head = heads.get(m.group(2)) if m else None
        tensors[hf_name(t.name)] = StoredTensor(
            t.name,
            file,
            shape,
            lambda t=t, n=n_head, s=shape: _dequantized(t, n, file, s),
            lambda index, t=t, n=n_head, s=shape: _dequantized_part(t, n, file, s, index),
            t.tensor_type.name,
            (lambda t=t, n=n_head, s=shape: _blocks(t, n, file, s))
            if t.tensor_type.name in _BLOCK_BYTES and len(shape) == 2
            else None,
        )
    return config, tensors, tokens is not None
