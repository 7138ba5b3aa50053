"""The DFlash drafter: a few Qwen3-style layers whose keys/values also cover the target's context.

One draft call (dflash-spec §1):
  c = hidden_norm(fc(concat taps))                      context, shared by every layer
  per layer: q from the block only; k/v = proj([c ; h]) context first, k_norm on both, RoPE at
  absolute positions (context slot s at s, block slot j at anchor + j); attention non-causal
  over visible context + own block (sliding layers: causal in the block and windowed, from
  each query or from the block's anchor: `DrafterConfig.window_from_anchor`)
  final `norm`, then the target's frozen lm_head on slots 1..bs-1.

Context K/V are computed once per appended context row (`context_kv`) and cached by the caller;
`__call__` runs the layers over embedded blocks against that cache.

DSpark (`config.is_dspark`): the DFlash layers, then a Markov logit bias and a confidence head
over each block (`models/dspark.py`; teacher-forced: `dspark_draft_logits`).

DFlash2 (`config.is_dflash2`): each layer wraps its attention and its MLP in a grouped dynamic
causal convolution over the block (`models/dflash2.py`; context rows are not convolved), and the
params gain a `candidate_selector` (used after the head, by decoding and training).

Letters: B batch, T context rows, S cache slots, Q block tokens (N blocks x block_size),
N blocks, K kv heads, H head dim, D model dim, F taps width, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.models import dspark
from dflash_jax.models.dflash2 import GroupedDynamicCausalConv, init_selector_params
from dflash_jax.models.layers import MLP, AttentionProjections, RMSNorm, rope_inv_freq, rope_tables
from dflash_jax.models.target import Head, Transformer
from dflash_jax.ops import dots
from dflash_jax.ops.dispatch import block_attention
from dflash_jax.ops.reductions import argmax_last


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference tap rule: one tap at N//2 for a 1-layer drafter, else L taps spread over
    [1, N-3] with banker's rounding (np.round), exactly as z-lab's `build_target_layer_ids`."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(
        int(np.round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
    )


class DrafterLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention keys are [context ; block]."""

    config: DrafterConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        self.self_attn = AttentionProjections(
            c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, True, c.rms_norm_eps, dtype
        )
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        self.mlp = MLP(c.intermediate_size, dtype)
        if c.is_dflash2:
            conv = lambda: GroupedDynamicCausalConv(
                c.hidden_size, c.conv_kernel_size, c.conv_group_size, dtype
            )
            self.attention_conv, self.mlp_conv = conv(), conv()

    def context_kv(self, c_btd, cos, sin):
        """Context rows (already fc + hidden_norm) -> (k [B,K,T,H] after k_norm + RoPE, v)."""
        return self.self_attn.key_value(c_btd, cos, sin)

    def __call__(
        self,
        x_bqd,
        cos,
        sin,
        ctx_k_bksh,
        ctx_v_bksh,
        context_lengths_b,
        anchors_bn,
        block_size: int,
        causal: bool,
        window: int | None,
    ):
        """x [B,Q,D] block tokens; ctx_k/ctx_v [B,K,S,H]; context_lengths [B]; anchors [B,N]
        (see `Drafter.__call__`). -> [B,Q,D]."""
        dflash2 = self.config.is_dflash2
        h_bqd = self.input_layernorm(x_bqd)
        if dflash2:
            h_bqd, attn_dyn = self.attention_conv.prepare(h_bqd, block_size)
        q_bqnh = self.self_attn.query(h_bqd, cos, sin)
        k_bkqh, v_bkqh = self.self_attn.key_value(h_bqd, cos, sin)
        attn_bqnh = block_attention(
            q_bqnh,
            ctx_k_bksh.astype(k_bkqh.dtype),
            ctx_v_bksh.astype(v_bkqh.dtype),
            k_bkqh,
            v_bkqh,
            context_lengths_b,
            anchors_bn,
            block_size=block_size,
            causal=causal,
            window=window,
            window_from_anchor=self.config.window_from_anchor,
            sinks_and_window=(self.config.draft_sinks, self.config.draft_window),
            impl=self.config.attention_impl,
        )
        attn_bqd = self.self_attn.output(attn_bqnh)
        if dflash2:
            attn_bqd = self.attention_conv.finish(attn_bqd, attn_dyn, block_size)
        x_bqd = x_bqd + attn_bqd
        y_bqd = self.post_attention_layernorm(x_bqd)
        if not dflash2:
            return x_bqd + self.mlp(y_bqd)
        y_bqd, mlp_dyn = self.mlp_conv.prepare(y_bqd, block_size)
        return x_bqd + self.mlp_conv.finish(self.mlp(y_bqd), mlp_dyn, block_size)


