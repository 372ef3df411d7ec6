"""The evaluation loop keeps the contract Lightning users know: the steps run in eval mode without autograd and hand
the model back in train mode; validation leaves BatchNorm's statistics as training left them; a set's mean weighs
a short last batch by its size; ``validate``/``test`` return one plain dict of the set's means and of what their end
hooks logged (Lightning returns a list of one dict per dataloader) and ``predict`` a list of per-batch outputs;
several validation loaders are refused naming how to combine them. (Each submodule's own mode kept, ``samples_in``,
empty batches: test_evaluate.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
         "checkpoint.enabled": False}  # fmt: skip


class Observed(ToyTrainer):
    """Records, in each step, whether the model trains and autograd records, and what the steps return."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, bool, bool]] = []

    def _note(self, where: str) -> None:
        self.seen.append((where, self.module.training, torch.is_grad_enabled()))

    def training_step(self, batch):
        self._note("train")
        return super().training_step(batch)

    def validation_step(self, batch):
        self._note("validation")
        return super().validation_step(batch)

    def test_dataloader(self):
        return self.val_dataloader()

    def test_step(self, batch):
        self._note("test")
        return super().validation_step(batch)

    def predict_dataloader(self):
        return self.val_dataloader()

    def predict_step(self, batch):
        self._note("predict")
        return self.model(batch[0])


def test_evaluation_steps_run_in_eval_mode_without_autograd_and_training_resumes_in_train_mode(tmp_path):
    trainer = Observed(toy_cfg(tmp_path, **QUIET, **{"trainer.val_every_n_steps": 3, "trainer.max_steps": 4}))
    trainer.fit()
    assert {s for s in trainer.seen if s[0] == "train"} == {("train", True, True)}
    assert {s for s in trainer.seen if s[0] == "validation"} == {("validation", False, False)}
    assert [s[0] for s in trainer.seen if s[0] == "train"] == ["train"] * 4  # a step after the validation at 3
    assert trainer.seen[-1] == ("train", True, True)
    for stage in ("validate", "test", "predict"):
        trainer.seen.clear()
        getattr(trainer, stage)()
        assert set(trainer.seen) == {(stage.replace("validate", "validation"), False, False)}
        assert trainer.module.training  # handed back as it was


class BatchNormed(ToyTrainer):
    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def train_dataloader(self):  # unshuffled: the runs compared draw nothing from the RNG for their order
        return DataLoader(toy_dataset(self.cfg.data.n), batch_size=self.cfg.data.batch_size)


def test_validation_leaves_batchnorm_statistics_as_training_left_them(tmp_path):
    """A validation in train mode would move the running statistics towards the validation set's and count its
    batches: a run validated every step ends with the same buffers as one never validated."""
    buffers = {}
    for name, every in (("validated", 1), ("never", 0)):
        settings = {"trainer.val_every_n_steps": every, "trainer.val_every_n_epochs": every, "trainer.max_epochs": 2}
        trainer = BatchNormed(toy_cfg(tmp_path / name, **QUIET, **settings, **{"trainer.num_sanity_val_steps": 2}))
        trainer.fit()
        buffers[name] = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    assert buffers["validated"]["1.num_batches_tracked"] == 16
    for key, value in buffers["never"].items():
        assert torch.equal(buffers["validated"][key], value), key
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    trainer.validate()
    for key, value in before.items():
        assert torch.equal(trainer.module.state_dict()[key], value), key


class ShortLastBatch(ToyTrainer):
    """20 validation samples in batches of 8, 8, 4; each batch returns its own targets' mean."""

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(20, 6), torch.arange(20.0)), batch_size=8)

    def validation_step(self, batch):
        return {"y": batch[1].mean()}


def test_a_sets_mean_weighs_a_short_last_batch_by_its_size(tmp_path):
    """The mean of the batch means, (3.5 + 11.5 + 17.5) / 3 = 10.83, overweighs the 4 samples of the last batch; the
    set's own mean is 9.5, as Lightning's epoch mean weighted by batch size gives."""
    metrics = ShortLastBatch(toy_cfg(tmp_path, **QUIET)).validate()
    assert metrics == {"y": pytest.approx(9.5)}


def test_validate_and_test_return_one_dict_of_means_and_predict_a_list_of_batch_outputs(tmp_path):
    trainer = Observed(toy_cfg(tmp_path, **QUIET))
    validated, tested = trainer.validate(), trainer.test()
    assert set(validated) == set(tested) == {"mse"} and validated == tested
    assert type(validated) is dict and all(type(value) is float for value in validated.values())
    torch.save(validated, tmp_path / "metrics.pt")  # plain: a weights_only load reads it back
    assert torch.load(tmp_path / "metrics.pt", weights_only=True) == validated
    predictions = trainer.predict()
    assert [p.shape for p in predictions] == [(8, 1)] * 3  # 24 samples in batches of 8, on the CPU, detached
    assert not any(p.requires_grad for p in predictions)


