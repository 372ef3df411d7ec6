"""What users' data, models and losses throw at the Trainer mid-run: a sample that raises, a DataLoader worker that
dies, a step that fails on one batch, parameters or losses that hold no values. Each error says where it struck and
what to do, and the last good checkpoint stays loadable."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit.config import ConfigError
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.inference import load_model
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False}


class _BadSample(Dataset):
    """The toy set, whose sample ``bad`` raises (a corrupt record)."""

    def __init__(self, n: int, bad: int) -> None:
        self.samples, self.bad = toy_dataset(n), bad

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"record {i} is corrupt")
        return self.samples[i]


class _BadStream(IterableDataset):
    """The same, without a length: with accumulation the loop fetches one batch ahead."""

    def __init__(self, n: int, bad: int) -> None:
        self.set = _BadSample(n, bad)

    def __iter__(self):
        return (self.set[i] for i in range(len(self.set)))


class RaisesAtSample40(ToyTrainer):
    workers = 0

    def train_dataloader(self):  # sample 40 is in batch 5 (batches of 8, in order)
        return DataLoader(_BadSample(64, 40), batch_size=8, num_workers=self.workers)


class RaisesInAWorker(RaisesAtSample40):
    workers = 2


class RaisesInAStream(ToyTrainer):
    def train_dataloader(self):
        return DataLoader(_BadStream(64, 40), batch_size=8)


class StepFailsOnce(ToyTrainer):
    def training_step(self, batch):
        if (self.state.epoch, self.state.batch_idx) == (1, 3):
            raise RuntimeError("shape mismatch in my loss")
        return super().training_step(batch)


@pytest.mark.parametrize(
    ("trainer_class", "settings", "where", "saved_step"),
    [
        (RaisesAtSample40, {}, "while train_dataloader() produced batch 5 of epoch 0", 5),
        (RaisesInAWorker, {}, "while train_dataloader() produced batch 5 of epoch 0", 5),
        (
            RaisesInAStream,
            {"trainer.accumulate_grad_batches": 2},
            "while train_dataloader() produced batch 5 of epoch 0",
            2,
        ),
        (StepFailsOnce, {"trainer.max_epochs": 2}, "in training batch 3 of epoch 1 (iteration 12)", 11),
    ],
    ids=["dataset", "worker", "stream read ahead", "training_step"],
)
def test_an_error_mid_epoch_names_its_batch_and_the_intact_checkpoint(
    tmp_path, trainer_class, settings, where, saved_step
):
    trainer = trainer_class(toy_cfg(tmp_path, **QUIET, **settings, **{"checkpoint.every_n_steps": 1}))
    with pytest.raises((ValueError, RuntimeError)) as failure:
        trainer.fit()
    last = trainer.version_dir / "checkpoints" / "last.pt"
    note = f"ampkit: raised {where}; the newest checkpoint, '{last}', is intact: --resume last"
    assert note in "\n".join(getattr(failure.value, "__notes__", []))
    assert load_checkpoint(last)["loop"]["global_step"] == saved_step


class GivesANoneBatch(ToyTrainer):
    """A collate_fn that returns None for a batch it drops: training_step's ``x, y = batch`` raised a bare TypeError."""

    def train_dataloader(self):
        batches = list(super().train_dataloader())
        return batches[:2] + [None] + batches[2:]


