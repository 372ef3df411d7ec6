"""Fault injection: SIGKILL or SIGINT a small run at random moments, over and over; every kill leaves a
loadable ``last.pt``, every restart tidies what the kill left (temp files, a stale lock), and every run,
restarted after each kill until it finishes, ends with a final checkpoint equal in every key (model,
optimizers, callbacks' states such as the best-k ranking, loop, RNG) to a run never killed.

Children fork from a forkserver that imported torch and ampkit once, so a kill-and-restart costs
milliseconds, not an interpreter start; the seed is printed so a failing schedule can be replayed.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

from checkpoint_compare import assert_same_checkpoint
from toy_trainers import fit_toy_resuming, toy_cfg

from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.run_life import LOCK_FILE, resolve_checkpoint

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
