"""``self.log`` keeps the contract Lightning users know: a value logged in a training hook reaches TensorBoard at
the iteration it was logged in, whichever hook logged it (a validation's hooks and the Trainer's own
``on_train_batch_end`` too); ``on_step``/``on_epoch`` together name ``_step``/``_epoch`` tags; numbers and
one-element tensors of any dtype log the same; a NaN is written as it is, neither dropped nor stopping the run; and
an ``on_epoch`` tag belongs to one hook, as Lightning keys each hook's values apart (a second hook logging it is
refused, where one mean would have mixed both).
(``log()`` in ``validation_step``, which returns its metrics instead, is refused with that advice:
test_user_mistakes.py.)"""

from __future__ import annotations

import math
import os
import re
import signal
import warnings
from typing import ClassVar

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from toy_trainers import ManualOptimization, ToyTrainer, toy_cfg

from ampkit import Callback, Preempted
from ampkit.trainer.user_code import UserCodeError

QUIET = {"checkpoint.enabled": False, "trainer.progress_bar": False, "logging.throughput": False,
         "trainer.num_sanity_val_steps": 0}  # fmt: skip


def _fit(tmp_path, trainer_class, **overrides):
    trainer = trainer_class(toy_cfg(tmp_path, **{**QUIET, **overrides}))
    trainer.fit()
    return trainer


