"""DSpark's two heads on a DFlash drafter (the reference: `speculators` 0.9.0, `DSparkDraftModel`).

Markov head (`markov_rank` R > 0): the draft at position anchor+i+1 is biased by the token at
anchor+i (the previous token of the block: the anchor, then each draft in turn):
  e      = markov_w1[prev]                                      [R]
  z      = e                                       (vanilla)
         = sigmoid(gate_proj([h ; e])) * e         (gated, h the slot's final-normed hidden)
         = tanh(o), where [g ; c ; o] = joint_proj([s ; e ; h]) and the state, zero before
           slot 0, becomes s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)     (rnn)
  bias   = markov_w2(z)                                         [U] (the drafter's vocabulary)
The walk covers every slot of the block, slot 0 (the anchor's) included, whose previous token
is the anchor itself; with `sample_from_anchor` slot j drafts anchor+j+1 from the token at
anchor+j, otherwise slot j (j >= 1) drafts anchor+j from the token at anchor+j-1, and slot 0
drafts nothing but still advances the rnn state (as the reference trains it).

Confidence head (`enable_confidence_head`): logit = proj([h ; e]) (`confidence_head_with_markov`)
or proj(h), one per slot: the predicted probability that the slot's draft is accepted.

`walk_step` is one slot of the walk (the form a decode, sampling slot by slot, needs);
`block_heads` runs it over whole teacher-forced blocks.

Letters: B batch, N blocks, S block slots, D model dim, R Markov rank, U drafter vocabulary.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.ops import dots


class MarkovHead(nn.Module):
    """Params: markov_w1{embedding [V,R]}, markov_w2{kernel [R,U]}; gated: gate_proj{kernel
    [D+R,R], bias [R]}; rnn: joint_proj{kernel [2R+D,3R], bias [3R]}. See the module
    docstring."""

    config: DrafterConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        r = c.markov_rank
        dense = lambda n, bias: nn.Dense(
            n, use_bias=bias, dtype=dtype, dot_general=dots.dot_general
        )
        self.markov_w1 = nn.Embed(
            c.vocab_size, r, dtype=dtype, embedding_init=nn.initializers.normal(0.01)
        )
        self.markov_w2 = dense(c.draft_vocab_size or c.vocab_size, False)
        if c.markov_head_type == "gated":
            self.gate_proj = dense(r, True)
        elif c.markov_head_type == "rnn":
            self.joint_proj = dense(3 * r, True)

    def embed(self, prev_x: jax.Array) -> jax.Array:
        """Previous-token ids [...] (target ids) -> their embeddings e [..., R]."""
        return self.markov_w1(prev_x)

    def walk_step(self, state_xr, e_xr, h_xd):
        """One slot: the state before it [..., R] (zeros before slot 0; carried by rnn only),
        the previous token's embedding e [..., R], the slot's hidden h [..., D] ->
        (the state after it, the slot's bias fp32 [..., U])."""
        state_xr, z_xr = self.walk_z(state_xr, e_xr, h_xd)
        return state_xr, self.bias(z_xr)

    def bias(self, z_xr) -> jax.Array:
        """z [..., R] -> the bias markov_w2(z), fp32 [..., U]."""
        return self.markov_w2(z_xr).astype(jnp.float32)

    def walk_z(self, state_xr, e_xr, h_xd):
        """`walk_step` before markov_w2: -> (the state after the slot, its z [..., R])."""
        kind = self.config.markov_head_type
        h_xd = h_xd.astype(e_xr.dtype)
        if kind == "vanilla":
            z_xr = e_xr
        elif kind == "gated":
            z_xr = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h_xd, e_xr], -1))) * e_xr
        else:
            joint = self.joint_proj(jnp.concatenate([state_xr, e_xr, h_xd], -1))
            g_xr, c_xr, o_xr = jnp.split(joint, 3, axis=-1)
            gate_xr = jax.nn.sigmoid(g_xr)
            state_xr = gate_xr * state_xr + (1.0 - gate_xr) * jnp.tanh(c_xr)
            z_xr = jnp.tanh(o_xr)
        return state_xr, z_xr

    def block_z(self, e_bnsr, h_bnsd) -> jax.Array:
        """`__call__` before markov_w2: each slot's z [B,N,S,R] (training applies markov_w2 in
        row chunks, never holding the whole [B,N,S,U] bias)."""
        state_bnr = jnp.zeros_like(e_bnsr[:, :, 0])
        zs = []
        for s in range(e_bnsr.shape[2]):
            state_bnr, z_bnr = self.walk_z(state_bnr, e_bnsr[:, :, s], h_bnsd[:, :, s])
            zs.append(z_bnr)
        return jnp.stack(zs, axis=2)

    def __call__(self, e_bnsr, h_bnsd) -> jax.Array:
        """Teacher-forced blocks: e [B,N,S,R] each slot's previous-token embedding, h [B,N,S,D]
        -> bias fp32 [B,N,S,U], the walk run slot by slot from slot 0."""
        return self.bias(self.block_z(e_bnsr, h_bnsd))


