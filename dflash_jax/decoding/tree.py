"""Tree verification: one step drafts a token tree instead of a chain, verifies every node in
one target pass and commits the longest accepted root path plus one target token.

The drafter already gives a distribution at every block position (depth d = 1..G, G = block
size - 1) in its one pass. `grow_tree` turns them into a tree of N = `DecodeConfig.tree_nodes`
tokens (the anchor as root, N - 1 drafted nodes) grown best-first by the product of the drafter's
probabilities along the path (DDTree's rule): the N most probable prefixes. The target verifies
the nodes at positions start + depth under the tree mask (each node sees the cache and its
ancestors, `ops.attention.tree_attention_mask`), its K/V rows returned unwritten; the accepted
path's rows are then gathered into a block as a chain step would give them (K/V at start..,
the drafter's context from the path's taps), so `speculative._apply` writes them unchanged.

Acceptance walks the tree from the root:
  greedy    a node is kept when its token is the target's argmax after its parent; the deepest
            node whose whole path is kept wins (siblings hold distinct tokens, so one path).
  sampling  multi-candidate rejection sampling over siblings (SpecInfer's rule with each sibling
            a deterministic candidate): the children of a kept node are tried in rank order,
            child x accepted with probability p'(x), where p' is the target's distribution with
            the siblings already rejected removed and renormalised; when all are rejected the
            bonus is drawn from p with every child removed. Each committed token is then an
            exact sample of the target (the tree depends on the drafter only).

Letters: B batch, N tree nodes, G drafted depths, K top candidates per depth, V vocab, W the
committed block (block size), D model width, F taps.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.decoding.phases import context_rows, draft_hidden
from dflash_jax.decoding.sampling import process_logits, row_keys, sample
from dflash_jax.decoding.state import step_key
from dflash_jax.models.drafter import drafter_logits
from dflash_jax.models.target import Transformer
from dflash_jax.ops.attention import tree_attention_mask


@flax.struct.dataclass
class Tree:
    """N nodes per row in topological order (a parent before its children); node 0 is the
    anchor. tokens, parent, depth, rank: [B,N] int32 (rank: the token's place among the
    drafter's candidates at its depth; siblings hold distinct ranks); valid [B,N] bool
    (False: the candidates ran out; such a node is never accepted)."""

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array
    rank: jax.Array
    valid: jax.Array


def grow_tree(anchor_b: jax.Array, logp_bgv: jax.Array, num_nodes: int) -> Tree:
    """The `num_nodes`-node tree of the most probable prefixes under the drafter's per-depth
    log-probs [B,G,V] (a prefix's score: the sum of its tokens' log-probs; DDTree's best-first
    rule). A prefix scores no more than its parent, so the M = N - 1 best prefixes form a tree,
    and those of depth d extend the M best of depth d - 1: a beam of M prefixes per depth, each
    grown from the last one's by `lax.top_k` over its M x K extensions (K = the drafter's top
    candidates per depth), then the M best of all G x M by one more `lax.top_k`. Candidates
    are laid out by depth, so an equal-scoring parent still comes before its child. Static
    shapes throughout; G + 1 top-k calls, no per-node loop. anchor [B] -> Tree."""
    b, g, v = logp_bgv.shape
    m = num_nodes - 1
    k = min(m, v)
    top_lp_bgk, top_tok_bgk = jax.lax.top_k(logp_bgv, k)
    # Beam of depth 1: the K candidates, padded to M with -inf (empty) entries.
    score_bm = jnp.pad(top_lp_bgk[:, 0], ((0, 0), (0, m - k)), constant_values=-jnp.inf)
    rank_bm = jnp.pad(jnp.arange(k, dtype=jnp.int32), (0, m - k))[None].repeat(b, 0)
    scores, parents, ranks = [score_bm], [jnp.zeros((b, m), jnp.int32)], [rank_bm]
    for d in range(1, g):
        ext_bmk = score_bm[:, :, None] + top_lp_bgk[:, d, None, :]
        score_bm, flat_bm = jax.lax.top_k(ext_bmk.reshape(b, m * k), m)
        scores.append(score_bm)
        parents.append((flat_bm // k).astype(jnp.int32))  # its parent's slot in the last beam
        ranks.append((flat_bm % k).astype(jnp.int32))
    score_bc, parent_bc, rank_bc = (jnp.concatenate(x, axis=1) for x in (scores, parents, ranks))
    # The M best of all candidates (c = (depth - 1) * M + slot), best first.
    node_score_bm, pick_bm = jax.lax.top_k(score_bc, m)
    valid_bm = node_score_bm > -jnp.inf
    depth_bm = (pick_bm // m + 1).astype(jnp.int32)
    rank_bm = jnp.take_along_axis(rank_bc, pick_bm, axis=1)
    token_bm = jnp.take_along_axis(top_tok_bgk.reshape(b, g * k), (depth_bm - 1) * k + rank_bm, 1)
    # Candidate -> its node index (1..M); a parent candidate sits one beam earlier.
    rows_bm = jnp.broadcast_to(jnp.arange(b)[:, None], (b, m))
    node_of_bc = jnp.zeros((b, g * m), jnp.int32).at[rows_bm, pick_bm].set(jnp.arange(1, m + 1))
    parent_c_bm = (depth_bm - 2) * m + jnp.take_along_axis(parent_bc, pick_bm, axis=1)
    parent_bm = jnp.take_along_axis(node_of_bc, jnp.maximum(parent_c_bm, 0), axis=1)
    parent_bm = jnp.where(depth_bm > 1, parent_bm, 0)
    # A node with no candidate left (fewer than M finite ones) is an isolated leaf of the root.
    parent_bm, depth_bm = jnp.where(valid_bm, parent_bm, 0), jnp.where(valid_bm, depth_bm, 1)
    root = lambda x0_b, x_bm: jnp.concatenate([x0_b[:, None], x_bm], axis=1)
    zero_b = jnp.zeros((b,), jnp.int32)
    return Tree(
        tokens=root(anchor_b.astype(jnp.int32), token_bm.astype(jnp.int32)),
        parent=root(zero_b, parent_bm),
        depth=root(zero_b, depth_bm),
        rank=root(zero_b, rank_bm),
        valid=root(jnp.ones((b,), bool), valid_bm),
    )


def deepest_kept(kept_bn: jax.Array, tree: Tree, anc_bnn: jax.Array) -> jax.Array:
    """The deepest node whose path from the root is all kept (the root always is) -> [B]."""
    path_kept_bn = jnp.all(~anc_bnn | kept_bn[:, None, :], axis=-1)
    return jnp.argmax(jnp.where(path_kept_bn, tree.depth, -1), axis=-1).astype(jnp.int32)


def accept_greedy_tree(choice_bn: jax.Array, tree: Tree, anc_bnn: jax.Array):
    """choice [B,N]: the target's greedy token after each node. -> (best node [B], bonus [B])."""
    after_parent_bn = jnp.take_along_axis(choice_bn, tree.parent, axis=1)
    kept_bn = (tree.valid & (tree.tokens == after_parent_bn)).at[:, 0].set(True)
    best_b = deepest_kept(kept_bn, tree, anc_bnn)
    return best_b, jnp.take_along_axis(choice_bn, best_b[:, None], axis=1)[:, 0]


