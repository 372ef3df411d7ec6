"""The exact sequence of hooks and user methods in a full fit(): 2 epochs, accumulation 2, validation."""

from __future__ import annotations

from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback
from ampkit.trainer.callback import HOOKS


class Recorder(Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls


def _recording_hook(name: str):
    def hook(self, trainer, *args):
        self.calls.append(name)

    return hook


for _hook in HOOKS:
    setattr(Recorder, _hook, _recording_hook(_hook))


class RecordingTrainer(ToyTrainer):
    calls: list[str]

    def configure_model(self):
        self.calls.append("configure_model")
        return super().configure_model()

    def configure_optimizers(self):
        self.calls.append("configure_optimizers")
        return super().configure_optimizers()

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        return super().train_dataloader()

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        return super().val_dataloader()

    def training_step(self, batch):
        self.calls.append("training_step")
        return super().training_step(batch)

    def validation_step(self, batch):
        self.calls.append("validation_step")
        return super().validation_step(batch)


def test_full_fit_hook_sequence(tmp_path):
    calls: list[str] = []
    cfg = toy_cfg(
        tmp_path,
        **{
            "data.n": 24,
            "trainer.max_epochs": 2,
            "trainer.accumulate_grad_batches": 2,
            "checkpoint.enabled": False,
            "logging.tensorboard": False,
            "trainer.progress_bar": False,
        },
    )
    trainer = RecordingTrainer(cfg, callbacks=[Recorder(calls)])
    trainer.calls = calls
    trainer.fit()

    # 24 samples / batch 8 = 3 batches per epoch; accumulation 2 -> iterations of 2 batches, then 1.
    def batch(ends_iteration: bool) -> list[str]:
        seq = ["on_train_batch_start", "training_step", "on_before_backward", "on_after_backward"]
        if ends_iteration:
            seq += ["on_before_optimizer_step", "on_after_optimizer_step", "on_before_zero_grad"]
        return seq + ["on_train_batch_end"]

    validation = ["on_validation_start", *["validation_step", "on_validation_batch_end"] * 3, "on_validation_end"]
    epoch = ["on_train_epoch_start", *batch(False), *batch(True), *batch(True), *validation, "on_train_epoch_end"]
    expected = [
        "configure_model", "configure_optimizers", "train_dataloader", "val_dataloader",
        "on_fit_start", "on_train_start", *epoch, *epoch, "on_train_end", "on_fit_end",
    ]  # fmt: skip
    assert calls == expected
    assert trainer.state.global_step == 4
    assert trainer.optimizer_state[trainer.optimizer].steps == 4


def test_exception_fires_on_exception_then_on_fit_end(tmp_path):
    calls: list[str] = []

    class Boom(ToyTrainer):
        def training_step(self, batch):
            raise ValueError("boom")

    trainer = Boom(
        toy_cfg(tmp_path, **{"checkpoint.enabled": False, "logging.tensorboard": False}), callbacks=[Recorder(calls)]
    )
    try:
        trainer.fit()
    except ValueError:
        pass
    assert calls[-4:] == ["on_train_epoch_start", "on_train_batch_start", "on_exception", "on_fit_end"]
