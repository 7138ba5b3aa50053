"""Orbax checkpoints of a training run: the train state (step, drafter params, optimizer state)
and the grain iterator position, saved together so a resumed run replays the exact data order.

Layout: `<workdir>/checkpoints/<step>/{state,data_iter}`. The exported drafter (what
`load_drafter` reads) lives beside it in `<workdir>/drafter`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp

from dflash_jax.config import DrafterConfig
from dflash_jax.io.drafter_io import save_drafter

CHECKPOINT_DIR = "checkpoints"
DRAFTER_DIR = "drafter"


def checkpoint_manager(workdir: str | Path, max_to_keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        Path(workdir).absolute() / CHECKPOINT_DIR,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )


def save_checkpoint(
    manager: ocp.CheckpointManager, step: int, state: dict, data_iter: grain.DatasetIterator
) -> None:
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data_iter=grain.checkpoint.CheckpointSave(data_iter)
        ),
    )


def restore_latest(
    manager: ocp.CheckpointManager, state: dict, data_iter: grain.DatasetIterator
) -> dict | None:
    """Restores the newest checkpoint into `state`'s structure and moves `data_iter` to the saved
    position. -> the restored state, or None when the run has no checkpoint yet."""
    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract),
            data_iter=grain.checkpoint.CheckpointRestore(data_iter),
        ),
    )
    return restored.state


def export_drafter(workdir: str | Path, config: DrafterConfig, params: dict) -> Path:
    """Writes `<workdir>/drafter` for `load_drafter`, replacing the previous export only once the
    new one is complete."""
    final = Path(workdir).absolute() / DRAFTER_DIR
    tmp = final.with_name(DRAFTER_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(tmp, config, jax.device_get(params))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
