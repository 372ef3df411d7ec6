"""A Trainer subclass used in odd ways (a second fit, a fit from a hook, a loader used up, a step that returns no loss
or backpropagates itself, callbacks given twice): each is one error naming the mistake, or a run that is right."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset, toy_model

import ampkit
from ampkit.amp import resolve_opt_level
from ampkit.callbacks import (
    DistributedSync,
    EarlyStopping,
    GradientClipping,
    LossScaling,
    MaxTime,
    MixedPrecision,
    ModelCheckpoint,
    ProgressBar,
    TensorBoardLogger,
    Throughput,
)
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


class _Batches:
    """An iterable without a length, of ``n`` toy batches of 8."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        x, y = toy_dataset(8 * self.n).tensors
        for i in range(self.n):
            yield x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]


class _OneShotSampler(torch.utils.data.Sampler):
    """A sampler whose second pass is empty (it hands out one iterator)."""

    def __init__(self, n: int) -> None:
        self.n, self.order = n, iter(range(n))

    def __iter__(self):
        return self.order

    def __len__(self) -> int:
        return self.n


class GeneratorData(ToyTrainer):
    def train_dataloader(self):
        return iter(_Batches(4))


class OneShotSampler(ToyTrainer):
    def train_dataloader(self):
        return DataLoader(toy_dataset(32), batch_size=8, sampler=_OneShotSampler(32))


class EmptyStream(ToyTrainer):
    def train_dataloader(self):
        return _Batches(0)


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        (GeneratorData, r"yielded no batch in epoch 1: a generator or iterator that an earlier epoch used up"),
        (OneShotSampler, r"yielded no batch in epoch 1 \(its len\(\) says 4\): a generator or iterator"),
        (EmptyStream, r"yielded no batch in epoch 0: an iterable that yields nothing"),
    ],
)
def test_an_epoch_whose_loader_yields_nothing_is_an_error_not_a_run_that_trains_nothing(
    tmp_path, trainer_class, message
):
    trainer = trainer_class(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3}))
    with pytest.raises(UserCodeError, match=message):
        trainer.fit()
    assert trainer.state.global_step == (0 if trainer_class is EmptyStream else 4)


def _returning(value):
    class Returns(ToyTrainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            return value(loss)

    return Returns


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda loss: None, r"returned None; .* to skip a batch, set automatic_optimization = False"),
        (lambda loss: {"mse": loss}, r"returned a dict without 'loss' \(keys: 'mse'\)"),
        (
            lambda loss: {"loss": loss.item()},
            r"returned a dict whose 'loss' is float [0-9.]+, a number with no autograd graph",
        ),
        (lambda loss: loss.item(), r"returned float [0-9.]+, a number with no autograd graph \(return the tensor"),
        (lambda loss: (loss, 1), r"returned a tuple; under automatic optimization it returns the loss tensor"),
    ],
)
def test_a_training_step_that_returns_no_loss_tensor_names_what_it_returned(tmp_path, value, message):
    with pytest.raises(UserCodeError, match=f"training_step {message}"):
        _returning(value)(toy_cfg(tmp_path, **QUIET)).fit()


class BackpropagatesItself(ToyTrainer):  # a manual-optimization habit under automatic optimization
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss)
        return loss


