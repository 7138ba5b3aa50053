"""Orbax checkpoints of a training run: the train state (step, drafter params, optimizer state)
and the grain iterator position, saved together so a resumed run replays the exact data order.

Layout: `<workdir>/checkpoints/<step>/{state,data_iter}`; damaged ones are moved to
`<workdir>/checkpoints_unreadable/<step>` when a resume finds them. The exported drafter (what
`load_drafter` reads) lives beside it in `<workdir>/drafter`. The workdir may be a URL
(`gs://bucket/run`, see `paths`); Orbax writes there directly.
"""

from __future__ import annotations

import os

import grain
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from dflash_jax import sharding
from dflash_jax.config import DrafterConfig
from dflash_jax.io import paths
from dflash_jax.io.drafter_io import save_drafter
from dflash_jax.io.hf import CheckpointError
from dflash_jax.models.drafter import init_drafter_params

CHECKPOINT_DIR = "checkpoints"
UNREADABLE_DIR = "checkpoints_unreadable"
DRAFTER_DIR = "drafter"


def checkpoint_manager(workdir: str | os.PathLike, max_to_keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        paths.path(workdir) / CHECKPOINT_DIR,
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


def abstract_state(drafter_config: DrafterConfig, optimizer, mesh=None) -> dict:
    """Shapes and dtypes of the train state {"step", "params", "opt_state"}, for restoring;
    with a `mesh`, also its shardings there (`sharding.state_shardings`), so that a checkpoint
    written on any mesh shape restores onto this one (Orbax reads each device's slice)."""

    def init():
        params = init_drafter_params(drafter_config, jax.random.key(0))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.build().init(params),
        }

    abstract = jax.eval_shape(init)
    if mesh is None:
        return abstract
    return sharding.with_shardings(abstract, sharding.state_shardings(abstract, mesh))


def restore_latest(
    manager: ocp.CheckpointManager, abstract: dict, data_iter: grain.DatasetIterator
) -> dict | None:
    """Restores the newest readable checkpoint into `abstract`'s structure and moves `data_iter`
    to its saved position. An unreadable checkpoint (truncated, corrupt) is moved aside to
    `<workdir>/checkpoints_unreadable/<step>` with a warning, and the previous one is tried.
    -> the state, or None when the run has no checkpoint yet. Raises CheckpointError
    when checkpoints exist but none is readable (rather than silently starting over)."""
    directory = paths.path(manager.directory)
    tried = []
    while (step := manager.latest_step()) is not None:
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract),
                    data_iter=grain.checkpoint.CheckpointRestore(data_iter),
                ),
            )
            if tried:
                logging.warning(
                    "resumed from step %d instead (checkpoints %s unreadable)", step, tried
                )
            return restored.state
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            aside = directory.parent / UNREADABLE_DIR / str(step)
            logging.warning(
                "checkpoint %s is unreadable (%s: %s); moved to %s, trying the previous one",
                directory / str(step),
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
                aside,
            )
            tried.append(step)
            if jax.process_index() == 0:
                aside.parent.mkdir(parents=True, exist_ok=True)
                if aside.exists():
                    aside.rmtree()
                paths.move(directory / str(step), aside)
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
            manager.reload()
    if tried:
        raise CheckpointError(
            f"no readable checkpoint in {directory}: steps {tried} are damaged (moved to "
            f"{directory.parent / UNREADABLE_DIR}); delete the workdir to start over"
        )
    return None


def warm_state(source_workdir: str | os.PathLike, abstract: dict) -> dict:
    """The train state of another run's newest checkpoint (params and optimizer state, into
    `abstract`'s structure: the drafter and optimizer must match), as a new run's start: step
    0, and every learning-rate schedule's count in the optimizer state set back to 0, so this
    run follows its own schedule while Adam's moments and bias-correction count go on.
    -> the state plus "source_step" (the checkpoint's step). Refuses a workdir without a
    readable checkpoint, or one whose shapes differ, naming it."""
    directory = paths.path(source_workdir) / CHECKPOINT_DIR
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"init_from_checkpoint: no checkpoint in {directory}")
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
    except Exception as e:  # orbax raises many types for a mismatch or damage
        raise CheckpointError(
            f"init_from_checkpoint: checkpoint {directory / str(step)} does not restore into "
            f"this run's drafter and optimizer ({type(e).__name__}: {str(e)[:300]})"
        ) from e
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    restart = lambda x: x._replace(count=jnp.zeros_like(x.count)) if is_schedule(x) else x
    opt_state = jax.tree.map(restart, restored["opt_state"], is_leaf=is_schedule)
    return {
        "step": jnp.zeros_like(restored["step"]),
        "params": restored["params"],
        "opt_state": opt_state,
        "source_step": step,
    }


def export_drafter(workdir: str | os.PathLike, config: DrafterConfig, params: dict) -> epath.Path:
    """Writes `<workdir>/drafter` for `load_drafter`, replacing the previous export only once the
    new one is complete. Every process must call it (the params are gathered from all of them);
    process 0 alone writes."""
    final = paths.path(workdir) / DRAFTER_DIR
    if jax.process_count() > 1:
        host = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return final
    else:
        host = jax.device_get(params)
    tmp = final.with_name(DRAFTER_DIR + ".tmp")
    for old in (tmp, final):
        if old.exists():
            old.rmtree()
    save_drafter(tmp, config, host)
    paths.move(tmp, final)
    return final
