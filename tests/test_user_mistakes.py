"""A user's mistake is an error before training starts, or one line naming its cause (``--debug`` keeps the
traceback); never a silent no-op, a raw traceback, or a failure after hours of training."""

from __future__ import annotations

import errno
import importlib
import os
import re
import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from toy_trainers import ToyConfig, ToyTrainer, toy_cfg, toy_dataset, toy_model

import ampkit
from ampkit.cli import main
from ampkit.config import ConfigError
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint, save_atomic
from ampkit.trainer.optimizers import unoptimized_parameters_warning, unreached_parameters_warning
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


def _cli(tmp_path, capsys, argv: list[str], trainer_class: str = "toy_trainers:ToyTrainer", **settings) -> tuple:
    config = tmp_path / "run.yaml"
    base = {"trainer_class": trainer_class, "run_dir": str(tmp_path / "runs")}
    OmegaConf.save(OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in settings.items()])), config)
    capsys.readouterr()
    code = main([argv[0], "--config", str(config), *argv[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampkit: error: "), err
    return lines[0]


class EmptyData(ToyTrainer):
    def train_dataloader(self):
        return DataLoader(toy_dataset(0), batch_size=8)


class EmptyValidation(ToyTrainer):
    def val_dataloader(self):
        return DataLoader(toy_dataset(0), batch_size=8)


class NoValidation(ampkit.Trainer):
    config_class = ToyConfig

    def configure_model(self):
        return toy_model()

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(toy_dataset(16), batch_size=8)

    def training_step(self, batch):
        return self.model(batch[0]).square().mean()


def test_no_training_data_is_an_error_naming_the_dataloader(tmp_path, capsys):
    code, _, err = _cli(tmp_path, capsys, ["fit"], "test_user_mistakes:EmptyData", **{"trainer.max_epochs": 3})
    assert code == 2 and "train_dataloader() yields no batches" in _one_line(err)
    assert not list((tmp_path / "runs").glob("version_*/checkpoints"))


def test_no_validation_data_warns_and_a_monitor_without_validation_is_refused(tmp_path):
    with pytest.warns(
        UserWarning, match="val_dataloader\\(\\) yields no batches: its dataset is empty; validation is skipped"
    ):
        EmptyValidation(toy_cfg(tmp_path, **QUIET)).fit()
    with pytest.raises(
        ConfigError, match="'checkpoint.monitor': monitors 'val/mse', but val_dataloader\\(\\) yields no"
    ):
        EmptyValidation(toy_cfg(tmp_path, **QUIET, **{"checkpoint.monitor": "val/mse"})).fit()
    for key in ("checkpoint.monitor", "early_stopping.monitor"):  # at construction: nothing runs
        with pytest.raises(ConfigError, match=f"'{key}': monitors 'val/mse', but NoValidation defines no val_data"):
            NoValidation(toy_cfg(tmp_path, **{key: "val/mse"}))
        never = {key: "val/mse", "trainer.val_every_n_epochs": 0}
        with pytest.raises(ConfigError, match=f"'{key}': monitors 'val/mse', but validation never runs"):
            ToyTrainer(toy_cfg(tmp_path, **never))


def test_a_misspelt_monitor_fails_before_training(tmp_path, capsys):
    for key in ("checkpoint.monitor", "early_stopping.monitor"):
        code, _, err = _cli(tmp_path, capsys, ["fit", f"{key}=val/acuracy"], **{"trainer.max_epochs": 2})
        line = _one_line(err)
        assert code == 2 and f"'{key}': monitors 'val/acuracy', which is not a validation metric" in line
        assert "validation_step returns val/mse" in line
    assert not list((tmp_path / "runs").glob("version_*"))  # no training happened, and no empty version_N is left


class TwoValidationSets(ToyTrainer):  # set a's 3 batches, then set b's one
    def val_dataloader(self):
        sets = {"a": super().val_dataloader(), "b": DataLoader(toy_dataset(8, seed=8), batch_size=8)}
        return [(*batch, name) for name, loader in sets.items() for batch in loader]

    def validation_step(self, batch):
        return {f"mse_{batch[2]}": super().validation_step(batch[:2])["mse"]}


def test_a_monitor_of_a_second_validation_set_names_the_sanity_steps_that_reach_it(tmp_path, capsys):
    settings = {"checkpoint.monitor": "val/mse_b", "trainer.max_epochs": 1}
    code, _, err = _cli(tmp_path, capsys, ["fit"], "test_user_mistakes:TwoValidationSets", **settings)
    assert code == 2 and "validation_step returns val/mse_a (checked before training on" in _one_line(err)
    assert "only later batches return (a second validation set) needs trainer.num_sanity_val_steps=4 (all" in err
    code, _, _ = _cli(tmp_path, capsys, ["fit", "trainer.num_sanity_val_steps=4"],
                      "test_user_mistakes:TwoValidationSets", **settings)  # fmt: skip
    assert code == 0


def test_a_resume_caught_by_the_sanity_validation_keeps_its_run_directory(tmp_path, capsys):
    code, _, _ = _cli(tmp_path, capsys, ["fit"], **{"trainer.max_epochs": 1})
    assert code == 0
    version = tmp_path / "runs" / "version_0"
    before = {p: p.read_bytes() for p in version.rglob("*") if p.is_file() and p.name != "run.lock"}
    code, _, err = _cli(tmp_path, capsys, ["fit", "--resume", "last", "checkpoint.monitor=val/acuracy"],
                        **{"trainer.max_epochs": 2})  # fmt: skip
    assert code == 2 and "which is not a validation metric" in _one_line(err)
    assert all(p.read_bytes() == data for p, data in before.items())  # the continued run's files all kept
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["version_0"]


def test_the_sanity_validation_catches_a_broken_validation_step_and_leaves_training_unchanged(tmp_path):
    class BrokenValidation(ToyTrainer):
        def validation_step(self, batch):
            return [1.0]

    trained: list[int] = []

    class Count(ampkit.Callback):
        def on_train_batch_end(self, trainer, outputs, batch):
            trained.append(1)

    with pytest.raises(UserCodeError, match="validation_step\\(batch\\) returned a list; expected a dict of metrics"):
        BrokenValidation(toy_cfg(tmp_path / "broken", **QUIET), callbacks=[Count()]).fit()
    assert trained == []
    # The sanity pass restores the RNG: the same run with and without it trains the same weights.
    runs = [ToyTrainer(toy_cfg(tmp_path / str(n), **QUIET, **{"trainer.num_sanity_val_steps": n})) for n in (0, 2)]
    for run in runs:
        run.fit()
    for key, value in runs[0].module.state_dict().items():
        assert torch.equal(value, runs[1].module.state_dict()[key]), key


def test_home_and_environment_variables_expand_in_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS_ROOT", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    for run_dir, root in [("~/runs", tmp_path / "home" / "runs"), ("$RUNS_ROOT/x", tmp_path / "env" / "x")]:
        trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, run_dir=run_dir))
        trainer.fit()
        assert trainer.version_dir == root / "version_0"
    assert not (tmp_path / "~").exists() and not (tmp_path / "$RUNS_ROOT").exists()
    with pytest.raises(ConfigError, match="'run_dir': '\\$NOT_SET_ANYWHERE/r' names environment variable NOT_SET_"):
        ToyTrainer(toy_cfg(tmp_path, run_dir="$NOT_SET_ANYWHERE/r"))


@pytest.mark.parametrize("device", ["mps", "meta", "xla"])
def test_devices_other_than_cpu_and_cuda_are_refused_at_construction(tmp_path, device):
    with pytest.raises(ConfigError, match=f"'trainer.device': '{device}' is not"):
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.device": device}))


class Misspelt(ToyTrainer):
    def on_train_epoch_ends(self):
        pass


class LightningEpochEndCallback(ampkit.Callback):  # Lightning's hook name: ampkit has none of that name
    def on_validation_epoch_end(self, trainer):
        pass


class HookWithoutTrainerCallback(ampkit.Callback):
    def on_train_epoch_end(self):
        pass


class MisspeltCallbackHook(ToyTrainer):
    def configure_callbacks(self):
        return [LightningEpochEndCallback()]


class CallbackHookWithoutTrainer(ToyTrainer):
    def configure_callbacks(self):
        return [HookWithoutTrainerCallback()]


class CallbackClassNotInstance(ToyTrainer):
    def configure_callbacks(self):
        return [LightningEpochEndCallback]


class NotAModule(ToyTrainer):
    def configure_model(self):
        return [toy_model()]


class NoOptimizer(ToyTrainer):
    def configure_optimizers(self):
        return None


class NoGrad(ToyTrainer):
    def training_step(self, batch):
        with torch.no_grad():
            return super().training_step(batch)


class NotScalar(ToyTrainer):
    def training_step(self, batch):
        return (self.model(batch[0]).squeeze(1) - batch[1]).square()


class ComplexLoss(ToyTrainer):
    def training_step(self, batch):
        return super().training_step(batch) * (1 + 1j)


class NoLoader(ToyTrainer):
    def train_dataloader(self):
        return None


class TwoValidationLoaders(ToyTrainer):  # Lightning's way to validate on two sets
    def val_dataloader(self):
        return [super().val_dataloader(), DataLoader(toy_dataset(8, seed=8), batch_size=8)]


class VectorMetric(ToyTrainer):
    def validation_step(self, batch):
        return {"mse": (self.model(batch[0]).squeeze(1) - batch[1]).square()}


class HugeIntMetric(ToyTrainer):  # a count or a product of counts, of more digits than a float holds
    def validation_step(self, batch):
        return {"mse": 10**400}


class HugeIntLogged(ToyTrainer):
    def training_step(self, batch):
        self.log("train/count", 10**400)
        return super().training_step(batch)


class LongMetricName(ToyTrainer):  # a pasted 100 kB name was repeated whole
    def validation_step(self, batch):
        return {"m" * 100_000: "0.5"}


class HugeNegativeBatchSize(ToyTrainer):  # repr() of it raised its own ValueError in place of log()'s error
    def training_step(self, batch):
        self.log("train/count", 1.0, batch_size=-(10**5000))
        return super().training_step(batch)


class LossIdList(ToyTrainer):
    automatic_optimization = False

    def training_step(self, batch):
        self.backward(super().training_step(batch), loss_id=[1])


class LongLossIds(ToyTrainer):
    """repr() of an integer of 5001 digits raises: the loss's own error became a bare ValueError."""

    automatic_optimization = False

    def training_step(self, batch):
        self.backward(super().training_step(batch).expand(2), loss_id=10**5000)


class LossIdTensor(ToyTrainer):
    """A tensor hashes by identity: at O0, where no scaler refused it, each backward made a new loss entry, which
    every iteration then walked (and ranks could never agree on)."""

    automatic_optimization = False

    def training_step(self, batch):
        self.backward(super().training_step(batch), loss_id=torch.tensor(0))


class UnknownOptimizerName(ToyTrainer):
    automatic_optimization = False

    def training_step(self, batch):
        self.backward(super().training_step(batch), optimizer="adam")


class PlateauWithoutMonitor(ToyTrainer):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}


