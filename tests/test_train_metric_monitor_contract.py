"""Monitoring a training value keeps the contract Lightning users know from ``check_on_train_epoch_end`` and
``save_on_train_epoch_end``: a ``train/`` tag logged with ``on_epoch=True`` ranks best-k checkpoints, counts early
stopping's patience and steps a ReduceLROnPlateau at each epoch's end, with no validation at all or validation less
often than that, by the whole epoch's mean also across a resume; a NaN epoch never ranks and stops the run; step
checkpoints between measurements are never ranked by an older value; a tag never logged, a validation metric in a run
that never validates and a train/ monitor over an endless stream are named instead of a run that silently ranks and
stops nothing."""

from __future__ import annotations

import math
import re
import warnings
from typing import ClassVar

import pytest
import torch
from best_checkpoints import best_pt_step, best_steps
from toy_trainers import ToyTrainer, toy_cfg

import ampkit
from ampkit import ConfigError
from ampkit.callbacks import EarlyStopping, ModelCheckpoint
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.optimizers import MonitorNotFoundError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
         "data.n": 16, "checkpoint.every_n_epochs": 0}  # fmt: skip
# data.n 16 in batches of 8: two batches (iterations) per epoch, so epoch e ends at step 2 * (e + 1).


class EpochScores(ToyTrainer):
    """No validation; each training batch logs ``scores[epoch]``, so the epoch mean of ``train/score`` is it."""

    scores: ClassVar[list[float]] = []
    on_step = False
    val_dataloader = ampkit.Trainer.val_dataloader

    def training_step(self, batch):
        self.log("train/score", self.scores[self.state.epoch], on_step=self.on_step, on_epoch=True)
        return super().training_step(batch)


class ValidatedEpochScores(EpochScores):
    val_dataloader = ToyTrainer.val_dataloader


