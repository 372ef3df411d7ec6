"""Gradient accumulation keeps Lightning's ``accumulate_grad_batches`` contract: a window of N batches steps as one
batch N times as large (each loss divided by N), an epoch's short last window steps too, schedulers and
``global_step`` count optimizer steps, and under a float16 loss scaler an overflow anywhere in a window skips the
whole window, as torch's GradScaler recipe does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False,
         "logging.throughput": False, "trainer.num_sanity_val_steps": 0, "trainer.val_every_n_epochs": 0}  # fmt: skip


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


class Plain(ToyTrainer):
    """No dropout, no shuffling, plain SGD with a per-step LambdaLR that counts its steps."""

    dtype = torch.float64

    def configure_model(self):
        return _model(self.dtype)

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.9**step)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": self.schedule, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(toy_dataset(self.cfg.data.n), batch_size=self.cfg.data.batch_size)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x.to(self.dtype)).squeeze(1), y.to(self.dtype))


def _fit(tmp_path, trainer=Plain, callbacks=(), resume=None, **overrides) -> Plain:
    run = trainer(toy_cfg(tmp_path, **{**QUIET, **overrides}), callbacks=list(callbacks))
    run.fit(resume=resume)
    return run


def test_a_window_of_n_batches_steps_as_one_batch_n_times_as_large(tmp_path):
    accumulated = _fit(tmp_path / "a", **{"data.n": 48, "data.batch_size": 4, "trainer.accumulate_grad_batches": 4,
                                          "trainer.max_epochs": 2})  # fmt: skip
    big = _fit(tmp_path / "b", **{"data.n": 48, "data.batch_size": 16, "trainer.max_epochs": 2})
    assert accumulated.state.global_step == big.state.global_step == 6
    assert accumulated.schedule.last_epoch == accumulated.optimizer_state[accumulated.optimizer].steps == 6
    for key, value in big.module.state_dict().items():
        torch.testing.assert_close(accumulated.module.state_dict()[key], value, rtol=1e-12, atol=1e-14)


def _hand_loop(n: int, batch_size: int, accumulate: int, epochs: int) -> tuple[torch.nn.Module, int]:
    """Lightning's rule by hand: every loss divided by ``accumulate``, a step after each window and after the
    epoch's last batch."""
    model = _model(torch.float64)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.9**step)
    batches = list(DataLoader(toy_dataset(n), batch_size=batch_size))
    steps = 0
    for _ in range(epochs):
        for i, (x, y) in enumerate(batches):
            (F.mse_loss(model(x.double()).squeeze(1), y.double()) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                sgd.step()
                schedule.step()
                sgd.zero_grad()
                steps += 1
    return model, steps


def test_an_epoch_s_short_last_window_steps_with_each_loss_still_divided_by_n(tmp_path):
    """Ten batches in windows of 4 are three steps an epoch; the last (2 batches) steps at the epoch's end, its losses
    divided by 4 as the full windows' are (Lightning's rule), and the schedule steps with it."""
    run = _fit(tmp_path, **{"data.n": 40, "data.batch_size": 4, "trainer.accumulate_grad_batches": 4,
                            "trainer.max_epochs": 2})  # fmt: skip
    reference, steps = _hand_loop(40, 4, 4, 2)
    assert run.state.global_step == run.schedule.last_epoch == steps == 6
    assert run.num_training_steps == 6
    for key, value in reference.state_dict().items():
        assert torch.equal(run.module.state_dict()[key], value), key


class Overflows(Plain):
    """Float32 under O1 float16; batch ``overflow_at`` (0-based, of the run) has a loss whose float16 gradients
    overflow."""

    dtype = torch.float32
    overflow_at = 4  # the middle batch of the second window of 3

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.epoch * self.num_train_batches + self.state.batch_idx == self.overflow_at:
            loss = loss * 1e30
        return loss


class Record(Callback):
    """The weights at each iteration's end, the skipped iterations and each scale update."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.skipped: list[int] = []
        self.scales: list[tuple[float, float]] = []

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids) -> None:
        self.skipped.append(trainer.state.iteration)

    def on_loss_scale_update(self, trainer, loss_id, old, new) -> None:
        self.scales.append((old, new))

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.is_iteration_end:
            self.weights.append({k: v.clone() for k, v in trainer.module.state_dict().items()})


def _grad_scaler_recipe(n: int, batch_size: int, accumulate: int, overflow_at: int) -> tuple[torch.nn.Module, list]:
    """torch's recipe for accumulation under GradScaler: scaled backwards summed over the window, one step (skipped
    on an inf anywhere in it) and one update per window."""
    model = _model(torch.float32)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.9**step)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for i, (x, y) in enumerate(DataLoader(toy_dataset(n), batch_size=batch_size)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).squeeze(1), y)
        if i == overflow_at:
            loss = loss * 1e30
        scaler.scale(loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            before = scaler.get_scale()
            scaler.step(sgd)
            scaler.update()
            if scaler.get_scale() == before:  # the recipe steps a scheduler only after a step that was taken
                schedule.step()
            scales.append((before, scaler.get_scale()))
            sgd.zero_grad()
    return model, scales


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_overflow_inside_a_window_skips_the_whole_window_as_the_grad_scaler_recipe_does(tmp_path, opt_level):
    """The overflowing batch sits between two clean ones: none of the window's three batches reaches the weights
    (O2: nor the fp32 masters), the scale backs off once (not per batch), the schedule does not advance, and the next
    window starts from zeroed gradients. At O1 the run ends where torch's GradScaler recipe ends."""
    record = Record()
    run = _fit(tmp_path, Overflows, [record], **{"data.n": 36, "data.batch_size": 3,
               "trainer.accumulate_grad_batches": 3, "precision.opt_level": opt_level, "precision.dtype": "float16",
               "precision.init_scale": 1024.0})  # fmt: skip
    assert record.skipped == [2]
    for key, value in record.weights[0].items():
        assert torch.equal(record.weights[1][key], value), key  # window 2 (batches 3-5) applied nothing
        assert not torch.equal(record.weights[2][key], value), key  # window 3 stepped
    assert record.scales == [(1024.0, 1024.0), (1024.0, 512.0), *[(512.0, 512.0)] * 2]
    opt_state = run.optimizer_state[run.optimizer]
    assert (run.state.global_step, opt_state.steps, opt_state.skipped_steps) == (4, 3, 1)
    assert run.schedule.last_epoch == 3
    assert all(v.isfinite().all() for v in run.module.state_dict().values())
    if opt_level == "O2":  # half weights: torch's recipe is O1's
        return
    reference, scales = _grad_scaler_recipe(36, 3, 3, Overflows.overflow_at)
    assert scales == record.scales
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(run.module.state_dict()[key], value, rtol=1e-6, atol=1e-7)


