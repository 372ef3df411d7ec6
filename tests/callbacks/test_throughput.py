"""Throughput figures: FLOPs counted against a hand count, rates from a fake clock, the peak table, the console."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback, Phase
from ampkit.callbacks.fp8 import Float8Telemetry
from ampkit.callbacks.grad_histograms import GradientHistograms
from ampkit.callbacks.nonfinite_guard import NonFiniteGuard
from ampkit.callbacks.progress import ProgressBar, _throughput
from ampkit.callbacks.throughput import (
    PEAK_TFLOPS,
    Throughput,
    count_training_flops,
    matmul_dtype,
    paused,
    peak_tflops,
)


def test_training_flops_of_a_linear_are_six_per_weight_per_sample():
    with torch.device("meta"):
        layer = torch.nn.Linear(48, 24)
        x = torch.zeros(5, 48)
    # forward x @ W^T (2 * 5 * 48 * 24), backward: grad of the weight and of nothing else (x needs no grad)
    assert count_training_flops(lambda: layer(x).sum()) == 2 * 5 * 48 * 24 * 2
    x.requires_grad_()
    assert count_training_flops(lambda: layer(x).sum()) == 6 * 5 * 48 * 24  # and the input's gradient


class ReadsAValue(torch.nn.Module):
    """A forward the meta device cannot run: it reads a value (a mixture-of-experts router's capacity, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * x.abs().sum().item()


def test_a_forward_the_flop_counter_cannot_run_or_a_non_scalar_loss_is_named():
    """torch's own words ("Tensor.item() cannot be called on meta tensors", "grad can be implicitly created only for
    scalar outputs") said neither which call failed nor what to do instead."""
    with torch.device("meta"):
        model, x = ReadsAValue(), torch.zeros(2, 8)
    with pytest.raises(
        RuntimeError,
        match=r"^count_training_flops: forward_loss\(\) failed \(RuntimeError: Tensor"
        r"\.item\(\) cannot be called on meta tensors\)\. On the meta device .* set flops_per_sample",
    ):
        count_training_flops(lambda: model(x).sum())
    for returned, shown in ((lambda: model.layer(x), "a tensor of shape (2, 8)"), (lambda: None, "None"),
                            (lambda: x.sum(), "a loss that needs no gradient")):  # fmt: skip
        with pytest.raises(TypeError, match=re.escape(f"count_training_flops: forward_loss() returned {shown}")):
            count_training_flops(returned)


class FakeClock:
    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 100.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


class Tokens(ToyTrainer):
    tokens_per_sample = 16
    flops_per_sample = 3e9


def test_rates_over_each_window_from_a_fake_clock_and_logged(tmp_path):
    """8 samples a batch, 0.5 s between clock reads (one read per window end): 4 batches a window of 4 steps."""
    clock = FakeClock(step_s=0.5)
    meter = Throughput(every_n_steps=4, peak_tflops=200.0, clock=clock)
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 9, "trainer.progress_bar": False, "trainer.device": "cpu",
                               "logging.throughput": False, "logging.log_every_n_steps": 4})  # fmt: skip
    trainer = Tokens(cfg, callbacks=[meter])
    trainer.fit()
    # iteration 1 starts the clock (t=100.5); iteration 4 reads 101.0: 3 batches x 8 samples in 0.5 s
    # iteration 8 reads 101.5: 4 batches in 0.5 s
    figures = trainer.state.throughput
    assert figures["samples_per_sec"] == pytest.approx(4 * 8 / 0.5)
    assert figures["tokens_per_sec"] == pytest.approx(4 * 8 * 16 / 0.5)
    assert figures["tflops"] == pytest.approx(4 * 8 * 3e9 / 0.5 / 1e12)
    assert figures["mfu"] == pytest.approx(figures["tflops"] / 200.0)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    tokens = [(e.step, e.value) for e in events.Scalars("perf/tokens_per_sec")]
    assert tokens == [(4, pytest.approx(3 * 8 * 16 / 0.5)), (8, pytest.approx(4 * 8 * 16 / 0.5))]
    assert {"perf/samples_per_sec", "perf/tflops", "perf/mfu"} <= set(events.Tags()["scalars"])