def _scalars(trainer, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


class LogsAtBatchEnd(ToyTrainer):
    """Lightning allows self.log in on_train_batch_end; the Trainer's own hook runs after every callback's."""

    def on_train_batch_end(self, outputs, batch):
        self.log("batch_end/index", float(self.state.batch_idx))


def test_a_value_logged_in_the_trainer_s_own_on_train_batch_end_reaches_tensorboard_at_its_step(tmp_path):
    """It runs after the TensorBoard callback had taken the batch's values, which were then cleared: every value was
    dropped. Now it waits for the next take and keeps its own step, the epoch's last one too."""
    trainer = _fit(tmp_path, LogsAtBatchEnd, **{"logging.log_every_n_steps": 2, "trainer.max_epochs": 2})
    assert _scalars(trainer, "batch_end/index") == [(step, float((step - 1) % 8)) for step in range(2, 17, 2)]


class LogsInValidationHooks(ToyTrainer):
    """A validation's own metric computed in on_validation_end, as Lightning's on_validation_epoch_end logs one (there
    its default is on_epoch=True, which a port may keep)."""

    def on_validation_start(self):
        self.log("val_custom/started", 1.0)

    def on_validation_end(self, metrics):
        self.log("val_custom/rmse", math.sqrt(metrics["mse"]))
        self.log("val_custom/twice", 2 * metrics["mse"], on_epoch=True)


@pytest.mark.parametrize("every", [{"trainer.val_every_n_steps": 3, "trainer.val_every_n_epochs": 0}, {}])
def test_a_value_logged_in_a_validation_hook_is_written_at_the_validation_s_step(tmp_path, every):
    """Step-based validation runs inside a training batch: a value its hooks logged was written only if that iteration
    was due to log (every 10th here), so at steps 3, 6, 9, 12, 15 nothing reached TensorBoard. It is written at once,
    as at an epoch's end, beside the val/ metrics of the same validation."""
    trainer = _fit(tmp_path, LogsInValidationHooks, **{"logging.log_every_n_steps": 10, "trainer.max_epochs": 2},
                   **every)  # fmt: skip
    validations = _scalars(trainer, "val/mse")
    assert len(validations) == (5 if every else 2)
    logged = _scalars(trainer, "val_custom/rmse")
    assert [step for step, _ in logged] == [step for step, _ in validations]
    for (_, rmse), (_, mse) in zip(logged, validations, strict=True):
        assert rmse == pytest.approx(math.sqrt(mse), rel=1e-6)
    # on_epoch=True there is the set's value too: written once per validation under its tag, not as _step and _epoch
    # tags of a training epoch's mean; and the HParams tab compares runs by both tags, as by val/mse.
    assert _scalars(trainer, "val_custom/twice") == [(step, pytest.approx(2 * mse)) for step, mse in validations]
    assert _scalars(trainer, "val_custom/twice_step") == _scalars(trainer, "val_custom/twice_epoch") == []
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    experiment = HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/experiment"]).experiment
    assert sorted(m.name.tag for m in experiment.metric_infos) == ["val/mse", "val_custom/rmse", "val_custom/twice"]


class _LogsInValidation(Callback):
    def __init__(self, hook: str, tag: str, **options) -> None:
        self.hook, self.tag, self.options = hook, tag, options

    def on_validation_start(self, trainer):
        if self.hook == "on_validation_start":
            trainer.log(self.tag, 1.0, **self.options)

    def on_validation_batch_end(self, trainer, metrics, batch):
        if self.hook == "on_validation_batch_end":
            trainer.log(self.tag, 1.0, **self.options)

    def on_validation_end(self, trainer, metrics):
        if self.hook == "on_validation_end":
            trainer.log(self.tag, 1.0, **self.options)


@pytest.mark.parametrize(
    ("hook", "tag", "options", "message"),
    [
        ("on_validation_end", "val/mse", {}, "log('val/mse') in on_validation_end: validation_step returns 'mse' "
         "(val/mse, its mean over the set), so one name would hold two values; log this one under a tag of its own"),
        ("on_validation_end", "mse", {}, "log('mse') in on_validation_end: validation_step returns 'mse'"),
        ("on_validation_batch_end", "val/x", {}, "log('val/x') in on_validation_batch_end: each validation "
         "batch's value would be written at one training step, the last batch's left (Lightning averages it over the "
         "set): return it from validation_step (averaged over the set and written as val/<name>), or log the set's "
         "value in on_validation_end"),
        ("on_validation_batch_end", "val/x", {"on_epoch": True}, "log('val/x') in on_validation_batch_end"),
        ("on_validation_start", "val/x", {"on_epoch": True}, "log('val/x', on_epoch=True) in on_validation_start: an "
         "epoch mean logged there would be one of the training epoch's; a value over the evaluated set is one its "
         "step returns (averaged over the set) or one on_validation_end logs"),
    ],
)  # fmt: skip
def test_a_validation_value_that_would_mix_with_another_is_refused_naming_the_hook(tmp_path, hook, tag, options,
                                                                                   message):  # fmt: skip
    """A tag the step returns too would hold two values in what validate() returns and in TensorBoard. Logged per
    validation batch, each batch's value overwrote the last at one training step (Lightning's default there is the
    set's mean), and an on_epoch mean joined the training epoch's sums, written at its end as a training value."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=[_LogsInValidation(hook, tag, **options)])
    with pytest.raises(UserCodeError, match=re.escape(message)):
        trainer.validate()


def test_a_value_logged_by_the_sanity_validation_or_a_validate_before_the_fit_is_not_written(tmp_path):
    """Both were written at step 0 (a validate()'s by the next fit's logger): the sanity pass's value of a few batches
    of an untrained model beside the fit's own, which Lightning keeps from its loggers, as ampkit keeps its val/.
    Whichever hook logged it: on_validation_start's too."""
    trainer = LogsInValidationHooks(toy_cfg(tmp_path, **{**QUIET, "trainer.num_sanity_val_steps": 2}))
    assert "val_custom/rmse" in trainer.validate()
    trainer.fit()
    validations = [step for step, _ in _scalars(trainer, "val/mse")]
    assert [step for step, _ in _scalars(trainer, "val_custom/rmse")] == validations == [8]
    assert [step for step, _ in _scalars(trainer, "val_custom/started")] == validations


class LogsEveryKind(ToyTrainer):
    """The same number logged as a float, an int, and tensors of three dtypes, with on_step and on_epoch."""

    def training_step(self, batch):
        value = float(self.state.batch_idx)
        self.log("kind/float", value, on_epoch=True)
        self.log("kind/int", int(value), on_epoch=True)
        self.log("kind/float16", torch.tensor(value, dtype=torch.float16), on_epoch=True)
        self.log("kind/float64", torch.tensor([value], dtype=torch.float64), on_epoch=True)
        self.log("kind/grad", torch.tensor(value, requires_grad=True) * 1, on_epoch=True)
        return super().training_step(batch)


def test_numbers_and_one_element_tensors_of_any_dtype_log_the_same_values_under_step_and_epoch_tags(tmp_path):
    """20 samples in batches of 8, 8, 4: each epoch mean is the batch index weighted by batch size, (0*8 + 1*8 +
    2*4) / 20 = 0.8, and each step value the batch's own."""
    trainer = _fit(tmp_path, LogsEveryKind, **{"data.n": 20, "logging.log_every_n_steps": 1})
    kinds = ["float", "int", "float16", "float64", "grad"]
    assert trainer.epoch_scalars == {f"kind/{kind}_epoch": pytest.approx(0.8) for kind in kinds}
    assert all(type(value) is float for value in trainer.epoch_scalars.values())
    for kind in kinds:
        assert _scalars(trainer, f"kind/{kind}_step") == [(1, 0.0), (2, 1.0), (3, 2.0)], kind
        assert _scalars(trainer, f"kind/{kind}_epoch") == [(3, pytest.approx(0.8))], kind
        assert _scalars(trainer, f"kind/{kind}") == [], kind  # with both, only the suffixed tags


class LogsANaN(ToyTrainer):
    def training_step(self, batch):
        self.log("maybe_nan", math.nan if self.state.batch_idx == 1 else 1.0, on_epoch=True)
        return super().training_step(batch)


def test_a_nan_is_written_as_it_is_and_makes_its_epoch_mean_nan_without_stopping_the_run(tmp_path):
    trainer = _fit(tmp_path, LogsANaN, **{"logging.log_every_n_steps": 1, "trainer.max_epochs": 2})
    assert trainer.state.global_step == 16
    steps = _scalars(trainer, "maybe_nan_step")
    assert [step for step, _ in steps] == list(range(1, 17))
    assert [step for step, value in steps if math.isnan(value)] == [2, 10]
    epoch_means = _scalars(trainer, "maybe_nan_epoch")
    assert [(step, math.isnan(value)) for step, value in epoch_means] == [(8, True), (16, True)]


class LogsBatchMse(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("train/mse", loss, on_epoch=True)
        return loss


class AlsoAtBatchEnd(LogsBatchMse):
    def on_train_batch_end(self, outputs, batch):
        self.log("train/mse", 2.0 * outputs["loss"], on_epoch=True)


class AlsoAtEpochEnd(LogsBatchMse):
    def on_train_epoch_end(self):
        self.log("train/mse", 0.0, on_epoch=True)


class AlsoBeforeTheStep(Callback):
    def on_before_optimizer_step(self, trainer, optimizer):
        trainer.log("train/mse", float(trainer.grad_norm(optimizer)), on_epoch=True)


@pytest.mark.parametrize(
    ("trainer_class", "callbacks", "second"),
    [
        (AlsoAtBatchEnd, [], "on_train_batch_end"),
        (AlsoAtEpochEnd, [], "on_train_epoch_end"),
        (LogsBatchMse, [AlsoBeforeTheStep()], "on_before_optimizer_step"),
    ],
)
def test_an_epoch_tag_logged_from_a_second_hook_is_refused_naming_both_hooks(tmp_path, trainer_class, callbacks,
                                                                            second):  # fmt: skip
    """Lightning keeps each hook's values of a tag apart (and writes one hook's epoch mean); here both went into one
    mean, the per-batch loss averaged with a gradient norm or with an epoch-end value weighing as one batch: a number
    that was neither hook's."""
    trainer = trainer_class(toy_cfg(tmp_path, **QUIET), callbacks=callbacks)
    message = f"log('train/mse', on_epoch=True) in {second}: 'train/mse' has an epoch mean logged in training_step"
    with pytest.raises(UserCodeError, match=re.escape(message)):
        trainer.fit()


def test_a_resume_refuses_the_second_hook_s_epoch_tag_as_the_run_before_it_did(tmp_path):
    """Which hook logs a tag was not in the checkpoint: resumed at the epoch's last batch (saved before the epoch's
    end), on_train_epoch_end claimed the tag first, and the run wrote what the uninterrupted one refused."""
    saves = {**QUIET, "checkpoint.enabled": True, "checkpoint.every_n_steps": 8}
    with pytest.raises(UserCodeError, match="on_train_epoch_end: 'train/mse' has an epoch mean logged in"):
        AlsoAtEpochEnd(toy_cfg(tmp_path, **saves)).fit()
    step_8 = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000008.pt"
    with pytest.raises(UserCodeError, match="on_train_epoch_end: 'train/mse' has an epoch mean logged in"):
        AlsoAtEpochEnd(toy_cfg(tmp_path, **saves)).fit(resume=step_8)


class ManualLogsAroundItsStep(ManualOptimization, ToyTrainer):
    """Logs one tag before its backward and after its step: both in training_step, whatever hooks ran between."""

    def training_step(self, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x).squeeze(1), y)
        self.log("manual/x", 1.0, on_epoch=True, on_step=False)
        self.backward(loss)
        self.step(self.optimizer)
        self.log("manual/x", 3.0, on_epoch=True, on_step=False)


class LogsAtBatchEndToo(Callback):
    def on_train_batch_end(self, trainer, outputs, batch):
        trainer.log("batch_end/x", 1.0, on_epoch=True, on_step=False)


class OwnBatchEndLogs(ManualLogsAroundItsStep):
    def on_train_batch_end(self, outputs, batch):
        self.log("batch_end/x", 3.0, on_epoch=True, on_step=False)


def test_one_hook_may_log_an_epoch_tag_many_times_and_a_callback_shares_its_hook_with_the_trainer(tmp_path):
    """As Lightning's key is the hook's name: training_step's values around its own backward and step (hooks ran in
    between) make one mean, and so do a callback's and the Trainer's own on_train_batch_end."""
    trainer = OwnBatchEndLogs(toy_cfg(tmp_path, **QUIET), callbacks=[LogsAtBatchEndToo()])
    trainer.fit()
    assert trainer.epoch_scalars == {"manual/x": 2.0, "batch_end/x": 2.0}


class LogsAtEpochEnd(ToyTrainer):
    """Lightning's on_train_epoch_end logs an epoch's metric with on_epoch=True (its default there)."""

    def on_train_epoch_end(self):
        self.log("epoch_end/x", 10.0 * (self.state.epoch + 1), on_epoch=True, on_step=False)


class LogsAtEpochEndInACallback(Callback):
    def on_train_epoch_end(self, trainer):
        trainer.log("epoch_end/x", 10.0 * (trainer.state.epoch + 1), on_epoch=True, on_step=False)


@pytest.mark.parametrize("where", ["trainer", "callback"])
def test_an_epoch_value_logged_in_on_train_epoch_end_is_written_once_at_that_epoch_s_end(tmp_path, where):
    """The epoch's means were taken before the hook ran: its value went into the next epoch's sums, written an epoch
    late as that epoch's mean (10 at step 16), and the last epoch's never. A callback's hook runs before the
    TensorBoard callback's, the Trainer's own after it: each value is written once either way."""
    if where == "trainer":
        trainer = _fit(tmp_path, LogsAtEpochEnd, **{"trainer.max_epochs": 3})
    else:
        trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3}),
                             callbacks=[LogsAtEpochEndInACallback()])  # fmt: skip
        trainer.fit()
    assert _scalars(trainer, "epoch_end/x") == [(8, 10.0), (16, 20.0), (24, 30.0)]


