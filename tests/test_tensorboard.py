"""TensorBoard events written by the logger read back with tensorboard's own reader."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from child_env import child_env
from rank_forkserver import ForkedPython
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, Phase
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.run_life import RunDirectoryError
from ampkit.trainer.user_code import UserCodeError

TESTS = Path(__file__).resolve().parent


def _events(trainer) -> EventAccumulator:
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"), size_guidance={"histograms": 0})
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
    # trainer.log follows log_every_n_steps: batches 2, 4, 6, 8 of each 8-batch epoch
    assert [(e.step, e.value) for e in events.Scalars("custom/batches")] == [
        (step, (step - 1) % 8 + 1) for step in range(2, 17, 2)
    ]
    experiment = _hparams_plugin_data(events, "_hparams_/experiment").experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["val/mse"]  # the HParams tab compares runs by it
    assert "lr" in {h.name for h in experiment.hparam_infos}
    start = _hparams_plugin_data(events, "_hparams_/session_start_info").session_start_info
    assert start.hparams["lr"].number_value == 0.01


def test_a_max_time_dict_is_one_hparam_as_written(tmp_path):
    """Lightning's max_time {hours: 1, minutes: 30} is one setting: the HParams tab shows it under trainer/max_time
    as written, where it split into trainer/max_time/hours and trainer/max_time/minutes."""
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "trainer.max_time": {"hours": 1, "minutes": 30}})
    trainer = ToyTrainer(cfg)
    trainer.fit()
    start = _hparams_plugin_data(_events(trainer), "_hparams_/session_start_info").session_start_info
    assert [name for name in start.hparams if name.startswith("trainer/max_time")] == ["trainer/max_time"]
    assert start.hparams["trainer/max_time"].string_value == "{'hours': 1, 'minutes': 30}"


def test_steps_per_sec_counts_every_step_since_the_last_log_step(tmp_path, monkeypatch):
    """The rate is the steps between two log steps over the time between them: on a clock that runs 0.25 s a step
    it is 4 steps/s at every log step, whatever log_every_n_steps is."""
    import types

    from ampkit.callbacks import tensorboard

    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.log_every_n_steps": 4}))
    clock = types.SimpleNamespace(time=time.time, sleep=time.sleep)
    clock.perf_counter = lambda: trainer.state.global_step * 0.25
    monkeypatch.setattr(tensorboard, "time", clock)
    trainer.fit()
    rates = [(e.step, e.value) for e in _events(trainer).Scalars("train/steps_per_sec")]
    assert rates == [(4, 4.0), (8, 4.0)]


def _hparams_plugin_data(events: EventAccumulator, tag: str):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    return HParamsPluginData.FromString(events.PluginTagToContent("hparams")[tag])


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


def test_the_batches_after_the_last_log_step_are_logged_at_the_last_step(tmp_path):
    """10 steps logged every 4: steps 9 and 10 were never written (a run shorter than log_every_n_steps showed no
    train/loss at all)."""
    losses: list[float] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, outputs, batch):
            losses.append(float(outputs["loss"]))

    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "trainer.max_steps": 10, "logging.log_every_n_steps": 4})
    trainer = ToyTrainer(cfg, callbacks=[Spy()])
    trainer.fit()
    logged = [(e.step, e.value) for e in _events(trainer).Scalars("train/loss")]
    expected = [
        (step, pytest.approx(sum(losses[a:step]) / (step - a), rel=1e-6)) for a, step in ((0, 4), (4, 8), (8, 10))
    ]
    assert logged == expected


def test_each_output_is_averaged_over_the_window_whatever_its_type(tmp_path):
    seen: dict[str, list[float]] = {"loss": [], "count": [], "half": []}

    class MixedOutputs(ToyTrainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            i = self.state.batch_idx
            shaped = loss.reshape(1) if i % 2 else loss  # () in some batches, (1,) in others
            half = (loss * 3).to(torch.bfloat16)
            for key, value in (("loss", shaped), ("count", i), ("half", half)):
                seen[key].append(float(value.detach()) if isinstance(value, torch.Tensor) else float(value))
            return {"loss": shaped, "count": i, "half": half}

    trainer = MixedOutputs(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.log_every_n_steps": 4}))
    trainer.fit()
    events = _events(trainer)
    for key, values in seen.items():
        logged = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        expected = [(i + 4, sum(values[i : i + 4]) / 4) for i in (0, 4)]
        assert [step for step, _ in logged] == [step for step, _ in expected]
        assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(logged, expected, strict=True)), key


class _LogsPictures(Callback):
    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.iteration == 3:
            image = torch.zeros(3, 5, 7)
            image[0, 1, 2] = 1.0
            trainer.logger.log_image("pictures/red_dot", image)
            trainer.logger.log_histogram("pictures/values", torch.arange(10.0))
            trainer.logger.log_text("pictures/note", "step three")


def test_logger_images_histograms_and_text_read_back(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1}), callbacks=[_LogsPictures()])
    trainer.fit()
    events = _events(trainer)
    (image,) = events.Images("pictures/red_dot")
    assert (image.step, image.width, image.height) == (3, 7, 5)
    import io

    from PIL import Image  # tensorboard's own image plugin depends on it

    pixels = torch.from_numpy(np.array(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB")))
    assert pixels[1, 2].tolist() == [255, 0, 0] and int(pixels.long().sum()) == 255
    (histogram,) = events.Histograms("pictures/values")
    value = histogram.histogram_value
    assert (histogram.step, value.num, value.sum, value.min, value.max) == (3, 10, 45.0, 0.0, 9.0)
    assert "pictures/note/text_summary" in events.Tags()["tensors"]
    assert type(trainer.logger).__name__ == "Logger"  # the writer is gone with the run


def test_logger_rejects_non_images_and_non_finite_histograms(tmp_path):
    class Bad(Callback):
        def __init__(self, call):
            self.call = call

        def on_train_batch_end(self, trainer, outputs, batch):
            self.call(trainer.logger)

    for call, message in [
        (lambda log: log.log_image("x", torch.zeros(5, 4, 4)), r"shape \(5, 4, 4\) is not an image"),
        (lambda log: log.log_histogram("h", torch.tensor([1.0, math.inf])), "hold inf/nan"),
        (lambda log: log.log_image("x", torch.full((3, 4, 4), 200.0)), r"span \[200, 200\]; expected \[0, 1\]"),
        (lambda log: log.log_image("x", torch.linspace(-1, 1, 16).view(4, 4)), r"span \[-1, 1\]"),
        (lambda log: log.log_image("x", torch.full((4, 4), math.nan)), r"span \[nan, nan\]"),
    ]:
        trainer = ToyTrainer(toy_cfg(tmp_path, **{"checkpoint.enabled": False}), callbacks=[Bad(call)])
        with pytest.raises(ValueError, match=message):
            trainer.fit()


class _LogsUnder(Callback):
    def __init__(self, tag):
        self.tag = tag

    def on_train_batch_end(self, trainer, outputs, batch):
        trainer.logger.log_text(self.tag, "sampled")


@pytest.mark.parametrize("tensorboard", [True, False])
def test_logger_tags_are_checked_as_log_s_are_with_or_without_tensorboard(tmp_path, tensorboard):
    """log() refuses a tag holding a newline or control character, as monitors do; trainer.logger wrote one to the
    event file (or dropped it without TensorBoard, or on the ranks but zero), and repeated a 10 kB tag whole."""
    cfg = toy_cfg(tmp_path, **{"checkpoint.enabled": False, "logging.tensorboard": tensorboard})
    with pytest.raises(UserCodeError, match=re.escape(r"log_text(tag='samples\n'): the tag is invalid; expected pr")):
        ToyTrainer(cfg, callbacks=[_LogsUnder("samples\n")]).fit()
    with pytest.raises(UserCodeError, match=r"log_text\(tag=7\): the tag is int; expected a string"):
        ToyTrainer(cfg, callbacks=[_LogsUnder(7)]).fit()


@pytest.mark.parametrize(
    ("call", "expected"),
    [(lambda log, tag: log.log_image(tag, torch.zeros(5, 4, 4)), "is not an image"),
     (lambda log, tag: log.log_histogram(tag, torch.tensor([math.inf])), "hold inf/nan"),
     (lambda log, tag: log.log_text(tag + "\x1b", "x"), "the tag is invalid")],
)  # fmt: skip
def test_logger_messages_name_a_long_tag_by_its_start_and_length(tmp_path, call, expected):
    tag = "samples/" + "a" * 10_000
    cfg = toy_cfg(tmp_path, **{"checkpoint.enabled": False, "trainer.max_steps": 1})

    class Calls(Callback):
        def on_train_batch_end(self, trainer, outputs, batch):
            call(trainer.logger, tag)

    with pytest.raises(ValueError, match=expected) as caught:
        ToyTrainer(cfg, callbacks=[Calls()]).fit()
    assert "characters)" in str(caught.value) and len(str(caught.value)) < 400


class _LogsLoss(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.seen.append((self.state.epoch, loss.item()))
        self.log("sq", loss, on_step=True, on_epoch=True)
        self.log("plain", 1.0)
        self.queued.extend(value for _, value, _ in self.logged_scalars)
        return loss


def test_log_detaches_follows_log_every_n_steps_and_averages_epochs(tmp_path):
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.log_every_n_steps": 4})
    trainer = _LogsLoss(cfg)
    trainer.seen, trainer.queued = [], []
    trainer.fit()
    assert trainer.queued and not any(isinstance(v, torch.Tensor) and v.requires_grad for v in trainer.queued)
    events = _events(trainer)
    assert [e.step for e in events.Scalars("plain")] == [4, 8, 12, 16]
    assert [e.step for e in events.Scalars("sq_step")] == [4, 8, 12, 16]
    epoch_means = [torch.tensor([v for ep, v in trainer.seen if ep == epoch]).mean().item() for epoch in (0, 1)]
    logged = events.Scalars("sq_epoch")
    assert [e.step for e in logged] == [8, 16]
    assert all(math.isclose(e.value, m, rel_tol=1e-5) for e, m in zip(logged, epoch_means, strict=True))
    assert trainer.epoch_scalars.keys() == {"sq_epoch"}


def test_a_value_logged_in_every_micro_batch_is_written_once_per_step_the_iteration_s_last(tmp_path):
    # Each micro-batch of a due iteration queued its value at that iteration's step: two points at one step,
    # a vertical stroke in TensorBoard's chart.
    cfg = toy_cfg(tmp_path, **{"trainer.accumulate_grad_batches": 2, "logging.log_every_n_steps": 1})
    trainer = ToyTrainer(cfg, callbacks=[_LogsExtra()])
    trainer.fit()
    logged = [(e.step, e.value) for e in _events(trainer).Scalars("custom/batches")]
    assert logged == [(step, 2 * step) for step in range(1, 5)]


def test_each_param_group_s_learning_rate_is_logged(tmp_path):
    # Only the first group's was: a fine-tuned backbone's own, smaller learning rate never showed.
    class TwoGroups(ToyTrainer):
        def configure_optimizers(self):
            head, body = list(self.module[3].parameters()), list(self.module[0].parameters())
            return torch.optim.SGD([{"params": head}, {"params": body, "lr": 0.001}], lr=0.01)

    trainer = TwoGroups(toy_cfg(tmp_path, **{"logging.log_every_n_steps": 4}))
    trainer.fit()
    events = _events(trainer)
    assert [e.value for e in events.Scalars("train/lr/sgd")] == pytest.approx([0.01, 0.01])
    assert [e.value for e in events.Scalars("train/lr/sgd/group_1")] == pytest.approx([0.001, 0.001])


def test_named_param_groups_and_momentum_are_tagged_as_lightning_s_lr_monitor_tags_them(tmp_path):
    """A group with a ``"name"`` is tagged by it; a name an earlier group took keeps its index, so neither curve
    hides the other; with log_momentum, Adam's first beta is the momentum."""

    class NamedGroups(ToyTrainer):
        def configure_optimizers(self):
            (w0, b0), (w3, b3) = self.module[0].parameters(), self.module[3].parameters()
            groups = [{"params": [w3]}, {"params": [b3], "lr": 0.002, "name": "head_bias"}]
            groups += [{"params": [w0], "lr": 0.003, "name": "body"}, {"params": [b0], "lr": 0.004, "name": "body"}]
            return torch.optim.Adam(groups, lr=0.001, betas=(0.8, 0.99))

    cfg = toy_cfg(tmp_path, **{"logging.log_every_n_steps": 4, "logging.log_momentum": True})
    trainer = NamedGroups(cfg)
    trainer.fit()
    events = _events(trainer)
    lrs = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"] if tag.startswith("train/lr/")}
    assert lrs == pytest.approx(
        {"train/lr/adam": 0.001, "train/lr/adam/head_bias": 0.002, "train/lr/adam/body": 0.003,
         "train/lr/adam/group_3": 0.004}
    )  # fmt: skip
    momenta = [tag for tag in events.Tags()["scalars"] if tag.startswith("train/momentum/")]
    assert sorted(momenta) == sorted(tag.replace("/lr/", "/momentum/") for tag in lrs)
    assert all(e.value == pytest.approx(0.8) for tag in momenta for e in events.Scalars(tag))


