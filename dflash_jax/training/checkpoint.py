"""Orbax checkpoints of a training run: the train state (step, drafter params, optimizer state)
and the grain iterator position, saved together so a resumed run replays the exact data order.

Layout: `<workdir>/checkpoints/<step>/{state,data_iter}`, and beside them
`<workdir>/run_config.json`: the settings those checkpoints depend on (`run_signature`), so that a
rerun whose drafter or data differs is refused, naming the fields, before anything is touched
(`check_run_config`). A checkpoint that does not read as itself (truncated, corrupt) is moved to
`<workdir>/checkpoints_unreadable/<step>` when a resume finds it; one that reads but does not fit
this run's drafter is a config mismatch, never moved; one whose train state reads but whose
data iterator position does not (each process saves its own: a run resumed on another process
count finds none for itself) resumes with the position rebuilt from the step, with a warning
(`data.seek`). The train state restores onto any mesh and process count. A workdir whose
checkpoints were all moved aside is refused until the caller says to start over
(`check_resumable`). The exported drafter (what `load_drafter` reads) lives beside it in
`<workdir>/drafter`. The workdir may be a URL
(`gs://bucket/run`, see `paths`); Orbax writes there directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex

import grain
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from dflash_jax import sharding
from dflash_jax.config import ConfigError, DrafterConfig
from dflash_jax.io import paths
from dflash_jax.io.drafter_io import ignore_closed_loop_callbacks, save_drafter
from dflash_jax.io.hf import CheckpointError
from dflash_jax.io.tokenizer import TRAINING_DATA_FILE
from dflash_jax.models.drafter import init_drafter_params
from dflash_jax.training import data

CHECKPOINT_DIR = "checkpoints"
UNREADABLE_DIR = "checkpoints_unreadable"
DRAFTER_DIR = "drafter"
RUN_CONFIG_FILE = "run_config.json"

# What a run's checkpoints depend on, named as the user sets it: the drafter's structure (its
# params' and Adam moments' shapes; DrafterConfig field -> config field, or the target's) ...
_MODEL_FIELDS = {
    **{
        f: f"drafter.{f}"
        for f in (
            "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "mask_token_id", "target_layer_ids", "conv_kernel_size",
            "conv_group_size", "selector_rank", "selector_top_k", "markov_rank",
            "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
            "sample_from_anchor",
        )
    },
    "block_size": "block_size",
    "vocab_size": "target's vocab_size",  # set by config.target
    "num_target_layers": "target's num_layers",
}  # fmt: skip
# ... and the data's order and shape (the saved iterator position indexes this data, split and
# batched this way). num_steps and the optimizer settings may change between reruns.
_DATA_FIELDS = (
    "data",
    "seq_len",
    "num_anchors",
    "batch_size",
    "seed",
    "num_eval_prompts",
    "group_batches",
)


def checkpoint_manager(workdir: str | os.PathLike, max_to_keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        paths.path(workdir) / CHECKPOINT_DIR,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )


def _json(value):
    """`value` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def run_signature(cfg, drafter_config: DrafterConfig) -> dict:
    """The settings a run's checkpoints depend on (`_MODEL_FIELDS`, `_DATA_FIELDS`), named as
    the user sets them ("drafter.num_layers", "batch_size", "target's vocab_size"), with the
    drafter's resolved tap layers."""
    config = dataclasses.asdict(drafter_config)
    sig = {label: config[f] for f, label in _MODEL_FIELDS.items()}
    sig.update({f: cfg[f] for f in _DATA_FIELDS})
    return _json(sig)


def checkpoint_steps(workdir, aside: bool = False) -> list[int]:
    """The steps of `<workdir>/checkpoints` (with `aside`: of `checkpoints_unreadable`), read
    from the directory names alone (Orbax's unfinished `<step>.orbax-checkpoint-tmp-*` skipped)."""
    directory = paths.path(workdir) / (UNREADABLE_DIR if aside else CHECKPOINT_DIR)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def check_resumable(workdir, start_over: bool = False) -> None:
    """Refuses a workdir whose checkpoints were all set aside as unreadable (in
    `checkpoints_unreadable/`) with none left in `checkpoints/`: a rerun would otherwise train
    from step 0 and replace the run's metrics and exported drafter, silently (as a scheduler's
    retry would). `start_over`: do that, knowingly (logged)."""
    if checkpoint_steps(workdir):
        return
    aside = checkpoint_steps(workdir, aside=True)
    if not aside:
        return
    workdir = paths.path(workdir)
    if start_over:
        logging.warning(
            "starting over from step 0 in %s (--start_over): its checkpoints %s stay in %s",
            workdir, aside, workdir / UNREADABLE_DIR,
        )  # fmt: skip
        return
    raise CheckpointError(
        f"{workdir}: every checkpoint of this run (steps {aside}) was unreadable and is set "
        f"aside in {workdir / UNREADABLE_DIR}, so there is nothing to resume; nothing was "
        f"changed. Put a readable checkpoint back into {workdir / CHECKPOINT_DIR}, or rerun "
        "with --start_over (trainer.train(..., start_over=True)) to train from step 0 here, "
        "replacing metrics.jsonl and the exported drafter, or use a new --workdir."
    )


