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

# Whether XLA:CPU compiles the traced program although TARGET is another platform:
# `infer.memory_plan` sets it, whose figures are XLA:CPU's buffer assignment of a TPU or GPU
# program. The 16-bit workarounds of XLA:CPU (`xla_cpu_codegen`) then apply there too, as they
# do to the CPU's own decode: without them XLA:CPU widens every bf16 cache a scatter writes to
# f32 (Qwen3-8B at 32K: the loop program's temporaries 12.83 GiB with the copies, 7.66 without;
# a TPU compiler makes none).
CPU_COMPILES: bool = False


def current() -> str:
    """The platform the program being traced is compiled for (`TARGET`, else the backend)."""
    return TARGET or jax.default_backend()


def is_cpu() -> bool:
    return current() == "cpu"


def xla_cpu_codegen() -> bool:
    """Whether XLA:CPU compiles the program being traced: the CPU's own (`is_cpu`), or another
    platform's planned on this CPU (`CPU_COMPILES`). Asked only by the rewrites that give the
    same bits while sparing XLA:CPU a widened copy of a 16-bit buffer."""
    return is_cpu() or CPU_COMPILES


def is_this_process() -> bool:
    """Whether the platform traced for is this process's backend ("cuda" and "rocm" are the
    "gpu" backend): what this process measures (a row rule) holds for it."""
    family = lambda name: "gpu" if name in ("cuda", "rocm") else name
    return family(current()) == family(jax.default_backend())
