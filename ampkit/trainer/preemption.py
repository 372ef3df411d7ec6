"""SIGTERM during ``fit()``: the notice a scheduler gives before it kills a job (Slurm's preemption or time limit,
Kubernetes, torchrun's agent passing its own SIGTERM on to the ranks), with a grace period (torchrun's: 30 s).

The first one asks the run to stop where the iteration it is in ends (under torchrun: at the next point where the
ranks agree on a stop, see ``Trainer._agree_stop``); the run saves that step's checkpoint and raises
:class:`Preempted`. The checkpoint records no early stop, so ``--resume last`` continues the run. Later SIGTERMs
change nothing: Slurm signals every process of a job step, so a rank gets one from Slurm and one from torchrun's
agent at once. Ctrl-C (SIGINT) still stops at once.

A Python SIGTERM handler installed before ``fit()`` (the user's, submitit's, a scheduler wrapper's) still hears every
SIGTERM, after ampkit has asked to stop. If it raises (``sys.exit`` in it), its exception is held until the run has
saved the step it stops at and is raised then, in place of :class:`Preempted` (a failure before the stop is raised
instead, noting it): raised where the signal landed, it would cut the step short (nothing saved since the last
checkpoint) and, under torchrun, leave the other ranks waiting in a collective.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ampkit.wording import shown

_Handler = Callable[[int, Any], Any]


class Preempted(KeyboardInterrupt):
    """``fit()`` stopped for SIGTERM; it unwinds as an interrupt does (the run lock released, exit status 143)."""


class HungUp(KeyboardInterrupt):
    """SIGHUP (the terminal or ssh session of the run closed), raised where the process is: the run unwinds as from a
    Ctrl-C (its lock released, what it saved left to resume), where SIGHUP's default action ends it without a word;
    exit status 129."""


# The shell's status of a process its signal ended (128 + its number): what `ampkit fit` and, left uncaught, a
# script's Preempted or HungUp exit with, so a wrapper or a scheduler (Slurm's RequeueExit=143) tells them apart.
SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM
SIGHUP_EXIT_STATUS = 128 + signal.SIGHUP
INTERRUPT_EXIT_STATUS = 128 + signal.SIGINT


def signal_exit_status(exc: BaseException) -> int | None:
    """The exit status of a process that ``exc``, a stop by a signal, ends: None for any other exception."""
    if isinstance(exc, Preempted):
        return SIGTERM_EXIT_STATUS
    if isinstance(exc, HungUp):
        return SIGHUP_EXIT_STATUS
    return None


class _ExitsWithSignalStatus:
    """``sys.excepthook`` that has the hook it wraps print an uncaught exception (its traceback, the resume line),
    then ends Python with :func:`signal_exit_status` of a :class:`Preempted` or :class:`HungUp`: Python's own is 1
    (only a plain ``KeyboardInterrupt`` gets 130). A ``SystemExit`` raised here ends it as ``sys.exit`` does, so
    ``atexit`` handlers still run. Left as it was in an interactive session (``python -i``, IPython), which goes on."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        self.previous(kind, value, tb)
        status = signal_exit_status(value)
        if status is not None and not _interactive():
            raise SystemExit(status)