def test_a_none_batch_is_named_as_the_loader_s_in_the_error_s_note(tmp_path):
    trainer = GivesANoneBatch(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(TypeError, match="cannot unpack non-iterable NoneType") as failure:
        trainer.fit()
    notes = "\n".join(getattr(failure.value, "__notes__", []))
    assert "in training batch 2 of epoch 0 (iteration 3) (train_dataloader() gave None as this batch" in notes


class _PidRecordingBadSample(_BadSample):
    """The bad-sample set, each worker writing its pid to ``folder`` as it reads."""

    def __init__(self, folder, n: int, bad: int) -> None:
        super().__init__(n, bad)
        self.folder = folder

    def __getitem__(self, i):
        (self.folder / str(os.getpid())).touch()
        return super().__getitem__(i)


class RaisesInATrainingWorker(ToyTrainer):
    pids = None  # the folder its workers write their pids to

    def train_dataloader(self):
        return DataLoader(_PidRecordingBadSample(self.pids, 64, 40), batch_size=8, num_workers=2)


class RaisesInAValidationWorker(RaisesInATrainingWorker):
    def train_dataloader(self):
        return ToyTrainer.train_dataloader(self)

    def val_dataloader(self):
        return DataLoader(_PidRecordingBadSample(self.pids, 24, 12), batch_size=8, num_workers=2)


@pytest.mark.parametrize("trainer_class", [RaisesInATrainingWorker, RaisesInAValidationWorker])
def test_the_workers_of_a_loader_that_raised_are_gone_when_the_error_reaches_the_caller(
    tmp_path, monkeypatch, trainer_class
):
    """The error's traceback held the loader's iterator, and torch's shutdown, run when the garbage collector took
    that traceback, waited 5 s for each worker: a notebook or a sweep stalled 10 s after a bad sample."""
    (tmp_path / "pids").mkdir()
    monkeypatch.setattr(trainer_class, "pids", tmp_path / "pids")
    trainer = trainer_class(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(ValueError, match="is corrupt") as failure:
        trainer.fit()
    workers = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(workers) == 2 and os.getpid() not in workers
    alive = [pid for pid in workers if _alive(pid)]
    assert alive == [], f"workers {alive} outlived the error {failure.value!r}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_error_before_the_first_checkpoint_says_none_was_saved(tmp_path):
    trainer = RaisesAtSample40(toy_cfg(tmp_path, **QUIET, **{"checkpoint.every_n_steps": 100}))
    with pytest.raises(ValueError, match="record 40 is corrupt") as failure:
        trainer.fit()
    assert failure.value.__notes__[-1] == (
        "ampkit: raised while train_dataloader() produced batch 5 of epoch 0; no checkpoint was saved before it"
    )


class _Samples(Dataset):
    """16 samples made by ``sample(i)``."""

    def __init__(self, sample) -> None:
        self.sample = sample

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        return self.sample(i)


class RaggedSamples(ToyTrainer):
    def train_dataloader(self):  # sequences of 1..3 values: torch.stack refuses them
        return DataLoader(_Samples(lambda i: (torch.ones(i % 3 + 1), torch.zeros(()))), batch_size=4)


class NoneSamples(ToyTrainer):
    def train_dataloader(self):  # a dataset returning None for records it could not parse
        return DataLoader(_Samples(lambda i: None if i == 6 else toy_dataset(16)[i]), batch_size=4)


@pytest.mark.parametrize(("trainer_class", "batch"), [(RaggedSamples, 0), (NoneSamples, 1)])
def test_samples_the_default_collate_cannot_stack_are_named_with_the_way_out(tmp_path, trainer_class, batch):
    with pytest.raises((RuntimeError, TypeError)) as failure:
        trainer_class(toy_cfg(tmp_path, **QUIET)).fit()
    assert (
        f"produced batch {batch} of epoch 0 (in the DataLoader's default collate_fn, which stacks each field of "
        "the samples into one tensor and cannot stack these: a None, tensors of unequal shapes, or a type it does not "
        "know; drop such samples in the dataset, or give the DataLoader a collate_fn that pads or filters them)"
    ) in failure.value.__notes__[-1]


class BadValidationSample(ToyTrainer):
    def val_dataloader(self):  # sample 10 is in batch 1
        return DataLoader(_BadSample(24, 10), batch_size=8)


@pytest.mark.parametrize("run", ["fit", "validate"])
def test_an_evaluation_sample_that_raises_names_its_loader_and_batch(tmp_path, run):
    trainer = BadValidationSample(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(ValueError, match="record 10 is corrupt") as failure:
        trainer.fit() if run == "fit" else trainer.validate()
    assert "ampkit: raised while val_dataloader() produced batch 1" in failure.value.__notes__


class _DecaysInForward(torch.nn.Module):
    """Shrinks its output layer's weight in its forward, after using it (a hand-made weight decay)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(6, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        y = self.out(torch.tanh(self.hidden(x)))
        with torch.no_grad():
            self.out.weight.mul_(0.99)  # autograd saved it for the hidden layer's gradient
        return y


class _ActivationInPlace(torch.nn.Module):
    """Changes an activation autograd saved, of the same shape as a parameter: no parameter is to blame."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Parameter(torch.ones(8, 6))

    def forward(self, x):
        h = torch.sigmoid(x * self.mix)
        out = h.sum(1, keepdim=True)
        h.mul_(2)
        return out


class DecaysInForward(ToyTrainer):
    def configure_model(self):
        return _DecaysInForward()


class ActivationInPlace(ToyTrainer):
    def configure_model(self):
        return _ActivationInPlace()


def test_a_parameter_changed_in_place_in_the_forward_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as failure:
        DecaysInForward(toy_cfg(tmp_path, **QUIET)).fit()
    assert (
        "raised in training batch 0 of epoch 0 (iteration 1) (autograd needed parameter 'out.weight' as the forward "
        "used it, and something changed it in place before the backward"
    ) in failure.value.__notes__[-1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as failure:
        ActivationInPlace(toy_cfg(tmp_path / "activation", **QUIET)).fit()
    assert "(iteration 1); no checkpoint" in failure.value.__notes__[-1]


class BuiltOnMeta(ToyTrainer):
    def configure_model(self):
        with torch.device("meta"):  # a big-model habit: build without memory, then forget to materialize
            return super().configure_model()


class LossOnMeta(ToyTrainer):
    def training_step(self, batch):
        return super().training_step(batch).to("meta")


def test_a_model_on_the_meta_device_is_refused_naming_its_tensors_and_the_way_out(tmp_path):
    message = r"configure_model\(\) returned a model whose 0.weight, 0.bias, 3.weight and 1 more are on the meta device"
    with pytest.raises(UserCodeError, match=message + r".*model.to_empty\(device='cpu'\)"):
        BuiltOnMeta(toy_cfg(tmp_path, **QUIET)).fit()
    trainer = ToyTrainer(toy_cfg(tmp_path / "trained", **QUIET, **{"trainer.max_steps": 1}))
    trainer.fit()
    with pytest.raises(UserCodeError, match=message):
        load_model(trainer.version_dir / "checkpoints" / "last.pt", trainer_class=BuiltOnMeta)


def test_a_loss_on_the_meta_device_is_named(tmp_path):
    with pytest.raises(UserCodeError, match="the loss of loss_id 0 is on the meta device, which holds no values"):
        LossOnMeta(toy_cfg(tmp_path, **QUIET)).fit()


class _Overstated(IterableDataset):
    """40 samples, whose ``__len__`` says 64 (a stream that counted its files, not what they hold)."""

    def __len__(self) -> int:
        return 64

    def __iter__(self):
        return iter(toy_dataset(40))


class OverstatedLength(ToyTrainer):
    def train_dataloader(self):  # 5 batches, len() 8
        return DataLoader(_Overstated(), batch_size=8)


def test_a_loader_shorter_than_its_len_leaving_an_accumulation_window_open_is_refused(tmp_path):
    trainer = OverstatedLength(toy_cfg(tmp_path, **QUIET, **{"trainer.accumulate_grad_batches": 4}))
    message = (
        r"yielded 5 batches in epoch 0, but its len\(\) says 8: the gradients of its last 1 wait for an accumulation "
        r"window \(trainer.accumulate_grad_batches\) to close at batch 7, which never comes"
    )
    with pytest.raises(UserCodeError, match=message):
        trainer.fit()
    assert trainer.state.global_step == 1


def test_a_loader_shorter_than_its_len_is_said_once(tmp_path):
    trainer = OverstatedLength(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    with pytest.warns(UserWarning, match=r"yielded 5 batches in epoch 0, but its len\(\) says 8: progress") as said:
        trainer.fit()
    assert trainer.state.global_step == 10
    assert len([w for w in said if "but its len() says" in str(w.message)]) == 1


class _Understated(IterableDataset):
    """40 samples, whose ``__len__`` says ``length`` (24: a stream that counted some of its files)."""

    def __init__(self, length: int = 24) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter(toy_dataset(40))


class UnderstatedLength(ToyTrainer):
    length = 24

    def train_dataloader(self):  # 5 batches, len() 3
        return DataLoader(_Understated(self.length), batch_size=8)


class ExactLength(UnderstatedLength):
    length = 40


BARE = {"trainer.val_every_n_epochs": 0, "checkpoint.enabled": False}  # training alone: what the check is in


def test_a_loader_longer_than_its_len_ends_each_epoch_there_and_is_said_once(tmp_path):
    trainer = UnderstatedLength(toy_cfg(tmp_path, **QUIET, **BARE, **{"trainer.max_epochs": 2}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit()
    assert trainer.state.global_step == 6  # each epoch ends at len(), as Lightning's does
    said = [str(w.message) for w in seen if "more batches than its len()" in str(w.message)]
    assert said == [
        "train_dataloader() has more batches than its len() of 3: epoch 0 ended after 3 of them, as every epoch will "
        "(as Lightning's do), and the rest are never trained on; make its len() count what it yields, or give it no "
        "__len__ (the epoch then ends where the data does)"
    ]
    assert not [w for w in seen if "Length of IterableDataset" in str(w.message)]  # torch's, on the batch checked

    # no word where len() counts every batch, nor where limit_train_batches, not len(), ends the epoch
    for trainer, limit in ((ExactLength, {}), (UnderstatedLength, {"trainer.limit_train_batches": 2})):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer(toy_cfg(tmp_path / trainer.__name__, **QUIET, **BARE, **limit)).fit()
        assert not [str(w.message) for w in seen if "len()" in str(w.message)]


class UnshardedWorkers(ExactLength):
    def train_dataloader(self):  # len() 5, each of 2 workers yields all 5 batches
        return DataLoader(_Understated(self.length), batch_size=8, num_workers=2)


def test_a_stream_each_worker_yields_whole_is_named_as_the_cause_of_more_batches_than_len(tmp_path):
    # The warning said only to fix __len__, which counted right: each of the 2 workers yielded every sample.
    trainer = UnshardedWorkers(toy_cfg(tmp_path, **QUIET, **BARE))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit()
    said = [str(w.message) for w in seen if "more batches than its len()" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(
        "its DataLoader runs num_workers=2, each with its own copy of the IterableDataset: unless its __iter__ "
        "yields only its worker's share, every worker yields the whole stream and each sample comes 2 times. Shard "
        "it in __iter__ by torch.utils.data.get_worker_info() (its id and num_workers: skip the samples of the other "
        "workers); else make its len() count what it yields, or give it no __len__ (the epoch then ends where the "
        "data does)"
    )


class ZeroLength(UnderstatedLength):
    length = 0  # 5 batches, len() 0


def test_a_stream_whose_len_is_0_is_refused_for_its_len_not_as_yielding_nothing(tmp_path):
    # The error said "yields no batches" of a stream that yields 5: only its len() was 0.
    message = (
        r"^len\(train_dataloader\(\)\) is 0, so no epoch would train on it \(an epoch ends at len\(\)\); its __len__"
    )
    with pytest.raises(UserCodeError, match=message):
        ZeroLength(toy_cfg(tmp_path, **QUIET)).fit()


class ZeroLengthValidation(ExactLength):
    def val_dataloader(self):  # 5 batches, len() 0
        return DataLoader(_Understated(0), batch_size=8)


class EmptyEvaluationSets(ExactLength):
    """A validation set emptied by a filter, a test set whose 3 samples drop_last leaves out of a batch of 8, and
    no predict set at all."""

    def val_dataloader(self):
        return DataLoader(toy_dataset(0), batch_size=8)

    def test_dataloader(self):
        return DataLoader(toy_dataset(3), batch_size=8, drop_last=True)

    def test_step(self, batch):
        return {"mse": self.model(batch[0]).square().mean()}

    def predict_dataloader(self):
        return DataLoader(toy_dataset(0), batch_size=8)


def _said(run) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in seen if "batches" in str(w.message) and "dataloader()" in str(w.message)]


def test_an_evaluation_loader_without_batches_is_said_as_precisely_as_the_train_loaders(tmp_path):
    # A validation stream whose len() is 0 (it yields 5) was said to yield no batches, and an empty test or predict
    # set returned {} or [] without a word: each now names what the train loader's error names.
    stream = ZeroLengthValidation(toy_cfg(tmp_path / "stream", **QUIET, **{"checkpoint.enabled": False}))
    assert _said(stream.fit) == [
        "len(val_dataloader()) is 0, so validation is skipped; its __len__ returns the number of batches a pass "
        "yields, or raises TypeError where it has no length (validation then runs to its end)"
    ]
    assert stream.val_metrics == {}
    monitored = {"checkpoint.monitor": "val/mse"}
    with pytest.raises(
        ConfigError, match=r"monitors 'val/mse', but len\(val_dataloader\(\)\) is 0, so validation never"
    ):
        ZeroLengthValidation(toy_cfg(tmp_path / "monitored", **QUIET, **monitored)).fit()

    empty = EmptyEvaluationSets(toy_cfg(tmp_path / "empty", **QUIET, **{"checkpoint.enabled": False}))
    assert _said(empty.fit) == ["val_dataloader() yields no batches: its dataset is empty; validation is skipped"]
    assert _said(empty.test) == [
        "test_dataloader() yields no batches: 3 samples per epoch, fewer than batch_size=8 with drop_last=True (a "
        "smaller batch_size, or drop_last=False); test() returns no metrics"
    ]
    assert _said(empty.predict) == [
        "predict_dataloader() yields no batches: its dataset is empty; predict() returns no predictions"
    ]
    assert _said(empty.validate) == [
        "val_dataloader() yields no batches: its dataset is empty; validate() returns no metrics"
    ]
    # a stream's pass runs to its end whatever its len() says: test() of one whose len() is 0 runs its 5 batches
    streamed = EmptyEvaluationSets(toy_cfg(tmp_path / "streamed", **QUIET))
    streamed.test_dataloader = lambda: DataLoader(_Understated(0), batch_size=8)
    assert _said(streamed.test) == [] and set(streamed.test()) == {"mse"}


class _Filtered(IterableDataset):
    """A stream whose filter dropped every sample; its ``__len__`` (None: none) is what it counted beforehand."""

    def __init__(self, length: int | None) -> None:
        self.length = length

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("a stream has no length")
        return self.length

    def __iter__(self):
        return iter(())


def test_an_evaluation_stream_that_yields_nothing_is_said_after_its_pass(tmp_path):
    # Judged by len() alone: a stream with no len(), or one whose len() promised 3 batches, yielding nothing returned {}
    # or [] from test() and predict() without a word (and validate() too).
    trainer = EmptyEvaluationSets(toy_cfg(tmp_path, **QUIET, **{"checkpoint.enabled": False}))
    trainer.test_dataloader = lambda: DataLoader(_Filtered(None), batch_size=8)
    trainer.predict_dataloader = lambda: DataLoader(_Filtered(24), batch_size=8)  # 3 batches
    trainer.val_dataloader = lambda: DataLoader(_Filtered(None), batch_size=8)
    assert _said(trainer.test) == [
        "test_dataloader() yielded no batches (it has no len() to tell beforehand); test() returns no metrics: a "
        "stream that ended at once (an iterator an earlier pass used up, a filter that drops every sample, a shard by "
        "rank that leaves none)"
    ]
    assert _said(trainer.predict)[0].startswith(
        "predict_dataloader() yielded no batches (though its len() is 3); predict() returns no predictions"
    )
    assert _said(trainer.validate)[0].startswith("val_dataloader() yielded no batches (it has no len() to tell")
    # said once: an empty set its len() named beforehand is not said again after the pass
    empty = EmptyEvaluationSets(toy_cfg(tmp_path / "empty", **QUIET, **{"checkpoint.enabled": False}))
    assert _said(empty.predict) == [
        "predict_dataloader() yields no batches: its dataset is empty; predict() returns no predictions"
    ]


def test_a_validation_stream_that_yields_nothing_in_a_fit_is_said_once(tmp_path):
    # Each epoch's validation ran no batch and gave {} without a word (no monitor to miss it).
    trainer = EmptyEvaluationSets(toy_cfg(tmp_path, **QUIET, **{"checkpoint.enabled": False, "trainer.max_epochs": 2}))
    trainer.val_dataloader = lambda: DataLoader(_Filtered(None), batch_size=8)
    assert _said(trainer.fit) == [
        "val_dataloader() yielded no batches (it has no len() to tell beforehand); the validation at step 5 gives no "
        "metrics (said once a fit): a stream that ended at once (an iterator an earlier pass used up, a filter that "
        "drops every sample, a shard by rank that leaves none)"
    ]
    assert trainer.state.global_step == 10 and trainer.val_metrics == {}  # 5 batches an epoch


class _Endless(IterableDataset):
    """The toy samples over and over: a stream with no end and no length."""

    def __iter__(self):
        samples = toy_dataset(64)
        while True:
            yield from (samples[i] for i in range(64))


class EndlessStream(ToyTrainer):
    def train_dataloader(self):
        return DataLoader(_Endless(), batch_size=8)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({}, "checkpoints are written (checkpoint.every_n_steps=0) and validation runs (trainer.val_every_n_steps=0)"),
        ({"trainer.val_every_n_steps": 2}, "checkpoints are written (checkpoint.every_n_steps=0) only at"),
        ({"checkpoint.every_n_steps": 2, "trainer.val_every_n_steps": 2}, None),
        ({"trainer.limit_train_batches": 3}, None),
    ],
)
def test_a_stream_without_length_warns_when_checkpoints_or_validation_wait_for_its_end(tmp_path, settings, said):
    trainer = EndlessStream(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3}, **settings))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit()
    assert trainer.state.global_step == 3
    told = [str(w.message) for w in seen if "an epoch ends only where its data does" in str(w.message)]
    assert len(told) == (0 if said is None else 1)
    assert said is None or said in told[0]


class _LengthRaises:
    """The toy batches, from an iterable whose __len__ raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error, self.loader = error, DataLoader(toy_dataset(32), batch_size=8)

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        raise self.error


@pytest.mark.parametrize(
    ("error", "loader", "message"),
    [
        (
            RuntimeError("index not built"),
            "train",
            r"len\(train_dataloader\(\)\) raised RuntimeError: index not built; ",
        ),
        (
            ValueError("__len__() should return >= 0"),
            "val",
            r"len\(val_dataloader\(\)\) raised ValueError: __len__\(\)",
        ),
        (NotImplementedError(), "train", None),  # a stream's way to say it has no length, as TypeError is
    ],
    ids=["raises", "negative", "not-implemented"],
)
def test_a_loader_whose_len_raises_is_named_unless_it_says_it_has_none(tmp_path, error, loader, message):
    """A __len__ that raised (or returned -1) surfaced as its own error from deep in the set-up, naming no loader;
    NotImplementedError, which some samplers and streams raise, failed the run instead of meaning no length."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": -1}))
    setattr(trainer, f"{loader}_dataloader", lambda: _LengthRaises(error))
    if message is None:
        with pytest.warns(UserWarning, match=r"train_dataloader\(\) has no length"):
            trainer.fit()
        assert trainer.state.global_step == 4
        return
    with pytest.raises(UserCodeError, match=message + r".*raises TypeError where it has no length"):
        trainer.fit()


