"""A Trainer subclass used in odd ways (a second fit, a fit from a hook): each is one error naming the mistake, or a
run that is right."""

from __future__ import annotations

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


def test_a_second_fit_trains_a_run_of_its_own_and_checkpoints_what_it_trained(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    trainer.fit()
    trainer.fit()  # the first fit's position (step 8, epoch 1) once ended this one at once, training nothing
    assert trainer.state.global_step == 8
    first = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")
    second = load_checkpoint(tmp_path / "run" / "version_1" / "checkpoints" / "last.pt")
    assert second["loop"] == first["loop"] == {"epoch": 1, "batches_done": 0, "global_step": 8}
    for name, trained in trainer.module.state_dict().items():  # seeded: the same run again, not a fresh model
        assert torch.equal(second["model"][name], trained)
        assert torch.equal(first["model"][name], trained)


class FitsInEpochEnd(ToyTrainer):
    def on_train_epoch_end(self):
        self.fit()


class FitsInValidationStep(ToyTrainer):
    def validation_step(self, batch):
        self.fit()


@pytest.mark.parametrize("trainer_class", [FitsInEpochEnd, FitsInValidationStep])
def test_fit_from_a_hook_or_step_of_a_running_fit_is_refused(tmp_path, trainer_class):
    with pytest.raises(UserCodeError, match=r"fit\(\) was called while fit\(\) is running \(from a hook or a step"):
        trainer_class(toy_cfg(tmp_path, **QUIET)).fit()


class FitsInValidate(ToyTrainer):
    def on_validation_start(self):
        self.fit()


def test_fit_from_a_hook_of_validate_is_refused_and_validate_then_fit_trains(tmp_path):
    with pytest.raises(UserCodeError, match=r"fit\(\) was called while validate\(\) is running"):
        FitsInValidate(toy_cfg(tmp_path / "a", **QUIET)).validate()
    trainer = ToyTrainer(toy_cfg(tmp_path / "b", **QUIET))
    trainer.validate()
    trainer.fit()
    assert trainer.state.global_step == 8