def test_each_rank_reports_the_whole_world_s_rates_against_the_whole_world_s_peak():
    """Under torchrun every rank counts its own batches: the figures are all ranks' (this rank's counts x world
    size) and MFU divides by every device's peak, so one rank's share is not reported as the run's."""
    import types

    logged = {}
    state = types.SimpleNamespace(is_iteration_end=True, iteration=0, batch_size=8, batch_tokens=100, throughput={})
    rank = types.SimpleNamespace(tokens_per_sample=16, flops_per_sample=3e9, world_size=2, device=torch.device("cpu"))
    rank.state, rank.log = state, lambda tag, value, always, step: logged.__setitem__(tag, value)
    meter = Throughput(every_n_steps=2, peak_tflops=100.0, clock=FakeClock(step_s=0.5))
    meter.on_train_start(rank)
    for state.iteration in (1, 2):  # the first starts the clock; the second closes a window of one batch in 0.5 s
        meter.on_train_batch_end(rank, {}, None)
    tflops = 2 * 8 * 3e9 / 0.5 / 1e12
    want = {"samples_per_sec": 2 * 8 / 0.5, "tokens_per_sec": 2 * 100 / 0.5, "tflops": tflops, "mfu": tflops / 200}
    assert state.throughput == pytest.approx(want)
    assert logged == pytest.approx({f"perf/{key}": value for key, value in want.items()})


class LogsAnEpochMean(Tokens):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("train/loss_mean", loss.detach(), on_step=False, on_epoch=True)  # weighted by the batch's size
        return loss


def test_a_training_batch_is_sized_once_for_the_empty_check_log_and_samples_per_second(tmp_path, monkeypatch):
    """The Trainer's empty-batch check, ``log``'s epoch weights and samples/s each walked the batch (three walks of
    a nested batch per step); the Trainer now sizes it once and keeps the count in its state."""
    import ampkit.trainer.evaluation as evaluation
    import ampkit.trainer.trainer as trainer_module

    sized = []

    def counting(batch):
        sized.append(batch)
        return evaluation.batch_size(batch)

    monkeypatch.setattr(trainer_module, "batch_size", counting)
    monkeypatch.setattr("ampkit.callbacks.throughput.batch_size", counting, raising=False)
    # No sanity validation: it sizes its own batches.
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 6, "trainer.progress_bar": False, "trainer.device": "cpu",
                               "logging.throughput": False, "trainer.num_sanity_val_steps": 0})  # fmt: skip
    trainer = LogsAnEpochMean(cfg, callbacks=[Throughput(every_n_steps=2, clock=FakeClock(step_s=0.5))])
    trainer.fit()
    assert len(sized) == 6
    assert trainer.state.batch_size == 8 and trainer.state.throughput["samples_per_sec"] == pytest.approx(2 * 8 / 0.5)


class Sampling(Tokens):
    """Generates a sample at iteration 5, taking 100 s of the fake clock, inside ``paused``."""

    clock: FakeClock

    def on_train_batch_end(self, outputs, batch) -> None:
        if self.state.iteration == 5:
            with paused(self):
                self.clock.now += 100.0


def test_work_a_hook_does_inside_paused_is_left_out_of_the_window(tmp_path):
    """Window 5..8: marks at its start (101.0), the pause (101.5 -> 102.0 + 100 s of sampling), its end (202.5):
    4 batches in 1.0 s of training, not in 101.5 s."""
    clock = FakeClock(step_s=0.5)
    meter = Throughput(every_n_steps=4, clock=clock)
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 8, "trainer.progress_bar": False, "trainer.device": "cpu",
                               "logging.throughput": False, "logging.tensorboard": False})  # fmt: skip
    trainer = type("Sampled", (Sampling,), {"clock": clock})(cfg, callbacks=[meter])
    trainer.fit()
    assert trainer.state.throughput["samples_per_sec"] == pytest.approx(4 * 8 / 1.0)
    with paused(ToyTrainer(cfg)):  # a Trainer without the callback: nothing to pause
        pass


