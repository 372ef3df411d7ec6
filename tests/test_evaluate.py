"""validate/test/predict on the Trainer and in the CLI, and ampkit.load_model for inference."""

from __future__ import annotations

import dataclasses
import warnings
from collections import UserDict
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

import ampkit
from ampkit.cli import main
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.evaluation import batch_size
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


class Evaluated(ToyTrainer):
    def test_dataloader(self):
        return DataLoader(toy_dataset(16, seed=11), batch_size=5)

    def test_step(self, batch):
        x, y = batch
        return {"mae": (self.model(x).squeeze(1) - y).abs().mean()}

    def predict_dataloader(self):
        return DataLoader(toy_dataset(10, seed=11), batch_size=4)

    def on_test_end(self, metrics):
        self.log("test_auc", 0.5)  # a value over the set, which the CLI prints under its own tag


def _fitted(tmp_path, **overrides) -> Evaluated:
    trainer = Evaluated(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}, **overrides))
    trainer.fit()
    return trainer


@pytest.mark.parametrize("precision", ["O0", "O2"])
def test_validate_a_checkpoint_in_a_fresh_trainer_reproduces_fit_under_its_precision(tmp_path, precision):
    overrides = {} if precision == "O0" else {"precision.opt_level": "O2", "precision.dtype": "bfloat16"}
    fitted = _fitted(tmp_path, **overrides)
    saved = load_checkpoint(fitted.version_dir / "checkpoints" / "last.pt")["val_metrics"]
    fresh = Evaluated(toy_cfg(tmp_path, **QUIET, **overrides))
    assert fresh.validate(ckpt="last") == saved  # same weights, same casts, same arithmetic
    if precision == "O2":
        assert fresh.module[0].weight.dtype == torch.bfloat16
        plain = Evaluated(toy_cfg(tmp_path, **QUIET)).validate(ckpt="last")
        assert plain != saved  # the same weights in float32 give other numbers: the cast was applied


def test_test_and_predict_use_their_own_loaders_and_the_loaded_weights(tmp_path):
    fitted = _fitted(tmp_path)
    x, y = toy_dataset(16, seed=11).tensors
    fitted.module.eval()
    with torch.no_grad():
        expected_mae = (fitted.module(x).squeeze(1) - y).abs().mean().item()
        expected_pred = fitted.module(toy_dataset(10, seed=11).tensors[0])
    fresh = Evaluated(toy_cfg(tmp_path, **QUIET))
    assert fresh.test(ckpt="last")["mae"] == pytest.approx(expected_mae, rel=1e-6)
    predictions = fresh.predict(ckpt=fitted.version_dir / "checkpoints" / "last.pt", output=tmp_path / "p.pt")
    assert [p.shape[0] for p in predictions] == [4, 4, 2]
    torch.testing.assert_close(torch.cat(predictions), expected_pred)
    torch.testing.assert_close(torch.load(tmp_path / "p.pt"), predictions)


class TwoValidationSets(ToyTrainer):
    """Two validation sets chained into one loader, each batch tagged with its set's name."""

    def val_dataloader(self):
        sets = {"a": DataLoader(toy_dataset(24, seed=7), batch_size=8), "b": DataLoader(toy_dataset(8, seed=8))}
        return [(*batch, name) for name, loader in sets.items() for batch in loader]

    def validation_step(self, batch):
        x, y, name = batch
        return {f"mse_{name}": F.mse_loss(self.model(x).squeeze(1), y)}


def test_a_metric_only_some_batches_return_is_averaged_over_those_batches(tmp_path):
    trainer = TwoValidationSets(toy_cfg(tmp_path, **QUIET))
    metrics = trainer.validate()
    trainer.module.eval()
    with torch.no_grad():
        for name, seed, n in (("a", 7, 24), ("b", 8, 8)):
            x, y = toy_dataset(n, seed=seed).tensors
            expected = F.mse_loss(trainer.module(x).squeeze(1), y).item()
            assert metrics[f"mse_{name}"] == pytest.approx(expected, rel=1e-5), name