class _Accuracy:
    """Stands for a torchmetrics Metric, which a Lightning port logs as an object (its log() computes it)."""

    def compute(self) -> float:
        return 0.5


class LogsATensor(ToyTrainer):
    value: torch.Tensor | str = torch.zeros(2, 3)

    def training_step(self, batch):
        self.log("train/acc", self.value)
        return super().training_step(batch)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(2, 3), "log('train/acc'): expected a scalar, got a tensor of shape (2, 3); log one number"),
        ("0.5", "log('train/acc'): expected a number or a one-element tensor, got str"),
        (_Accuracy(), "got _Accuracy; for a metric object, log its value (metric(preds, target) per step, or "
                      "metric.compute() in on_train_epoch_end, then metric.reset())"),
    ],
)  # fmt: skip
def test_a_value_that_is_no_scalar_is_a_user_error_naming_the_tag_and_its_shape(tmp_path, value, message):
    """A user error, which the CLI prints as one line: it was a bare ValueError (TypeError), a traceback."""
    LogsATensor.value = value
    with pytest.raises(UserCodeError, match=re.escape(message)):
        _fit(tmp_path, LogsATensor)


class LogsNeitherPerStepNorPerEpoch(ToyTrainer):
    def training_step(self, batch):
        self.log("train/acc", 0.5, on_step=False)  # on_epoch stays False: nothing would be written
        return super().training_step(batch)