class _Float64Layer(torch.nn.Module):
    """A first layer kept in float64 on purpose, then float32."""

    def __init__(self) -> None:
        super().__init__()
        self.wide, self.head = torch.nn.Linear(6, 4).double(), torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.wide(x.to(self.wide.weight.dtype)).to(self.head.weight.dtype))


class _Float64LayerTrainer(ToyTrainer):
    def configure_model(self):
        return _Float64Layer()


def test_o2_says_it_casts_float64_parameters_down_too(tmp_path):
    """O2 casts every floating-point parameter, float64 ones too, as Apex did: the layer kept in float64 trained in
    bfloat16 with float32 masters, silently."""
    precision = {"precision.opt_level": "O2", "precision.dtype": "bfloat16"}
    trainer = _Float64LayerTrainer(toy_cfg(tmp_path, **QUIET, **precision, **{"trainer.max_steps": 1}))
    with pytest.warns(UserWarning, match=r"opt_level=O2 casts the model's float64 parameters to bfloat16 too "
                                         r"\(wide.weight, wide.bias\).*O1 keeps them"):  # fmt: skip
        trainer.fit()


class _ImportsPastItsLen(_Understated):
    """Past its ``len()`` the stream's reader imports a library that installs a warning filter, as many do."""

    def __iter__(self):
        for index, sample in enumerate(super().__iter__()):
            if index == self.length:
                warnings.filterwarnings("ignore", message="a library's own filter")
            yield sample


