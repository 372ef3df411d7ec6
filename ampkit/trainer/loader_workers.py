"""DataLoader worker processes that outlive a preemption's SIGTERM, so that the run they feed can save its step.

Slurm signals every process of a job step, torchrun's agent signals each rank's whole process group, and a container
init may signal the whole group: the loader's workers get the SIGTERM the trainer stops and saves for
(``preemption.py``). torch's worker handler lets them die of it unless it came from the process that started them,
and the trainer then fails with ``DataLoader worker (pid N) is killed by signal: Terminated``, raised by torch's
SIGCHLD handler at any point of the step, and saves nothing. A worker that :class:`WorkerSigtermPolicy` starts
ignores such a SIGTERM and keeps serving until the trainer shuts its loader down (the None sentinel); it still exits
at once on a SIGTERM from the process that started it (torch's ``terminate()`` at shutdown and at interpreter exit)
or once that process is gone, and the scheduler's SIGKILL after its grace period ends it as before. A thread the
worker had before the policy (the OpenMP runtime's, under spawn or forkserver unless OMP_NUM_THREADS=1) still takes
SIGTERMs torch's way. The trainer
starts the workers with SIGTERM held (:func:`iterate`), so that one sent while a worker starts waits for the policy,
and persistent workers without drawing from torch's RNG, so that a resumed run draws as the run it continues did.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


class WorkerSigtermPolicy:
    """A loader's ``worker_init_fn``: in a worker process, SIGTERMs are ignored unless sent by the process that
    started the worker (or once that one is gone); then the user's ``init_fn`` runs as before."""

    def __init__(self, init_fn: Callable[[int], Any] | None, manager_pid: int) -> None:
        self.init_fn, self.manager_pid = init_fn, manager_pid

    def __call__(self, worker_id: int) -> None:
        if os.getpid() != self.manager_pid and hasattr(signal, "sigwaitinfo"):  # a worker process, not a thread
            _exit_only_on_own_sigterm(self.manager_pid)
        if self.init_fn is not None:
            self.init_fn(worker_id)


def _exit_only_on_own_sigterm(manager_pid: int) -> None:
    """Block SIGTERM in this worker's threads (those it starts later inherit that) and take each one in a thread of
    its own, which sees the sender: the starting process's (or, under forkserver, the parent's) ends the worker with
    status 0 as torch's handler does; another's is ignored while the parent lives."""
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take_sigterms() -> None:
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender in (manager_pid, parent) or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=take_sigterms, name="ampkit-worker-sigterm", daemon=True).start()


def iterate(loader: Any) -> Iterator[Any]:
    """``iter(loader)``; the worker processes it starts (a DataLoader's) run under :class:`WorkerSigtermPolicy`, its
    own ``worker_init_fn`` still run in each, with SIGTERM held in this thread meanwhile (a forked worker inherits
    that, until the policy takes its SIGTERMs) and delivered after; persistent workers start without drawing from
    torch's RNG. The loader is left as the caller made it: its ``worker_init_fn`` is the policy only while the
    workers start."""
    if getattr(loader, "persistent_workers", False):
        return _without_drawing(loader)
    return _iterate(loader)


class StartedWorkers:
    """The worker processes a run (a ``fit``, a standalone ``validate``...) started through :meth:`iterate`, ended by
    :meth:`shut_down` as the run ends, as Lightning's teardown ends them. Else persistent workers live on, with their
    pipes and threads, as long as the Trainer (which keeps its loaders) does: a notebook or a sweep keeping its
    Trainers piles them up. So do an epoch's workers while an error that stopped it is kept (IPython keeps the last
    one), since its traceback holds the epoch's iterator; and where the loader raised, torch's shutdown run once the
    garbage collector takes that traceback waited 5 s for each worker, where one run now takes milliseconds."""

    def __init__(self) -> None:
        self._started: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # iterator -> its loader

    def iterate(self, loader: Any) -> Iterator[Any]:
        """:func:`iterate`, its worker processes remembered until :meth:`shut_down`."""
        iterator = iterate(loader)
        if callable(getattr(iterator, "_shutdown_workers", None)):  # torch's multi-process iterator
            self._started[iterator] = loader
        return iterator

    def shut_down(self) -> None:
        """End the workers started since the last call; a persistent loader starts new ones when iterated again."""
        started, self._started = self._started, weakref.WeakKeyDictionary()
        for iterator, loader in list(started.items()):
            iterator._shutdown_workers()
            if getattr(loader, "_iterator", None) is iterator:  # a persistent loader's: it would reuse dead workers
                loader._iterator = None


def _without_drawing(loader: Any) -> Iterator[Any]:
    """``iter(loader)`` of persistent workers, torch's RNG left as it was: their start draws the workers' seed from
    it, which only the first epoch of a run does, so a resumed run's RNG (its dropout) would go off the course of
    the run it continues."""
    state = torch.get_rng_state()
    try:
        return _iterate(loader)
    finally:
        torch.set_rng_state(state)


def _iterate(loader: Any) -> Iterator[Any]:
    if not isinstance(loader, DataLoader) or loader.num_workers == 0 or not hasattr(signal, "sigwaitinfo"):
        return iter(loader)
    own = loader.worker_init_fn
    if not isinstance(own, WorkerSigtermPolicy):
        loader.worker_init_fn = WorkerSigtermPolicy(own, os.getpid())
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return iter(loader)  # starts the workers (persistent ones: the first time), which take worker_init_fn now
    finally:
        loader.worker_init_fn = own
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
