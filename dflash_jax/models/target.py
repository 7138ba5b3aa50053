"""The target causal LM (Llama family and Qwen3 dense) with a fixed-size KV cache and taps.

One forward serves prefill, verify blocks and plain full-sequence passes:
  tokens [B,T], positions [B,T]; optional cache with per-row lengths [B] — new K/V are written at
  slots lengths[b] + t (scatter, mode="drop", so nothing past the buffer is ever clobbered) and
  query t sees slots <= lengths[b] + t. Without a cache, attention is causal over the T tokens.
It returns logits, the concatenated taps (raw residual output of each requested decoder layer,
= HF `hidden_states[l+1]`) and the updated cache.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.models import hybrid, sliding
from dflash_jax.models.layers import MLP, AttentionProjections, RMSNorm, rope_inv_freq, rope_tables
from dflash_jax.models.linear_attention import commit_state, init_state
from dflash_jax.ops import dots, invariance, platform
from dflash_jax.ops.caches import write_rows
from dflash_jax.ops.dispatch import cached_attention, causal_attention
from dflash_jax.ops.reductions import argmax_last, head_argmax, head_argmax_applies


def row_rule(config: TargetConfig) -> invariance.RowRule | None:
    """The config's `invariant_rows` as an `ops.invariance.RowRule` (None: none)."""
    return None if config.invariant_rows is None else invariance.RowRule(*config.invariant_rows)


def norm_rows(config: TargetConfig) -> int:
    """The RMSNorms' fixed row tile under the config's row rule (0: none)."""
    rule = row_rule(config)
    return 0 if rule is None else rule.tile


@flax.struct.dataclass
class KVCache:
    """Per-layer key/value buffers, each kv-head-major [B,K,S,H]; lengths live with the caller.
    A hybrid target's k/v hold its full-attention layers only, and `state` each of its
    linear-attention layers' (conv [B,W,C], recurrent [B,Hv,Dk,Dv]) state, in layer order.
    rings (static): per k/v buffer, whether it is a ring (a sliding layer's: position p at slot
    p mod its length, `ops.caches.write_rows(ring=True)`); () for none."""

    k: tuple
    v: tuple
    state: tuple | None = None
    rings: tuple = flax.struct.field(pytree_node=False, default=())

    def written(self, k_rows: tuple, v_rows: tuple, start_b: jax.Array) -> KVCache:
        """The cache with rows [B,K,T,H] per buffer written at start[b] + t (`write_rows`)."""
        rings = self.rings or (False,) * len(self.k)
        write = lambda bufs, rows: tuple(
            write_rows(c, r, start_b, ring) for c, r, ring in zip(bufs, rows, rings, strict=True)
        )
        return self.replace(k=write(self.k, k_rows), v=write(self.v, v_rows))

    def with_prefix(self, prefix: KVCache) -> KVCache:
        """The cache with every row's first C slots a copy of `prefix`'s one row of C slots (the
        K/V of tokens every row begins with: `phases.prefill(prefix=...)`); flat buffers."""

        def put(big, one):
            rows = jnp.broadcast_to(one, (big.shape[0], *one.shape[1:])).astype(big.dtype)
            return jax.lax.dynamic_update_slice(big, rows, (0,) * big.ndim)

        return self.replace(
            k=tuple(map(put, self.k, prefix.k)), v=tuple(map(put, self.v, prefix.v))
        )

    @classmethod
    def zeros(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype) -> KVCache:
        shape = (batch, num_kv_heads, max_len, head_dim)
        # zeros, never jnp.empty (uninitialised since JAX 0.11).
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class DecoderLayer(nn.Module):
    config: TargetConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        dot, rows = invariance.dot_general(row_rule(c)), norm_rows(c)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype, rows)
        self.self_attn = AttentionProjections(
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            c.use_qk_norm,
            c.rms_norm_eps,
            dtype,
            dot,
            rows,
        )
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dtype, rows)
        self.mlp = MLP(c.intermediate_size, dtype, dot)

    def __call__(
        self,
        x_btd,
        cos,
        sin,
        layer_cache=None,
        cache_lengths=None,
        defer_write=False,
        tree_mask=None,
    ):
        """x [B,T,D]. With a cache ((k, v), each [B,K,S,H]) the T new tokens are written at
        cache_lengths[b] + t and query t sees slots <= cache_lengths[b] + t (cache_lengths None:
        an empty cache, written from slot 0); without, attention is causal over the T tokens.
        -> (x [B,T,D], updated cache or None). defer_write: the cache is left unwritten and the
        new rows (k, v) [B,K,T,H] are returned in its place. tree_mask [B,T,T] (with a cache):
        the T tokens are a token tree, query t sees new token t' iff tree_mask[b,t,t']."""
        h_btd = self.input_layernorm(x_btd)
        q_btnh = self.self_attn.query(h_btd, cos, sin)
        k_bkth, v_bkth = self.self_attn.key_value(h_btd, cos, sin)
        impl, rows = self.config.attention_impl, row_rule(self.config)
        if layer_cache is not None and cache_lengths is not None:
            new_cache = None
            if not defer_write:
                new_cache = (
                    write_rows(layer_cache[0], k_bkth, cache_lengths),
                    write_rows(layer_cache[1], v_bkth, cache_lengths),
                )
            new_kv = (k_bkth, v_bkth)
            attn_btnh = cached_attention(
                q_btnh,
                layer_cache,
                new_cache,
                new_kv,
                cache_lengths,
                impl=impl,
                rows=rows,
                tree_mask=tree_mask,
            )
            layer_cache = (k_bkth, v_bkth) if defer_write else new_cache
        else:
            # No cache, or an empty one (prefill): the new tokens attend among themselves.
            zeros_b = jnp.zeros((x_btd.shape[0],), jnp.int32)
            attn_btnh = causal_attention(q_btnh, k_bkth, v_bkth, zeros_b, impl=impl, rows=rows)
            if layer_cache is not None:
                layer_cache = (
                    write_rows(layer_cache[0], k_bkth, zeros_b),
                    write_rows(layer_cache[1], v_bkth, zeros_b),
                )
        x_btd = x_btd + self.self_attn.output(attn_btnh)
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd))
        return x_btd, layer_cache