# DrafterLayer.__call__'s static arguments (block_size, causal, window), counting self as 0.
LAYER_STATIC_ARGNUMS = (8, 9, 10)


class Drafter(nn.Module):
    """Params: fc{kernel [F,D]}, hidden_norm, layers_{i}{...}, norm. See module docstring.

    `remat` (training, `config.remat`): each layer's activations are recomputed in the backward
    pass instead of kept (`nn.remat`): the same params, values and gradients, a layer's
    activations live only while it runs, for one more forward of the layers."""

    config: DrafterConfig
    remat: bool = False

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.fc = nn.Dense(c.hidden_size, use_bias=False, dtype=dtype, dot_general=dots.dot_general)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, dtype)
        layer = (
            nn.remat(DrafterLayer, static_argnums=LAYER_STATIC_ARGNUMS)
            if self.remat
            else DrafterLayer
        )
        self.layers = [layer(c) for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, dtype)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def context_kv(self, taps_btf: jax.Array, positions_bt: jax.Array) -> tuple[tuple, tuple]:
        """taps [B,T,F] (raw target taps in target_layer_ids order), positions [B,T] ->
        (ks, vs): tuples of L arrays [B,K,T,H] (the cache layout); k after k_norm and RoPE at
        `positions`."""
        c_btd = self.hidden_norm(self.fc(taps_btf))
        cos, sin = rope_tables(positions_bt, self.inv_freq, c_btd.dtype)
        kvs = [layer.context_kv(c_btd, cos, sin) for layer in self.layers]
        return tuple(k for k, _ in kvs), tuple(v for _, v in kvs)

    def __call__(
        self,
        x_bqd: jax.Array,
        ctx_k: tuple,
        ctx_v: tuple,
        context_lengths_b: jax.Array,
        anchors_bn: jax.Array,
        block_size: int,
    ) -> jax.Array:
        """x [B,Q=N*block_size,D] embedded block tokens; ctx_k/ctx_v: L arrays [B,K,S,H] (slot s
        holds position s; slots >= context_lengths[b] are ignored); anchors [B,N]: block n's slot
        j sits at anchors[b,n] + j and sees context slots < min(anchor, context_length).
        -> final-normed hidden states [B,Q,D]."""
        b, q, _ = x_bqd.shape
        num_blocks = anchors_bn.shape[1]
        if q != num_blocks * block_size:
            raise ValueError(
                f"drafter input has {q} tokens; expected {num_blocks} blocks x {block_size}"
            )
        positions_bq = (anchors_bn[:, :, None] + jnp.arange(block_size)[None, None, :]).reshape(
            b, q
        )
        cos, sin = rope_tables(positions_bq, self.inv_freq, x_bqd.dtype)
        for i, layer in enumerate(self.layers):
            causal, window = self.config.layer_is_causal(i), self.config.layer_window(i)
            x_bqd = layer(
                x_bqd, cos, sin, ctx_k[i], ctx_v[i], context_lengths_b, anchors_bn, block_size,
                causal, window,
            )  # fmt: skip
        return self.norm(x_bqd)

    def forward_from_taps(
        self,
        taps_btf: jax.Array,
        x_bqd: jax.Array,
        context_lengths_b: jax.Array,
        anchors_bn: jax.Array,
        block_size: int,
    ) -> jax.Array:
        """Whole-sequence form (training): context slot t at position t, then `__call__`."""
        b, t, _ = taps_btf.shape
        positions_bt = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
        ctx_k, ctx_v = self.context_kv(taps_btf, positions_bt)
        return self(x_bqd, ctx_k, ctx_v, context_lengths_b, anchors_bn, block_size)