class StepsItself(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.step(self.optimizer)
        return loss


@pytest.mark.parametrize(("trainer_class", "method"), [(BackpropagatesItself, "backward"), (StepsItself, "step")])
def test_backward_or_step_inside_an_automatic_training_step_is_refused(tmp_path, trainer_class, method):
    with pytest.raises(UserCodeError, match=rf"training_step called self\.{method}\(\) under automatic optimization"):
        trainer_class(toy_cfg(tmp_path, **QUIET)).fit()


class ComplexMetric(ToyTrainer):
    def validation_step(self, batch):
        return {"mse": super().validation_step(batch)["mse"] * (1 + 1j)}


def test_a_complex_metric_is_named(tmp_path):
    with pytest.raises(
        UserCodeError,
        match=r"metric 'mse' as a torch.complex64 tensor; each metric is a real number \(take \.abs\(\) or \.real\)",
    ):
        ComplexMetric(toy_cfg(tmp_path, **QUIET)).fit()


def test_one_callback_given_twice_is_named_as_one_object(tmp_path):
    callback = ampkit.Callback()
    with pytest.raises(ValueError, match="the same Callback object is given twice"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=[callback, callback]).fit()


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        ({"stop": ampkit.Callback()}, r"Trainer\(callbacks=...\) is a dict \(keys \['stop'\]\)"),
        ("progress", r"Trainer\(callbacks=...\) is the str 'progress'; expected a Callback instance"),
    ],
)
def test_callbacks_given_as_a_dict_or_a_string_are_named_as_such(tmp_path, callbacks, message):
    with pytest.raises(UserCodeError, match=message):
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=callbacks)


class _Breaks(ampkit.Callback):
    """A user callback whose ending hooks raise, and whose ``at`` hook raises ``exception`` at step 3."""

    def __init__(self, at: str | None = None, exception: BaseException | None = None) -> None:
        self.at, self.exception = at, exception

    def on_train_batch_end(self, trainer, outputs, batch):
        if self.at == "on_train_batch_end" and trainer.state.global_step == 3:
            raise self.exception

    def on_exception(self, trainer, exception):
        raise KeyError("a bug in on_exception")

    def on_fit_end(self, trainer):
        raise KeyError("a bug in on_fit_end")


class _Sees(ampkit.Callback):
    phase = ampkit.Phase.OBSERVE  # after _Breaks at every hook

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_exception(self, trainer, exception):
        self.seen.append("on_exception")

    def on_fit_end(self, trainer):
        self.seen.append("on_fit_end")


def test_a_callback_raising_while_an_error_unwinds_leaves_that_error_and_the_other_callbacks_their_hooks(tmp_path):
    sees = _Sees()
    callbacks = [_Breaks("on_train_batch_end", ValueError("the run's own error")), sees]
    with pytest.raises(ValueError, match="the run's own error") as raised:
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=callbacks).fit()
    assert sees.seen == ["on_exception", "on_fit_end"]
    notes = raised.value.__notes__
    assert "_Breaks.on_exception raised KeyError: 'a bug in on_exception' while this error unwound" in notes
    assert "_Breaks.on_fit_end raised KeyError: 'a bug in on_fit_end' while this error unwound" in notes


def test_a_preempted_step_is_saved_though_a_callback_s_on_exception_raises(tmp_path):
    from ampkit.trainer.preemption import Preempted

    with pytest.raises(Preempted):
        ToyTrainer(
            toy_cfg(tmp_path, **QUIET), callbacks=[_Breaks("on_train_batch_end", Preempted("SIGTERM: stopped"))]
        ).fit()
    last = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")
    assert last["loop"]["global_step"] == 3


def test_a_callback_raising_in_on_fit_end_of_a_clean_run_raises_after_the_others_ran(tmp_path):
    sees = _Sees()
    with pytest.raises(KeyError, match="a bug in on_fit_end"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=[_Breaks(), sees]).fit()
    assert sees.seen == ["on_fit_end"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.backward(torch.ones((), requires_grad=True)), r"the hook on_before_backward has no callbacks yet"),
        (lambda t: t.step("sgd"), r"step\(\) was called before fit\(\) made the optimizers"),
    ],
)
def test_backward_or_step_before_fit_says_where_they_run(tmp_path, call, message):
    with pytest.raises(UserCodeError, match=message):
        call(ToyTrainer(toy_cfg(tmp_path, **QUIET)))


class SkipsTrainerInit(ToyTrainer):
    def __init__(self, cfg=None):
        self.lr = self.cfg.lr  # before super().__init__: no config yet
        super().__init__(cfg)


def test_a_subclass_init_that_reads_the_trainer_before_its_init_ran_is_told_to_call_it(tmp_path):
    with pytest.raises(
        AttributeError, match=r"Trainer.__init__ has not run; SkipsTrainerInit.__init__ must call super"
    ):
        SkipsTrainerInit(toy_cfg(tmp_path, **QUIET))