def test_without_flops_only_sample_rates_and_on_cpu_no_mfu(tmp_path):
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 8, "trainer.progress_bar": False, "trainer.device": "cpu",
                               "logging.tensorboard": False, "logging.log_every_n_steps": 4})  # fmt: skip
    trainer = ToyTrainer(cfg)
    trainer.fit()
    assert set(trainer.state.throughput) == {"samples_per_sec"}
    assert trainer.state.throughput["samples_per_sec"] > 0
    assert peak_tflops(torch.device("cpu"), "bf16") is None


def test_peak_table_is_dense_and_by_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_tflops(torch.device("cuda", 0), "bf16") == 989.4
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_tflops(torch.device("cuda", 0), "bf16") == 756.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    assert peak_tflops(torch.device("cuda", 0), "bf16") is None
    assert all(row["bf16"] == row["fp16"] and row["tf32"] <= row["bf16"] for row in PEAK_TFLOPS.values())
    assert matmul_dtype(torch.bfloat16) == "bf16" and matmul_dtype(None) == "fp32"


def test_the_console_shows_tokens_tflops_and_mfu():
    shown = _throughput({"samples_per_sec": 10.0, "tokens_per_sec": 12345.0, "tflops": 0.0211, "mfu": 0.4123})
    assert shown == ["tok/s=12.3k", "TFLOP/s=0.0211", "MFU=41.2%"]
    assert _throughput({"samples_per_sec": 250.0}) == ["samples/s=250"]


@pytest.mark.parametrize(("key", "value"), [("logging.peak_tflops", 0), ("logging.peak_tflops", -5)])
def test_bad_peak_is_a_config_error(tmp_path, key, value):
    import ampkit

    with pytest.raises(ampkit.ConfigError, match=f"'{key}'"):
        ToyTrainer(toy_cfg(tmp_path, **{key: value}))


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"peak_tflops": "989"}, "peak_tflops='989': expected a number"),  # was: a TypeError from '>'
        ({"peak_tflops": float("inf")}, "peak_tflops=inf: expected a finite number > 0"),  # was: MFU 0, silently
        ({"peak_tflops": True}, "peak_tflops=True: expected a number"),  # was: a peak of 1 TFLOP/s
        ({"every_n_steps": 2.5}, "every_n_steps=2.5: expected an integer >= 1"),  # was: a window every 5 steps
        ({"every_n_steps": "10"}, "every_n_steps='10': expected an integer >= 1"),
    ],
)
def test_a_peak_or_window_that_is_no_number_is_named_at_construction(kwargs, said):
    with pytest.raises(ValueError, match=re.escape(f"Throughput: {said}")):
        Throughput(**kwargs)
    assert Throughput(every_n_steps=4.0, peak_tflops=torch.tensor(989.0)).peak == 989.0  # whole and scalar: taken


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda n: ProgressBar(every_n_steps=n), "ProgressBar: every_n_steps"),
        (lambda n: GradientHistograms(every_n_steps=n), "GradientHistograms: every_n_steps"),
        (lambda n: Float8Telemetry("tensorwise", every_n_steps=n), "Float8Telemetry: every_n_steps"),
        (lambda n: NonFiniteGuard(check_every_n_steps=n), "NonFiniteGuard: check_every_n_steps"),
    ],
)
def test_every_callbacks_interval_is_one_check(make, named):
    """Each callback compared its interval with < 1 alone: 2.5 ran on every fifth step, True as 1, and "10" failed
    with Python's TypeError."""
    for bad in (2.5, "10", True, 0):
        with pytest.raises(ValueError, match=re.escape(f"{named}={bad!r}: expected an integer >= 1")):
            make(bad)


class LaggingWatch:
    """A stand-in for CUDA events: marks are fake times, and reading a window records which one was read when."""

    lags = True

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.reads = clock, []

    def mark(self) -> float:
        return self.clock()

    def seconds(self, start: float, end: float) -> float:
        self.reads.append(end)
        return end - start


