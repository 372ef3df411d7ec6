"""TensorBoard events written by the logger read back with tensorboard's own reader."""

from __future__ import annotations

import math

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback


def _events(trainer) -> EventAccumulator:
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    return events


class _LogsExtra(Callback):
    def on_train_batch_end(self, trainer, outputs, batch):
        trainer.log("custom/batches", trainer.state.batches_done)


def test_tags_steps_values_and_hparams(tmp_path):
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.log_every_n_steps": 2, "lr": 0.01})
    trainer = ToyTrainer(cfg, callbacks=[_LogsExtra()])
    grad_norms: list[float] = []
    original = trainer.grad_norm

    def spy(optimizer):
        norm = original(optimizer)
        grad_norms.append(norm.item())
        return norm

    trainer.grad_norm = spy
    trainer.fit()
    events = _events(trainer)
    scalars = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr/sgd",
        "train/grad_norm/sgd",
        "train/steps_per_sec",
        "val/mse",
        "custom/batches",
    } <= scalars
    assert [e.step for e in events.Scalars("train/loss")] == list(range(2, 17, 2))
    assert [e.step for e in events.Scalars("val/mse")] == [8, 16]
    assert all(math.isclose(e.value, 0.01, rel_tol=1e-6) for e in events.Scalars("train/lr/sgd"))
    logged = [e.value for e in events.Scalars("train/grad_norm/sgd")]
    assert len(logged) == 8 and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(logged, grad_norms, strict=True))
    assert [e.value for e in events.Scalars("custom/batches")][:3] == [1, 2, 3]
    assert len(events.Scalars("custom/batches")) == 16  # queued scalars are written at every batch
    plugins = events.PluginTagToContent("hparams")
    assert plugins, "hparams were not logged"


def test_logged_loss_is_the_mean_over_the_window(tmp_path):
    losses: list[float] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, outputs, batch):
            losses.append(float(outputs["loss"]))

    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.log_every_n_steps": 4})
    trainer = ToyTrainer(cfg, callbacks=[Spy()])
    trainer.fit()
    logged = [e.value for e in _events(trainer).Scalars("train/loss")]
    expected = [torch.tensor(losses[i : i + 4]).mean().item() for i in (0, 4)]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(logged, expected, strict=True))