@dataclasses.dataclass(frozen=True)
class _FrozenPair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Holder:
    pair: _FrozenPair
    name: str


def test_a_batch_of_frozen_dataclasses_moves_to_the_device_as_other_batches_do(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    trainer.device, trainer._on_cpu = torch.device("meta"), False  # a device other than the CPU, on any machine
    pair = _FrozenPair(torch.ones(2), torch.zeros(2))
    moved = trainer._to_device({"held": _Holder(pair, "a"), "pairs": [pair]})
    for got in (moved["held"].pair, moved["pairs"][0]):
        assert type(got) is _FrozenPair and got.x.is_meta and got.y.is_meta
    assert moved["held"].name == "a" and not pair.x.is_meta  # the batch the loader gave is left as it was


class IntegerLoss(ToyTrainer):
    def training_step(self, batch):
        return torch.tensor(3)


class LogsUnderANumber(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log(3, loss)
        return loss


class LogsUnderNoName(ToyTrainer):  # TensorBoard took '' as a tag
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("", loss)
        return loss


class ValidatesUnderANumber(ToyTrainer):  # written as 'val/3'; a monitor could not name it
    def validation_step(self, batch):
        return {3: super().validation_step(batch)["mse"]}


class ValidatesUnderNoName(ToyTrainer):  # written as 'val/'
    def validation_step(self, batch):
        return {"": super().validation_step(batch)["mse"]}


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        (IntegerLoss, r"the loss of loss_id 0 is a torch.int64 tensor, which has no gradient; expected a floating"),
        (LogsUnderANumber, r"log\(tag=3\): the tag is int; expected a string such as 'train/acc'"),
        (LogsUnderNoName, r"log\(tag=''\): the tag is empty; expected a string such as 'train/acc'"),
        (ValidatesUnderANumber, r"returned metric 3, a name that is int; each metric is named"),
        (ValidatesUnderNoName, r"validation_step\(batch\) returned metric '', an empty name"),
    ],
)
def test_an_integer_loss_and_a_tag_or_metric_name_that_is_no_string_are_named(tmp_path, trainer_class, message):
    with pytest.raises(UserCodeError, match=message):
        trainer_class(toy_cfg(tmp_path, **QUIET)).fit()


class ValidatesAtEpochEndAndFails(ToyTrainer):
    """A hook of fit runs validate(), whose step raises."""

    def on_train_epoch_end(self):
        self.validate()

    def validation_step(self, batch):
        if self.state.stage == "validate":
            raise ValueError("the nested validation failed")
        return super().validation_step(batch)


def test_an_error_in_validate_from_a_hook_reaches_each_callback_once(tmp_path):
    """The nested validate() fired on_exception, then the fit did again as the error unwound it: a callback that
    saves or reports on failure did so twice."""

    class Counts(ampkit.Callback):
        def __init__(self):
            self.errors = []

        def on_exception(self, trainer, exception):
            self.errors.append(str(exception))

    counts = Counts()
    with pytest.raises(ValueError, match="the nested validation failed"):
        ValidatesAtEpochEndAndFails(toy_cfg(tmp_path, **QUIET), callbacks=[counts]).fit()
    assert counts.errors == ["the nested validation failed"]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: TensorBoardLogger(log_every_n_steps=0),
            "TensorBoardLogger: log_every_n_steps=0: expected an integer >= 1",
        ),
        (lambda: TensorBoardLogger(flush_secs="5"), "TensorBoardLogger: flush_secs must be >= 0, got '5'"),
        (
            lambda: ModelCheckpoint(every_n_steps=2.5),
            r"ModelCheckpoint: every_n_steps=2.5: expected an integer >= 0 \(0: never\)",
        ),
        (lambda: ModelCheckpoint(every_n_epochs="1"), r"ModelCheckpoint: every_n_epochs='1': expected an integer >= 0"),
        (lambda: ModelCheckpoint(keep_last=0), "ModelCheckpoint: keep_last=0: expected an integer >= 1"),
        (lambda: EarlyStopping("val/loss", patience=2.5), "EarlyStopping: patience=2.5: expected an integer >= 1"),
        (lambda: GradientClipping("1.0"), "GradientClipping: max_norm='1.0': expected a number"),
        (lambda: GradientClipping(True), "GradientClipping: max_norm=True: expected a number"),
        (lambda: MaxTime("60"), "MaxTime: max_time_s='60': expected a number"),
        (lambda: MaxTime(True), "MaxTime: max_time_s=True: expected a number"),  # was a limit of 1 second
    ],
    ids=[
        "log every 0",
        "flush a string",
        "every 2.5 steps",
        "every '1' epochs",
        "keep none",
        "patience 2.5",
        "clip a string",
        "clip True",
        "time a string",
        "time True",
    ],  # fmt: skip
)
def test_a_callback_built_by_hand_refuses_a_number_that_is_no_number_naming_it(build, message):
    """Built in Python (the config checks its keys first), these raised ZeroDivisionError at the first step (0),
    Python's comparison TypeError (a string), or took 2.5 and saved or stopped on a schedule no one asked for."""
    with pytest.raises(ValueError, match=message):
        build()


