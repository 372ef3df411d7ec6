"""SIGTERM during ``fit()``: the notice a scheduler gives before it kills a job (Slurm's preemption or time limit,
Kubernetes, torchrun's agent passing its own SIGTERM on to the ranks), with a grace period (torchrun's: 30 s).

The first one asks the run to stop where the iteration it is in ends (under torchrun: at the next point where the
ranks agree on a stop, see ``Trainer._agree_stop``); the run saves that step's checkpoint and raises
:class:`Preempted`. The checkpoint records no early stop, so ``--resume last`` continues the run. A second SIGTERM
raises :class:`Preempted` at once, without saving.
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
    """While in the block, the first SIGTERM calls ``ask`` and a second raises :class:`Preempted` (only in the main
    thread, where signal handlers live, and unless the caller ignores SIGTERM); the previous handler is put back."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return
    received = 0

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal received
        received += 1
        if received > 1:
            raise Preempted("a second SIGTERM: stopped at once, without saving")
        ask()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