@functools.cache
def _jitted_layer(config: TargetConfig, defer_write: bool):
    """`DecoderLayer.apply` as a jitted function of (layer params, x, cos, sin, cache, lengths).
    Inside a jitted pass it is traced once per shape and called once per layer: the program is
    the same (XLA inlines the calls), but tracing and lowering a 30-layer target in four step
    kinds drop from one trace per layer and kind to one per kind."""

    def apply(params, x_btd, cos, sin, layer_cache, cache_lengths, tree_mask=None):
        return DecoderLayer(config, parent=None).apply(
            {"params": params}, x_btd, cos, sin, layer_cache, cache_lengths, defer_write, tree_mask
        )

    return jax.jit(apply)


class Transformer(nn.Module):
    """Causal LM. Params: embed_tokens, layers_{i}, norm, lm_head (absent when tied)."""

    config: TargetConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype)
        if c.sliding:  # Gemma 3 / gpt-oss: sliding-window layers (models/sliding.py)
            self.layers = sliding.make_layers(c)
            self.norm = sliding.final_norm(c)
            if c.per_layer_input_size:  # Gemma 4's per-layer inputs
                self.per_layer_inputs = sliding.PerLayerInputs(c)
        elif c.layered:  # MoE / hybrid families: layers built per kind (models/hybrid.py)
            self.layers = hybrid.make_layers(c)
            self.norm = hybrid.final_norm(c)
        else:
            self.layers = [DecoderLayer(c) for _ in range(c.num_layers)]
            self.norm = RMSNorm(c.rms_norm_eps, dtype, norm_rows(c))
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(
                c.vocab_size,
                use_bias=False,
                dtype=dtype,
                dot_general=invariance.dot_general(row_rule(c)),
            )
        self.inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling)

    def embed(self, tokens_bt: jax.Array, scaled: bool = True) -> jax.Array:
        """Tokens [B,T] -> [B,T,D]; scaled=False: the raw table's rows, without Gemma's
        sqrt(hidden) (how a drafter embeds its block)."""
        x_btd = self.embed_tokens(tokens_bt)
        scale = sliding.embed_scale(self.config) if scaled else None
        if scale is None:
            return x_btd
        # As HF: the multiplier rounded to the embedding's dtype first (bf16: sqrt(3072) -> 55.5)
        return x_btd * jnp.asarray(scale, self.embed_tokens.embedding.dtype).astype(x_btd.dtype)

    def unembed(self, x_btd: jax.Array, capped: bool = True) -> jax.Array:
        """Frozen LM head on already-normalised hidden states -> logits [..., V] (tanh-capped
        at `final_logit_softcapping` when set and `capped`; a drafter's are not)."""
        cap = self.config.final_logit_softcapping if capped else 0.0
        return softcap(self._unembed(x_btd), cap)

    def _unembed(self, x_btd: jax.Array) -> jax.Array:
        rule = row_rule(self.config)
        if self.config.tie_word_embeddings and rule is None:  # Embed.attend, fp32 accumulation
            dtype = jnp.dtype(self.config.dtype)
            emb_vd = self.embed_tokens.embedding.astype(dtype)
            dims = (((x_btd.ndim - 1,), (1,)), ((), ()))
            return dots.dot_general(x_btd.astype(dtype), emb_vd, dims)
        if self.config.tie_word_embeddings:
            return invariance.transposed_matmul(rule, x_btd, self.embed_tokens.embedding)
        return self.lm_head(x_btd)

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache | None = None,
        cache_lengths: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
        logit_indices: jax.Array | None = None,
    ):
        """Returns (logits, taps, cache).

        logits: [B,T,V], or [B,M,V] at `logit_indices` [B,M] (e.g. each row's last prompt token).
        taps: [B,T,len(tap_layers)*D] in tap_layers order (None when no taps are asked for).
        """
        hidden, taps_btf, new_cache = self.hidden(
            tokens_bt, positions_bt, cache, cache_lengths, tap_layers, logit_indices
        )
        return self.unembed(hidden), taps_btf, new_cache

    def hidden(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache | None = None,
        cache_lengths: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
        logit_indices: jax.Array | None = None,
        defer_cache_write: bool = False,
        tree_mask: jax.Array | None = None,
        prompt_ends: jax.Array | None = None,
    ):
        """`__call__` without the lm_head: (final-normed hidden [B,T or M,D], taps, cache). The
        decode loop applies the head itself (`Head`). defer_cache_write (with cache_lengths):
        the cache is not written; its place in the result holds the new rows, a `KVCache` of
        [B,K,T,H] per layer, for the caller to write (`write_rows`) where it suits it.
        tree_mask [B,T,T] (with cache_lengths): the tokens are a token tree, each seeing the
        cache and the new tokens it marks (`ops.attention.tree_attention_mask`). prompt_ends
        [B] (a sliding family's prefill chunk, `phases.prompt_pass`): where each row's prompt
        ends within the chunk, a sliding layer's ring written with the rows before it only."""
        c = self.config
        for l in tap_layers:
            if not -1 <= l < c.num_layers:
                raise ValueError(
                    f"tap layer {l} out of range for a {c.num_layers}-layer target "
                    "(-1: the embedding)"
                )
        x_btd = self.embed(tokens_bt)
        if c.sliding:
            tables = sliding.rope_tables(c, positions_bt, x_btd.dtype)
            ple = self.per_layer_inputs(tokens_bt, x_btd) if c.per_layer_input_size else None
            return self._layered_hidden(
                x_btd, tables, None, cache, cache_lengths, tap_layers, logit_indices,
                defer_cache_write, tree_mask, ple, prompt_ends,
            )  # fmt: skip
        cos, sin = rope_tables(positions_bt, self.inv_freq, x_btd.dtype)
        if c.layered:
            return self._layered_hidden(
                x_btd, cos, sin, cache, cache_lengths, tap_layers, logit_indices,
                defer_cache_write, tree_mask,
            )  # fmt: skip
        taps, new_k, new_v = {-1: x_btd}, [], []  # tap -1: the embedding's output
        params = None if self.is_initializing() else self.variables["params"]
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i])
            args = (x_btd, cos, sin, layer_cache, cache_lengths)
            if params is None:  # init: the submodules create their params
                x_btd, layer_cache = layer(*args, defer_cache_write, tree_mask)
            else:
                x_btd, layer_cache = _jitted_layer(c, defer_cache_write)(
                    params[f"layers_{i}"], *args, tree_mask
                )
            if layer_cache is not None:
                new_k.append(layer_cache[0])
                new_v.append(layer_cache[1])
            if i in tap_layers:
                taps[i] = x_btd
        taps_btf = jnp.concatenate([taps[l] for l in tap_layers], -1) if tap_layers else None
        if logit_indices is not None:
            x_btd = jnp.take_along_axis(x_btd, logit_indices[:, :, None], axis=1)
        new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
        return self.norm(x_btd), taps_btf, new_cache

    def _layered_hidden(
        self, x_btd, cos, sin, cache, cache_lengths, tap_layers, logit_indices, defer, tree_mask,
        ple=None, prompt_ends=None,
    ):  # fmt: skip
        """`hidden` for the MoE / hybrid families (`hybrid.forward_layers`). A prefill (a cache
        and no cache_lengths) of right-padded rows stops each linear layer's state at the row's
        last logit index, its last prompt token, and writes a sliding layer's ring up to it."""
        state_lengths = None
        if cache is not None and cache_lengths is None and logit_indices is not None:
            state_lengths = logit_indices[:, -1] + 1
        if prompt_ends is not None:
            state_lengths = prompt_ends
        params = None if self.is_initializing() else self.variables["params"]
        x_embed = x_btd
        if self.config.sliding:  # cos: the RoPE tables per layer kind (`sliding.rope_tables`)
            x_btd, taps, new = sliding.forward_layers(
                self.layers, params, self.config, x_btd, cos, cache, cache_lengths, tap_layers,
                defer, tree_mask, state_lengths, ple,
            )  # fmt: skip
            new = None if new is None else (*new, ())
        else:
            x_btd, taps, new = hybrid.forward_layers(
                self.layers, params, self.config, x_btd, cos, sin, cache, cache_lengths,
                state_lengths, tap_layers, defer, tree_mask,
            )  # fmt: skip
        taps[-1] = x_embed  # tap -1: the embedding's output
        taps_btf = jnp.concatenate([taps[l] for l in tap_layers], -1) if tap_layers else None
        if logit_indices is not None:
            x_btd = jnp.take_along_axis(x_btd, logit_indices[:, :, None], axis=1)
        new_cache = None
        if new is not None:
            new_cache = KVCache(k=new[0], v=new[1], state=new[2] or None, rings=cache.rings)
        return self.norm(x_btd), taps_btf, new_cache