def _fit(tmp_path, scores, *, trainer=EpochScores, callbacks=(), **overrides):
    trainer = type("Scripted", (trainer,), {"scores": scores})
    run = trainer(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": len(scores), **overrides}), callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short run's settings are named; these tests mean them
        run.fit()
    return run


@pytest.mark.parametrize(
    ("mode", "top_k", "kept", "best"),
    [("min", 1, [6], 6), ("min", 2, [2, 6], 6), ("max", 1, [4], 4), ("min", -1, [2, 4, 6, 8], 6)],
)
def test_a_train_epoch_mean_ranks_each_epoch_s_end_without_any_validation(tmp_path, mode, top_k, kept, best):
    """Epochs end at steps 2, 4, 6, 8 with means 0.5, 0.9, 0.1, 0.7: the k best of them are kept by mode, and
    best.pt is a copy of the best epoch's end (Lightning saves on train epoch end when nothing validates)."""
    run = _fit(tmp_path, [0.5, 0.9, 0.1, 0.7], **{"checkpoint.monitor": "train/score", "checkpoint.mode": mode,
                                                   "checkpoint.save_top_k": top_k})  # fmt: skip
    assert best_steps(run) == kept
    assert best_pt_step(run) == best


def test_a_tag_logged_on_step_too_is_monitored_by_its_name_as_its_epoch_mean(tmp_path):
    """log(on_step=True, on_epoch=True) writes train/score_step and train/score_epoch; monitoring 'train/score' reads
    the epoch mean, as Lightning's callback metrics hold the epoch value under the plain name at the epoch's end."""
    trainer = type("OnStepToo", (EpochScores,), {"on_step": True})
    run = _fit(tmp_path, [0.5, 0.1, 0.9], trainer=trainer, **{"checkpoint.monitor": "train/score"})
    assert best_steps(run) == [4]


def test_a_train_monitor_ranks_every_epoch_where_validation_runs_only_every_second(tmp_path):
    """Validation every 2nd epoch does not hold back a training monitor: each epoch's end is ranked."""
    run = _fit(tmp_path, [0.5, 0.9, 0.1, 0.7], trainer=ValidatedEpochScores,
               **{"checkpoint.monitor": "train/score", "checkpoint.save_top_k": -1,
                  "trainer.val_every_n_epochs": 2})  # fmt: skip
    assert best_steps(run) == [2, 4, 6, 8]
    assert best_pt_step(run) == 6


def test_a_nan_epoch_mean_is_never_best(tmp_path):
    run = _fit(tmp_path, [0.5, math.nan, 0.7], **{"checkpoint.monitor": "train/score", "checkpoint.save_top_k": -1})
    assert best_steps(run) == [2, 6]
    assert best_pt_step(run) == 2


def test_a_tie_with_the_best_epoch_keeps_the_earlier_file(tmp_path):
    run = _fit(tmp_path, [0.5, 0.2, 0.2, 0.9], **{"checkpoint.monitor": "train/score"})
    assert best_steps(run) == [4]


def test_early_stopping_on_a_train_epoch_mean_counts_epochs_without_validation(tmp_path):
    """Patience 2: the best is epoch 1's 0.2; epochs 2 and 3 do not improve on it, so the run stops after epoch 3 of
    6, and the checkpoint records why."""
    run = _fit(tmp_path, [0.5, 0.2, 0.3, 0.4, 0.1, 0.1],
               **{"early_stopping.monitor": "train/score", "early_stopping.patience": 2})  # fmt: skip
    assert (run.state.epoch, run.state.global_step) == (4, 8)
    assert "train/score did not improve on 0.2 for 2 epochs" in run.state.stop_reason
    last = load_checkpoint(run.version_dir / "checkpoints" / "last.pt")
    assert last["loop"]["global_step"] == 8 and "did not improve" in last["stopped_early"]


def test_a_nan_train_epoch_mean_stops_the_run_at_that_epoch(tmp_path):
    run = _fit(tmp_path, [0.5, math.nan, 0.1], **{"early_stopping.monitor": "train/score"})
    assert run.state.global_step == 4
    assert "not finite" in run.state.stop_reason


class RecordsItsLosses(EpochScores):
    """Logs no train/loss: records each batch's returned loss and size by epoch."""

    seen: ClassVar[dict[int, list[tuple[float, int]]]] = {}

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.seen.setdefault(self.state.epoch, []).append((float(loss), self.state.batch_size))
        return loss


class LogsItsOwnTrainLoss(EpochScores):
    def training_step(self, batch):
        self.log("train/loss", self.scores[self.state.epoch], on_step=False, on_epoch=True)
        return super().training_step(batch)


def test_the_returned_loss_is_monitored_as_train_loss_with_no_log_call(tmp_path):
    """checkpoint.monitor=train/loss names the loss training_step returns (TensorBoard's train/loss): each epoch's
    end is ranked by its mean over the epoch, weighted by batch size as log(on_epoch=True) is, which TensorBoard
    also writes as train/loss_epoch. It was an error naming a log() call the built-in configs cannot make."""
    trainer = type("Recorded", (RecordsItsLosses,), {"seen": {}})
    run = _fit(tmp_path, [0.5] * 3, trainer=trainer,
               **{"checkpoint.monitor": "train/loss", "checkpoint.save_top_k": -1})  # fmt: skip
    means = [sum(v * n for v, n in seen) / sum(n for _, n in seen) for _, seen in sorted(trainer.seen.items())]
    saved = load_checkpoint(run.version_dir / "checkpoints" / "last.pt")["callbacks"]
    ranked = saved["ModelCheckpoint[train/loss]"]["best_k"]
    by_step = {int(name.removeprefix("best-").removesuffix(".pt")): value for name, value in ranked.items()}
    assert [by_step[step] for step in (2, 4, 6)] == pytest.approx(means)


def test_a_train_loss_the_code_logs_itself_is_the_one_monitored(tmp_path):
    """Its own log('train/loss', on_epoch=True) values (0.1, 0.9, 0.5) rank, not the returned loss's mean."""
    run = _fit(tmp_path, [0.1, 0.9, 0.5], trainer=LogsItsOwnTrainLoss, **{"checkpoint.monitor": "train/loss"})
    assert best_steps(run) == [2]


@pytest.mark.parametrize("key", ["checkpoint.monitor", "early_stopping.monitor"])
def test_a_train_tag_never_logged_is_an_error_naming_the_tags_that_were(tmp_path, key):
    message = r"'train/acc' is no epoch mean of epoch 0, which logged train/score; .*self\.log\('train/acc', loss"
    with pytest.raises(MonitorNotFoundError, match=message):
        _fit(tmp_path, [0.5, 0.2], **{key: "train/acc"})


class BareScores(EpochScores):
    """Logs its score as 'score', on_step and on_epoch: written as score_step and score_epoch, no train/ tag."""

    def training_step(self, batch):
        self.log("score", self.scores[self.state.epoch], on_step=True, on_epoch=True)
        return ToyTrainer.training_step(self, batch)


@pytest.mark.parametrize("key", ["checkpoint.monitor", "early_stopping.monitor"])
def test_a_train_monitor_of_a_tag_logged_without_its_prefix_names_the_log_call_to_write(tmp_path, key):
    """log('score') for a train/score monitor: the message names 'score' as logged (not TensorBoard's score_epoch)
    and the train/ tag to log it under; it read 'which logged score_epoch', naming neither."""
    message = (
        r"'train/score' is no epoch mean of epoch 0, which logged score; 'score' is logged without the train/ "
        r"prefix a monitored tag needs; log it as self\.log\('train/score', value, on_epoch=True\)$"
    )
    with pytest.warns(UserWarning, match=r"gave it no value \(self\.log\('score'\) logs it without the train/ pref"):
        with pytest.raises(MonitorNotFoundError, match=message):
            type("Scripted", (BareScores,), {"scores": [0.5]})(toy_cfg(tmp_path, **{**QUIET, key: "train/score"})).fit()


def test_a_train_monitor_never_logged_names_the_train_tags_it_could_watch(tmp_path):
    """Logged on_step too, train/score is named as logged and as a monitor would name it, not as train/score_epoch."""
    trainer = type("OnStepToo", (EpochScores,), {"on_step": True})
    message = r"which logged train/score; monitor one of train/score, or log 'train/acc' in every epoch"
    with pytest.raises(MonitorNotFoundError, match=message):
        _fit(tmp_path, [0.5], trainer=trainer, **{"checkpoint.monitor": "train/acc"})


def test_a_train_tag_nothing_gives_a_value_is_named_at_the_first_iteration_not_an_epoch_later(tmp_path):
    """The epoch's end stops the run without the value: a warning after the first iteration (its hooks included,
    which may log it) lets a long first epoch be stopped before it is spent."""
    heard: list[int] = []

    class CountWarnings(ampkit.Callback):
        def on_train_batch_end(self, trainer, outputs, batch):
            heard.append(sum("'train/acc' is monitored, but the first iteration" in str(w.message) for w in caught))

    trainer = type("Scripted", (EpochScores,), {"scores": [0.5, 0.2]})
    cfg = toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 2, "checkpoint.monitor": "train/acc"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MonitorNotFoundError, match="'train/acc' is no epoch mean of epoch 0"):
            trainer(cfg, callbacks=[CountWarnings()]).fit()
    assert heard == [0, 1]