# Each on/off argument of a callback built by hand, as (build, the attribute it sets, its owner and name).
_SWITCHES = [
    (lambda v: EarlyStopping("val/loss", check_finite=v), "check_finite", "EarlyStopping: check_finite"),
    (lambda v: DistributedSync(sync_batchnorm=v), "sync_batchnorm", "DistributedSync: sync_batchnorm"),
    (lambda v: LossScaling(combine_grad=v), "combine_grad", "LossScaling: combine_grad"),
    (lambda v: LossScaling("none", check_nonfinite=v), "check_nonfinite", "LossScaling: check_nonfinite"),
    (lambda v: TensorBoardLogger(log_momentum=v), "log_momentum", "TensorBoardLogger: log_momentum"),
    (lambda v: ProgressBar(bar=v), "bar", "ProgressBar: bar"),
]


@pytest.mark.parametrize(("build", "attribute", "named"), _SWITCHES, ids=[s[2] for s in _SWITCHES])
def test_a_callback_switch_built_by_hand_is_true_or_false(build, attribute, named):
    """Taken as given, "False" (a value read as text) was truthy and switched the feature on: early stopping on a
    NaN, a sync batch norm conversion, flat gradient buffers, momentum logging or a bar no one asked for; 2 and None
    too. The config's schema made them bools; a callback built in Python had no check."""
    for bad in ("False", "no", 2, None, 0.5):
        if bad is None and attribute == "bar":
            continue  # ProgressBar's None: a bar where the console is interactive
        with pytest.raises(ValueError, match=re.escape(f"{named} must be True or False, got {bad!r}")):
            build(bad)
    for good, expected in ((0, False), (1, True), (np.bool_(False), False), (True, True)):
        value = getattr(build(good), attribute)
        assert value is expected


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: ModelCheckpoint(monitor=""), ValueError, "monitor '' is invalid; expected a metric's name"),
        (lambda: ModelCheckpoint(monitor=0), ValueError, "monitor 0 is invalid; expected a metric's name"),
        (lambda: ModelCheckpoint(monitor="val/"), ValueError, "monitor 'val/' is invalid; expected a metric's name"),
        (lambda: EarlyStopping("train/ "), ValueError, "monitor 'train/ ' is invalid; expected a metric's name"),
        (lambda: EarlyStopping(3), ValueError, "monitor 3 is invalid; expected a metric's name"),
        (lambda: ModelCheckpoint(mode="maximum"), ValueError, "mode 'maximum' is invalid; expected one of min, max"),
        (lambda: ModelCheckpoint(save_top_k=True), ValueError, "save_top_k True is invalid; expected an integer >= 1"),
        (lambda: ModelCheckpoint(save_top_k="3", monitor="val/loss"), ValueError, "save_top_k '3' is invalid"),
        (lambda: ModelCheckpoint(save_top_k=2.5, monitor="val/loss"), ValueError, "save_top_k 2.5 is invalid"),
        (lambda: EarlyStopping("val/loss", min_delta="0.1"), ValueError, "min_delta '0.1' is invalid"),
        (lambda: EarlyStopping("val/loss", min_delta=True), ValueError, "min_delta True is invalid"),
        (lambda: EarlyStopping("val/loss", min_delta=float("inf")), ValueError, "expected a finite number >= 0"),
        (lambda: EarlyStopping("val/loss", stopping_threshold="0.1"), ValueError, "stopping_threshold '0.1' is"),
        (lambda: EarlyStopping("val/loss", divergence_threshold=True), ValueError, "divergence_threshold True is"),
        (lambda: DistributedSync(ddp_kwargs=[]), TypeError, "DistributedSync: ddp_kwargs must be a dict"),
        (
            lambda: DistributedSync(ddp_kwargs={"find_unused_parameter": True}),
            ValueError,
            r"ddp_kwargs names \['find_unused_parameter'\], no option of Distributed.*, find_unused_parameters,",
        ),
        (lambda: DistributedSync(ddp_kwargs={"device_ids": [0]}), ValueError, r"names \['device_ids'\]"),
        (lambda: DistributedSync(failure_wait_s="5"), ValueError, "DistributedSync: failure_wait_s='5': expected a"),
        (lambda: DistributedSync(failure_wait_s=-1), ValueError, "failure_wait_s=-1.0: expected a finite number > 0"),
        (lambda: ProgressBar(refresh_s="0.1"), ValueError, "ProgressBar: refresh_s='0.1': expected a finite number"),
        (lambda: ProgressBar(refresh_s=-1), ValueError, "ProgressBar: refresh_s=-1: expected a finite number"),
        (lambda: Throughput(compute_dtype="bf16x"), ValueError, "Throughput: compute_dtype='bf16x': expected None"),
        (lambda: Throughput(compute_dtype=torch.int8), ValueError, "Throughput: compute_dtype=torch.int8: expected"),
        (lambda: Throughput(clock=0.5), TypeError, "Throughput: clock must be a function returning seconds"),
        (lambda: MixedPrecision("O2"), TypeError, "MixedPrecision: properties must be an OptLevelProperties"),
        (
            lambda: MixedPrecision(resolve_opt_level("O2"), cast_modules="generator"),
            TypeError,
            "MixedPrecision: cast_modules must be a list of module names, such as \\['generator'\\], got 'generator'",
        ),
        (lambda: MixedPrecision(resolve_opt_level("O2"), cast_modules=[1]), TypeError, "cast_modules must be a list"),
        (
            lambda: MixedPrecision(resolve_opt_level("O2"), cast_model_outputs=torch.int32),
            ValueError,
            "cast_model_outputs=torch.int32 is no dtype of a model's outputs",
        ),
    ],
    ids=[
        "blank monitor",
        "monitor 0",
        "monitor val/ alone",
        "monitor train/ alone",
        "monitor an int",
        "mode a typo",
        "top-k True",
        "top-k a string",
        "top-k 2.5",
        "min_delta a string",
        "min_delta True",
        "min_delta inf",
        "threshold a string",
        "threshold True",
        "ddp_kwargs a list",
        "ddp_kwargs a typo",
        "ddp_kwargs device_ids",
        "wait a string",
        "wait negative",
        "refresh a string",
        "refresh negative",
        "compute dtype a typo",
        "compute dtype int8",
        "clock a number",
        "properties a string",
        "cast_modules a string",
        "cast_modules ints",
        "outputs int32",
    ],  # fmt: skip
)
def test_a_callback_built_by_hand_refuses_a_value_of_the_wrong_kind_naming_it(build, error, message):
    """The config's schema and rules check these keys; built in Python they were taken as given: a blank or 0 monitor
    ranked nothing, True kept one best file, "bfloat16"'s typo read the fp32 peak (a wrong MFU), a ddp_kwargs typo
    failed at fit start on every rank, "generator" cast the modules g, e, n, ... and a string failed in a comparison
    or math.isfinite naming neither the callback nor the argument."""
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("callback", [ModelCheckpoint, EarlyStopping])
@pytest.mark.parametrize(
    ("monitor", "shown"),
    [
        ("val/a\nb", r"'val/a\\nb'"),
        ("val/\tloss", r"'val/\\tloss'"),
        ("\x1b[0m", r"'\\x1b\[0m'"),
        ("x" * 100_000 + "\n", r"'x{79}\.\.\. \(100004 characters\)"),
    ],
    ids=["newline", "tab", "escape", "100kB"],
)
def test_a_monitor_given_in_code_that_no_tag_can_be_is_refused_at_construction(callback, monitor, shown):
    """A newline or control character is in no tag a run logs: such a monitor was taken and failed only at the first
    validation, repeating a pasted 100 kB value whole."""
    with pytest.raises(ValueError, match=f"monitor {shown} is invalid; expected .*no newline, tab or control") as err:
        callback(monitor=monitor)
    assert len(str(err.value)) < 300