class LogsTheSetsValue(Observed):
    """Lightning's on_validation_epoch_end/on_test_epoch_end pattern: a value over the whole set, logged at its end."""

    logs_auc = True

    def on_validation_end(self, metrics):
        if self.logs_auc:
            self.log("val_auc", 0.75, on_epoch=True)

    def on_test_end(self, metrics):
        self.log("test/auc", torch.tensor(0.25))


class _LogsRmse(Callback):
    def on_validation_end(self, trainer, metrics):
        trainer.log("val/rmse", metrics["mse"] ** 0.5)


def test_validate_and_test_return_what_their_end_hooks_logged_beside_the_means(tmp_path):
    """As Lightning returns every epoch-level value logged in the run: a callback's and the Trainer's own, under the
    tags they were logged with. The step's means keep their names (and trainer.val_metrics holds only those), and a
    validation returns only what its own hooks logged, not an earlier one's."""
    trainer = LogsTheSetsValue(toy_cfg(tmp_path, **QUIET), callbacks=[_LogsRmse()])
    validated, tested = trainer.validate(), trainer.test()
    mse = validated["mse"]
    assert validated == {"mse": mse, "val/rmse": pytest.approx(mse**0.5), "val_auc": 0.75}
    assert tested == {"mse": pytest.approx(mse), "test/auc": 0.25}
    assert all(type(value) is float for value in [*validated.values(), *tested.values()])
    assert trainer.val_metrics == {"mse": mse}
    trainer.logs_auc = False
    assert set(trainer.validate()) == {"mse", "val/rmse"}


class _SeesValidationEndValues(Callback):
    def __init__(self) -> None:
        self.at_start: list[dict[str, float]] = []

    def on_train_start(self, trainer):
        self.at_start.append(dict(trainer.validation_end_values))


def test_a_second_fit_starts_without_the_values_the_first_fit_s_validation_logged(tmp_path):
    """Each fit() is a run of its own: the first's logged values reached the second (its hparams, were it to end
    before validating), where its means (val_metrics) did not."""
    seen = _SeesValidationEndValues()
    once = {"trainer.max_steps": 1, "trainer.val_every_n_steps": 1, "trainer.num_sanity_val_steps": 0}
    trainer = LogsTheSetsValue(toy_cfg(tmp_path, **QUIET, **once), callbacks=[seen])
    trainer.fit()
    assert trainer.validation_end_values == {"val_auc": 0.75}
    trainer.fit()
    assert seen.at_start == [{}, {}]


@pytest.mark.parametrize("container", [list, dict])
def test_several_validation_loaders_are_refused_before_training_naming_how_to_combine_them(tmp_path, container):
    """Lightning runs each and suffixes its metrics with /dataloader_idx_N; here one loader of tagged batches does."""

    class TwoValidationSets(ToyTrainer):
        def val_dataloader(self):
            loaders = [super().val_dataloader(), super().val_dataloader()]
            return loaders if container is list else dict(zip("ab", loaders, strict=True))

        def training_step(self, batch):
            raise AssertionError("trained before the validation loaders were checked")

    with pytest.raises(UserCodeError, match=r"val_dataloader\(\) returned a \w+ of 2 DataLoaders; it returns one"):
        TwoValidationSets(toy_cfg(tmp_path, **QUIET)).fit()


class TaggedSets(ToyTrainer):
    """Two validation sets in one loader, each batch tagged with its set, metrics named per set."""

    def val_dataloader(self):
        a = [(x, y, "a") for x, y in DataLoader(toy_dataset(12, seed=1), batch_size=4)]
        b = [(x, y, "b") for x, y in DataLoader(toy_dataset(6, seed=2), batch_size=4)]
        return a + b

    def validation_step(self, batch):
        x, y, which = batch
        return {f"mse_{which}": F.mse_loss(self.model(x).squeeze(1), y, reduction="sum") / len(y)}


def test_validation_sets_chained_in_one_loader_each_get_their_own_mean(tmp_path):
    trainer = TaggedSets(toy_cfg(tmp_path, **QUIET))
    metrics = trainer.validate()
    trainer.module.eval()  # its dropout, as validation ran it
    with torch.no_grad():
        expected = {
            f"mse_{which}": F.mse_loss(trainer.module(data.tensors[0]).squeeze(1), data.tensors[1]).item()
            for which, data in (("a", toy_dataset(12, seed=1)), ("b", toy_dataset(6, seed=2)))
        }
    assert metrics == pytest.approx(expected)
