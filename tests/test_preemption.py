"""SIGTERM handlers ampkit installs pass the signal on to the Python handler they replaced, and put it back; a
Python-API fit() stopped by a signal leaves a resumable run, no lock and a last line saying what resumes it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from rank_forkserver import ForkedPython
from toy_trainers import CtrlCToyTrainer, ToyTrainer, toy_cfg

from ampkit.trainer.preemption import HungUp, Preempted, signal_raises, sigterm_asks_to_stop


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
    with pytest.raises(_Terminated), signal_raises(_Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    assert heard == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is note


def test_inside_fit_the_cli_handler_stands_aside(heard):
    """fit() within the CLI asks to stop and passes the SIGTERM on to the caller's handler, not to the CLI's, whose
    raise would cut the step short."""
    asked = []
    with signal_raises(_Terminated), sigterm_asks_to_stop(lambda: asked.append(True)):
        os.kill(os.getpid(), signal.SIGTERM)
    assert asked == [True] and heard == [signal.SIGTERM]


def test_a_failure_inside_fit_notes_the_held_exit_by_its_start_and_length():
    """The note repeated a handler's exception whole: a 10 kB message in every traceback of the run."""

    def exits(signum, frame):
        raise SystemExit("x" * 10_000)

    previous = signal.signal(signal.SIGTERM, exits)
    try:
        with pytest.raises(RuntimeError) as failed, sigterm_asks_to_stop(lambda: None):
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("the step failed")
    finally:
        signal.signal(signal.SIGTERM, previous)
    (note,) = failed.value.__notes__
    assert "had raised SystemExit('xxx" in note and "characters), held until fit() ended" in note and len(note) < 200


def test_the_cli_leaves_an_ignored_sigterm_ignored():
    """A process started with SIGTERM ignored (``trap '' TERM``) was made to stop by the CLI's handler."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with signal_raises(_Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_cli_leaves_a_handler_installed_outside_python_in_place(monkeypatch):
    """``getsignal`` answers None for a C host's handler; putting None back after the command was a TypeError."""
    monkeypatch.setattr(signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: pytest.fail("SIGTERM's handler was replaced"))
    with signal_raises(_Terminated):
        pass


class SignalledAtStep2(ToyTrainer):
    """Sends itself ``signum`` in its third step, after the checkpoint of step 2."""

    signum = signal.SIGHUP

    def training_step(self, batch):
        if self.state.global_step == 2:
            os.kill(os.getpid(), self.signum)
        return super().training_step(batch)


@pytest.mark.parametrize(
    ("signum", "raised", "how", "step"),
    [
        (signal.SIGHUP, HungUp, "hung up (SIGHUP: its terminal closed)", 2),
        (signal.SIGINT, KeyboardInterrupt, "interrupted", 2),
        (signal.SIGTERM, Preempted, "stopped by SIGTERM", 3),  # at the step's end, saved
    ],
    ids=["SIGHUP", "SIGINT", "SIGTERM"],
)
def test_a_signal_to_a_python_api_fit_leaves_a_resumable_run_and_says_so(
    tmp_path, monkeypatch, signum, raised, how, step
):
    """Under ``python train.py`` a SIGHUP (the terminal closed) ended the process at once: no word, the run lock
    left; a Ctrl-C's traceback ended in a bare KeyboardInterrupt, naming nothing to resume. Left uncaught, the
    SIGTERM's and SIGHUP's stops end Python with ampkit fit's status (Python's own was 1), after the hook there
    printed their traceback; a Ctrl-C keeps Python's (130, a plain KeyboardInterrupt's)."""
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(value))
    settings = {"logging.tensorboard": False, "trainer.progress_bar": False, "checkpoint.every_n_steps": 2}
    # What a terminal's script has (a runner under nohup, or one whose workers ignore SIGINT, has others).
    handler = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    outside = signal.signal(signum, handler)
    trainer = type("Signalled", (SignalledAtStep2,), {"signum": signum})(toy_cfg(tmp_path, **settings))
    try:
        with pytest.raises(raised) as stopped:
            trainer.fit()
        assert signal.getsignal(signum) == handler
    finally:
        signal.signal(signum, outside)
    last = trainer.version_dir / "checkpoints" / "last.pt"
    assert (
        stopped.value.__notes__[-1] == f"ampkit: fit() {how} at step {step}; fit(resume='last') continues from '{last}'"
    )
    assert not (trainer.version_dir / "run.lock").exists()
    status = {signal.SIGHUP: 129, signal.SIGTERM: 143}.get(signum)
    with pytest.raises(SystemExit) if status else contextlib.nullcontext() as exits:
        sys.excepthook(raised, stopped.value, stopped.value.__traceback__)  # what Python calls, left uncaught
    assert printed == [stopped.value] and (exits is None or exits.value.code == status)
    resumed = ToyTrainer(toy_cfg(tmp_path, **settings))
    resumed.fit(resume="last")
    assert resumed.version_dir == trainer.version_dir and resumed.state.global_step == 8