class ManualAccumulation(Plain):
    """Manual optimization over windows of N: the step divides its own loss; step() acts at a window's end."""

    automatic_optimization = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss / self.cfg.trainer.accumulate_grad_batches)
        self.stepped.append(self.step(self.optimizer))
        return {"loss": loss}


@pytest.mark.parametrize("batches", [12, 10])
def test_manual_optimization_accumulates_too_stepping_at_each_window_s_end(tmp_path, batches):
    """Lightning refuses accumulate_grad_batches under manual optimization; ampkit's step() is a no-op (returning
    False) until the window ends, so a manual step accumulates as the automatic one does."""
    trainer = type("Manual", (ManualAccumulation,), {"stepped": []})
    manual = _fit(tmp_path / "manual", trainer, **{"data.n": 4 * batches, "data.batch_size": 4,
                                                   "trainer.accumulate_grad_batches": 4})  # fmt: skip
    automatic = _fit(tmp_path / "automatic", **{"data.n": 4 * batches, "data.batch_size": 4,
                                                "trainer.accumulate_grad_batches": 4})  # fmt: skip
    ends = [(i + 1) % 4 == 0 or i + 1 == batches for i in range(batches)]
    assert trainer.stepped == ends
    assert manual.state.global_step == automatic.state.global_step == sum(ends)
    for key, value in automatic.module.state_dict().items():
        assert torch.equal(manual.module.state_dict()[key], value), key


class StopInsideAWindow(Callback):
    """Sets should_stop after the 5th batch, the middle of the second window of 3."""

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.batches_done == 5 and trainer.state.epoch == 0:
            trainer.state.should_stop, trainer.state.stop_reason = True, "asked inside a window"


def test_a_stop_asked_inside_a_window_takes_effect_at_its_end_so_its_checkpoint_extends_exactly(tmp_path):
    """A stop mid-window dropped the window's batches so far and saved a checkpoint inside the window: extended
    (max_epochs raised), the resumed run's window lacked them. Now it stops where the window ends, as under torchrun
    (and as a SIGTERM does): the window steps, and the extension equals a run that never stopped."""
    keys = {"data.n": 48, "data.batch_size": 4, "trainer.accumulate_grad_batches": 3, "checkpoint.enabled": True}
    stopped = _fit(tmp_path / "split", Plain, [StopInsideAWindow()], **keys, **{"trainer.max_epochs": 1})
    assert (stopped.state.global_step, stopped.state.batches_done) == (2, 6)
    extended = _fit(tmp_path / "split", resume="last", **keys, **{"trainer.max_epochs": 2})
    whole = _fit(tmp_path / "whole", **keys, **{"trainer.max_epochs": 2})
    assert extended.state.global_step == whole.state.global_step == 8
    for key, value in whole.module.state_dict().items():
        assert torch.equal(extended.module.state_dict()[key], value), key