def commit_states(states: tuple, rows: tuple, produced_b) -> tuple:
    """A hybrid target's linear-layer states after a deferred verify
    (`Transformer.hidden(defer_cache_write=True)`, whose cache slot holds each layer's
    `LinearRows`): each advanced over the first produced[b] verified tokens only
    (`linear_attention.commit_state`). This is the rollback of recurrent state: rejected
    tokens leave no trace, as K/V rows past the lowered length leave none."""
    return tuple(commit_state(s, r, produced_b) for s, r in zip(states, rows, strict=True))


def unembedding_matrix(params, config: TargetConfig) -> jax.Array:
    """The frozen lm_head as a [D,V] matrix, for `hidden @ matrix` in the decode loops.

    A tied head is the embedding [V,D] transposed. On CPU the transpose is materialised once
    per decode call (outside the loop): XLA:CPU's GEMM on the stored [V,D] layout was ~12%
    slower per step (SmolLM2, 1 and 16 rows); the barrier keeps XLA from folding the copy
    back into the dot. Other backends contract either layout at full speed, so no copy.
    """
    if not config.tie_word_embeddings:
        return params["lm_head"]["kernel"]
    head_dv = params["embed_tokens"]["embedding"].T
    if platform.is_cpu():  # the platform compiled for (`ops.platform`), not this process's
        head_dv = jax.lax.optimization_barrier(head_dv)
    return head_dv


