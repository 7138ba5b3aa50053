"""Loader behaviour on good and bad inputs: every refusal names what is wrong."""

import json

import gguf
import huggingface_hub.constants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _tiny_models import (
    LLAMA3_ROPE,
    TINY_DIMS,
    load_hf_torch,
    make_tiny_gguf,
    make_tiny_hf_model,
    make_tiny_hf_target,
    torch_logits_and_hidden,
)
from safetensors.numpy import load_file, save_file

from dflash_jax.config import ConfigError
from dflash_jax.io import CheckpointError, load_target
from dflash_jax.models.target import Transformer

D, F, H, K = (
    TINY_DIMS[k] for k in ("hidden_size", "intermediate_size", "head_dim", "num_key_value_heads")
)


def _edit_config(path, **changes):
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    config_path.write_text(json.dumps(config))


def _edit_tensors(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)
    return file


def _assert_params_equal(a, b):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b
    )


@pytest.fixture()
def qwen3_dir(tmp_path):
    return make_tiny_hf_target(tmp_path, "qwen3")


def test_unknown_architecture_refused(qwen3_dir):
    _edit_config(qwen3_dir, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match=r"config\.json.*'gpt2'.*supported"):
        load_target(str(qwen3_dir))


def test_missing_tensor_refused(qwen3_dir):
    _edit_tensors(qwen3_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=rf"missing tensor 'layers\.1\.mlp\.up_proj\.weight'.*\({F}, {D}\)"
    ):
        load_target(str(qwen3_dir))


def test_wrong_shape_refused(qwen3_dir):
    name = "model.layers.2.self_attn.k_proj.weight"
    file = _edit_tensors(qwen3_dir, lambda t: t.update({name: np.zeros((H, D), np.float32)}))
    with pytest.raises(
        CheckpointError,
        match=rf"{file}.*'{name}' has shape \({H}, {D}\), expected \({K * H}, {D}\)",
    ):
        load_target(str(qwen3_dir))


def test_unknown_tensor_refused(qwen3_dir):
    name = "model.layers.0.self_attn.q_proj.bias"
    file = _edit_tensors(qwen3_dir, lambda t: t.update({name: np.zeros((D,), np.float32)}))
    with pytest.raises(CheckpointError, match=rf"{file}: unknown tensor '{name}'"):
        load_target(str(qwen3_dir))


def test_untied_without_lm_head_refused(qwen3_dir):
    _edit_tensors(qwen3_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'lm_head\.weight'.*tie_word_embeddings=false"
    ):
        load_target(str(qwen3_dir))


def test_tied_with_different_lm_head_refused(qwen3_dir):
    _edit_config(qwen3_dir, tie_word_embeddings=True)
    with pytest.raises(
        CheckpointError, match=r"ties word embeddings but 'lm_head\.weight' differs"
    ):
        load_target(str(qwen3_dir))


def test_tied_with_equal_lm_head_accepted(tmp_path):
    path = make_tiny_hf_target(tmp_path, "llama", tie=True)
    reference = load_target(str(path))
    _edit_tensors(
        path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()})
    )
    loaded = load_target(str(path))
    assert "lm_head" not in loaded.params
    _assert_params_equal(loaded.params, reference.params)


def test_yarn_rope_refused(qwen3_dir):
    _edit_config(qwen3_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ConfigError, match=r"rope scaling type 'yarn' is not supported"):
        load_target(str(qwen3_dir))


def test_hub_id_offline_names_the_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(OSError, match=r"cannot download target 'Qwen/Qwen3-8B'.*HF_HUB_OFFLINE"):
        load_target("Qwen/Qwen3-8B")