def test_log_rejects_a_non_scalar(tmp_path):
    class LogsVector(ToyTrainer):
        def training_step(self, batch):
            self.log("v", torch.ones(3))
            return super().training_step(batch)

    with pytest.raises(ValueError, match=r"log\('v'\): expected a scalar, got a tensor of shape \(3,\)"):
        LogsVector(toy_cfg(tmp_path, **{"checkpoint.enabled": False})).fit()


class _OverflowsBias(ToyTrainer):
    """The last layer's bias gets an infinite gradient at iteration 3 (and only it)."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.iteration == 3:
            loss = loss + math.inf * self.module[3].bias.sum()
        return loss


def test_gradient_histograms_and_the_parameters_that_overflowed(tmp_path):
    cfg = toy_cfg(
        tmp_path,
        **{
            "trainer.max_epochs": 1,
            "logging.grad_histograms_every_n_steps": 2,
            "precision.opt_level": "O1",
            "precision.dtype": "bfloat16",
            "precision.loss_scale": "dynamic",
        },
    )
    trainer = _OverflowsBias(cfg)
    trainer.fit()
    (histograms,) = [cb for cb in trainer.callbacks if cb.name == "GradientHistograms"]
    assert histograms.overflowed == {"sgd": ["3.bias"]}
    assert trainer.optimizer_state[trainer.optimizer].skipped_steps == 1
    events = _events(trainer)
    names = {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert {f"grad/{n}" for n in names} <= set(events.Tags()["histograms"])
    assert [e.step for e in events.Histograms("grad/0.weight")] == [2, 4, 6, 8]
    assert events.Histograms("grad/0.weight")[0].histogram_value.num == 16 * 6
    (note,) = events.Tensors("amp/overflow_params/sgd/text_summary")
    assert note.step == 3
    assert "non-finite gradients in 3.bias" in note.tensor_proto.string_val[0].decode()


class _CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.iteration == self.step:
            raise RuntimeError("boom")


def test_scalars_queued_before_a_crash_are_written(tmp_path):
    """Scalars wait in a queue between flushes; a run that dies still writes what it logged."""
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 3, "logging.log_every_n_steps": 2, "checkpoint.enabled": False})
    trainer = ToyTrainer(cfg, callbacks=[_CrashAt(7)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert [e.step for e in _events(trainer).Scalars("train/loss")] == [2, 4, 6]


class _ImageEvery(Callback):
    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.iteration % 3 == 0:
            trainer.logger.log_image("sample", torch.zeros(1, 4, 4))


def test_queued_scalars_keep_the_file_in_step_order(tmp_path):
    """Images and validation metrics are written at once, so the queued scalars go before them: every event's
    step is at least the step of the one before it (TensorBoard drops data that goes back in steps)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.log_every_n_steps": 2})
    trainer = ToyTrainer(cfg, callbacks=[_ImageEvery()])
    trainer.fit()
    (path,) = (trainer.version_dir / "tensorboard").glob("events.out.tfevents.*")
    steps = [event.step for event in EventFileLoader(str(path)).Load() if event.HasField("summary") and event.step]
    assert steps == sorted(steps) and len(steps) > 8
    assert [e.step for e in _events(trainer).Scalars("train/loss")] == list(range(2, 17, 2))
    images = EventAccumulator(str(trainer.version_dir / "tensorboard"), size_guidance={"images": 0})
    images.Reload()
    assert [e.step for e in images.Images("sample")] == list(range(3, 17, 3))


