"""Adaptive draft length: the controller inside the jitted loop, and step costs.

Each loop step runs one of a few compiled step kinds (`DecodeConfig.step_kinds`, block sizes;
1 = a plain target step that drafts nothing but still feeds the drafter's context). The kind
is chosen on device, before the step, by expected committed tokens per unit of cost:

  value(b) = E[tau | b] / cost(b),   E[tau | b] = 1 + sum_{j<b} prod_{i<=j} alpha_i

alpha_j is a running estimate, per row, of the chance that draft j is accepted given that
drafts 1..j-1 were; after a drafting step every tried position j (all earlier ones accepted)
moves it toward accepted-or-not by `adaptive_rate`. All rows of a batch share the kind (they
verify together); the choice maximises the mean value over the rows still decoding. After
`probe_every` plain steps in a row, the smallest drafting kind runs once: the estimates stay
fresh, and a drafter that starts to succeed later in a generation is taken up again. A probe
(any drafting step) that no row accepts anything from doubles the wait before the next one, up
to `probe_every * probe_backoff`; one that does resets it: on text the drafter cannot predict,
probes cost a few percent less (MT-Bench with the shipped SmolLM2 drafter drafted 8% of steps).

Prompt-lookup kinds (`DecodeConfig.lookup_kinds`, recorded as -b) draft by copying
(`decoding/lookup.py`) and are valued the same way with their own estimates, which move after
every step whatever kind ran (`update_lookup_estimates`: the copy proposed before the step
against the tokens the step committed), and only for rows where a copy exists.

A tree kind (`DecodeConfig.tree_nodes` in adaptive mode, recorded as `tree_kind(N)`; a step of
`decoding/tree.py`: a best-first tree of N tokens, one verify under the tree mask, the longest
accepted path) is valued the same way with its own per-depth estimates `tree_alpha` (the chance
that the accepted path reaches depth j given it reached j - 1), moved only by tree steps, over
the depths the tree can reach (`tree_reach`: min(G, N - 1)). In greedy decoding each is floored
by the chain's alpha_j: the tree's nodes are the drafter's most probable prefixes, the chain's
own drafts (the per-depth argmax) among them as deep as the tree reaches them, and there the
tree keeps a node wherever the chain keeps its draft. The floor lets a tree that has not run yet
look at least as good as the chain: one that costs about as much as the chain is tried, and its
own estimates take over where it does better. It is a heuristic past the depth to which the
tree holds the chain (DFlash2 and DSpark drafters, whose chains are walks, run no trees); sampling
has no floor (a sampled draft need not be in the tree). A wrong estimate costs speed, never the
output. A tree step moves the chain's estimates not at all, a chain step the tree's likewise.

cost(b) is one step of kind b in AR-step units. `decoding.calibration` measures it for a
target, drafter, batch, shape and platform (cached on disk); the costs enter the jitted function
as an array, so recalibrating never recompiles. `default_step_costs` is the fallback.

Each rule here belongs to one proposer of `decoding.proposers`, whose registry entries hold
their estimates in the loop state, value their kinds before a step (`proposers.choose_kind`)
and learn after it (`proposers.learn`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.settings import TREE_KIND_BASE, DecodeConfig


def default_step_costs(kinds: tuple[int, ...], platform: str | None = None) -> np.ndarray:
    """Step costs in AR steps when none were measured. CPU: 1 + 0.12 (b - 1), from SmolLM2-135M
    on our 2-core CPU (a 16-token step cost 2.7 AR steps, an 8-token one 1.8); a CPU pays for
    every verified token. GPU/TPU: 1.1 for every drafting kind, since a 16-token verify costs
    about one AR step there and the draft about a tenth of one (dflash-spec §11). A tree of N
    tokens is costed as a chain of N: its verify's rows (building it is a few top-k calls)."""
    platform = platform or jax.default_backend()
    kinds = np.asarray(kinds, np.int64)
    # The rows a kind verifies: a lookup kind (-b) b, a tree N.
    b = np.where(kinds >= TREE_KIND_BASE, kinds - TREE_KIND_BASE, np.abs(kinds)).astype(np.float32)
    if platform == "cpu":
        costs = 1.0 + 0.12 * (b - 1.0)
    else:
        costs = np.where(b > 1, 1.1, 1.0)
    return costs.astype(np.float32)


def expected_tokens(alpha_bg: jax.Array, kinds: tuple[int, ...]) -> jax.Array:
    """alpha [B, G] (per-position conditional acceptance) -> E[tau | kind] [B, num_kinds]."""
    csum_bg = jnp.cumsum(jnp.cumprod(alpha_bg, axis=-1), axis=-1)
    cols = [jnp.ones_like(alpha_bg[:, 0]) if b == 1 else 1.0 + csum_bg[:, b - 2] for b in kinds]
    return jnp.stack(cols, axis=-1)


