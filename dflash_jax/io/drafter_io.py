"""Drafter checkpoints: our Orbax format, z-lab HF and `speculators` directories (told apart by
their config.json), hub ids and the shipped default.

Orbax layout: `<dir>/drafter_config.json` (the z-lab config dict, so the same reader serves
both) + `<dir>/params/` (an `ocp.StandardCheckpointer` pytree). In a notebook:

    from dflash_jax.io.drafter_io import restore_drafter
    drafter = restore_drafter("/path/to/ckpt")   # or "gs://bucket/run/drafter"
    drafter.config, drafter.params
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging

from dflash_jax import sharding
from dflash_jax.config import DrafterConfig
from dflash_jax.io import corpus_table, paths
from dflash_jax.io.drafter_config import drafter_from_zlab, drafter_to_zlab
from dflash_jax.io.hf import CheckpointError
from dflash_jax.io.speculators import is_speculators, read_config_json, read_speculators
from dflash_jax.io.tokenizer import TRAINING_DATA_FILE, resolved_thinking, takes_thinking
from dflash_jax.io.zlab import CONFIG_FILE, read_zlab
from dflash_jax.models.drafter import check_fits, init_drafter_params
from dflash_jax.ops import ngrams

ORBAX_CONFIG_FILE = "drafter_config.json"
ORBAX_PARAMS_DIR = "params"
# the files of a z-lab or speculators drafter (hub or URL)
ZLAB_PATTERNS = (CONFIG_FILE, "*.safetensors")
DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "assets/drafters/smollm2-135m-instruct-b16"


@dataclasses.dataclass
class LoadedDrafter:
    """A drafter: its config and params, and the corpus table held beside them (never in the
    params): `corpus_table` the host table (`io.corpus_table`, what is saved with it), `corpus`
    its device arrays once `load_drafter` checked it against a target (what decodes read)."""

    config: DrafterConfig
    params: dict
    source: str
    corpus_table: corpus_table.CorpusTable | None = None
    corpus: dict | None = None

    @property
    def decode_params(self) -> dict:
        """The params a decode takes: with the corpus table's arrays when there is one."""
        return ngrams.with_table(self.params, self.corpus)


