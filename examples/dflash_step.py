"""DFlash in a few lines: greedy speculative decoding, one step at a time, with the public pieces.

Each step: the target's taps of the text so far become the drafter's context; the drafter
fills a block [last token, mask, mask, ...] in one parallel pass (the drafts); the target
verifies the block in one forward; the drafts are accepted up to the first one the target
would not have picked, and the target's own token there is added (the bonus). The output is
the target's greedy output, token for token. No caches and no jit, for clarity: the library's
loop (`dj.speculative_decode`) does the same inside one jitted `lax.while_loop`, with KV caches,
batches, sampling and adaptive block sizes (docs/decoding.md).

    python examples/dflash_step.py --max_new_tokens=32
"""

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import dflash_jax as dj
from dflash_jax import api
from dflash_jax.models.drafter import Drafter, draft_logits
from dflash_jax.models.target import Transformer

_PROMPT = flags.DEFINE_string("prompt", "Write a haiku about JAX.", "The user prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")


def target_pass(target, taps_from, tokens):
    """The target over `tokens` (no cache) -> (greedy next token at every position, taps)."""
    seq = jnp.asarray(tokens, jnp.int32)[None]
    logits, taps, _ = Transformer(target.config).apply(
        {"params": target.params}, seq, jnp.arange(len(tokens))[None], None, None, taps_from
    )
    return np.asarray(jnp.argmax(logits[0], -1)), taps


def dflash_step(target, drafter, tokens):
    """One draft -> verify -> accept step after `tokens` -> the tokens it commits (1 or more)."""
    tcfg, dcfg = target.config, drafter.config
    n, block = len(tokens), dcfg.block_size
    # Context: the target's taps (hidden states of a few layers) of every token but the last.
    _, taps = target_pass(target, dcfg.target_layer_ids, tokens)
    ctx_k, ctx_v = Drafter(dcfg).apply(
        {"params": drafter.params}, taps[:, : n - 1], jnp.arange(n - 1)[None], method="context_kv"
    )
    # Draft: the block [last token, mask x (block - 1)] in one pass; slot j predicts n - 1 + j.
    block_tokens = jnp.array([[tokens[-1]] + [dcfg.mask_token_id] * (block - 1)], jnp.int32)
    logits = draft_logits(
        drafter.params, target.params, tcfg, dcfg, block_tokens, ctx_k, ctx_v,
        jnp.array([n - 1]), jnp.array([[n - 1]]), block,
    )  # fmt: skip
    drafts = [int(t) for t in np.asarray(jnp.argmax(logits[0, 0], -1))]
    # Verify: one target pass over the text and the drafts; its greedy pick after each prefix.
    picks, _ = target_pass(target, (), tokens + drafts)
    picks = [int(t) for t in picks[n - 1 :]]  # picks[j]: the target's token at position n + j
    # Accept: the drafts up to the first the target would not pick, then the target's own.
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == picks[accepted]:
        accepted += 1
    return drafts[:accepted] + [picks[accepted]]


def main(argv):
    del argv
    target = dj.load_target("smollm2-135m-instruct")
    drafter = dj.load_drafter("default", target)
    prompt = api.render_prompt(target.tokenizer, _PROMPT.value)  # chat template, token ids
    stops = set(api.stop_token_ids(target))
    tokens, taus = list(prompt), []
    while len(tokens) - len(prompt) < _MAX_NEW.value and tokens[-1] not in stops:
        committed = dflash_step(target, drafter, tokens)
        taus.append(len(committed))
        tokens += committed
    out = tokens[len(prompt) :][: _MAX_NEW.value]
    ar = list(prompt)  # the target alone, one greedy token per pass
    while len(ar) - len(prompt) < len(out):
        ar.append(int(target_pass(target, (), ar)[0][-1]))
    print(target.tokenizer.decode(out, skip_special_tokens=True))
    same = "identical" if ar[len(prompt) :] == out else "DIFFERENT"
    print(f"{len(out)} tokens in {len(taus)} steps (tau {np.mean(taus):.2f}); target alone: {same}")


if __name__ == "__main__":
    app.run(main)
