"""SIGTERM during ``fit()``: the notice a scheduler gives before it kills a job (Slurm's preemption or time limit,
Kubernetes, torchrun's agent passing its own SIGTERM on to the ranks), with a grace period (torchrun's: 30 s).

The first one asks the run to stop where the iteration it is in ends (under torchrun: at the next point where the
ranks agree on a stop, see ``Trainer._agree_stop``); the run saves that step's checkpoint and raises
:class:`Preempted`. The checkpoint records no early stop, so ``--resume last`` continues the run. Later SIGTERMs
change nothing: Slurm signals every process of a job step, so a rank gets one from Slurm and one from torchrun's
agent at once. Ctrl-C (SIGINT) still stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Preempted(KeyboardInterrupt):
    """``fit()`` stopped for SIGTERM; it unwinds as an interrupt does (the run lock released, exit status 143)."""


@contextlib.contextmanager
def sigterm_asks_to_stop(ask: Callable[[], None]) -> Iterator[None]:
    """While in the block, a SIGTERM calls ``ask`` (only in the main thread, where signal handlers live, and unless
    the caller ignores SIGTERM or handles it outside Python, where its handler could not be put back); the previous
    handler is put back after it."""
    current = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if current is None or current == signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        ask()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