def test_missing_path_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_target(str(tmp_path / "nothing-here"))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_target("models/missing.gguf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(str(tmp_path))


def test_missing_weights_refused(qwen3_dir):
    (qwen3_dir / "model.safetensors").rename(qwen3_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors.*found pytorch_model\.bin"):
        load_target(str(qwen3_dir))


def test_bad_dtype_refused(qwen3_dir):
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        load_target(str(qwen3_dir), dtype="float16")


def test_sharded_index_loads_like_single_file(tmp_path):
    single = load_target(str(make_tiny_hf_target(tmp_path / "a", "qwen3")))
    sharded_dir = make_tiny_hf_target(tmp_path / "b", "qwen3", max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    assert len(shards) > 2
    _assert_params_equal(load_target(str(sharded_dir)).params, single.params)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard {shards[1].name} is missing"):
        load_target(str(sharded_dir))


def test_model_prefix_is_optional(qwen3_dir):
    reference = load_target(str(qwen3_dir))

    def strip(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("model.")] = tensors.pop(name)

    _edit_tensors(qwen3_dir, strip)
    _assert_params_equal(load_target(str(qwen3_dir)).params, reference.params)


def test_rope_v4_and_v5_configs_agree(tmp_path):
    path = make_tiny_hf_target(tmp_path, "llama", rope_scaling=LLAMA3_ROPE)
    v5 = json.loads((path / "config.json").read_text())
    assert v5["rope_parameters"]["rope_type"] == "llama3"  # transformers v5 writes this
    v5_config = load_target(str(path)).config
    scaling = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
    _edit_config(
        path,
        rope_parameters=None,
        rope_theta=v5["rope_parameters"]["rope_theta"],
        rope_scaling=scaling,
    )
    assert load_target(str(path)).config == v5_config
    assert v5_config.rope_scaling is not None and v5_config.rope_theta == TINY_DIMS["rope_theta"]


def test_generation_config_eos_merged(qwen3_dir):
    (qwen3_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_target(str(qwen3_dir)).config.eos_token_ids == (2, 7, 9)
    (qwen3_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_target(str(qwen3_dir)).config.eos_token_ids == (2, 5)


def test_bf16_checkpoint_and_bf16_params(tmp_path):
    model = make_tiny_hf_model("qwen3").to(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    as_f32 = load_target(str(tmp_path / "bf16"))
    q = model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(
        np.asarray(as_f32.params["layers_0"]["self_attn"]["q_proj"]["kernel"]),
        q.reshape(4, H, D).transpose(2, 0, 1),
    )
    as_bf16 = load_target(str(tmp_path / "bf16"), dtype="bfloat16")
    assert as_bf16.config.dtype == "bfloat16" and as_f32.config.dtype == "float32"
    assert {x.dtype for x in jax.tree_util.tree_leaves(as_bf16.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_matches_torch(tmp_path, tie):
    """A llama.cpp-style GGUF (permuted q/k) of a tiny Llama gives the HF model's logits."""
    model = make_tiny_hf_model("llama", tie)
    target = load_target(str(make_tiny_gguf(tmp_path, model)))
    assert target.config.tie_word_embeddings == tie and target.tokenizer is None
    tokens = np.random.RandomState(0).randint(0, TINY_DIMS["vocab_size"], (2, 40))
    positions = np.broadcast_to(np.arange(40), (2, 40))
    logits, _, _ = Transformer(target.config).apply(
        {"params": target.params}, jnp.asarray(tokens), jnp.asarray(positions)
    )
    ref, _ = torch_logits_and_hidden(model, tokens)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


def test_gguf_unknown_tensor_and_arch_refused(tmp_path):
    path = make_tiny_gguf(tmp_path, make_tiny_hf_model("llama"))
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.add_tensor("rope_freqs.weight", np.ones((H // 2,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"extra\.gguf: unknown tensor 'rope_freqs\.weight'"):
        load_target(str(tmp_path / "extra.gguf"))

    other = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), arch="gpt2")
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(
        CheckpointError, match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not supported"
    ):
        load_target(str(tmp_path / "gpt2.gguf"))


def test_loaded_tiny_target_matches_torch_reference(tmp_path):
    """Sanity for the helper itself: load_hf_torch reads back what make_tiny_hf_target wrote."""
    path = make_tiny_hf_target(tmp_path, "qwen3")
    tokens = np.arange(12)[None]
    a, _ = torch_logits_and_hidden(load_hf_torch(path), tokens)
    b, _ = torch_logits_and_hidden(make_tiny_hf_model("qwen3"), tokens)
    np.testing.assert_array_equal(a, b)