def tree_reach(cfg: DecodeConfig) -> int:
    """The deepest node a tree step can accept: min(G, N - 1) (G = block size - 1 drafted
    depths; N - 1 drafted nodes make at most a chain of N - 1)."""
    return min(cfg.block_size - 1, cfg.tree_nodes - 1)


def tree_expected_tokens(tree_alpha_bg, alpha_bg, cfg: DecodeConfig) -> jax.Array:
    """E[tau | tree] [B] from the tree's per-depth estimates [B, G] over the depths it can
    reach; in greedy decoding each estimate at least the chain's (`alpha_bg`, module
    docstring)."""
    a_bg = jnp.maximum(tree_alpha_bg, alpha_bg) if cfg.greedy else tree_alpha_bg
    return 1.0 + jnp.sum(jnp.cumprod(a_bg[:, : tree_reach(cfg)], axis=-1), axis=-1)


def next_probe_wait(probe_wait, block, accepted_b, active_b, cfg: DecodeConfig):
    """The wait (plain steps) before the next probe after a step of block size `block`: plain
    steps keep it; a drafting step that no active row accepted a draft from doubles it (up to
    probe_every * probe_backoff), one that some row did resets it to probe_every."""
    hit = jnp.any((accepted_b > 0) & active_b)
    longer = jnp.minimum(2 * probe_wait, cfg.probe_every * cfg.probe_backoff)
    after_draft = jnp.where(hit, cfg.probe_every, longer).astype(jnp.int32)
    return jnp.where(block > 1, after_draft, probe_wait)


def update_estimates(alpha_bg, a_b, tried_b, block_size, rate: float):
    """After a drafting step of `block_size` (an int, or traced) that accepted a_b drafts:
    every tried position j (1-based, j < block_size, a >= j - 1) moves toward (a >= j). Rows
    that tried nothing (tried_b == 0: already done) keep their estimates, and so does every row
    after a step that drafted nothing (block_size 1, or -b for a copied block)."""
    j_g = jnp.arange(1, alpha_bg.shape[1] + 1)
    tried_bg = (j_g[None, :] < block_size) & (tried_b[:, None] > 0)
    return _move_tried(alpha_bg, a_b, tried_bg, rate)


def _move_tried(alpha_bg, a_b, limit_bg, rate: float):
    """Moves every position j (1-based) inside `limit_bg` that was tried (the first j-1 drafts
    were accepted, a >= j - 1) toward whether it was accepted (a >= j)."""
    j_g = jnp.arange(1, alpha_bg.shape[1] + 1)
    tried_bg = limit_bg & (a_b[:, None] >= j_g[None, :] - 1)
    hit_bg = (a_b[:, None] >= j_g[None, :]).astype(alpha_bg.dtype)
    return jnp.where(tried_bg, (1.0 - rate) * alpha_bg + rate * hit_bg, alpha_bg)


def update_lookup_estimates(alpha_bg, proposal_bg, new_bt, produced_b, found_b, rate: float):
    """Moves the lookup estimates after any step, whatever kind ran: the copy proposed before
    the step is compared with the tokens the step committed (the target's), so position j
    counts as tried when j <= produced and the copy matched positions 1..j-1. Plain and drafter
    steps keep the estimates fresh this way at no cost; rows without a copy keep theirs. When
    the copy matched everything committed, the positions past it (not observed) are raised to
    the last observed one's estimate: otherwise a short kind that always succeeds would never
    let a longer one look worth trying."""
    g = alpha_bg.shape[1]
    t = min(g, new_bt.shape[1], proposal_bg.shape[1])
    match_bt = proposal_bg[:, :t] == new_bt[:, :t]
    a_b = jnp.sum(jnp.cumprod(match_bt.astype(jnp.int32), axis=-1), axis=-1)
    j_g = jnp.arange(1, g + 1)
    observed_bg = (j_g[None, :] <= produced_b[:, None]) & found_b[:, None]
    alpha_bg = _move_tried(alpha_bg, a_b, observed_bg, rate)
    last_b = jnp.clip(produced_b, 1, g) - 1
    last_alpha_b = jnp.take_along_axis(alpha_bg, last_b[:, None], 1)
    beyond_bg = (j_g[None, :] > produced_b[:, None]) & (a_b >= produced_b)[:, None]
    beyond_bg &= found_b[:, None] & (produced_b > 0)[:, None]
    return jnp.where(beyond_bg, jnp.maximum(alpha_bg, last_alpha_b), alpha_bg)