@pytest.mark.parametrize("callback", [ModelCheckpoint(monitor="val/mse"), EarlyStopping(monitor="val/mse")])
def test_a_validation_monitor_given_in_code_to_a_run_that_never_validates_is_refused(tmp_path, callback):
    """A callback built in code skips the config's checks: without validation it would rank or stop nothing, without
    a word. It is refused when fit starts, naming the train/ alternative."""
    message = r"'val/mse' is a validation metric, but this run never validates \(no val_dataloader\(\)\).*train/ tag"
    with pytest.raises(MonitorNotFoundError, match=message):
        _fit(tmp_path, [0.5], callbacks=[callback], **{"checkpoint.enabled": False})


def test_a_validation_monitor_in_the_config_of_a_run_without_validation_names_the_train_alternative(tmp_path):
    with pytest.raises(ConfigError, match=r"defines no val_dataloader\(\).*monitor 'train/<name>'"):
        _fit(tmp_path, [0.5], **{"early_stopping.monitor": "loss"})


class ValidationScores(ToyTrainer):
    """Validation after step N reports ``scores[N]``."""

    scores: ClassVar[dict[int, float]] = {}

    def validation_step(self, batch):
        return {"score": self.scores[self.state.global_step]}


@pytest.mark.parametrize(
    ("trainer", "scores", "settings", "ranked", "best"),
    [
        (EpochScores, [0.5, 0.1, 0.9], {"checkpoint.monitor": "train/score"}, [2, 4, 6], 4),
        (ValidationScores, {2: 0.5, 4: 0.1, 6: 0.9}, {"checkpoint.monitor": "val/score"}, [2, 4, 6], 4),
        (ValidationScores, {4: 0.5, 8: 0.1, 12: 0.9}, {"checkpoint.monitor": "val/score",
                                                       "trainer.val_every_n_epochs": 2}, [4, 8, 12], 8),
    ],
)  # fmt: skip
def test_step_checkpoints_between_measurements_are_never_ranked_by_an_older_value(
    tmp_path, trainer, scores, settings, ranked, best
):
    """A step-N.pt every step (2 per epoch), the monitored value measured only at epoch ends or validations: only
    those moments become best files, so no file is ranked by a value measured on other weights (Lightning ranks each
    step save by the latest value logged, which can be a validation or an epoch older than the step's weights)."""
    run = _fit(tmp_path, scores, trainer=trainer, **{"checkpoint.save_top_k": -1, "checkpoint.every_n_steps": 1,
               "trainer.num_sanity_val_steps": 0, "trainer.max_epochs": ranked[-1] // 2, **settings})  # fmt: skip
    assert best_steps(run) == ranked
    assert best_pt_step(run) == best


class PlateauOnTrainScore(EpochScores):
    """A ReduceLROnPlateau (patience 0, halving) on the monitored train/score; ``interval`` as the class says."""

    interval = "epoch"
    monitor = "train/score"

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, patience=0, factor=0.5)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": plateau, "monitor": self.monitor,
                                                   "interval": self.interval}}  # fmt: skip


