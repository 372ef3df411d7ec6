"""SIGTERM handlers ampkit installs pass the signal on to the Python handler they replaced, and put it back."""

from __future__ import annotations

import os
import signal

import pytest

from ampkit.trainer.preemption import sigterm_asks_to_stop, sigterm_raises


class _Terminated(Exception):
    pass


@pytest.fixture
def heard():
    """The SIGTERMs a handler the caller installed before ampkit's heard; the handler there before it is put back."""
    calls = []

    def note(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, note)
    yield calls
    signal.signal(signal.SIGTERM, previous)


def test_the_cli_handler_passes_a_sigterm_on_then_raises(heard):
    """`ampkit fit` replaced the caller's handler (a script calling ampkit.cli.main under its own) for the whole
    command, so that handler never heard a SIGTERM."""
    note = signal.getsignal(signal.SIGTERM)
    with pytest.raises(_Terminated), sigterm_raises(_Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    assert heard == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is note


def test_inside_fit_the_cli_handler_stands_aside(heard):
    """fit() within the CLI asks to stop and passes the SIGTERM on to the caller's handler, not to the CLI's, whose
    raise would cut the step short."""
    asked = []
    with sigterm_raises(_Terminated), sigterm_asks_to_stop(lambda: asked.append(True)):
        os.kill(os.getpid(), signal.SIGTERM)
    assert asked == [True] and heard == [signal.SIGTERM]


def test_the_cli_leaves_an_ignored_sigterm_ignored():
    """A process started with SIGTERM ignored (``trap '' TERM``) was made to stop by the CLI's handler."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with sigterm_raises(_Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_cli_leaves_a_handler_installed_outside_python_in_place(monkeypatch):
    """``getsignal`` answers None for a C host's handler; putting None back after the command was a TypeError."""
    monkeypatch.setattr(signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: pytest.fail("SIGTERM's handler was replaced"))
    with sigterm_raises(_Terminated):
        pass