class ConfidenceHead(nn.Module):
    """Params: proj{kernel [D(+R),1], bias [1]}: one acceptance logit per slot."""

    config: DrafterConfig

    def setup(self):
        dtype = jnp.dtype(self.config.dtype)
        self.proj = nn.Dense(1, dtype=dtype, dot_general=dots.dot_general)

    def __call__(self, h_xd, e_xr=None) -> jax.Array:
        """h [..., D] and, with `confidence_head_with_markov`, e [..., R] -> fp32 logits [...]."""
        if self.config.confidence_head_with_markov:
            h_xd = jnp.concatenate([h_xd, e_xr.astype(h_xd.dtype)], -1)
        return self.proj(h_xd)[..., 0].astype(jnp.float32)


def previous_tokens(config: DrafterConfig, tokens_bns: jax.Array) -> jax.Array:
    """Each slot's previous token for the Markov head, from the tokens at a block's positions
    anchor..anchor+S-1 [B,N,S]: those tokens with `sample_from_anchor` (slot j drafts anchor+j+1),
    else shifted by one with the anchor repeated at slot 0 (slot j drafts anchor+j)."""
    if config.sample_from_anchor:
        return tokens_bns
    return jnp.concatenate([tokens_bns[:, :, :1], tokens_bns[:, :, :-1]], axis=2)


def block_heads(config: DrafterConfig, params: dict, hidden_bnsd, prev_bns):
    """Both heads over teacher-forced blocks: final-normed hidden [B,N,S,D], previous tokens
    [B,N,S] (`previous_tokens`) -> (Markov bias fp32 [B,N,S,U] or None, confidence logits fp32
    [B,N,S] or None), every slot of each block (slot 0 included)."""
    bias = confidence = e_bnsr = None
    if config.markov_rank:
        markov = MarkovHead(config)
        variables = {"params": params["markov_head"]}
        e_bnsr = markov.apply(variables, prev_bns, method="embed")
        bias = markov.apply(variables, e_bnsr, hidden_bnsd)
    if config.enable_confidence_head:
        confidence = ConfidenceHead(config).apply(
            {"params": params["confidence_head"]}, hidden_bnsd, e_bnsr
        )
    return bias, confidence


def init_dspark_params(config: DrafterConfig, rng: jax.Array) -> dict:
    """Random params of a DSpark drafter's heads: {"markov_head": ..., "confidence_head": ...}
    (each only when the config has it)."""
    dtype = jnp.dtype(config.dtype)
    hidden = jnp.zeros((1, 1, 1, config.hidden_size), dtype)
    prev = jnp.zeros((1, 1, 1), jnp.int32)
    rng_markov, rng_confidence = jax.random.split(rng)
    out, e = {}, None
    if config.markov_rank:
        e = jnp.zeros((1, 1, 1, config.markov_rank), dtype)
        every_part = lambda head, prev, hidden: head(head.embed(prev), hidden)
        out["markov_head"] = MarkovHead(config).init(rng_markov, prev, hidden, method=every_part)[
            "params"
        ]
    if config.enable_confidence_head:
        out["confidence_head"] = ConfidenceHead(config).init(rng_confidence, hidden, e)["params"]
    return out