def test_flush_secs_is_checked():
    from ampkit.callbacks import TensorBoardLogger

    with pytest.raises(ValueError, match=r"flush_secs must be >= 0, got -1"):
        TensorBoardLogger(flush_secs=-1)
    # inf was taken, and the queue then waited for validation or the end of the run
    with pytest.raises(ValueError, match=r"flush_secs=inf would hold .* a finite number of seconds >= 0"):
        TensorBoardLogger(flush_secs=math.inf)


class _LogsBatchIndex(ToyTrainer):
    def training_step(self, batch):
        self.log("index", float(self.state.batch_idx), on_step=False, on_epoch=True)
        return super().training_step(batch)


def test_log_epoch_means_are_weighted_by_batch_size(tmp_path):
    """20 samples in batches of 8, 8, 4: the epoch mean of the batch index is (0*8 + 1*8 + 2*4) / 20, not 1."""
    cfg = toy_cfg(tmp_path, **{"data.n": 20, "logging.tensorboard": False, "checkpoint.enabled": False})
    trainer = _LogsBatchIndex(cfg)
    trainer.fit()
    assert trainer.epoch_scalars["index"] == pytest.approx(0.8)


class _LogsAtEpochEnd(ToyTrainer):
    def on_train_epoch_end(self):  # Lightning's habit: an epoch's metric (a torchmetrics compute()) logged here
        self.log("epoch_metric", float(self.state.epoch))


