"""Log verbosity for the entry points. No flags are defined here, so that any CLI can import it
without taking on infer.common's flags (infer.convert has a --dtype of its own)."""

from __future__ import annotations

from absl import flags, logging


def quiet_library_logs() -> None:
    """Libraries (orbax, grain) log every step at INFO: show warnings only, unless the user
    passed --verbosity. Call it in `main`, once flags are parsed."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