def sibling_accepts(u_bn: jax.Array, p_bn: jax.Array, p_before_bn: jax.Array) -> jax.Array:
    """Whether each node, tried after its earlier siblings were rejected, is accepted: with
    probability p(x) / (1 - p(earlier siblings)), its target probability once the rejected
    siblings are removed and the rest renormalised. u: uniforms [B,N]."""
    return u_bn * (1.0 - p_before_bn) < p_bn


def accept_sampled_tree(target_logp_bnv: jax.Array, tree: Tree, anc_bnn: jax.Array, key):
    """Multi-candidate rejection sampling down the tree (module docstring). target_logp [B,N,V]:
    the processed target distribution after each node. -> (best node [B], bonus [B])."""
    b, n, v = target_logp_bnv.shape
    k_accept, k_bonus = jax.random.split(key)
    node_bn = tree.valid & (jnp.arange(n) > 0)[None, :]
    # p(token) under the target's distribution after the node's parent.
    flat_bn = tree.parent * v + tree.tokens
    p_bn = jnp.exp(jnp.take_along_axis(target_logp_bnv.reshape(b, n * v), flat_bn, axis=1))
    p_bn = jnp.where(node_bn, p_bn, 0.0)
    # earlier[b, j, i]: node i is a sibling of node j tried before it.
    earlier_bnn = (
        (tree.parent[:, :, None] == tree.parent[:, None, :])
        & (tree.rank[:, None, :] < tree.rank[:, :, None])
        & node_bn[:, :, None]
        & node_bn[:, None, :]
    )
    p_before_bn = jnp.sum(jnp.where(earlier_bnn, p_bn[:, None, :], 0.0), axis=-1)
    u_bn = jax.vmap(lambda kk: jax.random.uniform(kk, (n,), jnp.float32))(row_keys(k_accept, b))
    ok_bn = node_bn & sibling_accepts(u_bn, p_bn, p_before_bn)
    kept_bn = ok_bn & ~jnp.any(earlier_bnn & ok_bn[:, None, :], axis=-1)
    best_b = deepest_kept(kept_bn.at[:, 0].set(True), tree, anc_bnn)
    # Every child of the best node was rejected: the bonus comes from p without them.
    p_bv = jnp.exp(jnp.take_along_axis(target_logp_bnv, best_b[:, None, None], axis=1)[:, 0])
    child_bn = node_bn & (tree.parent == best_b[:, None])
    rows_bn = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    removed_bv = jnp.zeros((b, v), bool).at[rows_bn, tree.tokens].max(child_bn)
    residual_bv = jnp.where(removed_bv, 0.0, p_bv)
    residual_bv = jnp.where(jnp.sum(residual_bv, -1, keepdims=True) > 0, residual_bv, p_bv)
    return best_b, sample(row_keys(k_bonus, b), jnp.log(residual_bv))