class StepTakesBatchIdx(ToyTrainer):  # Lightning's signature
    def validation_step(self, batch, batch_idx):
        return super().validation_step(batch)


class CallsOptimizers(ToyTrainer):  # Lightning's opt = self.optimizers()
    automatic_optimization = False

    def training_step(self, batch):
        (optimizer,) = self.optimizers()
        self.backward(super().training_step(batch), optimizer=optimizer)


class PlateauEveryStep(ToyTrainer):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "interval": "step"},
            "monitor": "val/mse",
        }


class NoOptimizersListed(ToyTrainer):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [], [torch.optim.lr_scheduler.StepLR(optimizer, 1)]


def _filtered_out_after_the_first_batch(samples):  # a collate that drops unwanted samples: here all of batch 1
    x, y = torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])
    keep = len(samples) * [_filtered_out_after_the_first_batch.calls == 0]
    _filtered_out_after_the_first_batch.calls += 1
    return x[keep], y[keep]


class EmptyBatch(ToyTrainer):
    def train_dataloader(self):
        _filtered_out_after_the_first_batch.calls = 0
        return DataLoader(toy_dataset(32), batch_size=8, collate_fn=_filtered_out_after_the_first_batch)


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        ("EmptyBatch", "train_dataloader() gave an empty batch (batch 1 of epoch 0, step 2): every tensor in it has 0"),
        ("NoLoader", "train_dataloader() returned a NoneType; expected a DataLoader or another iterable of batches"),
        ("TwoValidationLoaders", "val_dataloader() returned a list of 2 DataLoaders; it returns one iterable of"),
        ("VectorMetric", "returned metric 'mse' as a Tensor of shape (8,); each metric is a number or a one-element"),
        # both were a bare "OverflowError: int too large to convert to float" from the mean or a logger
        ("HugeIntMetric", "returned metric 'mse': an integer of 401 digits is beyond a float's range (+-1.8e308)"),
        ("HugeIntLogged", "log('train/count'): an integer of 401 digits is beyond a float's range (+-1.8e308)"),
        ("LongMetricName", f"returned metric '{'m' * 79}... (100002 characters) as a str; each metric is a number"),
        ("HugeNegativeBatchSize", "log('train/count', batch_size=a negative integer of 5001 digits): "),
        ("LossIdList", "backward(loss_id=[1]): a loss id is a name or an integer, not a list"),
        ("LossIdTensor", "backward(loss_id=tensor(0)): a loss id is a name or an integer, not a Tensor"),
        ("LongLossIds", "the loss of loss_id an integer of 5001 digits has shape (2,); expected a scalar"),
        ("UnknownOptimizerName", "backward(optimizer='adam'): no optimizer has that name; configure_optimizers() made"),
        ("PlateauWithoutMonitor", "a ReduceLROnPlateau steps on a metric: name it with 'monitor'"),
        ("NoOptimizersListed", "configure_optimizers() returned an empty list of optimizers"),
        ("CallsOptimizers", "self.optimizers is a dict of the optimizers by name (sgd), not a method as in Lightning"),
        (
            "StepTakesBatchIdx",
            "StepTakesBatchIdx.validation_step(self, batch, batch_idx) cannot be called with one batch; define it as "
            "def validation_step(self, batch) (the batch's index within the epoch is self.state.batch_idx",
        ),
        (
            "PlateauEveryStep",
            "scheduler of 'sgd' monitors 'val/mse', but validation produced nothing yet (its 'interval' is 'step'",
        ),
        ("Misspelt", "Misspelt.on_train_epoch_ends is not a hook the Trainer calls; did you mean 'on_train_epoch_end'"),
        ("MisspeltCallbackHook", "LightningEpochEndCallback.on_validation_epoch_end is not a hook the Trainer calls"),
        (
            "CallbackHookWithoutTrainer",
            "HookWithoutTrainerCallback.on_train_epoch_end(self) cannot take the hook's arguments; define it as "
            "def on_train_epoch_end(self, trainer)",
        ),
        (
            "CallbackClassNotInstance",
            "configure_callbacks()[0] is the class LightningEpochEndCallback; pass an instance: "
            "LightningEpochEndCallback()",
        ),
        ("NotAModule", "configure_model() must return a torch.nn.Module, got list"),
        ("NoOptimizer", "configure_optimizers() returned None"),
        ("NoGrad", "the loss of loss_id 0 does not require grad"),
        ("NotScalar", "the loss of loss_id 0 has shape (8,); expected a scalar"),
        ("ComplexLoss", "the loss of loss_id 0 is torch.complex64; expected a real number (take .abs() or .real)"),
    ],
)
def test_mistakes_in_trainer_code_are_one_line(tmp_path, capsys, trainer_class, message):
    code, _, err = _cli(tmp_path, capsys, ["fit"], f"test_user_mistakes:{trainer_class}")
    assert code == 2 and message in _one_line(err)
    with pytest.raises(UserCodeError):  # --debug keeps the traceback
        _cli(tmp_path, capsys, ["fit", "--debug"], f"test_user_mistakes:{trainer_class}")


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        (
            [HookWithoutTrainerCallback],
            r"Trainer\(callbacks=...\)\[0\] is the class HookWithoutTrainerCallback; pass an",
        ),
        ([object()], r"Trainer\(callbacks=...\)\[0\] is object; expected an ampkit.Callback instance"),
    ],
)
def test_callbacks_that_are_no_callback_instances_are_refused_at_construction(tmp_path, callbacks, message):
    with pytest.raises(UserCodeError, match=message):
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=callbacks)


