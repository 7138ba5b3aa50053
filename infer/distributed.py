"""Flags every CLI shares for device meshes and multi-process runs, and what they set up.

    --mesh=data=2,tensor=4                     the device mesh (sharding.parse_mesh)
    --coordinator_address=HOST:PORT --num_processes=N --process_id=I
    --distributed                              jax.distributed with cluster auto-detection
                                               (SLURM, Open MPI, TPU pods, Kubernetes)

`initialize()` runs `jax.distributed.initialize` when any of these (or the JAX_COORDINATOR_ADDRESS
environment variable) asks for it, before anything touches a device; it must come first in main.
Process 0 is the one that logs, writes results, plots and exports; every process runs the same
program on its own devices.
"""

from __future__ import annotations

import os

import jax
from absl import app, flags, logging
from jax.experimental import multihost_utils

from dflash_jax import sharding

flags.DEFINE_string(
    "mesh", "",
    "Device mesh as axis=size pairs over the axes data, fsdp, tensor, e.g. data=2,tensor=4 or "
    "fsdp=4,tensor=2 (data defaults to the devices the others leave): the batch splits over "
    "data (and fsdp), heads, MLP and vocabulary over tensor, the model dim over fsdp. Empty: "
    "one device. With several processes the mesh spans every process's devices.",
)  # fmt: skip
flags.DEFINE_string(
    "coordinator_address", "",
    "host:port of process 0's coordinator for a multi-process run (jax.distributed); default "
    "$JAX_COORDINATOR_ADDRESS. Give the same value to every process.",
)  # fmt: skip
flags.DEFINE_integer(
    "num_processes", 0, "Processes in a multi-process run (0: from the environment).",
    lower_bound=0,
)  # fmt: skip
flags.DEFINE_integer(
    "process_id", -1, "This process's index in [0, --num_processes) (-1: from the environment).",
    lower_bound=-1,
)  # fmt: skip
flags.DEFINE_bool(
    "distributed", False,
    "Initialise jax.distributed from the cluster's environment (SLURM, Open MPI, Cloud TPU "
    "pods, Kubernetes) without --coordinator_address/--num_processes/--process_id.",
)  # fmt: skip

FLAGS = flags.FLAGS
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"


def _wanted() -> bool:
    return bool(
        FLAGS.distributed
        or FLAGS.coordinator_address
        or FLAGS.num_processes
        or FLAGS.process_id >= 0
        or os.environ.get(COORDINATOR_ENV)
    )


def initialize() -> None:
    """Starts jax.distributed when the flags or the environment ask for it (a no-op otherwise)
    and quiets the logs of every process but 0. Call it first in main."""
    if not _wanted():
        return
    explicit = FLAGS.coordinator_address or os.environ.get(COORDINATOR_ENV)
    if explicit and (FLAGS.num_processes == 0) != (FLAGS.process_id < 0):
        raise app.UsageError(
            "--num_processes and --process_id go together (or both come from the environment)"
        )
    if FLAGS.num_processes and not 0 <= FLAGS.process_id < FLAGS.num_processes:
        raise app.UsageError(
            f"--process_id={FLAGS.process_id} is not in [0, --num_processes={FLAGS.num_processes})"
        )
    try:
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator_address or None,
            num_processes=FLAGS.num_processes or None,
            process_id=FLAGS.process_id if FLAGS.process_id >= 0 else None,
        )
    except (RuntimeError, ValueError) as e:
        raise app.UsageError(
            f"jax.distributed.initialize failed ({e}); give --coordinator_address=host:port, "
            "--num_processes and --process_id, or --distributed on a cluster it detects"
        ) from e
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    logging.info(
        "process %d of %d, %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_primary() -> bool:
    """Whether this process writes logs, results, plots and exports (process 0)."""
    return jax.process_index() == 0


def mesh(spec: str | None = None):
    """The mesh --mesh (or `spec`) describes over every process's devices, or None; a bad
    spec is a usage error naming what is wrong."""
    try:
        return sharding.mesh_from_spec(FLAGS.mesh if spec is None else spec)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from e


def local_mesh(spec: str | None = None):
    """Like `mesh`, over this process's devices only (for work each process does alone); with
    several processes and no spec, this process's first device."""
    spec = FLAGS.mesh if spec is None else spec
    try:
        if not spec and jax.process_count() > 1:
            return sharding.make_mesh(1, 1, 1, jax.local_devices())
        return sharding.mesh_from_spec(spec, jax.local_devices())
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from e


def barrier(name: str) -> None:
    """Waits until every process gets here (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