def test_a_value_logged_at_an_epoch_end_is_written_once_per_epoch_the_last_too(tmp_path):
    """Outside a batch the log interval does not apply (iterations 8, 16, 24 are not due every 5), and the last
    epoch's value, which no later batch end takes up, is written at the end of training."""
    trainer = _LogsAtEpochEnd(toy_cfg(tmp_path, **{"trainer.max_epochs": 3, "logging.log_every_n_steps": 5}))
    trainer.fit()
    assert [(e.step, e.value) for e in _events(trainer).Scalars("epoch_metric")] == [(8, 0.0), (16, 1.0), (24, 2.0)]


class _LogsAtTrainEnd(ToyTrainer):
    def on_train_end(self) -> None:  # a Trainer's own hooks run after the callbacks', TensorBoard's included
        self.log("final_metric", 3.5)


def test_a_value_logged_in_a_trainers_own_on_train_end_is_written(tmp_path):
    trainer = _LogsAtTrainEnd(toy_cfg(tmp_path, **{"trainer.max_epochs": 1}))
    trainer.fit()
    assert [(e.step, e.value) for e in _events(trainer).Scalars("final_metric")] == [(8, 3.5)]


class _ReadsEventsAfterSaves(Callback):
    """Reads the event files back from disk at the batch after each checkpoint, before anything logs again: what a
    SIGKILL just after the save would have left."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, batch):
        step = trainer.state.global_step
        if (trainer.version_dir / "checkpoints" / f"step-{step:08d}.pt").exists() and step not in self.seen:
            self.seen[step] = [e.step for e in _events(trainer).Scalars("train/loss")]


def test_a_checkpoint_s_save_writes_every_scalar_logged_up_to_its_step_to_the_event_file(tmp_path, monkeypatch):
    """The logger queues scalars (flush_secs) and SummaryWriter's thread writes them when it gets to them (on a slow
    disk, seconds later): without the flush in the logger's state_dict, a kill just after a checkpoint lost steps the
    resume never logs again. The writer thread here takes 20 ms a record, a slow disk's pace."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    write = RecordWriter.write
    monkeypatch.setattr(RecordWriter, "write", lambda self, data: (time.sleep(0.02), write(self, data))[1])
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.log_every_n_steps": 1, "checkpoint.every_n_steps": 3})
    reader = _ReadsEventsAfterSaves()
    ToyTrainer(cfg, callbacks=[reader]).fit()
    assert reader.seen == {3: [1, 2, 3], 6: [1, 2, 3, 4, 5, 6]}