def path_nodes(anc_bnn: jax.Array, depth_bn: jax.Array, best_b: jax.Array, width: int):
    """The nodes on the root path to `best` by depth: [B,W] (node at depth d; 0 past it)."""
    on_path_bn = jnp.take_along_axis(anc_bnn, best_b[:, None, None], axis=1)[:, 0]
    at_depth_bwn = on_path_bn[:, None, :] & (depth_bn[:, None, :] == jnp.arange(width)[:, None])
    return jnp.argmax(at_depth_bwn, axis=-1).astype(jnp.int32)


def build(
    head, tcfg, dcfg, cfg, drafter_params, hidden_bgd: jax.Array, anchor_b: jax.Array
) -> Tree:
    """Tree build: the drafter's hidden states at its G drafted positions [B,G,D] -> their
    distributions (the head, `drafter_logits`; log-softmax when greedy, else the sampling
    transform) -> the `cfg.tree_nodes`-token tree rooted at `anchor` [B] (`grow_tree`)."""
    logits_bgv = drafter_logits(head, tcfg, dcfg, drafter_params, hidden_bgd)
    draft_logp_bgv = (
        jax.nn.log_softmax(logits_bgv, -1) if cfg.greedy else process_logits(logits_bgv, cfg)
    )
    return grow_tree(anchor_b, draft_logp_bgv, cfg.tree_nodes)


def verify(target_params, tcfg, dcfg, t: Tree, start_b: jax.Array, cache):
    """The tree's verify: its N tokens through the target in one pass at positions
    start + depth, under the tree mask, the cache read and not written. -> (final-normed hidden
    [B,N,D], taps [B,N,F], the nodes' K/V rows (a `KVCache` of [B,Kv,N,H]), ancestor mask
    [B,N,N])."""
    anc_bnn = tree_attention_mask(t.parent)
    hidden_bnd, taps_bnf, kv_rows = Transformer(tcfg).apply(
        {"params": target_params},
        t.tokens,
        start_b[:, None] + t.depth,
        cache,
        start_b,
        dcfg.target_layer_ids,
        None,
        True,  # defer the cache write: only the accepted path's rows are written
        anc_bnn,
        method="hidden",
    )
    return hidden_bnd, taps_bnf, kv_rows, anc_bnn