def test_on_a_gpu_each_window_is_read_one_window_late_and_logged_at_its_own_step(tmp_path, monkeypatch):
    """With an asynchronous stopwatch (CUDA events) the window ending at iteration 4 is read at iteration 8, when
    its end has long passed, and logged at step 4; validation inside a window is still taken out."""
    import ampkit.callbacks.throughput as throughput

    clock = FakeClock(step_s=0.5)
    watch = LaggingWatch(clock)
    monkeypatch.setattr(throughput, "stopwatch_for", lambda device, clock: watch)
    meter = Throughput(every_n_steps=4, peak_tflops=200.0)
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 12, "trainer.max_epochs": 2, "trainer.progress_bar": False,
                               "trainer.device": "cpu", "logging.throughput": False, "logging.log_every_n_steps": 4,
                               "trainer.val_every_n_steps": 6})  # fmt: skip
    trainer = Tokens(cfg, callbacks=[meter])
    trainer.fit()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    tokens = [(e.step, e.value) for e in events.Scalars("perf/tokens_per_sec")]
    # marks (8 batches an epoch): start 100.5 (iteration 1), window end 101.0 (iteration 4); validation at 6:
    # 101.5 -> 102.0; window end 102.5 (iteration 8), when 1..4 is read: 3 batches in 0.5 s; at 12 the window 4..8
    # is read: 4 batches in 1.5 s less the 0.5 s validation; the last window (8..12) is never read
    assert tokens == [(4, pytest.approx(3 * 8 * 16 / 0.5)), (8, pytest.approx(4 * 8 * 16 / 1.0))]
    assert watch.reads == [101.0, 102.5, 102.0]  # each window's end (then its pause) only after the next one ended


class TextBatches(ToyTrainer):
    """Batches of strings, parsed in the step: no tensor for the meter to count samples by."""

    def train_dataloader(self):
        return DataLoader([" ".join(map(str, range(i, i + 7))) for i in range(64)], batch_size=8)

    def training_step(self, batch):
        rows = torch.tensor([[float(v) for v in text.split()] for text in batch])
        return F.mse_loss(self.model(rows[:, :6]).squeeze(1), rows[:, 6])


def test_batches_whose_samples_cannot_be_counted_train_and_report_no_rates(tmp_path):
    """A window of uncounted batches is unknown, not 0 samples/s (nor 0 tokens/s, TFLOP/s, MFU)."""
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 8, "trainer.progress_bar": False, "logging.tensorboard": False,
                               "logging.log_every_n_steps": 2})  # fmt: skip
    trainer = TextBatches(cfg)
    with pytest.warns(UserWarning, match=r"Throughput: a training batch \(list\) holds no tensor, so its samples"):
        trainer.fit()
    assert trainer.state.global_step == 8 and trainer.state.throughput == {}


class _TrainsForAQuarterSecond(Callback):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer, batch) -> None:
        self.clock.now += 0.25


def test_checkpoint_saves_are_left_out_of_the_window(tmp_path, monkeypatch):
    """Each batch takes 0.25 s of the fake clock and each save 100 s: window 5..8 holds the saves after steps 4 and
    6, and its rate is 4 batches in 1.0 s of training, not in 201 s."""
    import ampkit.callbacks.checkpoint as checkpoint

    clock, saved_at = FakeClock(step_s=0.0), []
    real_save = checkpoint.save_atomic

    def slow_save(*args, **kwargs):
        clock.now += 100.0
        saved_at.append(trainer.state.global_step)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_atomic", slow_save)
    meter = Throughput(every_n_steps=4, clock=clock)
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 8, "trainer.progress_bar": False, "logging.throughput": False,
                               "logging.tensorboard": False, "checkpoint.every_n_steps": 2})  # fmt: skip
    trainer = ToyTrainer(cfg, callbacks=[meter, _TrainsForAQuarterSecond(clock)])
    trainer.fit()
    assert saved_at[:3] == [2, 4, 6]
    assert trainer.state.throughput["samples_per_sec"] == pytest.approx(4 * 8 / 1.0)


