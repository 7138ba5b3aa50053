"""The platform a program is traced for, which traced code asks instead of the process's own
backend: `infer.lower` lowers TPU and CUDA programs from a CPU process, and a choice made by
`jax.default_backend()` inside a traced function (a kernel, a CPU-only barrier, a CPU-only
reduction) would bake this machine's answer into the other platform's program.

    platform.TARGET = "tpu"      # what infer.lower sets while it traces TPU programs
    platform.current()           # -> "tpu"; with TARGET None: jax.default_backend()
"""

from __future__ import annotations

import jax

# The platform whose programs are traced ("cpu", "tpu", "cuda", ...); None: this process's
# backend. `infer.lower` sets it per platform it lowers for.
TARGET: str | None = None


def current() -> str:
    """The platform the program being traced is compiled for (`TARGET`, else the backend)."""
    return TARGET or jax.default_backend()


def is_cpu() -> bool:
    return current() == "cpu"


def is_this_process() -> bool:
    """Whether the platform traced for is this process's backend ("cuda" and "rocm" are the
    "gpu" backend): what this process measures (a row rule) holds for it."""
    family = lambda name: "gpu" if name in ("cuda", "rocm") else name
    return family(current()) == family(jax.default_backend())
