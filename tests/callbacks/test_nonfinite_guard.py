"""A NaN that reaches the weights stops the run, naming its step, before it is written over a finite checkpoint."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from toy_trainers import ManualOptimization, NaNLossToyTrainer, ToyTrainer, toy_cfg

from ampkit import Callback, cli
from ampkit.callbacks import NonFiniteError
from ampkit.callbacks.nonfinite_guard import nonfinite_entries
from ampkit.trainer.checkpoint_io import load_checkpoint

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2}


def test_nan_loss_in_fp32_stops_before_overwriting_the_last_finite_checkpoint(tmp_path):
    trainer = NaNLossToyTrainer(toy_cfg(tmp_path, **QUIET, **{"checkpoint.every_n_steps": 1}))
    named = r"\(0.weight, 0.bias, 3.weight and 1 more hold NaN/inf\)"
    with pytest.raises(NonFiniteError, match=rf"not finite at step 6 {named}: step 6 applied a loss of nan"):
        trainer.fit()
    last = load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")
    assert last["loop"]["global_step"] == 5 and not nonfinite_entries(last["model"])


def test_without_checkpoints_the_periodic_check_names_the_first_bad_step(tmp_path):
    cfg = toy_cfg(tmp_path, **QUIET, **{"checkpoint.enabled": False, "logging.log_every_n_steps": 5})
    with pytest.raises(NonFiniteError, match="not finite at step 10 .*: step 6 applied a loss of nan"):
        NaNLossToyTrainer(cfg).fit()


@pytest.mark.parametrize("precision", [{}, {"precision.opt_level": "O1", "precision.dtype": "bfloat16"}])
def test_a_run_that_ends_before_the_periodic_check_is_checked_at_its_end(tmp_path, precision):
    """8 steps, a check every 10 and no checkpoint: a NaN at step 1 (float32, or bfloat16 with no loss scaler)
    must not end the fit with a NaN model and no word."""

    class NaNFirst(NaNLossToyTrainer):
        nan_at = 1

    cfg = toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 1, "checkpoint.enabled": False}, **precision)
    with pytest.raises(NonFiniteError, match=r"not finite at step 8 .*: step 1 applied a loss of nan"):
        NaNFirst(cfg).fit()


@pytest.mark.parametrize(("precision", "advice"), [
    ({}, "Lower the learning rate, clip gradients, or use a loss scaler"),
    ({"precision.opt_level": "O3", "precision.dtype": "bfloat16"}, "opt_level=O3 steps the half-precision weights"),
    ({"precision.opt_level": "O2", "precision.dtype": "bfloat16", "precision.master_weights": False},
     "opt_level=O2 steps the half-precision weights and optimizer state themselves, without fp32 master weights"),
])  # fmt: skip
def test_the_advice_names_missing_master_weights_where_they_are_missing(tmp_path, precision, advice):
    """O3 (and O2 with master weights off) steps half weights with a half optimizer state: the error says so, as
    'use a loss scaler' would send a user the wrong way."""
    cfg = toy_cfg(tmp_path, **QUIET, **{"checkpoint.every_n_steps": 1}, **precision)
    with pytest.raises(NonFiniteError, match=advice):
        NaNLossToyTrainer(cfg).fit()


def test_a_nan_that_never_reaches_the_weights_does_not_stop_the_run(tmp_path):
    class NaNReportedOnly(NaNLossToyTrainer):
        detached = True

    trainer = NaNReportedOnly(toy_cfg(tmp_path, **QUIET, **{"logging.log_every_n_steps": 2}))
    trainer.fit()
    assert trainer.state.global_step == 16 and not nonfinite_entries(trainer.module.state_dict())


def test_a_step_the_loss_scaler_skips_is_not_a_fault(tmp_path):
    cfg = toy_cfg(tmp_path, **QUIET, **{"precision.opt_level": "O1", "logging.log_every_n_steps": 2})

    class NoNaN(NaNLossToyTrainer):
        nan_at = -1

    class SkippedIterations(Callback):
        def __init__(self):
            self.iterations = []

        def on_optimizer_step_skipped(self, trainer, optimizer, culprits):
            self.iterations.append(trainer.state.iteration)

    seen = {"nan": SkippedIterations(), "clean": SkippedIterations()}
    with_nan, without = NaNLossToyTrainer(cfg, callbacks=[seen["nan"]]), NoNaN(cfg, callbacks=[seen["clean"]])
    with_nan.fit()
    without.fit()
    # The NaN iteration is one the scaler skips (and the clean run does not), and the guard lets the run finish.
    assert 6 in seen["nan"].iterations and 6 not in seen["clean"].iterations
    assert with_nan.state.global_step == 16
    assert not nonfinite_entries(with_nan.module.state_dict())


class ManualNaNLossToyTrainer(ManualOptimization, NaNLossToyTrainer):
    """The NaN loss of iteration 6, backpropagated and stepped by the training code itself."""


def test_under_manual_optimization_the_losses_given_to_backward_are_watched(tmp_path):
    cfg = toy_cfg(tmp_path, **QUIET, **{"checkpoint.enabled": False, "logging.log_every_n_steps": 5})
    with pytest.raises(NonFiniteError, match="not finite at step 10 .*: step 6 applied a loss of nan"):
        ManualNaNLossToyTrainer(cfg).fit()


def test_with_accumulation_a_nan_in_any_micro_batch_is_named_by_its_iteration(tmp_path):
    overrides = {"checkpoint.enabled": False, "logging.log_every_n_steps": 4, "trainer.accumulate_grad_batches": 2}

    class NaNInSecondMicroBatch(NaNLossToyTrainer):
        def training_step(self, batch):
            loss = ToyTrainer.training_step(self, batch)
            return loss * float("nan") if (self.state.iteration, self.state.batch_idx % 2) == (3, 1) else loss

    with pytest.raises(NonFiniteError, match="not finite at step 4 .*: step 3 applied a loss of nan"):
        NaNInSecondMicroBatch(toy_cfg(tmp_path, **QUIET, **overrides)).fit()


def test_cli_reports_it_in_one_line(tmp_path, capsys):
    path = tmp_path / "nan.yaml"
    cfg = toy_cfg(tmp_path, **QUIET, **{"checkpoint.every_n_steps": 1})
    OmegaConf.save(OmegaConf.create({**cfg, "trainer_class": "toy_trainers:NaNLossToyTrainer"}), path)
    assert cli.main(["fit", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ampkit: error: the model is not finite at step 6") and err.count("\n") == 1


def test_nonfinite_entries_reads_floats_only():
    state = {"w": torch.tensor([1.0, float("inf")]), "b": torch.zeros(2), "count": torch.tensor(3)}
    assert nonfinite_entries(state) == ["w"]