def apply_head(head_dv: jax.Array, hidden: jax.Array, rows=None) -> jax.Array:
    """Final-normed hidden [..., D] @ head [D,V] -> logits [..., V] in the hidden's dtype
    (fp32 accumulation, `ops.dots`); under the `ops.invariance.RowRule` `rows` when given."""
    head_dv = head_dv.astype(hidden.dtype)
    if rows is None:
        return dots.matmul(hidden, head_dv)
    return invariance.dot_general(rows)(hidden, head_dv, (((hidden.ndim - 1,), (0,)), ((), ())))


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap) in the logits' dtype (cap 0: the logits as they are)."""
    if not cap:
        return logits
    return (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)


@flax.struct.dataclass
class Head:
    """The frozen lm_head as the decode loops use it: `dv` [D,V] (`unembedding_matrix`) and,
    for a tied head, its [V,D] rows `vd` (the embedding itself, no copy), which let greedy
    decoding take the argmax without materialising the logits (`ops.reductions.head_argmax`)."""

    dv: jax.Array
    vd: jax.Array | None = None
    rows: invariance.RowRule | None = flax.struct.field(pytree_node=False, default=None)
    # The target's final_logit_softcapping (0: none): a monotone map, so the argmax is that of
    # the raw logits; `logits` (sampling) caps them.
    cap: float = flax.struct.field(pytree_node=False, default=0.0)
    # A grammar's allowed tokens at the positions the hidden states stand at [..., V] bool
    # (`decoding.grammar.masked_head`): the logits are -inf elsewhere, so the argmax and every
    # distribution drawn from them keep to the grammar; None: nothing masked.
    allowed: jax.Array | None = None

    def logits(self, hidden: jax.Array) -> jax.Array:
        logits = softcap(self._raw_logits(hidden), self.cap)
        if self.allowed is None:
            return logits
        allowed = self.allowed
        if allowed.ndim < logits.ndim:  # [B, V] for a [B, 1, V] pass (a prefill's last token)
            allowed = jnp.expand_dims(allowed, 1)
        return jnp.where(allowed, logits, -jnp.inf)

    def uncapped(self) -> Head:
        """This head without the target's softcapping: the drafter's head (the references
        apply the raw lm_head to draft hidden states, `DrafterConfig.final_logit_softcapping`
        being the drafter's own)."""
        return self.replace(cap=0.0)

    def _raw_logits(self, hidden: jax.Array) -> jax.Array:
        if self.rows is not None and self.vd is not None:  # as `Transformer.unembed` runs it
            return invariance.transposed_matmul(self.rows, hidden, self.vd)
        if self.rows is None and self.vd is not None and hidden.dtype == jnp.bfloat16:
            # The tied embedding as stored: on XLA:CPU a bf16 product with its transposed copy
            # outside a loop (a prefill) ran as an fp32 dot of the widened embedding, and
            # inside one the stored layout was faster (SmolLM2's head, 2026-12-03, avx512_bf16:
            # 4.6 against 7.8 ms at 1-2 rows, 6.4 against 9.5 ms at 16).
            return dots.matmul_t(hidden, self.vd.astype(hidden.dtype))
        return apply_head(self.dv, hidden, self.rows)

    @property
    def argmax_reads_logits(self) -> bool:
        """Whether `argmax` computes the full logits first (else it is `head_argmax`)."""
        # Under a row rule: the logits through the rule's GEMMs, then an exact argmax. Not
        # `head_argmax`: its fused GEMM + max and its recomputed chunk (a batched matvec over
        # the rows) are kernels the row tile does not fix, so nothing says they round a row
        # the same at every row count; a near tie would then resolve by the pass.
        if self.allowed is not None:  # the masked logits
            return True
        return self.rows is not None or not head_argmax_applies(self.vd, self.dv.shape[1])

    def argmax(self, hidden: jax.Array) -> jax.Array:
        """The greedy token of every final-normed hidden [..., D] -> int32 [...]."""
        return self.argmax_and_logits(hidden)[0]

    def argmax_and_logits(self, hidden: jax.Array):
        """(`argmax(hidden)`, a function giving `logits(hidden)`) for a pass that may need
        both (rows with their own settings: greedy tokens for all, logits if a row samples).
        Where the argmax reads the full logits anyway, the function returns those, so the
        head's product (a [rows, V] GEMM, ~5 ms of an 8-row fp32 step of SmolLM2 on 2
        cores) runs once; the bits are the same either way."""
        if self.argmax_reads_logits:
            logits = self.logits(hidden)
            return argmax_last(logits), lambda: logits
        return head_argmax(hidden, self.dv, self.vd), lambda: self.logits(hidden)