class BatchEncoding(UserDict):
    """Hugging Face's tokenizer and collator output: a mapping that is no dict."""


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize("wrap", [BatchEncoding, lambda b: Pair(**b)])
def test_batches_of_any_mapping_or_dataclass_weigh_metrics_and_throughput_by_their_size(tmp_path, wrap):
    # batch_size() knew only dicts, lists and tuples: such a batch counted as 1 sample, so the last short batch
    # weighed as much as a full one in every metric, and samples/s read 0.
    class Wrapped(ToyTrainer):
        def train_dataloader(self):
            return DataLoader(toy_dataset(20), batch_size=8, collate_fn=lambda items: wrap(_stacked(items)))

        val_dataloader = train_dataloader

        def training_step(self, batch):
            return self.model(batch["x"] if isinstance(batch, Mapping) else batch.x).pow(2).mean()

        def validation_step(self, batch):
            return {"mean_y": (batch["y"] if isinstance(batch, Mapping) else batch.y).mean()}

    trainer = Wrapped(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2, "logging.log_every_n_steps": 2}))
    trainer.fit()
    assert trainer.val_metrics["mean_y"] == pytest.approx(toy_dataset(20).tensors[1].mean().item(), rel=1e-5)
    assert trainer.state.throughput["samples_per_sec"] > 0


def _stacked(items):
    return {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items])}


class FrozenBatchNormBackbone(ToyTrainer):
    """Fine-tuning a head on a frozen backbone whose BatchNorm statistics stay fixed: it is kept in eval mode."""

    def configure_model(self):
        return nn.ModuleDict({"backbone": nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)), "head": nn.Linear(8, 1)})

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.head.parameters(), lr=0.05)

    def on_train_epoch_start(self):
        self.module.backbone.eval()

    def training_step(self, batch):
        self.backbone_modes.append(self.module.backbone[1].training)
        return F.mse_loss(self.module.head(self.module.backbone(batch[0])).squeeze(1), batch[1])

    def validation_step(self, batch):
        return {"mse": F.mse_loss(self.module.head(self.module.backbone(batch[0])).squeeze(1), batch[1])}


def test_a_validation_mid_epoch_hands_back_each_submodule_in_the_mode_it_was_in(tmp_path):
    # It called model.train() after validating: the backbone kept in eval mode trained in train mode from the first
    # validation on, its BatchNorm statistics moving (Lightning restores each submodule's mode, too).
    trainer = FrozenBatchNormBackbone(toy_cfg(tmp_path, **QUIET, **{"trainer.val_every_n_steps": 3}))
    trainer.backbone_modes = []
    trainer.fit()
    assert trainer.backbone_modes == [False] * 8
    assert trainer.module.head.training and not trainer.module.backbone.training
    assert torch.equal(trainer.module.backbone[1].running_mean, torch.zeros(8))  # the statistics never moved


def test_several_test_loaders_are_refused_naming_how_to_combine_them(tmp_path):
    class TwoTestLoaders(Evaluated):
        def test_dataloader(self):
            return {"a": super().test_dataloader(), "b": super().test_dataloader()}

    with pytest.raises(UserCodeError, match="test_dataloader\\(\\) returned a dict of 2 DataLoaders; it returns one"):
        TwoTestLoaders(toy_cfg(tmp_path, **QUIET)).test()