def check_run_config(workdir, signature: dict, cfg) -> None:
    """Refuses a rerun whose drafter or data differs from those of the checkpoints in
    `workdir` (`run_signature`, saved by `save_run_config`), before anything is touched, naming
    each differing field and the two ways on: the saved values, or a new workdir. No
    checkpoint, or no saved config (a run from before it was saved): nothing to compare."""
    workdir = paths.path(workdir)
    steps = checkpoint_steps(workdir)
    saved_file = workdir / RUN_CONFIG_FILE
    if not steps or not saved_file.exists():
        return
    try:
        saved = json.loads(saved_file.read_text())
        old_sig, old_cfg = saved["signature"], saved.get("config", {})
    except (ValueError, KeyError, TypeError) as e:  # cut short by a kill: rewritten after
        logging.warning("%s is unreadable (%s); not compared with this config", saved_file, e)
        return
    # A field this code added after the run was saved is not a difference.
    differ = [k for k in signature if k in old_sig and old_sig[k] != signature[k]]
    if not differ:
        return
    fmt = lambda v: repr(tuple(v)) if isinstance(v, list) else repr(v)
    diffs = "; ".join(f"{k} {fmt(old_sig[k])} there, {fmt(signature[k])} now" for k in differ)
    # The flags that give back the saved run's values (a tap list left empty stays empty).
    flag = lambda key, v: (
        f"--config.{key}=" + shlex.quote(str(tuple(v) if isinstance(v, list) else v))
    )
    now_cfg = _json(cfg.to_dict())
    flags = []
    for key in dict.fromkeys("target" if k.startswith("target's") else k for k in differ):
        *parents, leaf = key.split(".")
        old, new = old_cfg, now_cfg
        for part in parents:
            old, new = old.get(part, {}), new.get(part, {})
        if leaf in old and old[leaf] != new.get(leaf):
            flags.append(flag(key, old[leaf]))
    # A new run that starts from this one: its weights and Adam state when only the data
    # changed; its exported drafter, grown, when only the layer count grew (same taps).
    model = [k for k in differ if k not in _DATA_FIELDS]
    layers, taps = "drafter.num_layers", "drafter.target_layer_ids"
    if not model:
        start = f"--config.init_from_checkpoint={workdir}"
    elif set(model) <= {layers, taps} and signature[layers] > old_sig[layers]:
        start = f"--config.init_from={workdir / DRAFTER_DIR} --config.init_grow_layers=True"
        if taps in model:
            start += " " + flag(taps, old_sig[taps])
    else:
        start = None
    raise ConfigError(
        f"{workdir} holds checkpoints (steps {steps}) of a run with another config: {diffs}. "
        f"Nothing was changed. To resume that run, rerun with its values "
        f"({' '.join(flags) or 'see ' + str(saved_file)}); to train this config, use a new "
        "--workdir" + (f" (to start it from that run: {start})." if start else ".")
    )


def save_run_config(workdir, signature: dict, cfg) -> None:
    """Writes `<workdir>/run_config.json`: `signature` (what `check_run_config` compares) and
    the whole config, for reading. Process 0 writes."""
    if jax.process_index() != 0:
        return
    record = {"signature": signature, "config": _json(cfg.to_dict())}
    (paths.path(workdir) / RUN_CONFIG_FILE).write_text(json.dumps(record, indent=1) + "\n")