def init_drafter_params(config: DrafterConfig, rng: jax.Array) -> dict:
    """Random drafter params (tests, training from scratch, eval_shape of full configs)."""
    dtype = jnp.dtype(config.dtype)
    taps = jnp.zeros((1, 1, config.num_taps * config.hidden_size), dtype)
    x = jnp.zeros((1, config.block_size, config.hidden_size), dtype)
    one = jnp.ones((1,), jnp.int32)

    @jax.jit  # one compile instead of one per primitive
    def init(rng):
        rng, rng_selector = jax.random.split(rng) if config.is_dflash2 else (rng, None)
        params = Drafter(config).init(
            rng, taps, x, one, one[:, None], config.block_size, method="forward_from_taps"
        )["params"]
        if config.is_dflash2:
            params = {**params, "candidate_selector": init_selector_params(config, rng_selector)}
        if config.is_dspark:  # the backbone's init stays the DFlash drafter's for this rng
            params = {**params, **dspark.init_dspark_params(config, jax.random.fold_in(rng, 2))}
        if config.draft_vocab_size:
            shape = (config.hidden_size, config.draft_vocab_size)
            kernel = 0.02 * jax.random.normal(jax.random.fold_in(rng, 1), shape)
            params = {
                **params,
                "lm_head": {"kernel": kernel.astype(dtype)},
                "draft_to_target": jnp.arange(config.draft_vocab_size, dtype=jnp.int32),
            }
        return params

    return init(rng)


def embed_block(
    target_params, target_config: TargetConfig, drafter_config: DrafterConfig, tokens_bq
) -> jax.Array:
    """Block tokens [B,Q] -> [B,Q,D]: the target's raw embedding table (never Gemma's
    sqrt(hidden)) x the drafter's input_embedding_scale, in the drafter's dtype (as the
    references: `dflash.model._raw_input_embeddings`)."""
    x_bqd = Transformer(target_config).apply(
        {"params": target_params}, tokens_bq, False, method="embed"
    )
    if drafter_config.input_embedding_scale is not None:
        x_bqd = x_bqd * drafter_config.input_embedding_scale
    return x_bqd.astype(jnp.dtype(drafter_config.dtype))


def hidden_to_logits(
    target_params, target_config: TargetConfig, drafter_config: DrafterConfig, hidden
) -> jax.Array:
    """Final-normed drafter hidden states [..., D] -> fp32 logits [..., V]: the target's frozen
    lm_head (tied or not; raw, without the target's softcapping), then the drafter's
    output_multiplier and softcapping s*tanh(z/s)."""
    lead = hidden.shape[:-1]
    hidden_td = hidden.reshape(-1, hidden.shape[-1]).astype(jnp.dtype(target_config.dtype))
    logits_tv = Transformer(target_config).apply(
        {"params": target_params}, hidden_td, False, method="unembed"
    )
    logits_tv = finish_logits(drafter_config, logits_tv)
    return logits_tv.reshape(*lead, logits_tv.shape[-1])


def finish_logits(drafter_config: DrafterConfig, logits: jax.Array) -> jax.Array:
    """fp32, then output_multiplier and softcapping s*tanh(z/s)."""
    logits = logits.astype(jnp.float32)
    if drafter_config.output_multiplier is not None:
        logits = logits * drafter_config.output_multiplier
    cap = drafter_config.final_logit_softcapping
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    return logits


def drafter_logits(head: Head, target_config, drafter_config, drafter_params, hidden_bgd):
    """The draft distribution's fp32 logits over the target's vocabulary [..., V] from
    final-normed drafter hidden states [..., D]: the target's frozen head (uncapped), or, with
    a draft vocabulary, the drafter's own head over its draft ids (`on_target_vocab`)."""
    hidden_bgd = hidden_bgd.astype(jnp.dtype(target_config.dtype))
    if not drafter_config.draft_vocab_size:
        return finish_logits(drafter_config, head.uncapped().logits(hidden_bgd))
    logits_bgu = draft_vocab_logits(drafter_config, drafter_params, hidden_bgd)
    return on_target_vocab(drafter_params, logits_bgu, target_config.vocab_size)


def draft_vocab_logits(drafter_config, drafter_params, hidden_bgd) -> jax.Array:
    """A draft-vocabulary drafter's fp32 logits over its draft ids [..., draft vocab]."""
    kernel_du = drafter_params["lm_head"]["kernel"]
    logits = dots.einsum("...d,du->...u", hidden_bgd.astype(kernel_du.dtype), kernel_du)
    return finish_logits(drafter_config, logits)