class _LogsRunMark(Callback):
    def __init__(self, mark: float) -> None:
        self.mark = mark

    def on_train_batch_end(self, trainer, outputs, batch):
        trainer.log("run_mark", self.mark)


def test_a_continued_run_replaces_the_steps_logged_after_its_checkpoint(tmp_path):
    """A run killed after its last checkpoint had already written later steps; the continued run logs them again.
    TensorBoard showed each of those steps twice (two points per step, a zigzag where the killed run's values
    differ); the continued run's writer purges the killed run's events past the checkpoint, as SummaryWriter's
    purge_step does. Each run logs its own mark, so the steps shown say which run wrote them."""
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.log_every_n_steps": 1, "checkpoint.every_n_steps": 3,
                              "checkpoint.keep_last": 5})  # fmt: skip
    first = ToyTrainer(cfg, callbacks=[_LogsRunMark(1.0)])
    first.fit()
    _cut_back_to(first.version_dir / "checkpoints", 3)  # as if killed just after the save at step 3
    continued = ToyTrainer(cfg, callbacks=[_LogsRunMark(2.0)])
    continued.fit(resume="last")
    assert continued.version_dir == first.version_dir  # a continue, into the same TensorBoard directory
    events = _events(continued)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    assert [(e.step, e.value) for e in events.Scalars("run_mark")] == [(s, 1.0 if s <= 3 else 2.0) for s in range(1, 9)]