def structure_mismatch(step_dir, abstract: dict) -> str | None:
    """How the params saved in checkpoint `step_dir` differ from `abstract`'s (read from the
    checkpoint's own metadata), e.g. "layers_1 only in the checkpoint"; None when they agree, or
    when the metadata does not read (then the checkpoint is damaged, not another run's)."""
    try:
        tree = ocp.StandardCheckpointHandler().metadata(paths.path(step_dir) / "state").tree
        saved = {
            jax.tree_util.keystr(p, simple=True, separator="."): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(tree["params"])[0]
        }
    except Exception:  # noqa: BLE001 (orbax raises many types for unreadable metadata)
        return None
    here = {
        jax.tree_util.keystr(p, simple=True, separator="."): tuple(x.shape)
        for p, x in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]
    }
    top = lambda names: sorted({n.split(".")[0] for n in names})
    parts = []
    if only := top(saved.keys() - here.keys()):
        parts.append(f"params {only} only in the checkpoint")
    if only := top(here.keys() - saved.keys()):
        parts.append(f"params {only} only in this run's drafter")
    both = sorted(n for n in saved.keys() & here.keys() if saved[n] != here[n])
    shapes = [f"{n} {saved[n]} there, {here[n]} here" for n in both]
    if shapes:
        parts.append("shapes " + ", ".join(shapes[:3]) + (", ..." if len(shapes) > 3 else ""))
    return "; ".join(parts) or None


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
        # One device, named: a checkpoint written on a mesh (of any process count) then
        # restores onto it instead of asking for the writer's topology.
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract
        )
    return sharding.with_shardings(abstract, sharding.state_shardings(abstract, mesh))


def restore_latest(
    manager: ocp.CheckpointManager, abstract: dict, data_iter: grain.DatasetIterator
) -> dict | None:
    """Restores the newest readable checkpoint into `abstract`'s structure and moves `data_iter`
    to its saved position. One that does not read as itself (truncated, corrupt) is moved aside
    to `<workdir>/checkpoints_unreadable/<step>` with a warning, and the previous one is tried.
    One that reads but holds another drafter (`structure_mismatch`) is left in place and the
    run refused (ConfigError). -> the state, or None when the run has no checkpoint yet. Raises
    CheckpointError when checkpoints exist but none is readable (rather than starting over)."""
    directory = paths.path(manager.directory)
    tried = []
    ignore_closed_loop_callbacks()  # a damaged file's late callbacks can beat the except
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
            state = _state_alone(manager, step, abstract)
            if state is not None:
                # The params and Adam's state read; the data iterator's position did not (each
                # process saves its own, so another process count finds none for itself):
                # every batch is a function of its step, so the position is rebuilt from it.
                logging.warning(
                    "checkpoint %s: the data iterator's saved position does not restore here "
                    "(%s: %s; e.g. the checkpoint was written by another number of processes, "
                    "this run has %d); it is rebuilt from the step: batch %d is next",
                    directory / str(step),
                    type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "",
                    jax.process_count(),
                    step + 1,
                )
                data.seek(data_iter, step)
                return state
            mismatch = structure_mismatch(directory / str(step), abstract)
            if mismatch is not None:
                raise ConfigError(
                    f"checkpoint {directory / str(step)} is readable but holds another drafter "
                    f"({mismatch}); nothing was moved. Rerun with the config that wrote it to "
                    "resume, or use a new --workdir for this config."
                ) from e
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
            f"{directory.parent / UNREADABLE_DIR}); nothing else was changed. Put a readable "
            "checkpoint back, or rerun with --start_over (trainer.train(..., start_over=True)) "
            "to train from step 0 in this workdir, or use a new --workdir."
        )
    return None


def _state_alone(manager: ocp.CheckpointManager, step: int, abstract: dict) -> dict | None:
    """The train state of checkpoint `step` without its data iterator, or None when that does
    not read either (the checkpoint is damaged)."""
    try:
        return manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
    except Exception:  # noqa: BLE001 (orbax/tensorstore raise many types for damaged files)
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
    ignore_closed_loop_callbacks()  # a damaged file's late callbacks can beat the except
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


def export_drafter(
    workdir: str | os.PathLike, config: DrafterConfig, params: dict, metadata: dict | None = None
) -> epath.Path:
    """Writes `<workdir>/drafter` for `load_drafter`, replacing the previous export only once the
    new one is complete; `metadata` (what the training data was, e.g. its thinking mode) goes
    beside it as `io.tokenizer.TRAINING_DATA_FILE`. Every process must call it (the params are
    gathered from all of them); process 0 alone writes."""
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
    if metadata:
        (tmp / TRAINING_DATA_FILE).write_text(json.dumps(metadata, indent=1, sort_keys=True))
    paths.move(tmp, final)
    return final