class FirstLayerCalledDirectly(ToyTrainer):  # O2 casts inputs where the model is called, not its submodules
    def training_step(self, batch):
        x, y = batch
        return (self.module[3](self.module[0](x).tanh()).squeeze(1) - y).square().mean()


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_a_submodule_called_directly_under_a_cast_model_names_precision_cast_modules(tmp_path, capsys, opt_level):
    settings = {"precision.opt_level": opt_level, "precision.dtype": "bfloat16", "trainer.progress_bar": False}
    code, _, err = _cli(tmp_path, capsys, ["fit"], "test_user_mistakes:FirstLayerCalledDirectly", **settings)
    line = _one_line(err)
    assert code == 2 and "mat1 and mat2 must have the same dtype" in line
    assert f"precision.opt_level={opt_level} cast the model to bfloat16 and casts inputs only where the model" in line
    assert "names it in precision.cast_modules (the model's children: 0, 1, 2, 3)" in line
    with pytest.raises(RuntimeError):  # --debug keeps the traceback
        _cli(tmp_path, capsys, ["fit", "--debug"], "test_user_mistakes:FirstLayerCalledDirectly", **settings)
    code, _, _ = _cli(tmp_path, capsys, ["fit"], "test_user_mistakes:FirstLayerCalledDirectly",
                      **settings, **{"precision.cast_modules": "[0,3]"})  # fmt: skip
    assert code == 0  # naming the submodules the step calls is the way out


class _SeesExceptions(ampkit.Callback):
    seen: ClassVar[list[str]] = []

    def on_exception(self, trainer, exception) -> None:
        self.seen.append(type(exception).__name__)


