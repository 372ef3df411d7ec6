"""Fault injection: SIGKILL or SIGINT a small run at random moments, over and over; every kill leaves a
loadable ``last.pt``, every restart tidies what the kill left (temp files, a stale lock), and every run,
restarted after each kill until it finishes, ends with a final checkpoint equal in every key (model,
optimizers, callbacks' states such as the best-k ranking, loop, RNG) to a run never killed.

Children fork from a forkserver that imported torch and ampkit once, so a kill-and-restart costs
milliseconds, not an interpreter start; the seed is printed so a failing schedule can be replayed.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_compare import assert_same_checkpoint
from toy_trainers import ToyTrainer, fit_toy_resuming, toy_cfg

import ampkit
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint
from ampkit.trainer.run_life import LOCK_FILE, RunDirectoryError, resolve_checkpoint
from ampkit.trainer.sharded_checkpoint import checkpoint_damage

KILLS = 20
SETTINGS = {
    "trainer.max_epochs": 2,
    "trainer.progress_bar": False,
    "logging.tensorboard": False,
    "checkpoint.every_n_steps": 1,
    "checkpoint.keep_last": 2,
    "trainer.val_every_n_steps": 3,  # validations between checkpoints: the best-k ranking is state to resume
    "checkpoint.monitor": "val/mse",
    "checkpoint.save_top_k": 2,
}


def _assert_finished_and_tidy(run_dir: Path, reference: dict) -> None:
    last = resolve_checkpoint(run_dir, "last")
    assert_same_checkpoint(load_checkpoint(last), reference)
    names = sorted(p.name for p in last.parent.iterdir())  # what the kills left, the restarts removed
    # Also after a restart of a run that had finished, which trains and writes nothing but still tidies.
    assert not [n for n in names if n.endswith(".tmp")], names
    assert not [p.name for p in last.parent.parent.iterdir() if p.name.startswith(".")]
    periodic = [n for n in names if n.startswith(("step-", "epoch-"))]
    assert len(periodic) <= SETTINGS["checkpoint.keep_last"], names
    assert len([n for n in names if n.startswith("best-")]) <= SETTINGS["checkpoint.save_top_k"], names
    assert not (last.parent.parent / LOCK_FILE).exists()


def _signal(proc: multiprocessing.Process, signum: int) -> bool:
    """Send ``signum``; False if the process had already ended (the forkserver reaps it, so its pid is gone)."""
    try:
        os.kill(proc.pid, signum)
    except ProcessLookupError:
        return False
    return True


def test_random_sigkills_and_sigints_then_every_resume_is_bit_identical(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"fault-injection seed {seed}")
    rng = random.Random(seed)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch._dynamo", "ampkit.callbacks", "toy_trainers"])  # optimizers import dynamo

    def start(run_dir: Path) -> multiprocessing.Process:
        proc = ctx.Process(target=fit_toy_resuming, args=(toy_cfg(run_dir, **SETTINGS),))
        proc.start()
        return proc

    references = []
    for name in ("cold", "warm"):  # the second run, with the forkserver up, times a whole run
        began = time.perf_counter()
        reference_run = start(tmp_path / name)
        reference_run.join(300)
        duration = time.perf_counter() - began
        assert reference_run.exitcode == 0
        references.append(load_checkpoint(resolve_checkpoint(tmp_path / name / "run", "last")))
    reference = references[0]
    assert_same_checkpoint(references[1], reference)
    assert reference["loop"]["global_step"] == 16

    resumed_from: set[int] = set()  # the steps of the last.pt files that kills left for the next start
    kills = runs = 0
    # At least KILLS kills; more (up to 3x) while they have landed at too few distinct steps, which a loaded
    # machine, where start-up takes most of a run's time, can cause.
    while kills < KILLS or (len(resumed_from) < KILLS // 4 and kills < 3 * KILLS):
        run_dir = tmp_path / f"killed{runs}" / "run"
        proc = start(run_dir.parent)
        proc.join(rng.uniform(0.0, duration))
        if proc.is_alive() and _signal(proc, rng.choice([signal.SIGKILL, signal.SIGINT])):  # SIGINT: as Ctrl-C
            proc.join()
            kills += 1
            last = resolve_checkpoint(run_dir, "last")
            if last is not None:  # loadable, whatever the moment of the kill
                resumed_from.add(load_checkpoint(last)["loop"]["global_step"])
            continue
        proc.join()  # it ended by itself, perhaps between the check and the signal
        # This run, restarted after each kill until it finished, ends exactly where the reference did.
        assert proc.exitcode == 0, f"seed {seed}: a restarted run failed"
        _assert_finished_and_tidy(run_dir, reference)
        runs += 1
    proc = start(run_dir.parent)  # finish the run the last kill interrupted
    proc.join(300)
    assert proc.exitcode == 0, f"seed {seed}: a restarted run failed"
    _assert_finished_and_tidy(run_dir, reference)
    assert len(resumed_from) >= KILLS // 4, f"seed {seed}: kills landed at too few steps: {sorted(resumed_from)}"


# ------------------------------------------------------------------ storage failures injected in-process
# A run with periodic, best-k and end saves; a file system call fails at its N-th call with what a full disk, a dying
# device or a read-only remount raises. The indices land on each kind of write of a 6-step run (found by counting:
# a checkpoint's own file, its best-k copy, best, last, an fsync, a sharded save's links, an event file).
FAILING_RUN = {
    "trainer.max_epochs": 3,
    "data.n": 16,
    "trainer.progress_bar": False,
    "checkpoint.every_n_steps": 2,
    "checkpoint.keep_last": 2,
    "trainer.val_every_n_steps": 3,
    "checkpoint.monitor": "val/mse",
    "checkpoint.save_top_k": 2,
}
SHARDED = {"distributed.strategy": "fsdp", "distributed.fsdp.shard_modules": "[Linear]"}


def _event_file_write():
    from tensorboard.summary.writer.record_writer import RecordWriter

    return RecordWriter, "write"


_CALLS = {
    "os.replace": lambda: (os, "replace"),
    "os.fsync": lambda: (os, "fsync"),
    "os.copy_file_range": lambda: (os, "copy_file_range"),
    "os.unlink": lambda: (os, "unlink"),
    "os.unlink of a best-k file": lambda: (os, "unlink"),
    "torch.save": lambda: (torch, "save"),
    "event file": _event_file_write,
}


@pytest.mark.parametrize(
    ("call", "n", "failure", "sharded"),
    [
        ("os.replace", 7, errno.EIO, False),  # last.pt at the second save
        ("os.fsync", 6, errno.ENOSPC, False),
        ("os.copy_file_range", 3, errno.ENOSPC, False),  # a best-k copy
        ("torch.save", 4, errno.EROFS, False),
        ("event file", 5, errno.EIO, False),
        ("os.unlink", 2, errno.EROFS, False),  # keep_last's pruning: a bare OSError's traceback
        ("os.unlink of a best-k file", 1, errno.EIO, False),  # one pushed out of the top k: alike
        ("os.replace", 4, errno.EIO, True),  # the last link of the second save: its temp link was left
        ("os.replace", 11, errno.EROFS, True),  # the best link
        ("os.fsync", 9, errno.ENOSPC, True),
    ],
)
def test_a_storage_failure_at_any_write_stops_in_one_line_and_leaves_every_checkpoint_whole(
    tmp_path, monkeypatch, call, n, failure, sharded
):
    """Whatever write fails: the run stops with one line carrying the failure's errno (ampkit fit's status 74), every
    checkpoint name left loads whole, no temp file is left, nothing outside the run directory changes, and
    --resume last continues from last and finishes the run."""
    settings = {**FAILING_RUN, **(SHARDED if sharded else {})}
    if call.endswith("best-k file"):  # a validation at every step, the mse rising: each pushes one out of the top 2
        settings.update({"trainer.val_every_n_steps": 1, "checkpoint.mode": "max"})
    (tmp_path / "notes.txt").write_text("the user's")
    outside = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    owner, name = _CALLS[call]()
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        if call.endswith("best-k file") and not Path(args[0]).name.startswith("best-"):
            return real(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            raise OSError(failure, os.strerror(failure))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the changed-validation and FSDP notes
        with pytest.raises((CheckpointError, RunDirectoryError)) as raised:
            ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    monkeypatch.undo()
    assert raised.value.storage_errno == failure and "\n" not in str(raised.value)
    assert os.strerror(failure) in str(raised.value)
    run = tmp_path / "run"
    assert not [p for p in tmp_path.rglob(".*") if p.name != ".metadata"]  # DCP's own name, inside a checkpoint
    checkpoints = run / "version_0" / "checkpoints"
    assert {p.name: checkpoint_damage(p) for p in checkpoints.iterdir()} == {
        p.name: None for p in checkpoints.iterdir()
    }
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and run not in p.parents} == outside
    last = resolve_checkpoint(run, "last")
    step = load_checkpoint(last / "trainer.pt" if sharded else last)["loop"]["global_step"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a newer whole checkpoint beside last is named
        resumed = ToyTrainer(toy_cfg(tmp_path, **settings))
        resumed.fit(resume="last")
    assert resumed.fit_start.loop["global_step"] == step and resumed.state.global_step == 6
    assert checkpoint_damage(resolve_checkpoint(run, "last")) is None


def test_a_lock_the_failing_disk_will_not_let_go_leaves_the_runs_own_error_in_one_line(tmp_path, monkeypatch):
    """A read-only remount fails the save and then the removal of run.lock as the fit ends: the removal's bare OSError
    took the place of the save's one line (and of the teardown after it). It is a warning now."""
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if Path(path).name == LOCK_FILE:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_unlink(path, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(torch, "save", save)
    with pytest.warns(UserWarning, match="could not remove the run lock '.*run.lock' \\(Read-only file system\\)"):
        with pytest.raises(CheckpointError, match="could not write checkpoint .*step-00000002.pt' \\(Read-only file"):
            ToyTrainer(toy_cfg(tmp_path, **FAILING_RUN)).fit()


def test_a_fit_retried_in_the_same_process_takes_over_the_lock_its_failed_disk_kept(tmp_path, monkeypatch):
    """A script that retries fit(resume="last") once the disk is fine again (or a notebook's second fit()) was refused
    by its own process's stuck run.lock (its removal failed as the first fit ended), naming this live pid. Another
    fit() of this process that holds the lock now is still refused."""
    real_unlink, real_save = os.unlink, torch.save
    read_only = []

    def unlink(path, *args, **kwargs):
        if read_only and Path(path).name == LOCK_FILE:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_unlink(path, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("loop", {}).get("global_step") == 4:  # remounted after step 2's save
            read_only.append(True)
        if read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(torch, "save", save)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stuck lock's warning, pinned above
        with pytest.raises(CheckpointError, match="step-00000004.pt' \\(Read-only file"):
            ToyTrainer(toy_cfg(tmp_path, **FAILING_RUN)).fit()
    lock = tmp_path / "run" / "version_0" / LOCK_FILE
    assert json.loads(lock.read_text())["pid"] == os.getpid()  # stuck, naming this live process
    monkeypatch.undo()  # the disk is fine again

    class StartAnother(ampkit.Callback):  # a fit() nested in a live one of this process: refused, as before
        refusal = None

        def on_train_start(self, trainer) -> None:
            with pytest.raises(RunDirectoryError, match=f"in use by pid {os.getpid()}") as refused:
                ToyTrainer(toy_cfg(tmp_path, **FAILING_RUN)).fit(resume="last")
            StartAnother.refusal = refused

    retried = ToyTrainer(toy_cfg(tmp_path, **FAILING_RUN), callbacks=[StartAnother()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        retried.fit(resume="last")
    assert StartAnother.refusal is not None
    assert retried.version_dir == lock.parent and retried.fit_start.loop["global_step"] == 3  # its best-k save
    assert retried.state.global_step == 6 and not lock.exists()