def test_a_ctrl_c_after_the_last_save_says_which_step_resume_continues_from(tmp_path):
    """A Ctrl-C saves nothing: the note named last.pt alone, so the steps since its save looked kept."""
    settings = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2}
    trainer = CtrlCToyTrainer(toy_cfg(tmp_path, **settings))
    with pytest.raises(KeyboardInterrupt) as stopped:
        trainer.fit()
    last = trainer.version_dir / "checkpoints" / "last.pt"
    assert stopped.value.__notes__[-1] == (
        f"ampkit: fit() interrupted at step 10; fit(resume='last') continues from '{last}' (saved at step 8)"
    )


SCRIPT = """
import os, sys
from pathlib import Path
from toy_trainers import ToyTrainer, toy_cfg

class Preempted(ToyTrainer):
    def training_step(self, batch):
        if self.state.global_step == 2 and sys.argv[2] == "signal":
            os.kill(os.getpid(), 15)
        return super().training_step(batch)

settings = {"logging.tensorboard": False, "trainer.progress_bar": False, "checkpoint.every_n_steps": 2}
trainer = Preempted(toy_cfg(Path(sys.argv[1]), **settings))
trainer.fit()
if sys.argv[2] == "raise":
    raise KeyboardInterrupt("a script's own Ctrl-C after a fit")
"""


def test_a_script_leaving_a_preemption_uncaught_exits_143_with_its_traceback_and_atexit(tmp_path):
    """``python train.py`` whose fit() a SIGTERM stopped exited 1 (Python's status of any uncaught exception but a
    plain KeyboardInterrupt): a scheduler or wrapper reading 143 (Slurm's RequeueExit=143) saw a crash. Now 143, the
    traceback and its resume line printed and atexit handlers run; a script's own KeyboardInterrupt raised after a
    fit() that ended normally keeps Python's 130."""
    tests = Path(__file__).resolve().parent
    script = tmp_path / "train.py"
    script.write_text("import atexit\natexit.register(print, 'atexit ran')\n" + SCRIPT)
    env = child_env(tests, tests.parent)
    runs = {
        how: ForkedPython([sys.executable, str(script), str(tmp_path / how), how], env=env)
        for how in ("signal", "raise")
    }
    results = {how: (run.communicate(timeout=120), run.returncode) for how, run in runs.items()}
    (out, err), status = results["signal"]
    assert status == 143, err
    assert "ampkit.trainer.preemption.Preempted: SIGTERM: stopped at step 3" in err and "atexit ran" in out
    assert err.rstrip().endswith(
        "fit(resume='last') continues from '"
        + str(tmp_path / "signal" / "run" / "version_0" / "checkpoints" / "last.pt")
        + "'"
    )
    (out, err), status = results["raise"]
    assert status == subprocess.CompletedProcess([], -signal.SIGINT).returncode, err  # Python's own: killed by SIGINT


def test_an_interactive_session_goes_on_after_an_uncaught_preemption(monkeypatch):
    """In the REPL (or python -i after the script) an uncaught exception is printed and the session goes on: the hook
    ending Python with 143 there would close it."""
    from ampkit.trainer.preemption import uncaught_exits_with_signal_status

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(value))
    uncaught_exits_with_signal_status()
    stop = Preempted("SIGTERM: stopped at step 3")
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    sys.excepthook(Preempted, stop, None)
    monkeypatch.delattr(sys, "ps1")
    with pytest.raises(SystemExit) as exits:
        sys.excepthook(Preempted, stop, None)
    assert exits.value.code == 143 and printed == [stop, stop]