def accept_path(head, cfg, t: Tree, anc_bnn, hidden_bnd, taps_bnf, kv_rows, key, width: int):
    """Acceptance down the tree (greedy or sampled, module docstring), then the accepted path
    moved into a chain step's block of `width` rows. -> dict(new [B,W]: the path's drafts then
    the bonus, accepted [B]: the path's depth, k, v: per layer the path's target K/V rows
    [B,Kv,W,H] (the anchor's first), taps [B,W,F]: the path's taps)."""
    if cfg.greedy:
        best_b, bonus_b = accept_greedy_tree(head.argmax(hidden_bnd), t, anc_bnn)
    else:
        target_logp_bnv = process_logits(head.logits(hidden_bnd), cfg)
        best_b, bonus_b = accept_sampled_tree(target_logp_bnv, t, anc_bnn, key)
    path_bw = path_nodes(anc_bnn, t.depth, best_b, width)
    a_b = jnp.take_along_axis(t.depth, best_b[:, None], axis=1)[:, 0]
    path_tok_bw = jnp.take_along_axis(t.tokens, path_bw, axis=1)
    drafts_bw = jnp.pad(path_tok_bw[:, 1:], ((0, 0), (0, 1)))
    new_bw = jnp.where(jnp.arange(width)[None, :] == a_b[:, None], bonus_b[:, None], drafts_bw)
    rows = lambda x_bknh: jnp.take_along_axis(x_bknh, path_bw[:, None, :, None], axis=2)
    return dict(
        new=new_bw,
        accepted=a_b,
        k=tuple(map(rows, kv_rows.k)),
        v=tuple(map(rows, kv_rows.v)),
        taps=jnp.take_along_axis(taps_bnf, path_bw[:, :, None], axis=1),
    )


def propose(s, ctx, width: int) -> dict:
    """One tree step of the speculative loop (`speculative._StepContext` ctx, loop state s),
    writing nothing: the drafter's distributions -> a tree (`build`) -> one target pass under
    the tree mask (`verify`) -> acceptance and the accepted path as a block of `width` (= block
    size) rows (`accept_path`). -> the fields of a `speculative.Proposal` but its kind: new
    [B,W], accepted [B], k, v (target K/V rows per layer [B,Kv,W,H], the anchor's first),
    ctx_k, ctx_v (drafter context rows)."""
    tcfg, dcfg, cfg, head = ctx.tcfg, ctx.dcfg, ctx.cfg, ctx.head
    _, k_accept = jax.random.split(step_key(ctx.rng, s.step))
    start_b = ctx.prompt_lengths + s.n_gen - 1
    anchor_b1 = jnp.take_along_axis(s.gen, (s.n_gen - 1)[:, None], 1)
    hidden_bgd = draft_hidden(
        ctx.drafter_params,
        ctx.target_params,
        tcfg,
        dcfg,
        anchor_b1,
        s.ctx_k,
        s.ctx_v,
        s.drf_len,
        start_b,
        cfg.block_size,
    )
    t = build(head, tcfg, dcfg, cfg, ctx.drafter_params, hidden_bgd, anchor_b1[:, 0])
    hidden_bnd, taps_bnf, kv_rows, anc_bnn = verify(
        ctx.target_params, tcfg, dcfg, t, start_b, s.cache
    )
    out = accept_path(head, cfg, t, anc_bnn, hidden_bnd, taps_bnf, kv_rows, k_accept, width)
    ctx_ks, ctx_vs = context_rows(ctx.drafter_params, dcfg, s.drf_len, out.pop("taps"))
    return dict(**out, ctx_k=ctx_ks, ctx_v=ctx_vs)
