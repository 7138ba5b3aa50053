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