_PASTED = "bfloat16" * 12_500  # 100 kB


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: ModelCheckpoint(save_top_k=_PASTED, monitor="val/loss"), "save_top_k 'bfloat16bfloat16"),
        (lambda: EarlyStopping("val/loss", mode=_PASTED), "mode 'bfloat16bfloat16"),
        (lambda: DistributedSync(grad_sync=_PASTED), "grad_sync must be 'ddp', 'step' or 'fsdp', got 'bfloat16"),
        (lambda: DistributedSync(ddp_kwargs=list(range(20_000))), "got [0, 1, 2, 3, 4, 5,"),
        (lambda: ProgressBar(refresh_s=_PASTED), "ProgressBar: refresh_s='bfloat16bfloat16"),
    ],
    ids=["save_top_k", "mode", "grad_sync", "ddp_kwargs", "refresh_s"],
)
def test_a_long_option_given_to_a_callback_is_named_by_its_start_and_length(build, named):
    """A pasted 100 kB value, or a list of 20000 items, was repeated whole in the error."""
    with pytest.raises((TypeError, ValueError), match=re.escape(named)) as err:
        build()
    assert re.search(r"\.\.\. \(\d+ characters\)", str(err.value)) and len(str(err.value)) < 400


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: Throughput(compute_dtype=_PASTED), "Throughput: compute_dtype='bfloat16bfloat16"),
        (lambda: MixedPrecision(resolve_opt_level("O2"), cast_model_outputs=_PASTED), "cast_model_outputs='bfloat16"),
        (lambda: MixedPrecision(resolve_opt_level("O2"), cast_modules=_PASTED), "got 'bfloat16bfloat16"),
    ],
    ids=["compute_dtype", "cast_model_outputs", "cast_modules"],
)
def test_a_long_dtype_or_module_name_given_to_a_callback_is_named_by_its_start_and_length(build, named):
    """A pasted 100 kB value was repeated whole in the error."""
    with pytest.raises((TypeError, ValueError), match=re.escape(named)) as err:
        build()
    assert "... (100002 characters)" in str(err.value) and len(str(err.value)) < 400


