"""The speculators-format tests' shared pieces: the params check, and the reference run in the
separate venv named by DFLASH_JAX_SPECULATORS_PYTHON (tests/test_speculators.py says how to
make it; the script it runs is tests/_speculators_reference.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io.speculators import write_speculators
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Transformer

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = os.environ.get("DFLASH_JAX_SPECULATORS_PYTHON")


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@dataclasses.dataclass
class ReferenceRun:
    """The inputs the reference drafted from (16 tokens, their taps, the block's anchor)."""

    tokens: np.ndarray
    taps: np.ndarray
    anchor: int

    def context(self, config, params):
        """Our drafter's context K/V of the 16 rows (the block sees those before the anchor)."""
        taps, positions = jnp.asarray(self.taps[None]), jnp.arange(len(self.tokens))[None]
        return Drafter(config).apply({"params": params}, taps, positions, method="context_kv")


def run_reference(target_dir, target, exports: dict, tmp_path) -> ReferenceRun:
    """Writes each (config, params) of `exports` with --format=speculators and has the
    reference draft one teacher-forced block at anchor 9 of 16 random tokens from each, in the
    separate venv: `tmp_path/ref{i}.npy` (and DSpark's `ref{i}_confidence.npy`)."""
    for name, (config, params) in exports.items():
        write_speculators(tmp_path / name, config, params, "float32", verifier=str(target_dir))
    tokens = np.random.default_rng(0).integers(0, 500, size=16).astype(np.int64)
    tap_ids = next(iter(exports.values()))[0].target_layer_ids
    _, taps_btf, _ = Transformer(target.config).apply(
        {"params": target.params}, jnp.asarray(tokens[None], jnp.int32),
        jnp.arange(16, dtype=jnp.int32)[None], None, None, tap_ids,
    )  # fmt: skip
    run = ReferenceRun(tokens=tokens, taps=np.asarray(taps_btf[0], np.float32), anchor=9)
    np.savez(tmp_path / "inputs.npz", taps=run.taps, tokens=tokens, anchor=run.anchor)
    subprocess.run(
        [SPECULATORS_PYTHON, str(REPO / "tests" / "_speculators_reference.py"),
         str(tmp_path / "inputs.npz"), str(tmp_path / "ref"), *(str(tmp_path / n) for n in exports)],
        check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return run
