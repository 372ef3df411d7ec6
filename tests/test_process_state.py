"""What a fit leaves in the process it ran in (a notebook, a pytest session, a sweep running fits in a loop), after
it returns and after it raises: no worker processes, and the caller's random generators as they were. And the
caller's torch modes that a fit must not inherit (grad mode off, an outer autocast) or that it explains (anomaly
detection)."""

from __future__ import annotations

import multiprocessing
import random
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


class _WorkerLoaders(ToyTrainer):
    persistent = True
    fail_at: int | None = None

    def train_dataloader(self):
        data = toy_dataset(self.cfg.data.n)
        return DataLoader(data, batch_size=8, shuffle=True, num_workers=1, persistent_workers=self.persistent)

    def val_dataloader(self):
        return DataLoader(toy_dataset(24, seed=7), batch_size=8, num_workers=1, persistent_workers=self.persistent)

    def training_step(self, batch):
        if self.state.global_step == self.fail_at:
            raise ValueError("a step that fails")
        return super().training_step(batch)


def _workers() -> set[int]:
    return {child.pid for child in multiprocessing.active_children()}


def test_a_fit_ends_the_loader_workers_it_started_kept_trainer_or_kept_error(tmp_path):
    """Persistent workers lived as long as the Trainer that keeps their loaders (a notebook's variable, a sweep's
    list of Trainers: 2 processes per loader per fit), and an epoch's workers as long as the error that stopped it
    (IPython keeps the last one; its traceback holds the epoch's iterator). Lightning's teardown ends both."""
    before = _workers()
    trainer = _WorkerLoaders(toy_cfg(tmp_path / "a", **QUIET, **{"trainer.max_steps": 2}))
    trainer.fit()
    assert _workers() == before
    trainer.validate()  # a persistent loader iterated again starts new workers, and its run ends them too
    assert _workers() == before
    failing = _WorkerLoaders(toy_cfg(tmp_path / "b", **QUIET))
    failing.persistent, failing.fail_at = False, 1
    with pytest.raises(ValueError, match="a step that fails") as kept:
        failing.fit()
    assert kept.value is not None and _workers() == before


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_fit_called_with_grad_mode_off_trains(tmp_path, mode):
    """Under the caller's no_grad() (an evaluation function's decorator) every loss had no graph, and the fit failed
    at its first backward saying the loss was computed under torch.no_grad()."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2}))
    with mode():
        trainer.fit()
    assert trainer.state.global_step == 2
    assert all(p.requires_grad and not p.is_inference() for p in trainer.module.parameters())


def test_a_fit_inside_the_callers_autocast_is_refused_naming_it_before_anything_is_written(tmp_path):
    """An outer autocast cast every forward and backward of a float32 (O0) run to bfloat16, silently."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    message = r"torch.autocast\(device_type='cpu', dtype=torch.bfloat16\).*precision.opt_level=O0\).*O1 precision.dtype"
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UserCodeError, match=message):
        trainer.fit()
    assert not (tmp_path / "run").exists()


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def _seed_callers(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_a_seeded_run_leaves_the_callers_random_generators_as_they_were(tmp_path):
    """A fit or a fresh validate seeded by trainer.seed (0 by default) reseeded Python's, NumPy's and torch's global
    generators for good: a sweep drawing each trial's settings from random after a fit drew the same ones every
    time. With trainer.seed=null the run draws from the caller's generators, which it leaves advanced."""
    _seed_callers(1)
    expected = _draws()
    _seed_callers(1)
    ToyTrainer(toy_cfg(tmp_path / "a", **QUIET, **{"trainer.max_steps": 1})).fit()
    ToyTrainer(toy_cfg(tmp_path / "b", **QUIET)).validate()
    assert _draws() == expected
    _seed_callers(1)
    ToyTrainer(toy_cfg(tmp_path / "c", **QUIET, **{"trainer.max_steps": 1, "trainer.seed": "null"})).fit()
    assert _draws() != expected


def test_a_scaled_float16_run_under_anomaly_detection_says_why_it_stopped(tmp_path):
    """The first steps of a dynamic loss scale overflow by design (the step is skipped, the scale lowered); torch's
    anomaly detection raises on their NaN gradients, and the error named only a backward function."""
    precision = {"precision.opt_level": "O1", "precision.dtype": "float16", "trainer.max_steps": 2}
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **precision))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
        with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="returned nan values") as err:
            trainer.fit()
    note = "\n".join(err.value.__notes__)
    assert "anomaly detection stopped the run" in note and "scale now 65536" in note
    assert "precision.dtype=bfloat16" in note


