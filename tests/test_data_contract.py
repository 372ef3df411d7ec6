"""Training data keeps the contract Lightning users know: every sampler with ``set_epoch`` is told each epoch (also
one inside a ``batch_sampler=``), so a shuffle differs per epoch; a mid-epoch resume goes on with the next unseen
sample, none repeated or skipped; a stream without a length ends each epoch where it ends, or runs to
``max_steps``. Under two ranks a ``batch_sampler=`` keeps its batch size and a DistributedSampler in it is used as it
is, and one that pads a validation set with repeats is named. (Sharding plain loaders, each validation sample once,
bit-identical resumes: test_distributed.py, test_checkpoint.py.)"""

from __future__ import annotations

import itertools
import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit.trainer.distributed import DistributedEnv, distributed_loader, evaluation_loader

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
         "trainer.num_sanity_val_steps": 0}  # fmt: skip


def _indexed(n: int) -> TensorDataset:
    x, y = toy_dataset(n).tensors
    return TensorDataset(x, y, torch.arange(n))


class RecordsSamples(ToyTrainer):
    """Records the sample indices of each training batch, per epoch."""

    loader: ClassVar[str] = "shuffle"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, list[int]]] = []

    def train_dataloader(self):
        data = _indexed(self.cfg.data.n)
        if self.loader == "shuffle":
            return DataLoader(data, batch_size=8, shuffle=True)
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        return DataLoader(data, batch_sampler=BatchSampler(sampler, 8, drop_last=False))

    def training_step(self, batch):
        x, y, index = batch
        self.seen.append((self.state.epoch, index.tolist()))
        return F.mse_loss(self.model(x).squeeze(1), y)


def _epochs(trainer: RecordsSamples) -> list[list[int]]:
    return [[i for e, batch in trainer.seen if e == epoch for i in batch] for epoch in range(3)]


def test_a_distributed_sampler_inside_a_batch_sampler_is_told_each_epoch(tmp_path):
    """It sat inside the batch sampler, where only loader.sampler was told: every epoch drew epoch 0's order."""
    RecordsSamples.loader = "batch_sampler"
    trainer = RecordsSamples(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3, "checkpoint.enabled": False}))
    trainer.fit()
    reference = DistributedSampler(range(64), num_replicas=1, rank=0, shuffle=True, seed=3)
    for epoch, order in enumerate(_epochs(trainer)):
        reference.set_epoch(epoch)
        assert order == list(reference)
    assert len({tuple(order) for order in _epochs(trainer)}) == 3


class _EpochNoted(torch.utils.data.SequentialSampler):
    """A sampler that notes each ``set_epoch`` it is told."""

    def __init__(self, data) -> None:
        super().__init__(data)
        self.told: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.told.append(epoch)


class ValidatesWithEpochSampler(ToyTrainer):
    def val_dataloader(self):
        data = toy_dataset(24, seed=7)
        self.val_sampler = getattr(self, "val_sampler", None) or _EpochNoted(data)
        return DataLoader(data, batch_size=8, sampler=self.val_sampler)


def test_a_validation_sampler_is_told_each_epoch_as_a_training_one_is(tmp_path):
    """Lightning tells evaluation loaders' samplers the epoch too (a shuffled DistributedSampler there drew one
    order for good); they were never told."""
    settings = {"trainer.max_epochs": 3, "checkpoint.enabled": False, "trainer.val_every_n_epochs": 1}
    trainer = ValidatesWithEpochSampler(toy_cfg(tmp_path, **QUIET, **settings))
    trainer.fit()
    assert trainer.val_sampler.told == [0, 1, 2]


@pytest.mark.parametrize("loader", ["shuffle", "batch_sampler"])
def test_a_mid_epoch_resume_goes_on_with_the_next_unseen_sample(tmp_path, loader):
    """Stopped after 5 of 8 batches of epoch 1 and resumed: the samples of the rest of that epoch and of the next are
    the uninterrupted run's, each epoch a permutation of every sample, each differing from the last."""
    RecordsSamples.loader = loader
    epochs = {"trainer.max_epochs": 3, "checkpoint.every_n_steps": 1}
    whole = RecordsSamples(toy_cfg(tmp_path / "whole", **QUIET, **epochs))
    whole.fit()
    first = RecordsSamples(toy_cfg(tmp_path / "cut", **QUIET, **epochs, **{"trainer.max_steps": 13}))
    first.fit()
    rest = RecordsSamples(toy_cfg(tmp_path / "cut", **QUIET, **epochs))
    rest.fit(resume="last")
    assert first.seen + rest.seen == whole.seen
    assert rest.seen[0] == whole.seen[13]
    for order in _epochs(whole):
        assert sorted(order) == list(range(64))
    assert len({tuple(order) for order in _epochs(whole)}) == 3