def decoding_head(params, config: TargetConfig) -> Head:
    """The `Head` of a target for the decode loops (inside jit: the [D,V] copy is per call)."""
    vd = params["embed_tokens"]["embedding"] if config.tie_word_embeddings else None
    return Head(
        dv=unembedding_matrix(params, config),
        vd=vd,
        rows=row_rule(config),
        cap=config.final_logit_softcapping,
    )


def init_cache(
    config: TargetConfig, batch: int, max_len: int, dtype=None, verify: int | None = None
) -> KVCache:
    """An empty cache for up to `max_len` positions. verify: the most tokens one pass will
    append to it (a decode's verify width): a sliding layer then keeps a ring of its window +
    verify slots (`sliding.cache_slots`) instead of max_len; None: every layer max_len."""
    dtype = jnp.dtype(dtype or config.dtype)
    if config.sliding:  # each layer its own (kv heads, head dim) (Gemma 4's full layers)
        shapes = [
            (batch, *config.layer_heads(i), sliding.cache_slots(config, i, max_len, verify))
            for i in range(config.num_layers)
        ]
        zeros = lambda: tuple(jnp.zeros((b, k, s, h), dtype) for b, k, h, s in shapes)
        return KVCache(k=zeros(), v=zeros(), rings=sliding.rings(config))
    num_kv_layers = len(config.attention_layers) if config.layered else config.num_layers
    cache = KVCache.zeros(
        num_kv_layers, batch, max_len, config.num_kv_heads, config.head_dim, dtype
    )
    if config.linear_layers:
        states = tuple(init_state(config, batch, dtype) for _ in config.linear_layers)
        cache = cache.replace(state=states)
    return cache


def init_params(config: TargetConfig, rng: jax.Array):
    """Random params (tests, eval_shape of full-size configs)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    return Transformer(config).init(rng, tokens, jnp.zeros((1, 2), jnp.int32))["params"]