def test_any_callbacks_paused_encloses_each_checkpoint_save(tmp_path):
    """A save is marked as not training through ``trainer.paused()``, which a user's own timer sees as well: the
    checkpoint callback knows no timer (Throughput included)."""
    import contextlib

    events = []

    class Timer(Callback):
        @contextlib.contextmanager
        def paused(self):
            events.append(("pause", sorted(p.name for p in (tmp_path / "run").rglob("step-*.pt"))))
            yield
            events.append(("resume", sorted(p.name for p in (tmp_path / "run").rglob("step-*.pt"))))

    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 2, "trainer.progress_bar": False, "logging.tensorboard": False,
                               "checkpoint.every_n_steps": 2, "run_dir": str(tmp_path / "run")})  # fmt: skip
    ToyTrainer(cfg, callbacks=[Timer()]).fit()
    assert events[:2] == [("pause", []), ("resume", ["step-00000002.pt"])]


class _SlowAtValidationEnd(Callback):
    """A logger's flush at validation's end (100 s of the fake clock), and a hook's own pause inside it (50 s)."""

    phase = Phase.OBSERVE

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_validation_end(self, trainer, metrics) -> None:
        if trainer.state.stage == "fit":
            self.clock.now += 100.0
            with paused(trainer):
                self.clock.now += 50.0


def test_the_work_callbacks_do_at_validation_end_is_left_out_of_the_window_once(tmp_path):
    """Validation at step 6 of the window 5..8: the meter closed its pause at its own on_validation_end, before the
    loggers' (TensorBoard flushes there), so their time counted as training; a pause inside validation's was taken
    out twice. The window is 4 batches in 1.0 s of training."""
    clock = FakeClock(step_s=0.0)
    meter = Throughput(every_n_steps=4, clock=clock)
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 8, "trainer.progress_bar": False, "logging.throughput": False,
                               "logging.tensorboard": False, "trainer.val_every_n_steps": 6})  # fmt: skip
    slow, reports = _SlowAtValidationEnd(clock), _Reports()
    trainer = ToyTrainer(cfg, callbacks=[meter, _TrainsForAQuarterSecond(clock), slow, reports])
    trainer.fit()
    assert trainer.val_metrics_step == 8
    assert reports.rates == [pytest.approx(3 * 8 / 0.75), pytest.approx(4 * 8 / 1.0)]


class _Reports(Callback):
    """Each window's samples/s (None: not reported), taken from ``trainer.state`` at its last iteration."""

    phase = Phase.OBSERVE

    def __init__(self) -> None:
        self.rates: list[float | None] = []

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.iteration % 4 == 0:
            self.rates.append(trainer.state.throughput.get("samples_per_sec"))
            trainer.state.throughput = {}


@pytest.mark.parametrize(
    ("attribute", "value", "error", "named"),
    [
        ("tokens_per_sample", 0, ValueError, "0 is invalid"),  # was: no tokens/s, silently
        ("tokens_per_sample", -16, ValueError, "-16 is invalid"),  # was: negative tokens/s logged
        ("tokens_per_sample", float("nan"), ValueError, "nan is invalid"),
        ("flops_per_sample", float("inf"), ValueError, "inf is invalid"),
        ("flops_per_sample", True, TypeError, "True is a bool"),  # was: counted as 1 FLOP
        ("flops_per_sample", "3e9", TypeError, "'3e9' is a str"),  # was: a TypeError at the first window
        ("tokens_per_sample", torch.tensor(16), TypeError, r"is a Tensor, not a number \(use \.item\(\)\)"),
        ("tokens_per_sample", lambda self: 16, TypeError, r"is a method, not a number \(it is not called: set"),
    ],
)
def test_what_a_sample_is_worth_is_checked_before_training(tmp_path, attribute, value, error, named):
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 4, "trainer.progress_bar": False, "logging.tensorboard": False})
    trainer = type("Worth", (Tokens,), {attribute: value})(cfg)
    with pytest.raises(error, match=rf"Worth\.{attribute}: .*{named}.*expected a finite number > 0 \(.*or None"):
        trainer.fit()
    assert trainer.state.global_step == 0