def test_a_value_logged_neither_per_step_nor_per_epoch_is_refused_as_lightning_refuses_it(tmp_path):
    """It was dropped without a word: no tag, no epoch mean, nothing a monitor could read."""
    message = "log('train/acc', on_step=False, on_epoch=False) writes nothing; give on_step=True"
    with pytest.raises(UserCodeError, match=re.escape(message)):
        _fit(tmp_path, LogsNeitherPerStepNorPerEpoch)


class LogsItsOwnStepLoss(ToyTrainer):
    """Logs 'train/loss' itself, per step (a Lightning port's self.log('train/loss', loss)), as 100 x the step."""

    def training_step(self, batch):
        self.log("train/loss", 100.0 * self.state.iteration)
        return super().training_step(batch)


def test_a_train_loss_logged_per_step_is_written_as_logged_not_replaced_by_the_returned_loss_s_mean(tmp_path):
    """TensorBoard writes the returned loss under train/loss itself (the mean since the last log step); a tag the code
    logs is its author's curve, as Lightning writes only what log() gets: the returned loss's mean overwrote it at every
    log step."""
    trainer = _fit(tmp_path, LogsItsOwnStepLoss, **{"logging.log_every_n_steps": 4, "trainer.max_epochs": 2})
    assert _scalars(trainer, "train/loss") == [(4, 400.0), (8, 800.0), (12, 1200.0), (16, 1600.0)]


