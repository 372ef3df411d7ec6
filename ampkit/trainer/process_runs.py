"""The runs (``fit``, ``validate``, ``test``, ``predict``) in progress in this process, by thread.

Runs in two threads share what is process-wide: torch's, Python's and NumPy's global generators, which a seeded run
reseeds, then puts the caller's back as it ends, under the other run's feet. A seeded run beside another drew other
numbers than alone, silently, so a run in a second thread is refused, naming the one running, unless neither is
seeded (``trainer.seed=null``: their draws are the process's anyway). Runs nested in one thread (a hook that
evaluates another Trainer) take turns and stay allowed. A forked child starts with none: the threads that ran them
are not there.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ampkit.trainer.user_code import UserCodeError


@dataclass(frozen=True)
class _Run:
    thread: int
    thread_name: str
    what: str  # "fit() of MyTrainer"
    seeded: bool  # it reseeds the global generators (trainer.seed)


_runs: dict[int, _Run] = {}  # by id() of the Trainer running it
_lock = threading.Lock()


def enter_run(trainer: object, entry: str, seeded: bool) -> None:
    """Record ``entry`` (``"fit"``, ``"validate"``...) of ``trainer`` as running in this thread, or refuse it while
    a run is in progress in another thread of this process and either of them is ``seeded``."""
    here = threading.current_thread()
    what = f"{entry}() of {type(trainer).__name__}"
    with _lock:
        others = [run for run in _runs.values() if run.thread != here.ident]
        other = next((run for run in others if seeded or run.seeded), None)
        if other is None:
            _runs[id(trainer)] = _Run(here.ident, here.name, what, seeded)
            return
    raise UserCodeError(
        f"{what} was called in thread '{here.name}' while {other.what} is running in thread '{other.thread_name}' "
        "of this process: runs in two threads share torch's, Python's and NumPy's global random generators, which a "
        "seeded run (trainer.seed, 0 by default) reseeds, so neither would train as it does alone. Run them one "
        "after the other, each in a process of its own (multiprocessing with the 'spawn' start method, "
        "torch.multiprocessing.spawn, or one command per run), or unseeded (trainer.seed=null) where their draws "
        "may differ from run to run"
    )


def leave_run(trainer: object) -> None:
    """The run of ``trainer`` recorded by :func:`enter_run` has ended."""
    with _lock:
        _runs.pop(id(trainer), None)


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _runs.clear()


os.register_at_fork(after_in_child=_forget_in_child)