class EvaluatesFirstLayerDirectly(ToyTrainer):  # each evaluation step calls a submodule of the cast model
    def configure_callbacks(self):
        return [_SeesExceptions()]

    def validation_step(self, batch):
        x, y = batch
        return {"val/mse": (self.module[3](self.module[0](x).tanh()).squeeze(1) - y).square().mean()}

    def test_dataloader(self):
        return self.val_dataloader()

    def test_step(self, batch):
        return {"test/mse": self.validation_step(batch)["val/mse"]}

    def predict_dataloader(self):
        return self.val_dataloader()

    def predict_step(self, batch):
        return self.module[0](batch[0])


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_a_submodule_called_directly_in_evaluation_names_precision_cast_modules(tmp_path, capsys, command):
    """As in fit: one line naming precision.cast_modules, and callbacks see on_exception (autocast ends there)."""
    settings = {"precision.opt_level": "O2", "precision.dtype": "bfloat16"}
    argv = [command, "--output", str(tmp_path / "p.pt")] if command == "predict" else [command]
    fixed = {**settings, "precision.cast_modules": "[0,3]", "trainer.max_steps": 2, "trainer.progress_bar": False}
    assert _cli(tmp_path, capsys, ["fit"], "test_user_mistakes:EvaluatesFirstLayerDirectly", **fixed)[0] == 0
    seen = importlib.import_module("test_user_mistakes")._SeesExceptions.seen  # the copy the CLI imported
    seen.clear()
    code, _, err = _cli(tmp_path, capsys, argv, "test_user_mistakes:EvaluatesFirstLayerDirectly", **settings)
    line = _one_line(err)
    assert code == 2 and "mat1 and mat2 must have the same dtype" in line
    assert "precision.opt_level=O2 cast the model to bfloat16" in line and "precision.cast_modules" in line
    assert seen == ["RuntimeError"]
    assert _cli(tmp_path, capsys, argv, "test_user_mistakes:EvaluatesFirstLayerDirectly", **fixed)[0] == 0


class LogsInValidationStep(ToyTrainer):  # Lightning's way: self.log in validation_step
    options: dict = {}

    def validation_step(self, batch):
        metrics = super().validation_step(batch)
        self.log("val_mse", next(iter(metrics.values())), **self.options)
        return metrics


@pytest.mark.parametrize("options", [{}, {"prog_bar": True, "sync_dist": True}])
def test_log_in_an_evaluation_step_is_refused_naming_what_to_return(tmp_path, monkeypatch, options):
    """It wrote the sanity batches' values at step 0 and dropped the rest: the step returns its metrics instead. A
    port's usual prog_bar=True there was refused first, naming the progress bar rather than this fix."""
    expected = r"log\('val_mse'\) in validation_step: it returns its metrics \(e.g. \{'acc': acc\}\), each averaged"
    monkeypatch.setattr(LogsInValidationStep, "options", options)
    with pytest.raises(UserCodeError, match=expected):
        LogsInValidationStep(toy_cfg(tmp_path, **QUIET)).fit()
    with pytest.raises(UserCodeError, match=expected):
        LogsInValidationStep(toy_cfg(tmp_path, **QUIET)).validate()