class FailsInEvaluation(ToyTrainer):
    def validation_step(self, batch):
        raise RuntimeError("a bug in the step")

    test_step = predict_step = validation_step

    def test_dataloader(self):
        return self.val_dataloader()

    predict_dataloader = test_dataloader


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_failed_evaluation_leaves_no_autocast_on_in_the_callers_thread(tmp_path, stage):
    """O1/O4 evaluation runs under autocast: a step that raises must not leave the caller's own maths in bf16."""
    trainer = FailsInEvaluation(toy_cfg(tmp_path, **QUIET, **{"precision.opt_level": "O4"}))
    with pytest.raises(RuntimeError, match="a bug in the step"):
        getattr(trainer, stage)()
    assert not torch.is_autocast_enabled("cpu")
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_evaluation_without_its_loader_or_checkpoint_fails_clearly(tmp_path):
    with pytest.raises(NotImplementedError, match=r"ToyTrainer.test\(\) needs test_dataloader\(\) to return batches"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET)).test()
    with pytest.raises(ampkit.CheckpointError, match=r"validate: no 'best.pt' under"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET)).validate(ckpt="best")


def test_cli_validate_test_predict(tmp_path, capsys, monkeypatch):
    fitted = _fitted(tmp_path)
    config = tmp_path / "eval.yaml"
    # on the CPU, as the validation it is compared with: on a GPU, device auto would validate there, in other digits
    config.write_text(f"trainer_class: {__name__}:Evaluated\nrun_dir: {tmp_path / 'run'}\ntrainer:\n  device: cpu\n")
    metrics = Evaluated(toy_cfg(tmp_path, **QUIET)).validate(ckpt="last")
    capsys.readouterr()
    assert main(["validate", "--config", str(config), "trainer.progress_bar=false"]) == 0
    assert capsys.readouterr().out.strip() == f"ampkit: validate: val/mse={metrics['mse']:.4f}"
    assert main(["test", "--config", str(config), "--ckpt", "last"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("ampkit: test: test/mae=") and printed.endswith(", test_auc=0.5000")
    out = tmp_path / "preds.pt"
    assert main(["predict", "--config", str(config), "--ckpt", str(fitted.version_dir / "checkpoints/last.pt"),
                 "--output", str(out)]) == 0  # fmt: skip
    assert len(torch.load(out)) == 3
    assert main(["validate", "--config", str(config), "--ckpt", str(tmp_path / "nope.pt")]) == 2
    assert "no checkpoint file or sharded checkpoint at" in capsys.readouterr().err


def test_load_model_returns_the_trained_module_for_inference(tmp_path):
    fitted = _fitted(tmp_path)
    model = ampkit.load_model(fitted.version_dir / "checkpoints" / "last.pt")
    assert not model.training
    x = torch.randn(3, 6)
    fitted.module.eval()
    torch.testing.assert_close(model(x), fitted.module(x))


def test_load_model_into_another_model_names_the_mismatch_in_one_line(tmp_path):
    """load_state_dict lists every key before its reason; the error keeps the reason and names the checkpoint."""

    class Wider(ToyTrainer):
        def configure_model(self):
            return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.0), nn.Linear(32, 1))

    path = _fitted(tmp_path).version_dir / "checkpoints" / "last.pt"
    with pytest.raises(ampkit.CheckpointError) as caught:
        ampkit.load_model(path, trainer_class=Wider)
    message = str(caught.value)
    assert message.startswith(f"checkpoint '{path}' does not fit Wider's model: size mismatch for ")
    assert "\n" not in message


@dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize(
    ("batch", "samples"),
    [
        (torch.zeros(5, 3), 5),
        (torch.tensor(2.0), 1),
        ({"ids": torch.zeros(4, 7), "mask": torch.zeros(4, 7)}, 4),
        ([torch.zeros(0, 4), torch.zeros(6)], 6),  # a batch of 6 images, the first with no boxes
        (_Pair(torch.zeros(3, 2), torch.zeros(3)), 3),
        ({"pairs": (_Pair(torch.zeros(0, 2), torch.zeros(0)),)}, 0),
        ((torch.zeros(0, 6), torch.zeros(0)), 0),
        (["some", "strings"], None),
        ({"text": ["a", "b"], "meta": {"ids": [1, 2]}}, None),
        (object(), None),
    ],
)
def test_samples_are_counted_through_containers_and_unknown_without_a_tensor(batch, samples):
    assert batch_size(batch) == samples