class LogsTheStep(ToyTrainer):
    def training_step(self, batch):
        self.log("step/x", 10.0 * self.state.iteration)
        return super().training_step(batch)


class EndsAtStep5(Callback):
    """Stops the run at step 5 as ``how`` says: early stopping's flag, or a SIGTERM (a preemption)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.global_step == 5 and self.how == "should_stop":
            trainer.state.should_stop = True
        elif trainer.state.global_step == 5 and self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("how", ["max_steps", "should_stop", "sigterm"])
def test_a_run_ending_off_the_log_interval_writes_its_last_step_s_logged_values(tmp_path, how):
    """Step 5 of log_every_n_steps=4 ends the run: its log() values were dropped, while the returned loss got a point
    there (the batches since the last log step). Lightning logs at a stop's step too. A SIGTERM's step is no end: the
    resumed run logs as one never stopped, so neither gets a point at 5 (the loss's batches wait in the checkpoint)."""
    trainer = LogsTheStep(toy_cfg(tmp_path, **QUIET, **{"logging.log_every_n_steps": 4, "trainer.max_epochs": 2,
                                                        "trainer.max_steps": 5 if how == "max_steps" else -1}),
                          callbacks=[EndsAtStep5(how)])  # fmt: skip
    if how == "sigterm":
        with pytest.raises(Preempted):
            trainer.fit()
    else:
        trainer.fit()
    steps = [4] if how == "sigterm" else [4, 5]
    assert _scalars(trainer, "step/x") == [(step, 10.0 * step) for step in steps]
    assert [step for step, _ in _scalars(trainer, "train/loss")] == steps


class LogsOneTagTwoWays(ToyTrainer):
    """Logs 'acc' per step in training_step, and its epoch mean (or an epoch value) under the same tag in ``where``."""

    where = "training_step"

    def training_step(self, batch):
        self.log("acc", 0.5)
        if self.where == "training_step":
            self.log("acc", 0.5, on_step=False, on_epoch=True)
        return super().training_step(batch)

    def on_train_batch_end(self, outputs, batch):
        if self.where == "on_train_batch_end":
            self.log("acc", 0.7, on_step=False, on_epoch=True)

    def on_train_epoch_end(self):
        if self.where == "on_train_epoch_end":
            self.log("acc", 0.9)  # Lightning's default there is on_epoch=True: the epoch's value


def test_one_tag_logged_per_step_and_as_an_epoch_mean_in_one_hook_is_refused_naming_it(tmp_path):
    """Both reached one TensorBoard curve: eight per-step points and, at step 8, the epoch's mean among them, each
    read as the other. Lightning refuses the pair in one hook ('twice ... with different arguments')."""
    message = ("log() in training_step writes epoch means under 'acc', which gets per-step values logged in "
               "training_step: one curve of both is neither")  # fmt: skip
    with pytest.raises(UserCodeError, match=re.escape(message)):
        _fit(tmp_path, type("Logs", (LogsOneTagTwoWays,), {"where": "training_step"}))


class LogsALongTagTwoWays(ToyTrainer):
    def training_step(self, batch):
        self.log("a" * 10_000, 0.5)
        self.log("a" * 10_000, 0.5, on_step=False, on_epoch=True)
        return super().training_step(batch)


def test_one_long_tag_logged_two_ways_is_named_by_its_start_and_length(tmp_path):
    with pytest.raises(UserCodeError, match=r"writes epoch means under 'aaa.*\(10002 characters\), which") as caught:
        _fit(tmp_path, LogsALongTagTwoWays)
    assert len(str(caught.value)) < 600


@pytest.mark.parametrize("where", ["on_train_batch_end", "on_train_epoch_end"])
def test_one_tag_logged_per_step_and_as_an_epoch_mean_in_two_hooks_is_said_once(tmp_path, where):
    """Across hooks Lightning writes both into the one curve without a word; here the run goes on as there, and one
    warning names the tag and both hooks (not one per batch)."""
    message = (f"log() in {where} writes epoch means under 'acc', which gets per-step values logged in "
               "training_step: one curve of both is neither")  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        trainer = _fit(tmp_path, type("Logs", (LogsOneTagTwoWays,), {"where": where}))
    assert [str(w.message) for w in caught if "one curve of both" in str(w.message)] == [message + _TAG_ADVICE]
    assert trainer.state.global_step > 0


_TAG_ADVICE = (
    "; log one of them under a tag of its own (on_step and on_epoch together write <tag>_step and <tag>_epoch)"
)


class LogsWithOptions(ToyTrainer):
    options: ClassVar[dict] = {}

    def training_step(self, batch):
        self.log("train/acc", 0.25, **self.options)
        return super().training_step(batch)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_epoch": "False"}, "log('train/acc', on_epoch='False'): expected True or False or None (the hook's"),
        ({"on_step": 2}, "log('train/acc', on_step=2): expected True or False or None"),
        ({"always": "yes"}, "log('train/acc', always='yes'): expected True or False"),
        ({"step": "5"}, "log('train/acc', step='5'): expected None (this iteration) or an integer >= 0"),
        ({"step": -1}, "log('train/acc', step=-1): expected None"),
    ],
)
def test_an_option_that_is_no_switch_or_step_is_refused_naming_it(tmp_path, options, message):
    """on_epoch='False' (a value read from a config as text) was truthy: the tag was silently split into
    train/acc_step and train/acc_epoch."""
    with pytest.raises(UserCodeError, match=re.escape(message)):
        _fit(tmp_path, type("Logs", (LogsWithOptions,), {"options": options}))


