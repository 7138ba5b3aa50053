"""Stopping a training run cleanly when it is told to (preemption, Ctrl-C).

One process: SIGTERM (what a scheduler or a spot/preemptible VM sends before the kill) and
SIGINT (Ctrl-C) set a flag; the training loop finishes the step it is in, saves a checkpoint of
that step and returns, and the command exits 0 saying how to resume. A second SIGINT
interrupts at once (the default handler is back after the first).

Several processes: every host must save the same step, so the decision is jax's preemption
sync (`multihost_utils.reached_preemption_sync_point`, the one Orbax's
`CheckpointManager.reached_preemption` asks): a SIGTERM on any host reaches the coordination
service, which names the first step every host can still reach, and there each host's call
returns True. jax's own SIGTERM notifier does this, so no Python handler is installed then
(it would replace jax's); SIGINT keeps its default (KeyboardInterrupt) on each host.
"""

from __future__ import annotations

import signal

import jax
from absl import logging
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`stop(step)` -> True when the run should checkpoint step `step` and end. A context
    manager: the handlers are installed on entry (one process, main thread only) and the
    previous ones put back on exit."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        del frame
        self.signal_name = signal.Signals(signum).name
        logging.warning(
            "%s received: finishing this step, then saving a checkpoint and stopping "
            "(press Ctrl-C again to stop at once)",
            self.signal_name,
        )
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> StopRequest:
        if jax.process_count() == 1:
            try:
                for sig in SIGNALS:
                    self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                self._previous.clear()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            # Every host calls this at every step: all of them answer True at the same step.
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "preemption notice"
                return True
            return False
        return self.signal_name is not None