@pytest.mark.parametrize("monitor", ["val/acc@1", "loss/epoch", "val/top-1 acc", "train/loss", "val/précision"])
def test_a_monitor_given_in_code_with_an_odd_but_loggable_name_is_taken(monitor):
    assert str(ModelCheckpoint(monitor=monitor).monitor) == str(EarlyStopping(monitor).monitor) == monitor


def test_a_callback_built_by_hand_takes_what_its_config_key_takes():
    """The checks above refuse no value the config passes, nor the obvious spellings of one."""
    assert ModelCheckpoint(mode="max").monitor is None  # a mode without a monitor: checked, then unused
    assert ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=np.int64(3)).save_top_k == 3
    assert EarlyStopping("val/loss", min_delta=0, stopping_threshold=np.float32(0.5)).monitor.min_delta == 0
    assert DistributedSync(ddp_kwargs={"find_unused_parameters": True}).ddp_kwargs == {"find_unused_parameters": True}
    assert DistributedSync(failure_wait_s=0.5).failure_wait_s == 0.5
    assert ProgressBar(refresh_s=0).refresh_s == 0.0
    assert Throughput(compute_dtype="bfloat16").compute_dtype is torch.bfloat16
    assert Throughput(compute_dtype="fp32").compute_dtype is torch.float32
    cast = MixedPrecision(resolve_opt_level("O2"), cast_modules=("generator",), cast_model_outputs=torch.float64)
    assert (cast.cast_modules, cast.cast_model_outputs) == (("generator",), torch.float64)


