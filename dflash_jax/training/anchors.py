"""Anchor sampling for block-diffusion training (dflash-spec §7.2), in numpy for the data pipeline.

An anchor p starts a block [x_p, MASK x (block_size-1)] whose slot k is labelled with x_{p+k}.
Candidates are the positions whose token and next token are both assistant tokens
(loss_mask[p] = loss_mask[p+1] = 1, p+1 < length), so every kept block has at least one label.
"""

from __future__ import annotations

import numpy as np


def anchor_candidates(loss_mask_s: np.ndarray, length: int) -> np.ndarray:
    """Positions p < length-1 with loss_mask[p] and loss_mask[p+1] both set -> int32 [C]."""
    m = np.asarray(loss_mask_s[:length], dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:]).astype(np.int32)


def sample_anchors(
    loss_mask_s: np.ndarray, length: int, num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Randomly permutes the candidates, keeps up to `num_anchors`, sorts them ascending.

    -> (anchors int32 [num_anchors], valid bool [num_anchors]). Padding slots repeat the last kept
    anchor (0 when there is none) so the array stays sorted, which block-sparse attention kernels
    rely on; `valid` is False there and the loss ignores them.
    """
    candidates = anchor_candidates(loss_mask_s, length)
    kept = np.sort(rng.permutation(candidates)[:num_anchors])
    anchors = np.full((num_anchors,), kept[-1] if kept.size else 0, dtype=np.int32)
    anchors[: kept.size] = kept
    valid = np.arange(num_anchors) < kept.size
    return anchors, valid
