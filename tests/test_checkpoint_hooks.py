"""The dict the checkpoint hooks get, as a Lightning port meets it: a KeyError of one of Lightning's checkpoint keys
(``checkpoint["epoch"]``, ``checkpoint["state_dict"]``) names ampkit's, and an ``on_load_checkpoint`` that edits the
weights, which Lightning loads after that hook but ampkit before it, is refused rather than dropped without a word."""

from __future__ import annotations

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
         "trainer.num_sanity_val_steps": 0, "data.n": 16}  # fmt: skip


class ReadsLightningEpoch(ToyTrainer):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["saved_at_epoch"] = checkpoint["epoch"]


class ReadsAmpkitEpoch(ToyTrainer):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["saved_at_epoch"] = checkpoint["loop"]["epoch"]


def test_a_lightning_checkpoint_key_read_in_on_save_checkpoint_is_a_key_error_naming_ampkit_s(tmp_path):
    with pytest.raises(KeyError, match="epoch") as caught:
        ReadsLightningEpoch(toy_cfg(tmp_path, **QUIET)).fit()
    assert any("checkpoint['loop']['epoch']" in note for note in caught.value.__notes__)
    ReadsAmpkitEpoch(toy_cfg(tmp_path, **QUIET)).fit()  # the name the note gives holds the epoch
    saved = load_checkpoint(tmp_path / "run" / "version_1" / "checkpoints" / "last.pt")
    assert saved["saved_at_epoch"] == saved["loop"]["epoch"] == 1


class RenamesOldKeys(ToyTrainer):
    """Lightning's way to load an older model's checkpoint: rename its keys in on_load_checkpoint."""

    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {f"net.{key}": value for key, value in checkpoint["state_dict"].items()}


class ReplacesAWeight(ToyTrainer):
    def on_load_checkpoint(self, checkpoint):
        checkpoint["model"]["0.weight"] = torch.zeros(16, 6)


class AssignsStateDict(ToyTrainer):
    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = dict(checkpoint["model"])


class DeletesTheWeights(ToyTrainer):
    def on_load_checkpoint(self, checkpoint):
        del checkpoint["model"]  # to free the memory, or as a Lightning port dropped keys it would not load


class ReadsTheRestoredRun(ToyTrainer):
    def on_load_checkpoint(self, checkpoint):
        self.resumed_at = (checkpoint["loop"]["epoch"], float(self.module[0].weight.detach().sum()))


@pytest.mark.parametrize(
    ("trainer_class", "error", "said"),
    [
        (RenamesOldKeys, KeyError, "'state_dict' is Lightning's checkpoint key; in on_load_checkpoint's checkpoint it "
                                   "is checkpoint['model']"),
        (ReplacesAWeight, UserCodeError, "on_load_checkpoint changed checkpoint['model'], which would change "
                                         "nothing: the model's weights were loaded"),
        (AssignsStateDict, UserCodeError, "on_load_checkpoint changed checkpoint['state_dict']"),
        (DeletesTheWeights, UserCodeError, "on_load_checkpoint removed checkpoint['model'], which would change"),
        (ReadsTheRestoredRun, None, None),
    ],
)  # fmt: skip
def test_on_load_checkpoint_editing_the_weights_it_runs_after_is_refused_and_reading_them_is_not(
    tmp_path, trainer_class, error, said
):
    """A hook's edit of the weights came after they were loaded: the resumed run trained on the saved ones without
    a word. Reading the checkpoint, and the model it was loaded into, stays as it was."""
    ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit()
    saved = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")
    resumed = trainer_class(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 2}))
    if error is None:
        resumed.fit(resume="last")
        assert resumed.resumed_at == (1, pytest.approx(float(saved["model"]["0.weight"].sum())))
        return
    with pytest.raises(error) as caught:
        resumed.fit(resume="last")
    shown = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    assert said in shown


class SavesForLightningTools(ToyTrainer):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = checkpoint["model"]  # so that Lightning's tools read the file too


class StripsACompilePrefix(ToyTrainer):
    """A migration that rebuilds the weights' dict: on a checkpoint of a model never compiled no key changes."""

    def on_load_checkpoint(self, checkpoint):
        checkpoint["model"] = {key.removeprefix("_orig_mod."): value for key, value in checkpoint["model"].items()}


class ClonesTheWeights(ToyTrainer):
    def on_load_checkpoint(self, checkpoint):
        checkpoint["model"] = {key: value.clone() for key, value in checkpoint["model"].items()}


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        (SavesForLightningTools, SavesForLightningTools),
        (ToyTrainer, StripsACompilePrefix),
        (ToyTrainer, ClonesTheWeights),
    ],
)
def test_on_load_checkpoint_that_changes_no_weight_resumes(tmp_path, saver, loader):
    """Refused as an edit were a ``state_dict`` entry the file itself holds (so every resume of such a run failed,
    with or without a hook) and a hook that rebuilt the weights' dict with the same weights in it."""
    saver(toy_cfg(tmp_path, **QUIET)).fit()
    resumed = loader(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 2}))
    resumed.fit(resume="last")
    assert resumed.state.epoch == 2