def _cut_back_to(checkpoints, step):
    """As if the run was killed just after its save at ``step``."""
    import shutil

    for later in sorted(checkpoints.glob("step-*.pt")):
        if int(later.stem.partition("-")[2]) > step:
            later.unlink()
    shutil.copy(checkpoints / f"step-{step:08d}.pt", checkpoints / "last.pt")


def test_a_mid_window_resume_logs_the_loss_over_the_whole_window(tmp_path):
    """Killed at step 3 of a window of 4: the continued run's step-4 point averaged only step 4's loss (the three
    before were lost). The checkpoint keeps the window; a resume without TensorBoard drops it without a warning."""
    settings = {"trainer.max_epochs": 1, "logging.log_every_n_steps": 4, "checkpoint.every_n_steps": 3,
                "checkpoint.keep_last": 5}  # fmt: skip
    cfg = toy_cfg(tmp_path, **settings)
    first = ToyTrainer(cfg)
    first.fit()
    uninterrupted = [(e.step, e.value) for e in _events(first).Scalars("train/loss")]
    checkpoints = first.version_dir / "checkpoints"
    _cut_back_to(checkpoints, 3)
    continued = ToyTrainer(cfg)
    continued.fit(resume="last")
    assert [(e.step, e.value) for e in _events(continued).Scalars("train/loss")] == uninterrupted
    _cut_back_to(checkpoints, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ToyTrainer(toy_cfg(tmp_path, **settings, **{"logging.tensorboard": False})).fit(resume="last")
    assert not [w for w in caught if "state of callbacks" in str(w.message)]


class _SigkillAfter(Callback):
    """SIGKILL once every callback, the checkpoint's included, is done with ``hook`` at ``step`` (a node lost there)."""

    phase = Phase.PERSIST
    # A checkpoint writer reading logged values, as ModelCheckpoint: those run after the rest of their phase, and given
    # after the built-in ModelCheckpoint, it runs after its save (a plain PERSIST callback, or a checkpoint writer that
    # reads nothing, ran before it, so the kill came before the save).
    saves_checkpoints = True
    reads_logged_values = True

    def __init__(self, hook: str, step: int) -> None:
        self.hook, self.step = hook, step

    def on_train_batch_end(self, trainer, outputs, batch):
        self._kill_at("on_train_batch_end", trainer)

    def on_validation_end(self, trainer, metrics):
        self._kill_at("on_validation_end", trainer)

    def _kill_at(self, hook, trainer):
        if hook == self.hook and trainer.state.global_step == self.step and trainer.state.stage == "fit":
            os.kill(os.getpid(), signal.SIGKILL)


def fit_killed(cfg_json: str, hook: str, step: int) -> None:
    """A subprocess's run: ToyTrainer continuing ``cfg``'s newest checkpoint, if any, SIGKILLed at ``hook``/``step``."""
    from ampkit.trainer.run_life import resolve_checkpoint

    cfg = json.loads(cfg_json)
    ToyTrainer(cfg, callbacks=[_SigkillAfter(hook, step)]).fit(resume=resolve_checkpoint(cfg["run_dir"], "last"))


def run_killed(how: str, cfg: dict, hook: str, step: int, script: Path) -> tuple[int, str, str]:
    """``how`` (:func:`fit_killed` or :func:`fit_killed_logging`) in a process of its own: its exit status, stdout and
    stderr. Forked from the warm rank server, not a new Python: that one spent seconds importing torch, ampkit and
    TensorBoard. It computes with this process's thread count (the server's ranks run one), as a new Python would."""
    script.write_text(
        f"import torch, test_tensorboard\ntorch.set_num_threads({torch.get_num_threads()})\n"
        f"test_tensorboard.{how}({json.dumps(cfg)!r}, {hook!r}, {step})\n"
    )
    killed = ForkedPython([sys.executable, str(script)], env=child_env(TESTS, TESTS.parent))
    stdout, stderr = killed.communicate(timeout=240)
    return killed.returncode, stdout, stderr


def test_a_run_killed_after_its_checkpoints_shows_every_step_once_as_an_uninterrupted_one(tmp_path):
    """SIGKILLed just after the step-4 checkpoint: the events of steps 1-4 sat in SummaryWriter's buffer (written to
    the file every 120 s) and were lost, and the resume logs only from step 5. Then killed after the step-8 checkpoint
    at the epoch's last batch, once validation had written val/mse at step 8: the resume validates again, and step 8
    showed two values (purge_step hid only steps 9 on). Each killed run's console lines stay in its pipe."""
    settings = {"trainer.max_epochs": 2, "logging.log_every_n_steps": 1, "checkpoint.every_n_steps": 4,
                "logging.console_every_n_steps": 1}  # fmt: skip
    straight = ToyTrainer(toy_cfg(tmp_path / "straight", **settings))
    straight.fit()
    cfg = toy_cfg(tmp_path / "killed", **settings)
    for hook, step in (("on_train_batch_end", 4), ("on_validation_end", 8)):
        returncode, stdout, stderr = run_killed("fit_killed", cfg, hook, step, tmp_path / f"killed_at_{step}.py")
        assert returncode == -signal.SIGKILL, stderr
        assert f"step {step} |" in stdout.splitlines()[-1]
        assert (Path(cfg["run_dir"]) / "version_0" / "checkpoints" / f"step-{step:08d}.pt").exists()  # killed after it
    resumed = ToyTrainer(cfg)
    resumed.fit(resume="last")
    events, reference = _events(resumed), _events(straight)
    for tag in events.Tags()["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: {steps}"
    for tag in ("train/loss", "train/lr/sgd", "val/mse"):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(e.step, e.value) for e in reference.Scalars(tag)]


class LogsInItsOwnHooks(ToyTrainer):
    """Logs in its own batch-end and epoch-end hooks, as Lightning users log a metric computed there."""

    def on_train_batch_end(self, outputs, batch):
        self.log("own/batch_end", float(self.state.global_step))

    def on_train_epoch_end(self):
        self.log("own/epoch_end", float(self.state.epoch))


def fit_killed_logging(cfg_json: str, hook: str, step: int) -> None:
    """As :func:`fit_killed`, with :class:`LogsInItsOwnHooks`."""
    from ampkit.trainer.run_life import resolve_checkpoint

    cfg = json.loads(cfg_json)
    LogsInItsOwnHooks(cfg, callbacks=[_SigkillAfter(hook, step)]).fit(resume=resolve_checkpoint(cfg["run_dir"], "last"))


def test_what_the_trainer_logs_in_its_own_hooks_at_a_checkpoint_s_step_survives_a_kill(tmp_path):
    """The Trainer's own on_train_batch_end and on_train_epoch_end ran after the checkpoint's save: what they logged
    at its step was in no event file and no checkpoint when a kill came after the save, and the resume starts at the
    next step, so the step's value never showed. Killed right after the step-8 save, the epoch's end still to come:
    the resume runs it first, and stamped its values at step 0."""
    settings = {"trainer.max_epochs": 2, "logging.log_every_n_steps": 1, "trainer.progress_bar": False,
                "checkpoint.every_n_steps": 4}  # fmt: skip
    cfg = toy_cfg(tmp_path, **settings)
    returncode, _, stderr = run_killed("fit_killed_logging", cfg, "on_train_batch_end", 8, tmp_path / "killed.py")
    assert returncode == -signal.SIGKILL, stderr
    assert (Path(cfg["run_dir"]) / "version_0" / "checkpoints" / "step-00000008.pt").exists()  # killed after it
    resumed = LogsInItsOwnHooks(cfg)
    resumed.fit(resume="last")
    events = _events(resumed)
    assert [(e.step, e.value) for e in events.Scalars("own/batch_end")] == [(s, float(s)) for s in range(1, 17)]
    assert [(e.step, e.value) for e in events.Scalars("own/epoch_end")] == [(8, 0.0), (16, 1.0)]


def test_a_continued_run_waits_at_most_a_second_for_an_event_file_stamped_ahead(tmp_path, monkeypatch):
    """A continued run starts its event file in a later second than the newest there (TensorBoard reads them in name
    order); one stamped an hour ahead (copied from a machine whose clock runs ahead) made the resume sleep an hour."""
    import ampkit.callbacks.tensorboard as tensorboard

    cfg = toy_cfg(tmp_path, **{"trainer.progress_bar": False, "trainer.max_steps": 2})
    first = ToyTrainer(cfg)
    first.fit()
    ahead = int(time.time()) + 3600
    (first.version_dir / "tensorboard" / f"events.out.tfevents.{ahead}.elsewhere.1.0").write_bytes(b"")
    slept = []
    monkeypatch.setattr(tensorboard.time, "sleep", slept.append)
    ToyTrainer(toy_cfg(tmp_path, **{"trainer.progress_bar": False, "trainer.max_steps": 4})).fit(resume="last")
    assert max(slept, default=0) <= 1


class _DiskFillsAtEpoch1(Callback):
    full = False

    def on_train_epoch_start(self, trainer):
        _DiskFillsAtEpoch1.full = trainer.state.epoch >= 1


@pytest.mark.parametrize("failing", ["write", "flush"])
def test_a_full_disk_under_the_event_files_is_one_line_naming_them_and_the_run_resumes(
    tmp_path, monkeypatch, capfd, failing
):
    """TensorBoard's writer thread hits the full disk and the next write raises a bare OSError (no path), and
    closing the writer raises it again: one error naming the event files, and last.pt resumes. The writer thread
    itself prints no traceback before that line."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    real = getattr(RecordWriter, failing)

    def fails_when_full(self, *args):
        if _DiskFillsAtEpoch1.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args)

    _DiskFillsAtEpoch1.full = False  # as the previous parameter's run left it: full
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    monkeypatch.setattr(RecordWriter, failing, fails_when_full)
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.log_every_n_steps": 1})
    events = tmp_path / "run" / "version_0" / "tensorboard"
    message = f"cannot write TensorBoard events under '{events}' (No space left on device)"
    with pytest.raises(RunDirectoryError, match=re.escape(message)):
        ToyTrainer(cfg, callbacks=[_DiskFillsAtEpoch1()]).fit()
    monkeypatch.undo()
    assert thread_errors == [] and "Traceback" not in capfd.readouterr().err
    last = events.parent / "checkpoints" / "last.pt"
    assert load_checkpoint(last)["loop"]["epoch"] == 1
    resumed = ToyTrainer(cfg)
    resumed.fit(resume="last")
    assert resumed.state.global_step == 16


class _Warmup(ToyTrainer):
    """A per-step warmup: step n trains at lr n/10."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.module.parameters(), lr=1.0)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: (done + 1) / 10)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def test_the_logged_learning_rate_is_the_one_the_step_used(tmp_path):
    """Step-interval schedulers step at the iteration's end, before the logger's batch end: it logged the next
    step's rate (0.2 at step 1)."""
    cfg = toy_cfg(
        tmp_path, **{"trainer.max_steps": 4, "logging.log_every_n_steps": 1, "trainer.accumulate_grad_batches": 2}
    )
    trainer = _Warmup(cfg)
    trainer.fit()
    logged = [(e.step, e.value) for e in _events(trainer).Scalars("train/lr/sgd")]
    assert logged == [(n, pytest.approx(n / 10)) for n in range(1, 5)]


class _FailsAtStep2(Callback):
    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.global_step == 2:
            raise RuntimeError("a callback failed")


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_fit_leaves_the_threads_excepthook_as_it_found_it(tmp_path, monkeypatch, ends):
    """The hook that keeps the writer threads' OSErrors quiet stayed installed after fit(), in place of the caller's."""

    def callers_hook(args):
        raise AssertionError("no thread failed")

    monkeypatch.setattr(threading, "excepthook", callers_hook)
    trainer = ToyTrainer(
        toy_cfg(tmp_path, **{"trainer.max_steps": 4}), callbacks=[_FailsAtStep2()] if ends == "raises" else []
    )
    if ends == "raises":
        with pytest.raises(RuntimeError, match="a callback failed"):
            trainer.fit()
    else:
        trainer.fit()
    assert threading.excepthook is callers_hook