@pytest.mark.parametrize("section", ["optimizer_counts", "optimizers", "model"])
def test_a_checkpoint_missing_a_section_is_refused_naming_it(tmp_path, section):
    """E.g. a checkpoint trimmed of its optimizers to ship it: resuming it is refused by name, not a KeyError."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    trainer.fit()
    checkpoint = load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")
    del checkpoint[section]
    save_atomic(checkpoint, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match=f"old.pt' \\(format 1\\) lacks {section}: it cannot be resumed"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2})).fit(resume=tmp_path / "old.pt")
    if section == "model":
        with pytest.raises(CheckpointError, match="old.pt' has no 'model' entry: it holds no weights to load"):
            ToyTrainer(toy_cfg(tmp_path, **QUIET)).validate(ckpt=tmp_path / "old.pt")
    else:
        ToyTrainer(toy_cfg(tmp_path, **QUIET)).validate(ckpt=tmp_path / "old.pt")


def test_a_mid_epoch_resume_whose_epoch_got_shorter_is_refused(tmp_path):
    steps = {**QUIET, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 9}
    trainer = ToyTrainer(toy_cfg(tmp_path, **steps, **{"trainer.max_steps": 6}))
    trainer.fit()
    less_data = toy_cfg(tmp_path, **steps, **{"trainer.max_steps": 9, "data.n": 32})  # 4 batches of 8, not 8
    with pytest.raises(CheckpointError, match="is 6 batches into epoch 0, but this run's epoch has 4"):
        ToyTrainer(less_data).fit(resume="last")


def test_a_full_disk_while_checkpointing_names_the_file_and_keeps_last(tmp_path, monkeypatch):
    import ampkit.callbacks.checkpoint as checkpoint_module

    writes = []

    def full_after_two(obj, path):
        writes.append(path)
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save_atomic(obj, path)

    monkeypatch.setattr(checkpoint_module, "save_atomic", full_after_two)
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"checkpoint.every_n_steps": 1}))
    with pytest.raises(CheckpointError, match="step-00000003.pt' \\(No space left on device\\); last.pt still holds"):
        trainer.fit()
    assert load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")["loop"]["global_step"] == 2


def test_small_config_mistakes_name_the_right_thing(tmp_path, capsys):
    code, _, err = _cli(tmp_path, capsys, ["fit", "+trainer.foo=1"])
    assert code == 2 and "unknown config key 'trainer.foo'" in _one_line(err)
    code, _, err = _cli(tmp_path, capsys, ["fit", "+trainer.max_epochs=0"])  # Hydra's "+" on a known key
    assert code == 0
    capsys.readouterr()
    assert main(["fit", "--config", str(tmp_path)]) == 2
    assert f"--config '{tmp_path}' is a directory" in _one_line(capsys.readouterr().err)


def test_resuming_a_finished_run_from_the_cli_says_so(tmp_path, capsys):
    code, out, _ = _cli(tmp_path, capsys, ["fit"], **{"trainer.max_epochs": 1, "logging.tensorboard": False})
    assert code == 0 and "finished 8 steps" in out
    code, out, err = _cli(tmp_path, capsys, ["fit", "--resume", "last"], **{"trainer.max_epochs": 1})
    assert code == 0 and "finished" not in out and "nothing to train" in err and "nothing was written" in err


def test_a_single_file_checkpoint_resumed_under_fsdp_names_the_strategy(tmp_path):
    ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit()
    sharded = {"trainer.max_epochs": 2, "distributed.strategy": "fsdp", "trainer.device": "cpu"}
    with pytest.raises(CheckpointError, match="this run uses distributed.strategy=fsdp, which resumes sharded"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **sharded)).fit(resume="last")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["version_0"]


def test_a_sharded_checkpoint_resumed_without_fsdp_is_refused_before_anything_runs(tmp_path):
    """Resumed without FSDP, it would train and then save single files beside the shard directories (its pruning
    once failed on them): refused at start, naming the strategy to use."""
    sharded = {"trainer.device": "cpu", "distributed.strategy": "fsdp"}
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **sharded)).fit()
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(
        CheckpointError, match="is a sharded checkpoint directory .* resume it with distributed.strategy=fsdp"
    ):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2, "trainer.device": "cpu"})).fit(resume="last")
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before


def test_a_bad_opt_level_names_its_dotted_key(tmp_path):
    with pytest.raises(ConfigError, match="config key 'precision.opt_level': '01' is invalid; expected one of O0, O1"):
        ToyTrainer(toy_cfg(tmp_path, **{"precision.opt_level": "'01'"}))


class StepByName(ToyTrainer):
    automatic_optimization = False

    def training_step(self, batch):
        self.backward(super().training_step(batch), optimizer="sgd")
        self.step("sgd")


class NeverSteps(ToyTrainer):
    automatic_optimization = False

    def training_step(self, batch):
        self.backward(super().training_step(batch))


class LossOffTheModel(ToyTrainer):
    def configure_model(self):
        model = super().configure_model()
        model.offset = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        self.free = torch.zeros((), requires_grad=True)
        return model

    def training_step(self, batch):
        return (self.free - 1.0).square()


def test_an_optimizer_may_be_named_in_backward_and_step(tmp_path):
    trainer = StepByName(toy_cfg(tmp_path, **QUIET))
    trainer.fit()
    assert trainer.optimizer_state[trainer.optimizer].steps == trainer.state.global_step > 0


@pytest.mark.parametrize(("trainer_class", "why"), [
    (NeverSteps, "under manual optimization training_step calls self.step(optimizer)"),
    (LossOffTheModel, "no parameter of theirs received a gradient"),
])  # fmt: skip
def test_an_epoch_that_trained_nothing_says_why(tmp_path, trainer_class, why):
    with pytest.warns(UserWarning, match=rf"epoch 0: no optimizer stepped in this epoch: .*{re.escape(why)}"):
        trainer_class(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})).fit()


class NaNLoss(ToyTrainer):
    """A loss that is NaN at every step (or only at the first, ``first_only``): a scaler can only skip it."""

    first_only = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        return loss * float("nan") if not self.first_only or self.state.global_step == 0 else loss


class NaNFirstLoss(NaNLoss):
    first_only = True


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("settings", [{"trainer.max_epochs": 1}, {"trainer.max_steps": 3}])
def test_an_fp16_epoch_whose_every_step_was_skipped_says_nothing_was_trained(tmp_path, opt_level, settings):
    """The scaler backs off and skips each step; the run used to end like any other, its weights untouched."""
    cfg = toy_cfg(tmp_path, **QUIET, **settings, **{"precision.opt_level": opt_level})
    steps = settings.get("trainer.max_steps", 8)
    with pytest.warns(UserWarning, match=rf"epoch 0: every step of this epoch was skipped, so the model did not "
                      rf"change \(optimizer 'sgd' skipped all {steps}: inf/NaN gradients from loss_id 0; loss scale "
                      rf"now: loss_id 0's is {2.0 ** (16 - steps):g}\)\. .*look for a NaN/inf loss"):  # fmt: skip
        NaNLoss(cfg).fit()
    with warnings.catch_warnings():  # an early skip while the scale backs off is no reason to warn
        warnings.filterwarnings("error", message=".*every step of this epoch")
        trainer = NaNFirstLoss(toy_cfg(tmp_path / "first", **QUIET, **settings, **{"precision.opt_level": opt_level}))
        trainer.fit()
    counts = trainer.optimizer_state[trainer.optimizer]
    assert counts.skipped_steps >= 1 and counts.steps >= 1


class NaNFirstThreeLoss(NaNLoss):
    """A scale backing off for three iterations, longer than an epoch of two batches."""

    def training_step(self, batch):
        loss = ToyTrainer.training_step(self, batch)
        return loss * float("nan") if self.state.global_step < 3 else loss


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_epoch_of_skips_while_the_scale_backs_off_warns_only_if_the_run_never_steps(tmp_path, opt_level):
    """An epoch shorter than the scaler's back-off warned that nothing was trained, though the next one trained.
    One that never steps is said once, at the run's end, naming its last epoch."""
    settings = {**QUIET, "trainer.max_epochs": 3, "data.n": 16, "precision.opt_level": opt_level}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*every step of this epoch")
        trainer = NaNFirstThreeLoss(toy_cfg(tmp_path, **settings))
        trainer.fit()
    assert trainer.optimizer_state[trainer.optimizer].steps == 3
    with pytest.warns(UserWarning) as record:
        NaNLoss(toy_cfg(tmp_path / "never", **settings)).fit()
    said = [str(w.message) for w in record if "every step of this epoch" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("epoch 2: every step of this epoch was skipped"), said


class HeadOnlyOptimized(ToyTrainer):
    """Fine-tuning the head, with the body left trainable by mistake (or a layer left out of the optimizer)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.module[3].parameters(), lr=0.05)


class NetWithAnUnusedLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra = toy_model(), torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.body(x)  # self.extra is never called


class UnusedLayer(ToyTrainer):
    def configure_model(self):
        return NetWithAnUnusedLayer()


@pytest.mark.parametrize("opt_level", ["O0", "O2"])  # O2: the optimizer holds fp32 masters, named as their params
def test_parameters_the_loss_never_reaches_are_named_once_after_the_first_epoch(tmp_path, opt_level):
    """The optimizer stepped around a layer the forward never called, which never trained, without a word."""
    trainer = UnusedLayer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3, "precision.opt_level": opt_level}))
    with pytest.warns(UserWarning) as record:
        trainer.fit()
    named = [str(w.message) for w in record if "received no gradient" in str(w.message)]
    assert named == [
        "2 parameters of optimizer 'sgd' received no gradient in any of its first 3 steps ('extra.weight', "
        "'extra.bias'): the loss does not depend on them, so they do not train (a layer the forward never calls? a "
        "head the loss leaves out?). Freeze them with requires_grad_(False), or leave them out of the optimizer"
    ]


class NetWithASometimesLayer(NetWithAnUnusedLayer):
    """A conditional layer (a routed expert, an auxiliary head): called on every third training batch only, not
    the first."""

    calls = 0

    def forward(self, x):
        self.calls += self.training
        return self.body(self.extra(x) if self.training and self.calls % 3 == 0 else x)


class SometimesLayer(ToyTrainer):
    def configure_model(self):
        return NetWithASometimesLayer()


def test_a_layer_some_batches_reach_is_not_named(tmp_path):
    """Named at the first step, which did not call it: a mixture of experts warned on a healthy run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*received no gradient")
        SometimesLayer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})).fit()