class LogsTag(LogsWithOptions):
    tag: ClassVar[str] = "train/acc"

    def training_step(self, batch):
        self.log(self.tag, 0.25, **self.options)
        return super().training_step(batch)


@pytest.mark.parametrize(
    ("tag", "named"),
    [("train/acc\n", r"log(tag='train/acc\n')"), ("train/\tacc", r"log(tag='train/\tacc')"),
     ("val/\x1b[2J", r"log(tag='val/\x1b[2J')"), ("train/" + "a" * 5000 + "\n", "... (5010 characters)")],
)  # fmt: skip
def test_a_tag_holding_a_newline_tab_or_control_character_is_refused_at_the_log_call_naming_it(tmp_path, tag, named):
    """A monitor holding one is refused when it is built; log() wrote such a tag to TensorBoard and the console, where
    no monitor can name it and a newline splits the console's line."""
    with pytest.raises(UserCodeError, match=re.escape(named) + ".*no newline, tab or control character"):
        _fit(tmp_path, type("Logs", (LogsTag,), {"tag": tag}))


def test_a_long_tag_is_named_by_its_start_and_length_in_log_s_errors(tmp_path):
    tag = "train/" + "a" * 10_000
    with pytest.raises(UserCodeError, match=r"\.\.\. \(10008 characters\), on_step=2\): expected True") as caught:
        _fit(tmp_path, type("Logs", (LogsTag,), {"tag": tag, "options": {"on_step": 2}}))
    assert len(str(caught.value)) < 400