class _CountedMeta(type):
    """Stands in for the Mapping ABC, counting the isinstance checks made against it."""

    checks = 0

    def __instancecheck__(cls, obj):
        _CountedMeta.checks += 1
        return isinstance(obj, Mapping)


class _CountedMapping(metaclass=_CountedMeta):
    pass


def test_an_x_y_batch_is_counted_without_the_mapping_abcs_isinstance(monkeypatch):
    # Every training batch is counted twice (the empty-batch check, samples/s); an ABC isinstance costs about a
    # microsecond each time, for the usual (x, y) batch that is no mapping.
    from ampkit.trainer import evaluation

    monkeypatch.setattr(evaluation, "Mapping", _CountedMapping)
    _CountedMeta.checks = 0
    assert batch_size((torch.zeros(4, 3), torch.zeros(4))) == 4
    assert batch_size([torch.zeros(0, 3), (torch.zeros(0), torch.zeros(2))]) == 2
    assert _CountedMeta.checks == 0
    assert batch_size(UserDict(ids=torch.zeros(5, 2))) == 5  # a mapping is still found as one


def test_a_nested_tensor_batch_counts_its_samples():
    # Its .shape raises ('NestedTensorImpl doesn't support sizes'), now on every training batch, not only for samples/s.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided layout's 'prototype stage' notice
        ragged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(1, 3)])
    assert batch_size({"tokens": ragged}) == 3


def _empty_third_batch(samples):  # a collate whose filter dropped every sample of one batch
    x, y = torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])
    _empty_third_batch.calls += 1
    return (x[:0], y[:0]) if _empty_third_batch.calls == 3 else (x, y)


class EmptyValidationBatch(ToyTrainer):
    def val_dataloader(self):
        _empty_third_batch.calls = 0
        return DataLoader(toy_dataset(24, seed=7), batch_size=6, collate_fn=_empty_third_batch)


def test_a_validation_batch_of_no_samples_is_left_out_of_the_means_with_a_warning(tmp_path):
    """Its step's metric is nan (a mean over nothing); weighted by 1 it made the whole set's mean nan."""
    trainer = EmptyValidationBatch(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1}))
    trainer.fit()
    _empty_third_batch.calls = 0
    with pytest.warns(UserWarning, match=r"validation_step: batch\(es\) 2 held 0 samples .*left out of the means"):
        mse = trainer.validate()["mse"]
    x, y = toy_dataset(24, seed=7)[:]
    kept = torch.cat([torch.arange(0, 12), torch.arange(18, 24)])
    trainer.module.eval()
    with torch.no_grad():
        expected = F.mse_loss(trainer.module(x[kept]).squeeze(1), y[kept])
    assert mse == pytest.approx(float(expected), rel=1e-5)


class TimeMajorValidation(ToyTrainer):
    """Validation batches laid out (time, batch, features): 3 time steps, then 16 and 8 samples."""

    def val_dataloader(self):
        def time_major(rows):
            x = torch.stack([r[0] for r in rows])
            return x.unsqueeze(0).expand(3, -1, -1).contiguous(), torch.stack([r[1] for r in rows])

        return DataLoader(toy_dataset(24, seed=7), batch_size=16, collate_fn=time_major)

    def validation_step(self, batch):
        return {"samples": float(batch[0].size(1))}

    def samples_in(self, batch):
        return batch[0].size(1)


def test_validation_averages_weigh_each_batch_by_the_trainers_samples_in(tmp_path):
    """By the leading size both batches weighed 3 (the time steps): the mean was 12, not the per-sample 40/3."""
    metrics = TimeMajorValidation(toy_cfg(tmp_path, **{"logging.tensorboard": False})).validate()
    assert metrics["samples"] == pytest.approx((16 * 16 + 8 * 8) / 24)