class EpochStartRates(ampkit.Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_epoch_start(self, trainer) -> None:
        self.rates.append(trainer.optimizer.param_groups[0]["lr"])


def test_a_plateau_scheduler_steps_on_a_train_epoch_mean_without_validation(tmp_path):
    """As Lightning's {'monitor': 'train_loss'}: epoch 2's 0.3 does not improve on 0.2, so epoch 3 trains at half."""
    rates = EpochStartRates()
    _fit(tmp_path, [0.5, 0.2, 0.3, 0.1], trainer=PlateauOnTrainScore, callbacks=[rates])
    assert rates.rates == pytest.approx([0.1, 0.1, 0.1, 0.05])


@pytest.mark.parametrize(
    ("interval", "monitor", "logs", "error", "message"),
    [
        ("step", "train/score", EpochScores, ConfigError, r"monitors 'train/score', an epoch mean known at epoch ends "
                                                          r"only, but steps every step: give it 'interval': 'epoch'"),
        ("epoch", "train/acc", EpochScores, MonitorNotFoundError, r"monitors 'train/acc', but epoch 0 logged "
                                                                  r"train/score: log it in training_step with "
                                                                  r"self\.log\('train/acc'"),
        ("epoch", "train/score", BareScores, MonitorNotFoundError, r"monitors 'train/score', but epoch 0 logged score: "
                                                                   r"'score' is logged without the train/ prefix a "
                                                                   r"monitored tag needs; log it"),
    ],
)  # fmt: skip
def test_a_plateau_scheduler_s_train_monitor_it_cannot_read_is_named(tmp_path, interval, monitor, logs, error, message):
    trainer = type("Plateau", (PlateauOnTrainScore, logs), {"interval": interval, "monitor": monitor})
    with pytest.raises(error, match=message):
        _fit(tmp_path, [0.5, 0.2], trainer=trainer)


class Stream(EpochScores):
    """Its batches come from a generator: no length, so an epoch ends where the data does."""

    def train_dataloader(self):
        return (batch for batch in super().train_dataloader())


def test_a_train_monitor_over_a_stream_is_named_at_fit_start_as_checked_only_where_the_data_ends(tmp_path):
    settings = {**QUIET, "checkpoint.monitor": "train/score", "checkpoint.every_n_steps": 1,
                "trainer.max_steps": 1, "trainer.max_epochs": -1}  # fmt: skip
    trainer = type("Scripted", (Stream,), {"scores": [0.5]})(toy_cfg(tmp_path, **settings))
    with pytest.warns(UserWarning, match=r"has no length, so an epoch ends only where its data does, and "
                      r"checkpoint.monitor='train/score' \(an epoch mean\) is checked only then"):  # fmt: skip
        trainer.fit()


class BatchScores(EpochScores):
    """Logs 10 * epoch + batch_idx: an epoch's mean needs both of its batches (epoch 0: 0.5, epoch 1: 10.5)."""

    def training_step(self, batch):
        self.log("train/score", 10.0 * self.state.epoch + self.state.batch_idx, on_step=False, on_epoch=True)
        return ToyTrainer.training_step(self, batch)


class CrashAtStep(ampkit.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, batch) -> None:
        if trainer.state.global_step == self.step:
            raise RuntimeError("crash")


def test_a_run_resumed_mid_epoch_ranks_the_whole_epoch_s_mean_as_an_uninterrupted_one(tmp_path):
    settings = {"checkpoint.monitor": "train/score", "checkpoint.save_top_k": -1, "checkpoint.every_n_steps": 1}
    whole = _fit(tmp_path / "whole", [0, 0], trainer=BatchScores, **settings)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path / "resumed", [0, 0], trainer=BatchScores, callbacks=[CrashAtStep(1)], **settings)
    trainer = type("Scripted", (BatchScores,), {"scores": [0, 0]})
    resumed = trainer(toy_cfg(tmp_path / "resumed", **{**QUIET, "trainer.max_epochs": 2, **settings}))
    resumed.fit(resume="last")

    def ranking(run) -> dict[str, float]:
        return load_checkpoint(run.version_dir / "checkpoints" / "last.pt")["callbacks"][
            "ModelCheckpoint[train/score]"
        ]["best_k"]

    assert ranking(resumed) == ranking(whole) == {"best-00000002.pt": 0.5, "best-00000004.pt": 10.5}


