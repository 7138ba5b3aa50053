"""How every entry point ends on bad input: `run(main)` in place of absl's `app.run(main)`.

A bad input (a missing file, a misfit drafter, a malformed JSONL line, a config that does not
fit a workdir's checkpoints: the library raises ValueError, OSError or one of their subclasses
such as ConfigError and CheckpointError, each naming the problem and the fix) ends the program
with exit code 1 and two lines on stderr, the message and how to see more, with no traceback and
no --help text (absl's app.UsageError alone would print the module's whole --help first).
`-v 1` (absl's --verbosity=1) shows the traceback too. Flags that fail to parse or validate
(a bound, a required flag) are absl's two lines, exit code 1. No flags are defined here, so any
CLI can import it.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback

from absl import app, flags

# What bad input raises: ConfigError, CheckpointError, CacheError (ValueError), missing files
# (OSError), a training step gone non-finite (trainer.NonFiniteError, a FloatingPointError).
BAD_INPUT = (ValueError, OSError, FloatingPointError)


def run(main) -> None:
    """`app.run(main)`, with bad input ending the program as the module docstring says."""
    app.run(functools.partial(_guarded, main))


def verbose() -> bool:
    """Whether the user asked for tracebacks: --verbosity (-v) 1 or more."""
    flag = flags.FLAGS["verbosity"]
    return flag.present and flag.value >= 1


def fail(message: str, more: str) -> None:
    """Ends the program: exit code 1, `message` and `more` (how to see more) on stderr."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m infer.generate
    prog = spec.name if spec is not None else os.path.basename(sys.argv[0] if sys.argv else "")
    sys.stdout.flush()
    lines = [f"{prog}: error: {message}"] + ([f"{prog}: {more}"] if more and not verbose() else [])
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(1)


def _guarded(main, argv):
    try:
        return main(argv)
    except (app.UsageError, *BAD_INPUT) as e:
        if verbose():
            traceback.print_exc()
        from dflash_jax.io.drafter_io import ignore_closed_loop_callbacks

        ignore_closed_loop_callbacks()  # a failed Orbax read's late callbacks, on the way out
        plain_usage = isinstance(e, app.UsageError) and not isinstance(e.__cause__, BAD_INPUT)
        if plain_usage:
            fail(str(e), "--helpshort lists the flags")
        message = str(e) if isinstance(e, app.UsageError) else f"{type(e).__name__}: {e}"
        fail(message, "-v 1 (--verbosity=1) shows the traceback")