class FrozenBody(HeadOnlyOptimized):
    def configure_model(self):
        model = super().configure_model()
        model[0].requires_grad_(False)
        return model


def test_trainable_parameters_that_get_gradients_in_no_optimizer_are_named_once(tmp_path):
    """They never train, yet each backward computes their gradients, which summed up in .grad over the run."""
    trainer = HeadOnlyOptimized(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    with pytest.warns(UserWarning) as record:
        trainer.fit()
    named = [str(w.message) for w in record if "no optimizer holds them" in str(w.message)]
    assert named == [
        "configure_optimizers(): 2 parameters of the model receive gradients but no optimizer holds them ('0.weight', "
        "'0.bias'; 112 elements): they never train, and their .grad sums up the gradients of every backward. Add "
        "them to an optimizer, or freeze them with requires_grad_(False)"
    ]
    with warnings.catch_warnings():  # every trainable parameter held, or the others frozen: nothing to say
        warnings.filterwarnings("error", message=".*(no optimizer holds (it|them)|received no gradient)")
        ToyTrainer(toy_cfg(tmp_path / "all", **QUIET, **{"trainer.max_steps": 1})).fit()
        FrozenBody(toy_cfg(tmp_path / "frozen", **QUIET, **{"trainer.max_steps": 1})).fit()


def test_one_parameter_left_out_or_unreached_is_worded_in_the_singular():
    """'1 parameters of the model receive gradients ... they never train' read for a single bias left out."""
    bias = torch.nn.Parameter(torch.zeros(1))
    assert unoptimized_parameters_warning([("head.bias", bias)]) == (
        "configure_optimizers(): 1 parameter of the model receives gradients but no optimizer holds it ('head.bias'; "
        "1 element): it never trains, and its .grad sums up the gradients of every backward. Add it to an optimizer, "
        "or freeze it with requires_grad_(False)"
    )
    module = torch.nn.Linear(2, 1)
    assert unreached_parameters_warning([module.bias], "sgd", 1, module) == (
        "1 parameter of optimizer 'sgd' received no gradient in its first step ('bias'): the loss does not depend on "
        "it, so it does not train (a layer the forward never calls? a head the loss leaves out?). Freeze it with "
        "requires_grad_(False), or leave it out of the optimizer"
    )


class WithAnAverage(ToyTrainer):
    """An EMA of the model kept as a submodule (so checkpoints hold it) and validated: torch's AveragedModel copies
    the model, requires_grad included, and no loss reaches it."""

    def configure_model(self):
        model = torch.nn.ModuleDict({"net": toy_model()})
        model["ema"] = torch.optim.swa_utils.AveragedModel(model["net"])
        return model

    def configure_optimizers(self):
        return torch.optim.SGD(self.module["net"].parameters(), lr=0.05)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model["net"](x).squeeze(1), y)

    def on_train_batch_end(self, outputs, batch):
        self.module["ema"].update_parameters(self.module["net"])

    def validation_step(self, batch):
        x, y = batch
        return {"mse": F.mse_loss(self.model["ema"](x).squeeze(1), y)}


class FrozenInAHook(HeadOnlyOptimized):
    """Fine-tuning as Lightning's BackboneFinetuning does it: the body is frozen when fit starts, after
    configure_optimizers built the head's optimizer."""

    def on_fit_start(self):
        self.module[0].requires_grad_(False)


class GroupAddedInAHook(HeadOnlyOptimized):
    """An optimizer built for the head, given the trainable body as a second group when training starts."""

    def on_train_start(self):
        self.optimizer.add_param_group({"params": list(self.module[0].parameters()), "lr": 0.01})


@pytest.mark.parametrize("trainer_class", [WithAnAverage, FrozenInAHook, GroupAddedInAHook])
def test_trainable_parameters_no_loss_reaches_outside_the_optimizers_are_not_named(tmp_path, trainer_class):
    """Named at fit start, as if each backward computed their gradients: an EMA copy or a teacher model kept in the
    model, a body frozen in a hook, or one an optimizer got in a hook, warned on a healthy run. An epoch of 101
    steps: the window closes at the 100th, before that iteration's zero_grad clears the gradients."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(no optimizer holds (it|them)|received no gradient)")
        trainer_class(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1, "data.n": 808})).fit()


class EpochCosine(ToyTrainer):
    """A cosine schedule returned bare: Lightning's default interval steps it once per epoch."""

    every: ClassVar[dict] = {}

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, **self.every}}


class EveryTwentySteps(EpochCosine):
    every: ClassVar[dict] = {"interval": "step", "frequency": 20}


@pytest.mark.parametrize(("trainer_class", "settings", "message"), [
    (EpochCosine, {"trainer.max_epochs": 1},
     "the LR scheduler CosineAnnealingLR of optimizer 'sgd' steps every 1 epoch(s), and this run finishes 1: the "
     "learning rate does not change while it trains; for a schedule over iterations"),
    (EveryTwentySteps, {}, "CosineAnnealingLR of optimizer 'sgd' steps every 20 iterations, and this run trains 16: "
     "it never steps. Lower its 'frequency'"),
    (ToyTrainer, {"trainer.accumulate_grad_batches": 16},
     "trainer.accumulate_grad_batches=16 is more than the 8 batches of an epoch: each epoch steps once, on 8 batches "
     "whose losses are each divided by 16, so its gradient is 8/16 of a full window's. Set it to at most 8"),
    (NoValidation, {"trainer.val_every_n_steps": 2},
     "trainer.val_every_n_steps=2 does nothing: NoValidation defines no val_dataloader()"),
    (ToyTrainer, {"trainer.val_every_n_epochs": 3, "checkpoint.monitor": "val/mse"},
     "validation never runs in this run: trainer.val_every_n_epochs=3 is more than its 2 full epochs and "
     "trainer.val_every_n_steps=0, and no value reaches checkpoint.monitor='val/mse'. Lower the interval"),
    (ToyTrainer, {"trainer.val_every_n_epochs": 0, "trainer.val_every_n_steps": 17},
     "validation never runs in this run: trainer.val_every_n_epochs=0 and trainer.val_every_n_steps=17 is more than "
     "its 16 steps. Lower"),
    (ToyTrainer, {"trainer.max_steps": 12},  # the 12th step is not an epoch's end, nor a validation
     "validation never runs in this run: trainer.val_every_n_epochs=2 is more than its 1 full epoch and "),
])  # fmt: skip
def test_a_setting_that_does_nothing_in_this_run_is_named_at_fit_start(tmp_path, trainer_class, settings, message):
    """Each of these trained on as if the setting had not been given, without a word."""
    settings = {"trainer.max_epochs": 2, "trainer.val_every_n_epochs": 2, **settings}
    with pytest.warns(UserWarning, match=re.escape(message)):
        trainer_class(toy_cfg(tmp_path, **QUIET, **settings)).fit()