def save_drafter(
    directory: str | os.PathLike, config: DrafterConfig, params: dict, corpus=None
) -> None:
    """Writes params with Orbax and the config as JSON beside them (`directory` local or a URL)
    and, given a `corpus` table (`LoadedDrafter.corpus_table`), its file beside them; never
    overwrites one."""
    directory = paths.path(directory)
    if (directory / ORBAX_PARAMS_DIR).exists():
        raise CheckpointError(
            f"{directory} already holds a drafter checkpoint; pick a new directory"
        )
    directory.mkdir(parents=True, exist_ok=True)
    # Host arrays need no other process: with several, this one writes alone (Orbax would
    # otherwise wait for all of them at its barriers).
    this = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=this, active_processes={this})
    checkpointer = ocp.StandardCheckpointer(
        **({"multiprocessing_options": alone} if jax.process_count() > 1 else {})
    )
    checkpointer.save(directory / ORBAX_PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    config_json = json.dumps(drafter_to_zlab(config), indent=2, sort_keys=True)
    (directory / ORBAX_CONFIG_FILE).write_text(config_json + "\n")
    if corpus is not None:  # the table is a file of its own, not an Orbax param
        corpus_table.save_table(corpus, directory / ngrams.CORPUS_FILE)


def _closed_loop(e: BaseException | None) -> bool:
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def ignore_closed_loop_callbacks() -> None:
    """When an Orbax restore fails, the tensorstore reads still in flight finish on their own
    threads and call back into the restore's event loop, which Orbax closes as the error leaves
    it: each raises "RuntimeError: Event loop is closed", which tensorstore reports through
    `PyErr_Print` (so `sys.excepthook`) or `sys.unraisablehook`, a traceback apiece around the
    real error. From this call on, those (and only those) are dropped. A callback can fire
    before the failed restore's `except` runs, so call it before a restore that may fail."""
    if not getattr(sys.unraisablehook, "_drops_closed_loop_callbacks", False):
        previous_unraisable = sys.unraisablehook

        def unraisable_hook(unraisable):
            if not _closed_loop(unraisable.exc_value):
                previous_unraisable(unraisable)

        unraisable_hook._drops_closed_loop_callbacks = True
        sys.unraisablehook = unraisable_hook
    if not getattr(sys.excepthook, "_drops_closed_loop_callbacks", False):
        previous_except = sys.excepthook

        def except_hook(kind, value, tb):
            if not _closed_loop(value):
                previous_except(kind, value, tb)

        except_hook._drops_closed_loop_callbacks = True
        sys.excepthook = except_hook


def _first_part(e: Exception) -> str:
    """A tensorstore error's message without the JSON specs it appends (kilobytes of them)."""
    return str(e).split(" [tensorstore_spec")[0]


def restore_drafter(
    directory: str | os.PathLike, dtype: str | None = None, mesh=None
) -> LoadedDrafter:
    """Restores a `save_drafter` directory (local or a URL); `dtype` defaults to the saved one.
    With a `mesh`, every param is restored straight onto its table sharding (each device reads
    its slice)."""
    directory = paths.path(directory)
    config_path = directory / ORBAX_CONFIG_FILE
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read the drafter config {config_path}: {e}") from e
    config = drafter_from_zlab(hf, dtype=dtype or hf.get("torch_dtype", "float32"))
    floats = lambda x: jnp.dtype(config.dtype) if jnp.issubdtype(x, jnp.floating) else x
    shapes = jax.tree.map(  # the weights in `dtype`; a draft vocabulary's ids stay int32
        lambda x: jax.ShapeDtypeStruct(x.shape, floats(x.dtype)),
        jax.eval_shape(functools.partial(init_drafter_params, config), jax.random.key(0)),
    )
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        placement = jax.tree.map(lambda _: device, shapes)
    else:
        placement = sharding.param_shardings(shapes, mesh)
    abstract = sharding.with_shardings(shapes, placement)
    params_path = directory / ORBAX_PARAMS_DIR
    ignore_closed_loop_callbacks()  # before: a damaged file's late callbacks can beat the except
    try:
        params = ocp.StandardCheckpointer().restore(params_path, abstract)
    except Exception as e:  # orbax/tensorstore raise many types for missing or corrupt files
        raise CheckpointError(
            f"cannot restore drafter params from {params_path} (config {config_path}), damaged "
            f"or incomplete: {_first_part(e)}; export it again or pass another drafter"
        ) from e
    return LoadedDrafter(config=config, params=params, source=str(directory))


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(ZLAB_PATTERNS)))
    except Exception as e:  # offline, unknown id, gated repo: all mean "not available here"
        raise CheckpointError(
            f"drafter {repo_id!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e})"
        ) from e


def drafter_directory(source: str | os.PathLike):
    """The directory a drafter `source` names (see `read_drafter`): "default", a local path or
    URL, or a hub id (fetched to the hub's cache)."""
    source = str(source)
    if source == "default":
        if not DEFAULT_DRAFTER.is_dir():
            raise CheckpointError(
                f"the default drafter is missing: {DEFAULT_DRAFTER} does not exist (reinstall "
                "dflash-jax from its repository); pass a drafter directory or hub id instead"
            )
        return DEFAULT_DRAFTER
    if paths.path(source).exists():
        return paths.path(source)
    if source.count("/") == 1 and not source.startswith((".", "/")):
        return _hub_snapshot(source)
    raise CheckpointError(f"drafter {source!r}: no such directory (nor a hub id owner/name)")


def read_drafter(
    source: str | os.PathLike, dtype: str = "float32", mesh=None, corpus: bool = True
) -> LoadedDrafter:
    """Reads a drafter without checking it against a target. `source`: our Orbax dir, a z-lab
    HF or `speculators` dir (local or a URL such as `gs://bucket/drafter`), a hub id
    (`owner/name`) or "default" (the drafter shipped in the repository). With a `mesh`, params
    are placed on their table shardings. `corpus`: also read the corpus table beside them
    (False: leave it, e.g. to count a new one)."""
    return _read_at(drafter_directory(source), str(source), dtype, mesh, corpus)