class _RecordsForwardDtypes(ToyTrainer):
    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.dtypes = getattr(self, "dtypes", set()) | {out.dtype}
        return F.mse_loss(out.squeeze(1).float(), y)


def test_apex_patches_of_torch_functions_leave_a_fit_at_its_own_precision(tmp_path):
    """An O0 fit after an Apex script's amp.init() (or amp.initialize(..., patch_torch_functions=True)) in the same
    process ran its forward in float16: those patches are process-wide. They still cast outside the run."""
    from ampkit.compat import amp

    handle = amp.init(enabled=True, patch_type=torch.float16)
    try:
        trainer = _RecordsForwardDtypes(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1}))
        trainer.fit()
        assert trainer.dtypes == {torch.float32}
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float16
    finally:
        handle._deactivate()


class _WaitsInFit(ToyTrainer):
    def on_train_start(self):
        self.started.set()
        self.release.wait(30)


def test_a_fit_or_validate_from_another_thread_while_one_runs_is_refused_naming_both_threads(tmp_path):
    """A second thread's fit() was refused as one 'from a hook or a step' of the running fit, and its validate() ran
    beside the fit on the same model and loop state."""
    trainer = _WaitsInFit(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1}))
    trainer.started, trainer.release = threading.Event(), threading.Event()
    first = threading.Thread(target=trainer.fit, name="first")
    first.start()
    try:
        assert trainer.started.wait(30)
        refused = r"in thread 'MainThread' while fit\(\) is running in thread 'first'"
        for call in (trainer.fit, trainer.validate):
            with pytest.raises(UserCodeError, match=refused):
                call()
    finally:
        trainer.release.set()
        first.join(30)
    assert trainer.state.global_step == 1
    trainer.validate()  # the run is over: its thread no longer holds the Trainer


def _fit_beside_a_waiting_fit(tmp_path, seeds: tuple[int | str, int | str], runs) -> None:
    """``runs(other)`` in this thread while a _WaitsInFit fits in thread 'first' (``seeds``: theirs, other's)."""
    trainer = _WaitsInFit(toy_cfg(tmp_path / "a", **QUIET, **{"trainer.max_steps": 1, "trainer.seed": seeds[0]}))
    trainer.started, trainer.release = threading.Event(), threading.Event()
    first = threading.Thread(target=trainer.fit, name="first")
    first.start()
    other = ToyTrainer(toy_cfg(tmp_path / "b", **QUIET, **{"trainer.max_steps": 1, "trainer.seed": seeds[1]}))
    try:
        assert trainer.started.wait(30)
        runs(other)
    finally:
        trainer.release.set()
        first.join(30)
    assert trainer.state.global_step == 1


def test_another_trainers_run_in_another_thread_while_one_runs_is_refused_naming_it_unless_neither_is_seeded(
    tmp_path,
):
    """Two Trainers fitting in two threads (a sweep's thread pool) shared torch's global generators: a seeded fit
    drew other numbers than alone, and each one's end put the caller's generators back under the other's feet."""
    refused = r"fit\(\) of _WaitsInFit is running in thread 'first' of this process.*'spawn'.*trainer.seed=null"

    def refuses(other):
        for call in (other.fit, other.validate):
            with pytest.raises(UserCodeError, match=refused):
                call()

    _fit_beside_a_waiting_fit(tmp_path / "seeded", (0, "null"), refuses)
    assert not (tmp_path / "seeded" / "b").exists()
    _fit_beside_a_waiting_fit(tmp_path / "unseeded", ("null", "null"), lambda other: other.fit())


def test_a_fit_under_a_meta_default_device_names_that_setting(tmp_path):
    """It was told to materialize its model, which would not help: the run's own tensors would be on meta too."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    torch.set_default_device("meta")
    try:
        with pytest.raises(UserCodeError, match=r"torch.set_default_device\('meta'\) puts every tensor.*set it back"):
            trainer.fit()
    finally:
        torch.set_default_device(None)