class _StepIsNone(ToyTrainer):  # Lightning code disabling a step
    validation_step = None


class _LoaderIsAName(ToyTrainer):
    train_dataloader = "toy"


def _instance_step_none(trainer):
    trainer.training_step = None


def _instance_hook(trainer):
    trainer.on_train_epoch_end = lambda: None


@pytest.mark.parametrize(
    ("trainer_class", "change", "message"),
    [
        (_StepIsNone, None, r"_StepIsNone.validation_step is None, which replaces the method Trainer.validation_step "
                            r"with no function; define it as def validation_step\(self, batch\), or delete"),
        (_LoaderIsAName, None, r"_LoaderIsAName.train_dataloader is 'toy', which replaces the method"),
        (ToyTrainer, _instance_step_none, r"trainer.training_step was set to None on this ToyTrainer, which replaces "
                                          r"its method training_step\(\) with no function; delete the attribute"),
        (ToyTrainer, _instance_hook, r"trainer.on_train_epoch_end was set on this ToyTrainer instance, where the "
                                     r"Trainer never calls it.*Define def on_train_epoch_end\(self, ...\) in Toy"),
    ],
    ids=["step-none", "loader-str", "instance-step-none", "instance-hook"],
)  # fmt: skip
def test_a_method_replaced_by_no_function_or_a_hook_set_on_the_instance_is_named_before_anything_runs(
    tmp_path, trainer_class, change, message
):
    """A step set to None failed inside inspect ('None is not a callable object'); on the instance, at its first
    batch with a TypeError. A hook set on the instance never ran, silently: hooks are read from the class."""
    if change is None:
        with pytest.raises(UserCodeError, match=message):
            trainer_class(toy_cfg(tmp_path, **QUIET))
        return
    trainer = trainer_class(toy_cfg(tmp_path, **QUIET))
    change(trainer)
    for run in (trainer.fit, trainer.validate):
        with pytest.raises(UserCodeError, match=message):
            run()
    assert not (tmp_path / "run").exists()