def _read_at(path, source: str, dtype: str, mesh, corpus: bool = True) -> LoadedDrafter:
    """`read_drafter` of the drafter in directory `path` (`drafter_directory(source)`), with
    the corpus table beside its params (`corpus_table`: checked against the drafter's
    vocabulary size only; `load_drafter` checks it against the target's tokenizer)."""
    loaded = _read_params(path, source, dtype, mesh)
    if not corpus:
        return loaded
    table = corpus_table.read(path, loaded.config.vocab_size)
    return dataclasses.replace(loaded, corpus_table=table)


def _read_params(path, source: str, dtype: str, mesh) -> LoadedDrafter:
    if (path / ORBAX_CONFIG_FILE).is_file():
        loaded = restore_drafter(path, dtype, mesh)
        return dataclasses.replace(loaded, source=source)
    if (path / CONFIG_FILE).is_file():
        local = paths.localize(path, ZLAB_PATTERNS)
        read = read_speculators if is_speculators(read_config_json(local)) else read_zlab
        config, params = read(local, dtype)
        if mesh is None:
            params = jax.tree.map(jnp.asarray, params)
        else:
            params = sharding.put(params, sharding.param_shardings(params, mesh))
        return LoadedDrafter(config=config, params=params, source=source)
    raise CheckpointError(
        f"{path} is neither an Orbax drafter ({ORBAX_CONFIG_FILE} + {ORBAX_PARAMS_DIR}/) nor a "
        f"z-lab or speculators drafter ({CONFIG_FILE} + model.safetensors); pass a drafter "
        "directory"
    )


def load_drafter(
    source: str | os.PathLike, target, dtype: str | None = None, mesh=None
) -> LoadedDrafter:
    """Reads a drafter (see `read_drafter`) in the target's dtype unless `dtype` is given, and
    refuses one that does not fit `target` (anything with `.config`: a TargetConfig). `mesh`
    defaults to the target's (`load_target(..., mesh=...)`). A corpus table in the drafter's
    directory (`io.corpus_table`) is read beside its params, refused when it counts another
    tokenizer's ids: the decodes' copy steps read it (`LoadedDrafter.decode_params`)."""
    if mesh is None:
        mesh = getattr(target, "mesh", None)
    path = drafter_directory(source)  # once: a hub id is looked up on the hub
    loaded = _read_at(path, str(source), dtype or target.config.dtype, mesh)
    check_fits(loaded.config, target.config, loaded.params)
    tokenizer = getattr(target, "tokenizer", None)
    vocab_hash = corpus_table.vocabulary_hash(tokenizer) if tokenizer is not None else None
    table = corpus_table.read(path, target.config.vocab_size, vocab_hash)
    arrays = None if table is None else corpus_table.device_arrays(table, mesh)
    loaded = dataclasses.replace(loaded, corpus_table=table, corpus=arrays)
    warn_thinking_mismatch(source, target)
    return loaded


def warn_thinking_mismatch(source, target) -> str | None:
    """Warns (and returns the warning) when the drafter in directory `source` was trained on
    data of one thinking mode (`TRAINING_DATA_FILE`, written by train.train_drafter) and the
    target's chat template serves the other by default: acceptance drops far (z-lab/dflash
    issue 133: 25% against 60%). Cheap: one small file read, two renders only when it exists."""
    try:
        recorded = json.loads((paths.path(source) / TRAINING_DATA_FILE).read_text())["thinking"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    template = getattr(target, "chat_template", None)
    tokenizer = getattr(target, "tokenizer", None)
    if recorded not in ("on", "off") or tokenizer is None or not takes_thinking(template):
        return None
    serving = resolved_thinking(tokenizer, template)
    if serving in (recorded, "none"):
        return None
    message = (
        f"the drafter {source} was trained on data generated with thinking {recorded}, but the "
        f"target's chat template serves thinking {serving} by default: expect far lower "
        "acceptance; serve in the drafter's mode or train it on data of this one "
        f"(train.generate_data --thinking={serving})"
    )
    logging.warning(message)
    return message