def test_settings_a_run_reaches_are_not_named(tmp_path):
    reached = {"trainer.max_epochs": 2, "trainer.val_every_n_epochs": 2, "trainer.val_every_n_steps": 16,
               "trainer.accumulate_grad_batches": 8, "checkpoint.monitor": "val/mse"}  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*(never runs|does nothing|more than the|never steps|does not change)"
        )
        EpochCosine(toy_cfg(tmp_path, **QUIET, **reached)).fit()
        ToyTrainer(toy_cfg(tmp_path / "steps", **QUIET, **{**reached, "trainer.max_steps": 2})).fit()  # by steps


def test_a_resume_with_other_optimizers_names_both(tmp_path):
    ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit()

    class Adam(ToyTrainer):
        def configure_optimizers(self):
            return torch.optim.Adam(self.module.parameters())

    with pytest.raises(
        CheckpointError, match=r"has the optimizers \['sgd'\]; this run's configure_optimizers\(\) makes \['adam'\]"
    ):
        Adam(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2})).fit(resume="last")


class CosineToyTrainer(ToyTrainer):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


def test_a_resume_names_the_optimizer_settings_the_checkpoint_keeps_over_the_code(tmp_path):
    """torch's load_state_dict restores lr, momentum, weight decay...: a resume with lr changed in the config trained
    on at the old rate, while the config-change warning said 'lr: 0.05 -> 0.001'."""
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2})).fit()
    lowered = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4, "lr": 0.001}))
    kept = (
        "restores its optimizers' settings over configure_optimizers()'s: sgd[0].lr=0.05 (configure_optimizers: 0.001)"
    )
    with pytest.warns(UserWarning) as warned:
        lowered.fit(resume="last")
    said = [str(w.message) for w in warned if "lr" in str(w.message)]  # one warning: it warned of the change twice
    assert said == [
        f"resuming '{tmp_path / 'run' / 'version_0' / 'checkpoints' / 'last.pt'}' with a changed config: lr: 0.05 -> "
        f"0.001; but it {kept}, so those train on as saved; to change them on resume, set param_groups in "
        "on_load_checkpoint"
    ], said
    assert lowered.optimizer.param_groups[0]["lr"] == 0.05
    scheduled = CosineToyTrainer(toy_cfg(tmp_path / "cosine", **QUIET, **{"trainer.max_steps": 2}))
    scheduled.fit()
    resumed = CosineToyTrainer(toy_cfg(tmp_path / "cosine", **QUIET, **{"trainer.max_steps": 4}))
    with warnings.catch_warnings(record=True) as caught:  # its lr is the schedule's, not a setting the code changed
        warnings.simplefilter("always")
        resumed.fit(resume="last")
    assert not [w for w in caught if "optimizers' settings" in str(w.message)]


class DecaysItsOwnRate(ToyTrainer):
    """nanoGPT's way: the training step sets each group's lr itself, with no scheduler object."""

    def training_step(self, batch):
        for group in self.optimizer.param_groups:
            group["lr"] = 0.05 / (1 + self.state.global_step)
        return super().training_step(batch)


def test_a_rate_the_training_code_sets_itself_resumes_without_a_warning_until_the_config_changes(tmp_path):
    """The checkpoint's lr is where the code's own decay reached: the same config resumes it quietly (it warned at
    every resume, as if the user had changed the rate); a changed config is still named."""
    DecaysItsOwnRate(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2})).fit()
    resumed = DecaysItsOwnRate(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(resume="last")
    assert not [w for w in caught if "optimizers' settings" in str(w.message)]
    changed = DecaysItsOwnRate(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 6, "lr": 0.001}))
    with pytest.warns(UserWarning, match=re.escape("sgd[0].lr=")):
        changed.fit(resume="last")


def test_a_logged_value_that_is_no_number_is_named(tmp_path):
    class LogsText(ToyTrainer):
        def training_step(self, batch):
            self.log("note", "abc")
            return super().training_step(batch)

    with pytest.raises(TypeError, match="log\\('note'\\): expected a number or a one-element tensor, got str"):
        LogsText(toy_cfg(tmp_path, **QUIET)).fit()
    with pytest.raises(ampkit.ConfigError, match="precision.warn_consecutive_skips"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"precision.warn_consecutive_skips": -1}))


def test_a_damaged_shard_is_named_with_the_way_back(tmp_path):
    sharded = {**QUIET, "trainer.device": "cpu", "distributed.strategy": "fsdp", "checkpoint.every_n_steps": 4}
    ToyTrainer(toy_cfg(tmp_path, **sharded)).fit()
    last = (tmp_path / "run" / "version_0" / "checkpoints" / "last").resolve()
    shard = next(last.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    named = rf"cannot be read \(rank 0: CheckpointError: shard file '{shard.name}' is damaged \(.*\)\): a shard file is"
    with pytest.raises(CheckpointError, match=named):
        ToyTrainer(toy_cfg(tmp_path, **sharded, **{"trainer.max_epochs": 2})).fit(resume="last")


def test_a_run_dir_too_long_for_the_filesystem_is_named(tmp_path):
    with pytest.raises(ConfigError, match="is too long a path"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"run_dir": str(tmp_path / ("x" * 300))}))


def test_a_lost_last_checkpoint_points_to_what_is_left(tmp_path):
    cfg = {**QUIET, "checkpoint.every_n_steps": 4, "checkpoint.every_n_epochs": 0, "checkpoint.keep_last": 2}
    trainer = ToyTrainer(toy_cfg(tmp_path, **cfg))
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    (checkpoints / "last.pt").unlink()
    newest = max(checkpoints.glob("step-*.pt"))
    with pytest.raises(CheckpointError, match=rf"the newest checkpoint left is '{re.escape(str(newest))}'"):
        ToyTrainer(toy_cfg(tmp_path, **cfg, **{"trainer.max_epochs": 2})).fit(resume="last")