def test_a_model_set_by_hand_that_configure_model_does_not_return_is_named_not_dropped(tmp_path):
    """trainer.model set by hand was silently dropped by fit() (which builds from configure_model) and by a fresh
    validate(); after a fit, validate(ckpt=...) loaded the checkpoint into trainer.module and evaluated the model set
    by hand. A wrapper of trainer.module evaluates it, and Lightning code's self.model set in __init__ and returned
    by configure_model still trains."""
    trainer = ToyTrainer(toy_cfg(tmp_path / "a", **QUIET, **{"trainer.max_steps": 1}))
    trainer.model = torch.nn.Linear(6, 1)
    for run in (trainer.fit, trainer.validate):
        with pytest.raises(UserCodeError, match=r"trainer.model was set to a Linear which configure_model\(\) did not"):
            run()
    trainer.model = None
    trainer.fit()
    trained = trainer.validate(ckpt="last")
    trainer.model = torch.nn.Sequential(trainer.module)  # a wrapper of the run's module (torch.compile's) runs it
    assert trainer.validate(ckpt="last") == trained
    trainer.module = torch.nn.Linear(6, 1)
    with pytest.raises(UserCodeError, match=r"validate\(\) of ToyTrainer: trainer.module was set to a Linear and"):
        trainer.validate(ckpt="last")

    class SetInInit(ToyTrainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.model = toy_model()

        def configure_model(self):
            return self.model

    own = SetInInit(toy_cfg(tmp_path / "b", **QUIET, **{"trainer.max_steps": 1}))
    first = own.model
    own.fit()
    assert own.module is first and own.state.global_step == 1


def test_a_config_changed_between_runs_is_checked_and_followed(tmp_path):
    """trainer.cfg.trainer.max_steps raised in a notebook between two fits: the loop kept the settings taken at
    construction, so the resume said its checkpoint had reached the old limit while the warnings quoted the new one."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2}))
    trainer.fit()
    trainer.cfg.trainer.accumulate_grad_batches = 0
    with pytest.raises(ampkit.ConfigError, match="trainer.accumulate_grad_batches"):
        trainer.fit(resume="last")
    trainer.cfg.trainer.accumulate_grad_batches = 1
    trainer.cfg.trainer.max_steps = 4
    trainer.fit(resume="last")
    assert trainer.state.global_step == 4


class _BuffersOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(6))

    def forward(self, x):
        return (x @ self.weight)[:, None]


class _FixedTransformTrainer(ToyTrainer):
    def configure_model(self):
        return _BuffersOnly()


def test_a_model_of_buffers_only_is_named_by_fit_and_evaluated_by_validate(tmp_path):
    """fit() failed inside torch ('optimizer got an empty parameter list'), in configure_optimizers."""
    trainer = _FixedTransformTrainer(toy_cfg(tmp_path, **QUIET))
    message = r"returned a _BuffersOnly with no parameters to train \(only buffers: weight\): make trainable tensors"
    with pytest.raises(UserCodeError, match=message):
        trainer.fit()
    assert set(_FixedTransformTrainer(toy_cfg(tmp_path, **QUIET)).validate()) == {"mse"}


class _OptimizersFailOnce(ToyTrainer):
    failed = False

    def configure_optimizers(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("no optimizer yet")
        return super().configure_optimizers()


def test_validate_after_a_fit_that_failed_while_setting_up_evaluates_as_before_any_fit(tmp_path):
    """The failed fit left a model but no callbacks: validate() then failed saying the hook on_exception had no
    callbacks yet, as if called from outside a run."""
    trainer = _OptimizersFailOnce(toy_cfg(tmp_path / "a", **QUIET, **{"trainer.max_steps": 1}))
    with pytest.raises(RuntimeError, match="no optimizer yet"):
        trainer.fit()
    assert trainer.validate() == ToyTrainer(toy_cfg(tmp_path / "b", **QUIET)).validate()
    trainer.fit()
    assert trainer.state.global_step == 1


class _RecordsHooks(ToyTrainer):
    def on_train_start(self):
        self.heard.append("on_train_start")

    def on_fit_end(self):
        self.heard.append("on_fit_end")


@pytest.mark.parametrize("key", ["trainer.max_epochs", "trainer.max_steps"])
def test_a_limit_of_zero_trains_nothing_and_leaves_no_checkpoint_as_in_lightning(tmp_path, key, capsys):
    """Lightning's fit with max_epochs=0 (or max_steps=0) runs no training hook and saves nothing; here it wrote a
    step-0 checkpoint of the untrained model in a new version_N, which a resume then took as the run's end."""
    trainer = _RecordsHooks(toy_cfg(tmp_path, **{key: 0, "trainer.progress_bar": False}))
    trainer.heard = []
    trainer.fit()
    assert trainer.heard == ["on_fit_end"] and trainer.state.global_step == 0
    said = capsys.readouterr()
    assert f"trainer.{key.split('.')[1]}=0 (as in Lightning); nothing was saved" in said.out + said.err
    assert list((tmp_path / "run").iterdir()) == []  # no version_N, no checkpoint
    with pytest.raises(ampkit.CheckpointError, match=r"resume='last': no checkpoint under run_dir"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit(resume="last")