def test_none_for_on_step_and_on_epoch_is_the_hook_s_default_as_in_lightning(tmp_path):
    """A port passing Lightning's None ("the hook's default") got 'writes nothing': both were falsy."""
    trainer = _fit(tmp_path, type("Logs", (LogsWithOptions,), {"options": {"on_step": None, "on_epoch": None}}),
                   **{"logging.log_every_n_steps": 4})  # fmt: skip
    assert _scalars(trainer, "train/acc") == [(4, 0.25), (8, 0.25)]


class LogsOneTagTwiceInAStep(ToyTrainer):
    """Logs 'x' in training_step, then again in its own on_train_batch_end, which runs after TensorBoard's."""

    def training_step(self, batch):
        self.log("x", 1.5)
        return super().training_step(batch)

    def on_train_batch_end(self, outputs, batch):
        self.log("x", 2.0)


@pytest.mark.parametrize("every", [{}, {"trainer.val_every_n_steps": 4, "trainer.val_every_n_epochs": 0}])
def test_a_tag_logged_twice_in_a_step_is_one_point_the_last_value_also_where_validation_or_an_epoch_ends(
    tmp_path, every
):
    """As Lightning writes a step's last value. At a step whose validation or epoch end wrote the queue, the first
    value was written there and the second at the next write: two points at one step, the stale one first."""
    trainer = _fit(tmp_path, LogsOneTagTwiceInAStep, **{"logging.log_every_n_steps": 1, "trainer.max_epochs": 2},
                   **every)  # fmt: skip
    assert _scalars(trainer, "x") == [(step, 2.0) for step in range(1, 17)]


@pytest.mark.parametrize("every", [1, 3])
def test_a_tag_logged_twice_in_a_step_is_one_point_also_where_the_timed_flush_falls_on_that_step(
    tmp_path, monkeypatch, every
):
    """The timed flush (every flush_secs; 0 here: every log step) wrote the queue at the batch's end, before the
    Trainer's own on_train_batch_end logged the tag again: two points at that step, the stale one first."""
    from ampkit.callbacks import tensorboard

    init = tensorboard.TensorBoardLogger.__init__
    monkeypatch.setattr(tensorboard.TensorBoardLogger, "__init__",
                        lambda self, *args, **kwargs: init(self, *args, **{**kwargs, "flush_secs": 0.0}))  # fmt: skip
    trainer = _fit(tmp_path, LogsOneTagTwiceInAStep, **{"logging.log_every_n_steps": every, "trainer.max_epochs": 2})
    steps = [*range(every, 17, every), *([16] if 16 % every else [])]  # and the run's last
    assert _scalars(trainer, "x") == [(step, 2.0) for step in steps]