class Stream(IterableDataset):
    """``n`` samples (None: without end), no length."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __iter__(self):
        data = toy_dataset(24)
        for i in itertools.count() if self.n is None else range(self.n):
            yield data[i % 24]


class Streamed(ToyTrainer):
    stream_length: ClassVar[int | None] = 20

    def train_dataloader(self):
        return DataLoader(Stream(self.stream_length), batch_size=8)


def test_a_stream_without_a_length_ends_each_epoch_where_it_ends_or_runs_to_max_steps(tmp_path):
    Streamed.stream_length = 20  # batches of 8, 8, 4
    trainer = Streamed(toy_cfg(tmp_path / "ends", **QUIET, **{"trainer.max_epochs": 2, "checkpoint.enabled": False}))
    assert trainer.num_train_batches is None
    trainer.fit()
    assert (trainer.state.epoch, trainer.state.global_step) == (2, 6)
    assert trainer.val_metrics_step == 6  # validated at each epoch's end, the stream's end
    Streamed.stream_length = None
    endless = {"trainer.max_epochs": -1, "trainer.max_steps": 7, "checkpoint.enabled": False}
    trainer = Streamed(toy_cfg(tmp_path / "endless", **QUIET, **endless))
    trainer.fit()
    assert (trainer.state.epoch, trainer.state.global_step) == (0, 7)


def _batches(loader) -> list[list[int]]:
    return [batch[2].tolist() for batch in loader]


def test_a_batch_sampler_given_to_the_loader_keeps_its_batch_size_under_two_ranks():
    """Rebuilt from loader.batch_size, which a batch_sampler= leaves None, the loader gave each rank single samples
    (training on batches of one), and evaluation failed on None // int."""
    data = _indexed(16)
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, drop_last=False))
    shards = [distributed_loader(loader, 0, DistributedEnv(rank=r, world_size=2), True) for r in range(2)]
    for shard in shards:
        shard.sampler.set_epoch(0)
    trained = [_batches(shard) for shard in shards]
    assert [[len(batch) for batch in rank] for rank in trained] == [[4, 4], [4, 4]]
    assert sorted(i for rank in trained for batch in rank for i in batch) == list(range(16))
    assert shards[0].sampler.shuffle  # the RandomSampler's shuffle kept
    evaluated = [_batches(evaluation_loader(loader, DistributedEnv(rank=r, world_size=2))) for r in range(2)]
    assert evaluated == [[[0, 2, 4, 6], [8, 10, 12, 14]], [[1, 3, 5, 7], [9, 11, 13, 15]]]


def test_a_distributed_sampler_inside_a_batch_sampler_is_used_as_it_is_under_two_ranks():
    """It shards already: it was taken for a sampler over the whole set and rebuilt, unbatched."""
    data = _indexed(16)
    loaders = [
        DataLoader(data, batch_sampler=BatchSampler(DistributedSampler(data, 2, rank, shuffle=True), 4, False))
        for rank in range(2)
    ]
    for rank, loader in enumerate(loaders):
        env = DistributedEnv(rank=rank, world_size=2)
        assert distributed_loader(loader, 0, env, True) is loader
        assert evaluation_loader(loader, env) is loader


def test_a_distributed_sampler_that_pads_a_validation_set_with_repeats_is_named(monkeypatch):
    """5 samples on 2 ranks: it repeats one so that each rank has 3, and that one counts twice in the means (is
    predicted twice: predict's warning spoke of means it has none of)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # a run sets it: alone, this test had none
    data = _indexed(5)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    with pytest.warns(UserWarning, match=r"val_dataloader\(\)'s DistributedSampler repeats 1 of its 5 samples to give"):
        assert evaluation_loader(loader, DistributedEnv(rank=0, world_size=2)) is loader
    with pytest.warns(UserWarning, match=r"repeats 1 of its 5 samples .*, so they are predicted twice: give"):
        evaluation_loader(loader, DistributedEnv(rank=0, world_size=2), "predict_dataloader()")  # no means there
    even = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, rank=0, shuffle=False, drop_last=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # drop_last: no repeats, nothing to say
        evaluation_loader(even, DistributedEnv(rank=0, world_size=2))