def test_varying_batch_sizes_and_an_unsized_loader_are_counted_batch_by_batch(tmp_path):
    """Batches of 24, 24, 16 (the epoch's short last one) from a loader without a length: each window's samples are
    the sizes of its batches, whatever a loader or sampler says of them."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from toy_dataset(64)

    class Streamed(Tokens):
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=24)

    clock = FakeClock(step_s=0.5)
    cfg = toy_cfg(tmp_path, **{"trainer.max_steps": 7, "trainer.max_epochs": 3, "trainer.progress_bar": False,
                               "trainer.val_every_n_epochs": 0, "checkpoint.every_n_epochs": 0,
                               "logging.tensorboard": False, "logging.throughput": False})  # fmt: skip
    trainer = Streamed(cfg, callbacks=[Throughput(every_n_steps=3, clock=clock)])
    trainer.fit()
    # epochs of 24, 24, 16; the window 4..6 (one clock read at each end) holds 24 + 24 + 16 samples in 0.5 s
    assert trainer.state.throughput["samples_per_sec"] == pytest.approx(64 / 0.5)
    assert trainer.state.throughput["tokens_per_sec"] == pytest.approx(64 * 16 / 0.5)


class TimeMajor(Tokens):
    """Batches laid out (time, batch, features), as an RNN's: the leading size is the sequence length, not samples."""

    def train_dataloader(self):
        return DataLoader(toy_dataset(64), batch_size=8, shuffle=True, collate_fn=_time_major)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x.mean(0)).squeeze(1), y)

    def samples_in(self, batch):
        return batch[0].size(1)


def _time_major(rows):
    x = torch.stack([r[0] for r in rows])  # (8, 6)
    return x.unsqueeze(0).expand(3, -1, -1).contiguous(), torch.stack([r[1] for r in rows])  # (3, 8, 6)


class PackedTokens(Tokens):
    """Variable-length sequences: each batch's real tokens (here 10 a sample, as if the rest were padding)."""

    def tokens_in(self, batch):
        return int(batch[0].size(0)) * 10


def test_a_trainer_says_the_samples_and_tokens_of_its_batches(tmp_path):
    """samples_in: a time-major batch's samples are its second size (the leading one counted 3, the time steps);
    tokens_in: packed or variable-length sequences count their real tokens, not samples x tokens_per_sample."""
    settings = {"trainer.max_steps": 8, "trainer.progress_bar": False, "trainer.device": "cpu",
                "logging.throughput": False, "logging.tensorboard": False}  # fmt: skip
    figures = {}
    for cls in (TimeMajor, PackedTokens):
        trainer = cls(toy_cfg(tmp_path / cls.__name__, **settings),
                      callbacks=[Throughput(every_n_steps=4, clock=FakeClock(step_s=0.5))])  # fmt: skip
        trainer.fit()
        figures[cls.__name__] = trainer.state.throughput
    assert figures["TimeMajor"]["samples_per_sec"] == pytest.approx(4 * 8 / 0.5)
    assert figures["TimeMajor"]["tokens_per_sec"] == pytest.approx(4 * 8 * 16 / 0.5)
    assert figures["PackedTokens"]["samples_per_sec"] == pytest.approx(4 * 8 / 0.5)
    assert figures["PackedTokens"]["tokens_per_sec"] == pytest.approx(4 * 8 * 10 / 0.5)


@pytest.mark.parametrize(
    ("method", "value", "error", "said"),
    [
        ("samples_in", 8.0, TypeError, "returned 8.0: a float, not an int"),
        ("samples_in", True, TypeError, "returned True: a bool, not an int"),
        ("tokens_in", -3, ValueError, "returned -3: negative"),
        ("tokens_in", torch.tensor(80), TypeError, "returned tensor(80): a Tensor, not an int (count on the host"),
    ],
)
def test_a_count_that_is_no_integer_is_named_before_it_skews_a_figure(tmp_path, method, value, error, said):
    cls = type("Counts", (ToyTrainer,), {method: lambda self, batch: value})
    trainer = cls(toy_cfg(tmp_path, **{"trainer.max_steps": 2, "trainer.progress_bar": False}))
    with pytest.raises(error, match=re.escape(f"Counts.{method}(batch) {said}")):
        trainer.fit()
    assert trainer.state.global_step == 0