def on_target_vocab(drafter_params, logits_bgu: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-id logits [..., U] placed at their target ids -> [..., V], -inf at every other id:
    the proposal never drafts a token outside the draft vocabulary, and rejection sampling
    reads its probability there as 0."""
    full_bgv = jnp.full((*logits_bgu.shape[:-1], vocab_size), -jnp.inf, logits_bgu.dtype)
    return full_bgv.at[..., drafter_params["draft_to_target"]].set(logits_bgu)


def draft_vocab_argmax(drafter_config, drafter_params, hidden_bgd) -> jax.Array:
    """The greedy drafts of a draft-vocabulary drafter as target ids, int32 [...]: the argmax
    over its draft ids, mapped (the full logits' argmax: ascending target ids keep ties)."""
    best = argmax_last(draft_vocab_logits(drafter_config, drafter_params, hidden_bgd))
    return jnp.take(drafter_params["draft_to_target"], best).astype(jnp.int32)


def unembedding_rows(target_params, target_config: TargetConfig, ids_u: jax.Array) -> jax.Array:
    """The frozen lm_head's rows for vocabulary ids [U] -> [U, D] (the tied embedding, or the
    transposed lm_head kernel)."""
    if target_config.tie_word_embeddings:
        return jnp.take(target_params["embed_tokens"]["embedding"], ids_u, axis=0)
    return jnp.take(target_params["lm_head"]["kernel"], ids_u, axis=1).T


def hidden_to_subset_logits(
    target_params,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    hidden_td: jax.Array,
    rows_ud: jax.Array,
) -> jax.Array:
    """`hidden_to_logits` restricted to the vocabulary rows `rows_ud` (from `unembedding_rows`):
    [T, D] -> fp32 [T, U], equal to the full logits' columns for those ids."""
    dtype = jnp.dtype(target_config.dtype)
    logits_tu = dots.einsum("td,ud->tu", hidden_td.astype(dtype), rows_ud.astype(dtype))
    return finish_logits(drafter_config, logits_tu)


def block_hidden(
    drafter_params,
    target_params,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    block_tokens_bq: jax.Array,
    ctx_k: tuple,
    ctx_v: tuple,
    context_lengths_b: jax.Array,
    anchors_bn: jax.Array,
    block_size: int,
) -> jax.Array:
    """Embed the blocks and run the drafter (see `Drafter.__call__`): block_tokens
    [B, N*block_size] -> final-normed hidden states [B, N, block_size, D], every slot."""
    x_bqd = embed_block(target_params, target_config, drafter_config, block_tokens_bq)
    hidden_bqd = Drafter(drafter_config).apply(
        {"params": drafter_params}, x_bqd, ctx_k, ctx_v, context_lengths_b, anchors_bn, block_size
    )
    b, n = anchors_bn.shape
    return hidden_bqd.reshape(b, n, block_size, -1)


def own_vocab_logits(
    drafter_params, target_params, target_config, drafter_config, hidden, bias=None
) -> jax.Array:
    """Final-normed hidden [..., D] (+ a logit bias over the drafter's own vocabulary) ->
    fp32 logits over the target's vocabulary [..., V]: the target's head, or the drafter's own
    over its draft ids placed at their target ids (`on_target_vocab`)."""
    if drafter_config.draft_vocab_size:
        logits = draft_vocab_logits(drafter_config, drafter_params, hidden)
    else:
        logits = hidden_to_logits(target_params, target_config, drafter_config, hidden)
    if bias is not None:
        logits = logits + bias
    if drafter_config.draft_vocab_size:
        return on_target_vocab(drafter_params, logits, target_config.vocab_size)
    return logits


def draft_logits(
    drafter_params,
    target_params,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    block_tokens_bq: jax.Array,
    ctx_k: tuple,
    ctx_v: tuple,
    context_lengths_b: jax.Array,
    anchors_bn: jax.Array,
    block_size: int,
) -> jax.Array:
    """Embed the blocks, run the drafter, drop each block's anchor slot, apply the lm_head (the
    drafter's own over a draft vocabulary, `on_target_vocab`). block_tokens [B, N*block_size]
    -> logits [B, N, block_size-1, V] (slot j predicts anchor+j)."""
    hidden_bnsd = block_hidden(
        drafter_params, target_params, target_config, drafter_config, block_tokens_bq,
        ctx_k, ctx_v, context_lengths_b, anchors_bn, block_size,
    )  # fmt: skip
    return own_vocab_logits(
        drafter_params, target_params, target_config, drafter_config, hidden_bnsd[:, :, 1:]
    )


def dspark_draft_logits(
    drafter_params,
    target_params,
    target_config: TargetConfig,
    drafter_config: DrafterConfig,
    tokens_bq: jax.Array,
    ctx_k: tuple,
    ctx_v: tuple,
    context_lengths_b: jax.Array,
    anchors_bn: jax.Array,
    block_size: int,
) -> tuple[jax.Array, jax.Array | None]:
    """A DSpark drafter's teacher-forced drafts (`models/dspark.py`). tokens [B, N*block_size]:
    the sequence's tokens at each block's positions anchor..anchor+block_size-1 (the block
    drafted is its anchor then mask tokens; the Markov head reads the true previous tokens).
    -> (logits [B, N, J, V] with the Markov bias, confidence logits [B, N, J] or None), J the
    drafts per block: with `sample_from_anchor` every slot (slot j predicts anchor+j+1), else
    slots 1.. (slot j predicts anchor+j), so draft i always predicts anchor+i+1."""
    b, n = anchors_bn.shape
    tokens_bns = tokens_bq.reshape(b, n, block_size)
    block_bq = tokens_bns.at[:, :, 1:].set(drafter_config.mask_token_id).reshape(b, -1)
    hidden_bnsd = block_hidden(
        drafter_params, target_params, target_config, drafter_config, block_bq,
        ctx_k, ctx_v, context_lengths_b, anchors_bn, block_size,
    )  # fmt: skip
    prev_bns = dspark.previous_tokens(drafter_config, tokens_bns)
    bias_bnsu, confidence_bns = dspark.block_heads(
        drafter_config, drafter_params, hidden_bnsd, prev_bns
    )
    first = 0 if drafter_config.sample_from_anchor else 1
    logits_bnjv = own_vocab_logits(
        drafter_params, target_params, target_config, drafter_config, hidden_bnsd[:, :, first:],
        None if bias_bnsu is None else bias_bnsu[:, :, first:],
    )  # fmt: skip
    return logits_bnjv, None if confidence_bns is None else confidence_bns[:, :, first:]


def check_fits(
    drafter_config: DrafterConfig, target_config: TargetConfig, drafter_params=None
) -> None:
    """Raises ConfigError naming the first mismatch between a drafter and its target. With
    `drafter_params`, also checks that fc's input width matches taps x target hidden size."""
    d, t = drafter_config, target_config
    if d.hidden_size != t.hidden_size:
        raise ConfigError(
            f"drafter hidden_size={d.hidden_size} does not match the target's "
            f"hidden_size={t.hidden_size}"
        )
    if d.vocab_size != t.vocab_size:
        raise ConfigError(
            f"drafter vocab_size={d.vocab_size} does not match the target's "
            f"vocab_size={t.vocab_size}"
        )
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise ConfigError(
            f"drafter mask_token_id={d.mask_token_id} is not a row of the target embedding "
            f"(vocab_size={t.vocab_size})"
        )
    bad = [l for l in d.target_layer_ids if not -1 <= l < t.num_layers]
    if bad:
        raise ConfigError(
            f"drafter target_layer_ids {list(d.target_layer_ids)} include {bad}, outside "
            f"[-1 (the embedding), {t.num_layers - 1}] for a {t.num_layers}-layer target"
        )
    if drafter_params is not None and d.draft_vocab_size:
        ids = np.asarray(jax.device_get(drafter_params["draft_to_target"]))
        if ids.min() < 0 or ids.max() >= t.vocab_size or np.any(np.diff(ids) <= 0):
            raise ConfigError(
                f"drafter draft_to_target maps its {d.draft_vocab_size} draft ids onto "
                f"[{ids.min()}, {ids.max()}], not distinct ascending ids of the target's "
                f"vocabulary [0, {t.vocab_size}); re-export the drafter"
            )
    if drafter_params is not None:
        width = drafter_params["fc"]["kernel"].shape[0]
        if width != d.num_taps * t.hidden_size:
            raise ConfigError(
                f"drafter fc takes {width} inputs; {d.num_taps} taps x hidden_size "
                f"{t.hidden_size} = {d.num_taps * t.hidden_size} expected"
            )
