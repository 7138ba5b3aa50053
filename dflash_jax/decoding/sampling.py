"""Logit processing, sampling and the two acceptance rules (greedy prefix match and lossless
speculative rejection sampling).

Letters: B batch, G = block_size - 1 drafted tokens, V vocab.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.ops.reductions import argmax_last


@flax.struct.dataclass
class RowSettings:
    """Each row's own request settings, carried in the loop state of a decode whose rows are
    different requests (`DecodeConfig.row_settings`: a server's slots, `decoding.slots`):
    temperature [B] (0 = greedy), top_k [B] (0 = off), top_p [B] (1 = off), key_data [B, 2]
    (the raw PRNG key of the request's seed) and max_new [B] (its token limit, at most
    `max_new_tokens`), and with `DecodeConfig.logprobs` logprobs [B] (bool: whether the
    request wants its tokens' log-probabilities). Passed where a DecodeConfig gives the
    sampling settings: it takes the sampling path (`greedy` is False), and the phases give
    greedy rows the argmax (`where_sampled`)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key_data: jax.Array
    max_new: jax.Array
    logprobs: jax.Array | None = None

    greedy = False  # not a field: the sampling path runs, greedy rows mixed in by the phases

    @classmethod
    def uniform(cls, cfg: DecodeConfig, rng: jax.Array, batch: int) -> RowSettings:
        """Every row with `cfg`'s settings and its own key (`rng` folded with its index)."""
        full = lambda value, dtype: jnp.full((batch,), value, dtype)
        return cls(
            temperature=full(cfg.temperature, jnp.float32),
            top_k=full(cfg.top_k, jnp.int32),
            top_p=full(cfg.top_p, jnp.float32),
            key_data=jax.random.key_data(row_keys(rng, batch)),
            max_new=full(cfg.max_new_tokens, jnp.int32),
            logprobs=full(False, bool) if cfg.logprobs else None,
        )

    def keys(self) -> jax.Array:
        """The rows' PRNG keys [B]."""
        return jax.random.wrap_key_data(self.key_data)

    def where_sampled(self, sampled, greedy):
        """`greedy` (a pytree of [B, ...] arrays), where any row samples with the sampled rows
        replaced by `sampled()`'s: the sampling arithmetic runs only when a row needs it."""

        def mixed():
            pick_b = self.temperature > 0
            return jax.tree.map(
                lambda s, g: jnp.where(pick_b.reshape((-1,) + (1,) * (s.ndim - 1)), s, g),
                sampled(),
                greedy,
            )

        return jax.lax.cond(jnp.any(self.temperature > 0), mixed, lambda: greedy)


# The log-probability of an alternative outside a row's support (top-k / top-p cut it): finite,
# so that JSON can carry it (as vLLM's -9999.0).
CUT_LOGPROB = -9999.0


def token_logprobs(logits, tokens_bt, rows: RowSettings, k: int, asked_b):
    """Each row's log-probabilities of `tokens_bt` and of its `k` likeliest tokens under the
    distribution it draws from (temperature, top-k, top-p; a greedy row's raw distribution);
    computed only if a row in `asked_b` [B] asks, zeros otherwise. `logits`: a function ->
    the logits [B,T,V], called inside that branch, so that a step where no row asks pays no
    head product for them either.
    -> (logp [B,T], top_logp [B,T,k], top_ids [B,T,k])."""
    b, t = tokens_bt.shape

    def compute():
        logits_btv = logits()
        raw = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
        sampled_b = rows.temperature > 0
        logp = jax.lax.cond(
            jnp.any(sampled_b),
            lambda: jnp.where(sampled_b[:, None, None], process_logits(logits_btv, rows), raw),
            lambda: raw,
        )
        token = jnp.take_along_axis(logp, tokens_bt[..., None], axis=-1)[..., 0]
        top_logp, top_ids = jax.lax.top_k(logp, k)
        return token, jnp.maximum(top_logp, CUT_LOGPROB), top_ids.astype(jnp.int32)

    zeros = lambda: (
        jnp.zeros((b, t), jnp.float32),
        jnp.zeros((b, t, k), jnp.float32),
        jnp.zeros((b, t, k), jnp.int32),
    )
    return jax.lax.cond(jnp.any(asked_b), compute, zeros)


def process_logits(logits: jax.Array, cfg: DecodeConfig | RowSettings) -> jax.Array:
    """Temperature, top-k then top-p -> fp32 log-probabilities with -inf outside the support.
    Applied identically to target and draft logits. Not for greedy decoding. `cfg` a
    RowSettings: each row [B, ...] with its own settings (a greedy row as temperature 1)."""
    if isinstance(cfg, RowSettings):
        return _process_rows(logits.astype(jnp.float32), cfg)
    x = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        # Keep the smallest prefix whose mass reaches top_p (the crossing token included).
        keep = mass_before < cfg.top_p
        threshold = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


# The largest values `_process_rows` looks at first: a top-k cut up to this k, and a top-p cut
# whose crossing value is among them, come from one `lax.top_k` (~9 ms for 56 rows of a 49k
# vocabulary on a 2-core CPU, where sorting the rows took ~1 s); other rows use `_cut_key`.
CANDIDATES = 256


def _process_rows(x: jax.Array, rows: RowSettings) -> jax.Array:
    """`process_logits` of x [B, ..., V] with per-row settings, the same cuts found without a
    sort: the k-th value and top-p's crossing value among the `CANDIDATES` largest, else by
    bisection over the values' order (`_cut_key`); each cut runs only if some row asks."""
    per_row = lambda a: a.reshape((-1,) + (1,) * (x.ndim - 1))
    x = x / per_row(jnp.where(rows.temperature > 0, rows.temperature, 1.0))
    k, p = per_row(rows.top_k), per_row(rows.top_p)
    c = min(CANDIDATES, x.shape[-1])

    def top_k(x):  # keep x >= the k-th largest (ties kept, as `lax.top_k`'s cut)
        top = jax.lax.top_k(x, c)[0]
        kth = jnp.take_along_axis(top, jnp.broadcast_to(jnp.clip(k - 1, 0, c - 1), p.shape), -1)
        found = k <= c
        cut = jnp.where(found, _order_key(kth), _slow_cut(x, found, jnp.ones_like(x), k))
        return jnp.where((k > 0) & (_order_key(x) < cut), -jnp.inf, x)

    def top_p(x):  # keep the largest values up to the one whose mass crosses top_p
        top = jax.lax.top_k(x, c)[0]
        mass = jnp.exp(top - jax.nn.logsumexp(x, axis=-1, keepdims=True))
        before = jnp.cumsum(mass, axis=-1) - mass
        kept = jnp.min(jnp.where(before < p, top, jnp.inf), axis=-1, keepdims=True)
        found = (before[..., -1:] + mass[..., -1:] >= p) | (p >= 1.0)
        cut = jnp.where(found, _order_key(kept), _slow_cut(x, found, jax.nn.softmax(x), p))
        return jnp.where((p < 1.0) & (_order_key(x) < cut), -jnp.inf, x)

    x = jax.lax.cond(jnp.any(rows.top_k > 0), top_k, lambda x: x, x)
    x = jax.lax.cond(jnp.any(rows.top_p < 1.0), top_p, lambda x: x, x)
    return jax.nn.log_softmax(x, axis=-1)


def _slow_cut(x, found, weight, target):
    """`_cut_key` for the rows whose cut lies past the candidates (run only if there are)."""
    key = lambda: _cut_key(_order_key(x), weight, target.astype(weight.dtype))
    none = lambda: jnp.zeros(x.shape[:-1] + (1,), jnp.int32)
    return jax.lax.cond(jnp.any(~found), key, none)


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys of float32 values in the same order (-0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _cut_key(key: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    """The smallest key c with sum(weight[key > c]) < target, per row (keys [..., V], target
    [..., 1]) by bisection over the int32 range: the key of the value that `process_logits`'s
    sorted cut stops at, so `key >= c` keeps what it keeps (weights 1: the k-th largest value;
    probabilities: the value whose mass crosses top_p)."""
    hi = jnp.max(key, axis=-1, keepdims=True)  # nothing above the largest
    lo = jnp.full(hi.shape, jnp.iinfo(jnp.int32).min, jnp.int32)  # the sum there: all

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        below = jnp.sum(jnp.where(key > mid, weight, 0.0), axis=-1, keepdims=True) < target
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One key per batch row (fold in the row index), so a row's randomness never depends on
    the other rows of its batch. -> [B] keys. Keys that are already one per row ([B]: each
    request's own, `RowSettings`) are returned as they are."""
    if per_row(key):
        return key
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


def per_row(key: jax.Array) -> bool:
    """Whether `key` is [B] typed keys, one per row, rather than one key."""
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two keys from one, or from each of [B] per-row keys (two [B] arrays)."""
    if per_row(key):
        pairs = jax.vmap(jax.random.split)(key)
        return pairs[:, 0], pairs[:, 1]
    first, second = jax.random.split(key)
    return first, second


def sample(keys_b: jax.Array, logp_bxv: jax.Array, cfg=None) -> jax.Array:
    """One categorical draw per row from log-probs [B, ..., V] with per-row keys [B]: Gumbel-max,
    or with `cfg` a RowSettings (a server's rows) `sample_inverse_cdf`."""
    if isinstance(cfg, RowSettings):
        return sample_inverse_cdf(keys_b, logp_bxv)
    draw = lambda k, lp: jax.random.categorical(k, lp, axis=-1)
    return jax.vmap(draw)(keys_b, logp_bxv).astype(jnp.int32)


# Ids per chunk of `sample_inverse_cdf`'s first level.
SAMPLE_CHUNK = 128


def sample_inverse_cdf(keys_b: jax.Array, logp_bxv: jax.Array) -> jax.Array:
    """`sample` by inverse CDF in two levels: a chunk of SAMPLE_CHUNK ids by its mass, then an
    id inside it, from two uniforms per draw where Gumbel-max draws V noise values and two logs
    of each ([8, 15, 49152] draws: 25 against 380 ms on the 2-core CPU). Exact up to fp32
    rounding, as Gumbel-max is; the uniforms are in (0, 1], so an id of probability 0 (one a
    top-k or top-p cut removed) is never drawn. Unnormalised log-weights are fine."""

    def one(key, lp):  # lp [..., V]
        p = jnp.exp(lp - jnp.max(lp, axis=-1, keepdims=True))
        p = jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, -p.shape[-1] % SAMPLE_CHUNK)])
        chunks = p.reshape(*p.shape[:-1], -1, SAMPLE_CHUNK)
        u = 1.0 - jax.random.uniform(key, (2, *p.shape[:-1]), jnp.float32)
        cum = jnp.cumsum(jnp.sum(chunks, axis=-1), axis=-1)
        c = jnp.sum(cum < u[0][..., None] * cum[..., -1:], axis=-1)  # first with cum >= u*total
        inner = jnp.take_along_axis(chunks, c[..., None, None], axis=-2)[..., 0, :]
        icum = jnp.cumsum(inner, axis=-1)
        j = jnp.sum(icum < u[1][..., None] * icum[..., -1:], axis=-1)
        return (c * SAMPLE_CHUNK + j).astype(jnp.int32)

    return jax.vmap(one)(keys_b, logp_bxv)


def pick(logits_bv: jax.Array, key: jax.Array, cfg: DecodeConfig | RowSettings) -> jax.Array:
    """Greedy argmax (temperature 0) or one sample per row of the processed distribution."""
    if cfg.greedy:
        return argmax_last(logits_bv)
    return sample(row_keys(key, logits_bv.shape[0]), process_logits(logits_bv, cfg), cfg)


def accept_greedy(drafts_bg: jax.Array, target_logits_bgv: jax.Array):
    """Greedy verification. drafts [B,G]; target logits [B,G+1,V] (row i predicts the token
    after block slot i). Returns (accepted count a [B], committed tokens [B,G+1]): the first a
    drafts, then the target's own token (the bonus) at index a."""
    return accept_greedy_choices(drafts_bg, argmax_last(target_logits_bgv))


def accept_greedy_choices(drafts_bg: jax.Array, choice_bt: jax.Array, kept_b=None):
    """`accept_greedy` from the target's greedy tokens [B,G+1] instead of its logits; with
    `kept_b` [B], only the first kept_b drafts of each row can be accepted."""
    match_bg = drafts_bg == choice_bt[:, :-1]
    if kept_b is not None:
        match_bg &= jnp.arange(drafts_bg.shape[1]) < kept_b[:, None]
    a_b = jnp.sum(jnp.cumprod(match_bg.astype(jnp.int32), axis=-1), axis=-1)
    return a_b, _commit_tokens(drafts_bg, a_b, jnp.take_along_axis(choice_bt, a_b[:, None], 1))


def accept_rejection(
    drafts_bg: jax.Array,
    draft_logp_bgv: jax.Array,
    target_logits_bgv: jax.Array,
    key: jax.Array,
    cfg: DecodeConfig | RowSettings,
    kept_b: jax.Array | None = None,
):
    """Lossless speculative rejection sampling (Leviathan et al.; Chen et al.).

    Draft j was sampled from q_j = draft_logp[:, j]. Accept it iff u_j * q_j(d_j) < p_j(d_j)
    (probability min(1, p/q)), where p_j is the processed target distribution at the same
    position. At the first rejection the bonus is drawn from normalise(max(p - q, 0)); if every
    draft is accepted it is drawn from the target's last row. Every committed token is then an
    exact sample of the target given its prefix.

    kept_b [B] (a confidence cut): only the first kept_b drafts are offered. A draft past the
    cut was never proposed, so its q is 0: it is never accepted and, when every kept draft
    is, the bonus at the cut is drawn from normalise(max(p - 0, 0)) = p, the target itself.
    """
    b, g = drafts_bg.shape
    target_logp_btv = process_logits(target_logits_bgv, cfg)
    p_btv = jnp.exp(target_logp_btv)
    q_bgv = jnp.exp(draft_logp_bgv)
    k_accept, k_bonus = split_key(key)
    keys_accept, keys_bonus = row_keys(k_accept, b), row_keys(k_bonus, b)
    p_d = jnp.take_along_axis(p_btv[:, :g], drafts_bg[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q_bgv, drafts_bg[..., None], -1)[..., 0]
    u_bg = jax.vmap(lambda k: jax.random.uniform(k, (g,), jnp.float32))(keys_accept)
    accept_bg = u_bg * q_d < p_d
    if kept_b is not None:
        accept_bg, q_bgv = past_the_cut(accept_bg, q_bgv, kept_b)
    a_b = jnp.sum(jnp.cumprod(accept_bg.astype(jnp.int32), axis=-1), axis=-1)

    q_pad_btv = jnp.concatenate([q_bgv, jnp.zeros_like(q_bgv[:, :1])], axis=1)
    p_a = jnp.take_along_axis(p_btv, a_b[:, None, None], 1)[:, 0]
    q_a = jnp.take_along_axis(q_pad_btv, a_b[:, None, None], 1)[:, 0]
    residual_bv = jnp.maximum(p_a - q_a, 0.0)
    residual_bv = jnp.where(jnp.sum(residual_bv, -1, keepdims=True) > 0, residual_bv, p_a)
    bonus_b = sample(keys_bonus, jnp.log(residual_bv), cfg)
    return a_b, _commit_tokens(drafts_bg, a_b, bonus_b[:, None])


def past_the_cut(accept_bg, q_bgv, kept_b):
    """The drafts after a row's first kept_b were not offered: never accepted, q = 0 there."""
    offered_bg = jnp.arange(accept_bg.shape[1]) < kept_b[:, None]
    return accept_bg & offered_bg, jnp.where(offered_bg[..., None], q_bgv, 0.0)


def _commit_tokens(drafts_bg, a_b, bonus_b1):
    """[d_1 .. d_a, bonus, (unused)] -> [B, G+1]."""
    padded_bt = jnp.concatenate([drafts_bg, bonus_b1], axis=1)
    idx_t = jnp.arange(padded_bt.shape[1])
    return jnp.where(idx_t[None, :] == a_b[:, None], bonus_b1, padded_bt)