class LogsPerStepThenAsAnEpochMean(ToyTrainer):
    """Logs 'acc' per step in its first epoch, then as an epoch mean in the same hook."""

    def training_step(self, batch):
        self.log("acc", 0.5, on_step=self.state.epoch == 0, on_epoch=self.state.epoch > 0)
        return super().training_step(batch)


def test_a_resume_refuses_one_tag_s_per_step_values_and_epoch_means_as_the_run_before_it_did(tmp_path):
    """Which kind of value a tag got first was not in the checkpoint: resumed at the first epoch's last batch, the
    run took the second epoch's means under a tag of per-step values, which the uninterrupted run refused."""
    saves = {**QUIET, "checkpoint.enabled": True, "checkpoint.every_n_steps": 8, "trainer.max_epochs": 2}
    message = (
        "log() in training_step writes epoch means under 'acc', which gets per-step values logged in training_step"
    )
    with pytest.raises(UserCodeError, match=re.escape(message)):
        LogsPerStepThenAsAnEpochMean(toy_cfg(tmp_path, **saves)).fit()
    step_8 = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000008.pt"
    with pytest.raises(UserCodeError, match=re.escape(message)):
        LogsPerStepThenAsAnEpochMean(toy_cfg(tmp_path, **saves)).fit(resume=step_8)
    checkpoint = torch.load(step_8, weights_only=True)  # one of an older ampkit, without the record, still loads
    del checkpoint["curve_kind"], checkpoint["curve_mix_said"]
    torch.save(checkpoint, step_8)
    trainer = LogsPerStepThenAsAnEpochMean(toy_cfg(tmp_path, **saves))
    trainer.fit(resume=step_8)
    assert trainer.state.global_step == 16


def test_a_mix_of_one_tag_across_two_hooks_is_said_once_in_a_run_also_across_a_resume(tmp_path):
    """Resumed at the second epoch's last batch, the run said it again, with the hooks the other way round."""
    saves = {
        **QUIET,
        "checkpoint.enabled": True,
        "checkpoint.every_n_steps": 8,
        "trainer.max_epochs": 3,
        "checkpoint.keep_last": 9,
    }
    trainer_class = type("Logs", (LogsOneTagTwoWays,), {"where": "on_train_epoch_end"})
    with pytest.warns(UserWarning, match="one curve of both"):
        trainer_class(toy_cfg(tmp_path, **saves)).fit(resume=None)
    step_16 = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000016.pt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_class(toy_cfg(tmp_path, **saves)).fit(resume=step_16)
    assert [str(w.message) for w in caught if "one curve of both" in str(w.message)] == []


class WritesTextThenLogsTheTagAgain(LogsOneTagTwiceInAStep):
    """Its own on_train_batch_end writes a note through self.logger (as the GAN example writes its samples), which
    writes the queued scalars first, then logs 'x' again."""

    def on_train_batch_end(self, outputs, batch):
        self.logger.log_text("note", "sampled")
        super().on_train_batch_end(outputs, batch)


def test_a_tag_logged_twice_in_a_step_is_one_point_also_where_an_image_or_text_is_written_between(tmp_path):
    """Writing an image, histogram or text wrote every queued scalar, this step's first value too, before the Trainer's
    own on_train_batch_end logged the tag again: two points at each step."""
    trainer = _fit(tmp_path, WritesTextThenLogsTheTagAgain, **{"logging.log_every_n_steps": 1, "trainer.max_epochs": 2})
    assert _scalars(trainer, "x") == [(step, 2.0) for step in range(1, 17)]