class _FilterPastItsLen(UnderstatedLength):
    def train_dataloader(self):
        return DataLoader(_ImportsPastItsLen(self.length), batch_size=8)


def test_the_batch_checked_past_len_leaves_a_filter_the_loader_installs(tmp_path):
    """The batch fetched past len() ran under warnings.catch_warnings, which swaps the process's filters: a filter
    installed meanwhile (by the loader, or by another thread's unseeded run) was dropped as the check ended."""
    trainer = _FilterPastItsLen(toy_cfg(tmp_path, **QUIET, **BARE))
    with pytest.warns(UserWarning, match=r"more batches than its len\(\)"):  # its exit restores the filters
        trainer.fit()
        assert any(f[0] == "ignore" and f[1] and f[1].pattern == "a library's own filter" for f in warnings.filters)


@dataclasses.dataclass(frozen=True)
class _Features:
    x: torch.Tensor
    source: str = "sensor"


@dataclasses.dataclass
class _Prediction:
    value: torch.Tensor


class _TakesAndGivesDataclasses(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 1)

    def forward(self, features: _Features) -> _Prediction:
        return _Prediction(self.linear(features.x).squeeze(1))


class DataclassModel(ToyTrainer):
    def configure_model(self):
        return _TakesAndGivesDataclasses()

    def training_step(self, batch):
        x, y = batch
        out = self.model(_Features(x))
        self.output_dtypes = getattr(self, "output_dtypes", set()) | {out.value.dtype}
        return torch.nn.functional.mse_loss(out.value, y)

    def validation_step(self, batch):
        x, y = batch
        return {"mse": torch.nn.functional.mse_loss(self.model(_Features(x)).value, y)}


@pytest.mark.parametrize("opt_level", ["O2", "O3", "O5"])
def test_a_model_taking_and_returning_dataclasses_trains_with_a_cast_model(tmp_path, opt_level):
    """A cast model's inputs in a dataclass stayed float32 (torch's 'mat1 and mat2 must have the same dtype' at the
    first step), and its output dataclass stayed in the model's dtype, where a dict's or a tuple's are float32."""
    cfg = toy_cfg(
        tmp_path, **QUIET, **{"precision.opt_level": opt_level, "trainer.max_steps": 2, "precision.init_scale": 128}
    )
    trainer = DataclassModel(cfg)
    trainer.fit()
    assert trainer.state.global_step == 2 and trainer.output_dtypes == {torch.float32}