class StepOnlyScores(EpochScores):
    """Logs train/acc per step only (log()'s default), as a Lightning training_step does."""

    def training_step(self, batch):
        self.log("train/acc", 0.5)
        return super().training_step(batch)


class CountsBatches(ampkit.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.batches += 1


@pytest.mark.parametrize("key", ["checkpoint.monitor", "early_stopping.monitor"])
def test_a_train_tag_logged_per_step_only_is_refused_after_the_first_iteration_naming_on_epoch(tmp_path, key):
    """A monitored train/ tag is its epoch mean; Lightning ranks one logged per step only by its last batch's value
    (one batch's noise). The run trained its whole first epoch (4 batches) before the epoch's end named the tags it
    logged; the first iteration shows what is wrong, and the error says how to log it."""
    counted = CountsBatches()
    message = r"'train/acc' is monitored, but log\('train/acc'\) gives it per step only.*on_epoch=True"
    with pytest.raises(MonitorNotFoundError, match=message):
        _fit(tmp_path, [0.5], trainer=StepOnlyScores, callbacks=[counted], **{key: "train/acc", "data.n": 32})
    assert counted.batches == 1


LONG_TAG = "train/" + "a" * 10_000


class LongStepOnlyTag(EpochScores):
    def training_step(self, batch):
        self.log(LONG_TAG, 0.5)
        return ToyTrainer.training_step(self, batch)


def test_the_monitor_messages_of_the_first_iteration_name_a_long_tag_by_its_start_and_length(tmp_path):
    """They repeated a pasted 10 kB tag whole, up to four times in one message."""
    with pytest.raises(MonitorNotFoundError, match=r"\(10008 characters\) is monitored, but log") as caught:
        _fit(tmp_path, [0.5], trainer=LongStepOnlyTag, **{"checkpoint.monitor": LONG_TAG})
    assert len(str(caught.value)) < 600
    cfg = toy_cfg(tmp_path / "unheard", **{**QUIET, "trainer.max_epochs": 1, "checkpoint.monitor": LONG_TAG})
    with warnings.catch_warnings(record=True) as caught_warnings, pytest.raises(MonitorNotFoundError):
        warnings.simplefilter("always")
        type("Scripted", (EpochScores,), {"scores": [0.5]})(cfg).fit()
    (unheard,) = [str(w.message) for w in caught_warnings if "the first iteration gave it no value" in str(w.message)]
    assert "(10008 characters) is monitored" in unheard and len(unheard) < 700


class EpochLevelScores(EpochScores):
    """Every batch of epoch e logs scores[e]: an epoch's mean, whole or cut short, is scores[e]."""

    def training_step(self, batch):
        self.log("train/score", self.scores[self.state.epoch], on_step=False, on_epoch=True)
        return ToyTrainer.training_step(self, batch)


def test_a_max_steps_stop_mid_epoch_ranks_the_partial_epoch_s_mean_as_lightning_does(tmp_path):
    """Lightning runs on_train_epoch_end where max_steps cuts an epoch short, and its checkpoint ranks the mean of the
    batches run: step 6 (2 of epoch 1's 4 batches) is ranked by epoch 1's partial mean."""
    run = _fit(tmp_path, [0.5, 0.2], trainer=EpochLevelScores,
               **{"checkpoint.monitor": "train/score", "checkpoint.save_top_k": -1, "data.n": 32,
                  "trainer.max_steps": 6})  # fmt: skip
    saved = load_checkpoint(run.version_dir / "checkpoints" / "last.pt")["callbacks"]
    ranked = saved["ModelCheckpoint[train/score]"]["best_k"]
    assert ranked == {"best-00000006.pt": pytest.approx(0.2), "best-00000004.pt": pytest.approx(0.5)}


def test_an_epoch_cut_short_by_max_steps_and_finished_on_resume_counts_once_against_patience(tmp_path):
    """Epoch 1 (no improvement) is cut at step 6 and finished by a resume with a larger max_steps: early stopping
    counted it at the cut and again at its end, and with patience 2 stopped at step 8, an epoch before the run that
    was never cut (epoch 2 improves). The cut epoch is checked once, at its end: the run ended at the cut anyway."""
    settings = {"early_stopping.monitor": "train/score", "early_stopping.patience": 2, "data.n": 32}
    scores = [1.0, 2.0, 0.5]
    whole = _fit(tmp_path / "whole", scores, trainer=EpochLevelScores, **settings)
    _fit(tmp_path / "cut", scores, trainer=EpochLevelScores, **{**settings, "trainer.max_steps": 6})
    trainer = type("Scripted", (EpochLevelScores,), {"scores": scores})
    resumed = trainer(toy_cfg(tmp_path / "cut", **{**QUIET, **settings, "trainer.max_epochs": 3}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit(resume="last")
    assert whole.state.global_step == resumed.state.global_step == 12
    assert not resumed.state.stop_reason


class LogsAtItsEpochEnd(EpochScores):
    """Lightning's pattern: an epoch's metric computed in on_train_epoch_end, logged there, and monitored."""

    def training_step(self, batch):
        return ToyTrainer.training_step(self, batch)

    def on_train_epoch_end(self):
        if self.on_step:  # log()'s defaults, where Lightning's in this hook are on_step=False, on_epoch=True
            self.log("train/epoch_score", self.scores[self.state.epoch])
        else:
            self.log("train/epoch_score", self.scores[self.state.epoch], on_epoch=True, on_step=False)


@pytest.mark.parametrize("on_step", [False, True], ids=["on_epoch", "defaults"])
def test_a_value_the_trainer_logs_in_its_own_on_train_epoch_end_is_monitored_as_that_epoch_s(tmp_path, on_step):
    """Lightning runs monitoring callbacks' on_train_epoch_end after the module's for this. Here the value reached
    TensorBoard but no monitor: the first iteration warned, and epoch 0's end stopped the run naming no epoch mean.
    Patience 1: epoch 2's 0.3 does not improve on 0.2, so the run stops there, every epoch's end ranked."""
    scripted = {"scores": [0.5, 0.2, 0.3, 0.1], "on_step": on_step}
    trainer = type("Scripted", (LogsAtItsEpochEnd,), scripted)
    cfg = toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 4, "checkpoint.monitor": "train/epoch_score",
                               "checkpoint.save_top_k": -1, "early_stopping.monitor": "train/epoch_score",
                               "early_stopping.patience": 1})  # fmt: skip
    run = trainer(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit()
    assert not [w for w in caught if "train/epoch_score" in str(w.message)]
    assert run.state.global_step == 6 and re.search(r"did not improve on 0\.2 for 1 epoch\b", run.state.stop_reason)
    assert best_steps(run) == [2, 4, 6]
    assert best_pt_step(run) == 4


class PlateauOnItsEpochEndValue(LogsAtItsEpochEnd):
    """The plateau scheduler monitors the value the Trainer logs in its own on_train_epoch_end; records the rate
    that hook reads."""

    interval, monitor = "epoch", "train/epoch_score"
    configure_optimizers = PlateauOnTrainScore.configure_optimizers
    rates: ClassVar[list[float]] = []

    def on_train_epoch_end(self):
        super().on_train_epoch_end()
        self.rates.append(self.optimizer.param_groups[0]["lr"])


def test_a_plateau_scheduler_steps_on_a_value_logged_in_on_train_epoch_end_after_that_hook(tmp_path):
    """Lightning steps epoch schedulers after on_train_epoch_end: a ReduceLROnPlateau reads an epoch metric the module
    logs there (here it stepped first and found none), and the rate read there is the epoch's own. The epoch's
    checkpoint is saved after the step, so it holds the halved rate a resume continues with."""
    trainer = type("Scripted", (PlateauOnItsEpochEndValue,), {"rates": []})
    starts = EpochStartRates()
    run = _fit(tmp_path, [0.5, 0.2, 0.3, 0.1], trainer=trainer, callbacks=[starts], **{"checkpoint.every_n_epochs": 1})
    assert starts.rates == pytest.approx([0.1, 0.1, 0.1, 0.05])  # epoch 2's 0.3 does not improve on 0.2
    assert trainer.rates == pytest.approx([0.1, 0.1, 0.1, 0.05])
    saved = load_checkpoint(run.version_dir / "checkpoints" / "epoch-0003.pt")["optimizers"]
    assert next(iter(saved.values()))["param_groups"][0]["lr"] == pytest.approx(0.05)