def _interactive() -> bool:
    """Whether Python goes on after an uncaught exception: ``python -i``, the REPL, or an IPython shell."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", None)
    return bool(sys.flags.interactive) or hasattr(sys, "ps1") or (shell is not None and shell() is not None)


def uncaught_exits_with_signal_status() -> None:
    """Have a :class:`Preempted` or :class:`HungUp` that the script leaves uncaught end Python with ``ampkit fit``'s
    status (143, 129), as a process the signal ended would: set as ``fit()`` raises one, over the hook there then."""
    if not isinstance(sys.excepthook, _ExitsWithSignalStatus):
        sys.excepthook = _ExitsWithSignalStatus(sys.excepthook)


def interrupt_note(exc: KeyboardInterrupt, step: int, newest: Any, saved: int | None = None) -> str:
    """The last line of the traceback of a ``fit()`` that ``exc`` stopped: why, at which step, and what
    ``fit(resume="last")`` continues from (``newest``; None before the run's first checkpoint), with the step it
    ``saved`` where that is older (a Ctrl-C saves nothing: the steps between are trained again)."""
    how = (
        "stopped by SIGTERM"
        if isinstance(exc, Preempted)
        else "hung up (SIGHUP: its terminal closed)"
        if isinstance(exc, HungUp)
        else "interrupted"
    )
    if newest is None:
        return f"ampkit: fit() {how} at step {step}, before its first checkpoint: fit() again starts over"
    behind = f" (saved at step {saved})" if saved is not None and saved < step else ""
    return f"ampkit: fit() {how} at step {step}; fit(resume='last') continues from '{newest}'{behind}"


class _Raise:
    """The CLI's SIGTERM handler (outside ``fit()``): the handler it replaced hears the signal, then ``exception`` is
    raised where the process is."""

    def __init__(self, exception: Callable[[], BaseException], previous: _Handler | None) -> None:
        self.exception, self.previous = exception, previous

    def __call__(self, signum: int, frame: Any) -> None:
        if self.previous is not None:  # first: once ours raised, it would never run
            self.previous(signum, frame)
        raise self.exception()


class _AskToStop:
    """``fit()``'s SIGTERM handler: ``ask``, then the handler it replaced; what that one raises is kept in
    ``raised`` (the first of it) for the end of ``fit()``."""

    def __init__(self, ask: Callable[[], None], previous: _Handler | None) -> None:
        self.ask, self.previous = ask, previous
        self.raised: BaseException | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.ask()  # first: a handler that raises or takes long must not keep the run from stopping and saving
        if self.previous is None:
            return
        try:
            self.previous(signum, frame)
        except BaseException as exc:
            if self.raised is None:
                self.raised = exc


def _replaceable(signum: int = signal.SIGTERM) -> tuple[bool, Any]:
    """Whether ampkit may install a handler of ``signum`` now, and the handler there: only in the main thread (where
    signal handlers live), and not where the caller ignores the signal (``nohup`` ignores SIGHUP) or handles it outside
    Python (``getsignal`` says None; that handler could not be put back)."""
    if threading.current_thread() is not threading.main_thread():
        return False, None
    current = signal.getsignal(signum)
    return current is not None and current != signal.SIG_IGN, current


def _passed_on_to(replaced: Any) -> _Handler | None:
    """The handler that one of ampkit's, replacing ``replaced``, calls too: a Python function, not the default action
    (it would end the process before the run saved). The CLI's handler stands aside for the one it replaced: inside
    ``fit()`` the stop is fit's, and its raise would cut the step short."""
    if isinstance(replaced, _Raise):
        return replaced.previous
    return replaced if callable(replaced) else None


@contextlib.contextmanager
def sigterm_asks_to_stop(ask: Callable[[], None]) -> Iterator[None]:
    """While in the block, a SIGTERM calls ``ask``, then the Python handler that was there before (its exception
    raised as the block ends); that handler is put back after."""
    replace, current = _replaceable()
    if not replace:
        yield
        return
    handler = _AskToStop(ask, _passed_on_to(current))
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Preempted as stop:
        if handler.raised is None:
            raise
        raise handler.raised from stop
    except BaseException as exc:  # a failure before the stop: it stands, and says what it cut short
        if handler.raised is not None:
            exc.add_note(
                f"A SIGTERM handler set before fit() had raised {shown(handler.raised)}, held until fit() ended"
            )
        raise
    else:
        if handler.raised is not None:
            raise handler.raised
    finally:
        signal.signal(signal.SIGTERM, current)


@contextlib.contextmanager
def sighup_raises() -> Iterator[None]:
    """While in the block, a SIGHUP raises :class:`HungUp` where the process is, if its default action was to come
    (which ends the process at once: no last line, the run lock left). A handler the caller set stays: ``nohup``'s
    (ignored), a Python one (``ampkit fit``'s, the user's). Put back after."""
    if signal.getsignal(signal.SIGHUP) != signal.SIG_DFL:
        yield
        return
    with signal_raises(HungUp, signal.SIGHUP):
        yield


@contextlib.contextmanager
def signal_raises(exception: Callable[[], BaseException], signum: int = signal.SIGTERM) -> Iterator[None]:
    """While in the block, ``signum`` (SIGTERM by default) raises ``exception()`` where the process is, after the
    Python handler that was there before heard it; that handler is put back after. ``fit()`` inside the block takes
    SIGTERM over (it asks to stop instead) and passes it on to that handler, not to this one; another signal (SIGHUP,
    whose default action ends the process without a word) is raised inside ``fit()`` too, which unwinds as from a
    Ctrl-C."""
    replace, current = _replaceable(signum)
    if not replace:
        yield
        return
    signal.signal(signum, _Raise(exception, _passed_on_to(current)))
    try:
        yield
    finally:
        signal.signal(signum, current)