def test_a_resume_of_last_that_skips_a_newer_version_says_so(tmp_path):
    cfg = {**QUIET, "checkpoint.every_n_steps": 4}
    ToyTrainer(toy_cfg(tmp_path, **cfg)).fit()
    newer = ToyTrainer(toy_cfg(tmp_path, **cfg))
    newer.fit()
    (newer.version_dir / "checkpoints" / "last.pt").unlink()
    with pytest.warns(UserWarning, match="version_1 under run_dir .* is newer but has no last checkpoint; resuming"):
        ToyTrainer(toy_cfg(tmp_path, **cfg, **{"trainer.max_epochs": 2})).fit(resume="last")


class ReadsLightningsEpoch(ToyTrainer):  # a ported step: Lightning's module attributes
    def training_step(self, batch):
        return super().training_step(batch) * (1 + 0 * self.current_epoch)


def test_lightnings_attribute_names_give_the_ampkit_spelling(tmp_path):
    """A ported step reaching for self.current_epoch hears where the epoch is; a property's own error still wins."""
    trainer = ReadsLightningsEpoch(toy_cfg(tmp_path, **{"logging.tensorboard": False}))
    with pytest.raises(AttributeError, match=r"'current_epoch' \(Lightning's name; here it is self.state.epoch\)"):
        trainer.fit()
    with pytest.raises(AttributeError, match=r"no attribute 'trainer' \(Lightning's name; here it is self "):
        _ = trainer.trainer
    with pytest.raises(AttributeError, match=r"'callback_metrics' \(Lightning's name; here it is self.val_metrics "):
        _ = trainer.callback_metrics  # after fit, as a Lightning test reads the last metrics
    for name in ("callback_metrics", "logged_metrics"):  # a port's .item() on them meets a float: said up front
        with pytest.raises(AttributeError, match=r"its values Python floats where Lightning's are tensors"):
            getattr(trainer, name)
    with pytest.raises(AttributeError, match=r"'checkpoint_callback' \(Lightning's name; here it is the ModelCheckp"):
        _ = trainer.checkpoint_callback.best_model_path  # after fit, to load the best model
    with pytest.raises(AttributeError, match=r"^'ReadsLightningsEpoch' object has no attribute 'epoch_count'$"):
        _ = trainer.epoch_count
    trainer.optimizers = {"a": trainer.optimizer, "b": trainer.optimizer}
    with pytest.raises(AttributeError, match=r"there are 2 optimizers \(a, b\); use self.optimizers\[name\]"):
        _ = trainer.optimizer


def test_lightnings_trainer_attributes_give_a_spelling_that_reads_here(tmp_path):
    """A ported test reading trainer.max_epochs or trainer.log_dir after a fit hears the ampkit spelling, and that
    spelling (the part before any parenthesis) reads on the Trainer: it met a bare AttributeError."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1}))
    trainer.fit()
    for name in ["num_training_batches", "max_epochs", "max_steps", "accumulate_grad_batches", "num_sanity_val_steps",
                 "check_val_every_n_epoch", "val_check_interval", "log_every_n_steps", "log_dir", "default_root_dir",
                 "lightning_module", "local_rank", "sanity_checking"]:  # fmt: skip
        with pytest.raises(AttributeError, match=rf"'{name}' \(Lightning's name; here it is ") as caught:
            getattr(trainer, name)
        spelling = str(caught.value).partition("here it is ")[2].partition(" (")[0].removesuffix(")")
        eval(spelling, {}, {"self": trainer})  # the spelling is ours: it must read on a fitted Trainer


class _StopsAsLightningDoes(ampkit.Callback):
    """A ported Lightning callback: asks the run to stop by setting trainer.should_stop."""

    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.global_step == 2:
            trainer.should_stop = True


def test_lightnings_should_stop_set_on_the_trainer_is_refused_naming_state_should_stop(tmp_path):
    """trainer.should_stop = True set an attribute nothing reads: the run trained on to its end without a word."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3}), callbacks=[_StopsAsLightningDoes()])
    said = (
        r"^ToyTrainer.should_stop = True would stop nothing: Lightning's trainer.should_stop is self.state.should_stop"
    )
    with pytest.raises(AttributeError, match=said):
        trainer.fit()
    assert trainer.state.global_step == 2
    with pytest.raises(AttributeError, match=r"'should_stop' \(Lightning's name; here it is self.state.should_stop"):
        _ = trainer.should_stop


def test_settings_passed_as_keyword_arguments_name_their_config_keys():
    """Lightning's Trainer(max_epochs=3, precision=...) here: each name's config key, not Python's bare TypeError."""
    with pytest.raises(TypeError) as err:
        ToyTrainer(max_epochs=3, precision="bf16-mixed", batch_size=4, bogus=1)
    assert str(err.value) == (
        "ToyTrainer() takes a config, not settings as keyword arguments (max_epochs is trainer.max_epochs; "
        "precision is precision.opt_level; batch_size is data.batch_size; bogus is no config key); pass them in cfg, "
        "e.g. ToyTrainer({'trainer': {'max_epochs': 3}})"
    )


class KeywordModel(torch.nn.Module):
    """A Hugging Face-style model: its inputs are keyword arguments; ``strict`` refuses a dict for a tensor."""

    def __init__(self, takes_dict: bool = False) -> None:
        super().__init__()
        self.layer = toy_model()
        self.takes_dict = takes_dict

    def forward(self, input_ids, attention_mask=None):
        if self.takes_dict:  # its own mistake, not the batch's
            return self.layer(input_ids["input_ids"]) + "a string"
        return self.layer(input_ids) * attention_mask[:, :1]


class DictBatches(ToyTrainer):
    takes_dict = False

    def configure_model(self):
        return KeywordModel(self.takes_dict)

    def predict_dataloader(self):
        x = toy_dataset(8).tensors[0]
        return DataLoader([{"input_ids": row, "attention_mask": torch.ones(6)} for row in x], batch_size=4)


def test_the_default_predict_step_on_a_dict_batch_says_to_unpack_it(tmp_path):
    # The dict went to the model as its first argument: a raw TypeError from inside the model's first layer.
    said = r"^the default predict_step\(\) passed the batch, a dict of input_ids, attention_mask, to the model as one"
    with pytest.raises(UserCodeError, match=said + r" argument.*returning self.model\(\*\*batch\)$"):
        DictBatches(toy_cfg(tmp_path)).predict()
    own = type("OwnMistake", (DictBatches,), {"takes_dict": True})  # a model that takes the dict: its error stands
    with pytest.raises(TypeError, match="unsupported operand"):
        own(toy_cfg(tmp_path)).predict()
